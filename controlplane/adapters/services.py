"""Every write to LoRA adapters and their files; views, the dashboard and the admin call these.

Validation is the engine's own (`inference.lora.format`): nothing is unpickled, and an adapter becomes `ready`
only once both files are stored and the pair passed `inspect_adapter` against the base model's dimensions.
Files go through Django's default storage under a name built here (`adapters/<account>/<adapter>/<file>`), never
from anything the client sent. Storage writes happen outside database transactions (a 300 MB copy must not
hold SQLite's write lock); the short transaction that follows records the file or, if anything fails, the
stored copy is deleted again. So do not call the upload functions inside an outer `transaction.atomic()`: a
rollback there would leave a stored file that no row owns.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.files import File
from django.core.files.storage import FileSystemStorage, default_storage
from django.core.files.uploadedfile import UploadedFile
from django.db import IntegrityError, transaction
from django.db.models import Q, QuerySet

from controlplane.accounts.models import Account
from controlplane.adapters.models import NAME_PATTERN, Adapter, AdapterFile
from controlplane.adapters.upload import (
    CHUNK,
    LocalFile,
    hash_into,
    limit_bytes,
    local_copy,
    read_chunks,
    too_large,
)
from controlplane.api import errors
from controlplane.api.errors import ApiError
from controlplane.catalog.services import get_model
from inference.errors import ModelNotFoundError
from inference.lora.format import (
    CONFIG_FILE,
    MAX_RANK,
    WEIGHTS_FILE,
    AdapterError,
    AdapterSpec,
    BaseDims,
    check_config,
    inspect_adapter,
    parse_config,
    read_safetensors_header,
)
from inference.models.catalog import model_path

log = logging.getLogger("controlplane.adapters")
Kind = AdapterFile.Kind
KIND_OF = {CONFIG_FILE: Kind.CONFIG, WEIGHTS_FILE: Kind.WEIGHTS}
FILE_OF = {kind: name for name, kind in KIND_OF.items()}
OTHER = {Kind.CONFIG: Kind.WEIGHTS, Kind.WEIGHTS: Kind.CONFIG}
CONFIG_MAX_BYTES = 1024 * 1024  # a PEFT config is a few hundred bytes; parsing must stay cheap
DESCRIPTION_MAX_CHARS = 2000
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_NAME_CHARS = NAME_PATTERN.removeprefix("^").removesuffix("$")


# ------------------------------------------------------------------------------------------------ checks
def _kind(file_name: Any) -> str:
    """Which of the two files a client-given name is; only the two exact names are accepted."""
    if isinstance(file_name, str) and file_name in KIND_OF:
        return KIND_OF[file_name]
    shown = repr(file_name[:100]) if isinstance(file_name, str) else "missing"
    if isinstance(file_name, str) and file_name.lower().endswith(_PICKLE_SUFFIXES):
        raise errors.invalid(f"file {shown}: only {WEIGHTS_FILE} is accepted for the weights; pickle formats "
                             f"({', '.join(_PICKLE_SUFFIXES)}) are never loaded", "file_name")
    raise errors.invalid(f"file name {shown}: an adapter is two files, {CONFIG_FILE} and {WEIGHTS_FILE}",
                         "file_name")


def _check_fields(name: Any, description: Any) -> None:
    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
        raise errors.invalid("name: 1 to 100 characters, letters, digits, '.', '_' or '-', starting with a letter "
                             f"or digit (pattern {_NAME_CHARS})", "name")
    if not isinstance(description, str) or len(description) > DESCRIPTION_MAX_CHARS:
        raise errors.invalid(f"description: a string of at most {DESCRIPTION_MAX_CHARS} characters", "description")


def _check_model(base_model: Any) -> None:
    if not isinstance(base_model, str) or not base_model:
        raise errors.invalid("model: the name of the base model the adapter was trained for", "model")
    entry = get_model(base_model)
    if entry is None:
        raise errors.unknown_model(base_model)
    if not entry.supports_lora:
        raise errors.lora_unsupported(base_model)
    if not entry.installed:
        raise ApiError(400, errors.CODE_NO_SUCH_MODEL, f"The model {base_model} is not installed on this server",
                       openai_code="model_not_found", param="model")


def _base_dims(base_model: str) -> BaseDims:
    _check_model(base_model)
    try:
        return BaseDims.from_model_dir(model_path(base_model))
    except ModelNotFoundError:
        raise errors.unknown_model(base_model) from None
    except FileNotFoundError:
        raise ApiError(400, errors.CODE_NO_SUCH_MODEL, f"The model {base_model} is not installed on this server",
                       openai_code="model_not_found", param="model") from None


def _refusal(exc: AdapterError) -> ApiError:
    if exc.kind == "missing_files":
        return errors.lora_files_missing(str(exc), "file")
    if exc.kind == "unsupported_model":
        return ApiError(400, errors.CODE_LORA_UNSUPPORTED, str(exc), openai_code="lora_not_supported", param="model")
    return errors.invalid(f"Invalid LoRA adapter: {exc}", "file")


def _check_room(account: Account, name: str) -> None:
    if Adapter.objects.filter(account=account, name=name).exists():
        raise errors.conflict(f"An adapter named {name!r} already exists in this account", "name")
    limit = int(settings.HEARTH_LORA_MAX_PER_ACCOUNT)
    count = Adapter.objects.filter(account=account).count()
    if count >= limit:
        raise errors.conflict(f"This account has {count} LoRA adapters, the most it may keep ({limit}); delete one "
                              "first", "name")


def _config_alone(path: Path) -> None:
    """What can be checked of a config before the weights are there: it parses and is a LoRA we can serve."""
    try:
        check_config(parse_config(path.read_bytes()), MAX_RANK)
    except AdapterError as exc:
        raise _refusal(exc) from None


def _weights_alone(path: Path) -> None:
    """What can be checked of the weights alone: a sane safetensors header with allowed dtypes."""
    try:
        read_safetensors_header(path)
    except AdapterError as exc:
        raise _refusal(exc) from None


def _inspect(config_raw: bytes, weights_path: Path, base: BaseDims) -> AdapterSpec:
    try:
        return inspect_adapter(config_raw, weights_path, base, MAX_RANK)
    except AdapterError as exc:
        raise _refusal(exc) from None


# ------------------------------------------------------------------------------------------------ storage
def _local_path(storage_name: str) -> Path | None:
    """Where a stored file lies on this machine's disk; None for storages that keep files elsewhere (S3 and
    the like, or in memory: `path()` alone does not tell, some answer it for files they do not keep there)."""
    if isinstance(default_storage, FileSystemStorage):
        return Path(default_storage.path(storage_name))
    return None


@contextmanager
def _stored_path(storage_name: str) -> Iterator[Path]:
    """A stored file as a local path: the file itself on a filesystem storage, else a temporary copy."""
    path = _local_path(storage_name)
    if path is not None:
        if not path.is_file():
            raise errors.lora_files_missing(f"The stored {path.name} is missing; delete the adapter and upload it "
                                            "again")
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="hearth-adapter-") as tmp:
        local = Path(tmp) / Path(storage_name).name
        try:
            with default_storage.open(storage_name, "rb") as src, local.open("wb") as out:
                shutil.copyfileobj(src, out, CHUNK)
        except FileNotFoundError:
            raise errors.lora_files_missing(f"The stored {local.name} is missing; delete the adapter and upload "
                                            "it again") from None
        yield local


def _stored_config(storage_name: str) -> bytes:
    with _stored_path(storage_name) as path:
        return path.read_bytes()


def _prefix(account_id: str, adapter_id: str) -> str:
    return f"adapters/{account_id}/{adapter_id}"


def _store(adapter: Adapter, file_name: str, local: Path) -> str:
    """Save under the fixed name. Storage picks another name when that one is taken (an upload of the same
    file racing this one, or a copy whose request died before recording it); files are never replaced."""
    target = f"{_prefix(adapter.account_id, adapter.pk)}/{file_name}"
    with local.open("rb") as f:
        stored = default_storage.save(target, File(f, name=file_name))
    if stored != target:
        default_storage.delete(stored)
        raise _already(adapter, file_name)
    return stored


def _already(adapter: Adapter, file_name: str) -> ApiError:
    return errors.conflict(f"{file_name} is already stored for the adapter {adapter.name} (or is being uploaded); "
                           "stored files cannot be replaced: delete the adapter and create it again", "file")


def _remove_files(account_id: str, adapter_id: str, names: list[str]) -> None:
    """Delete an adapter's stored files (and anything else left in its folder) and its local cache copy."""
    prefix = _prefix(account_id, adapter_id)
    try:
        leftovers = [f"{prefix}/{name}" for name in default_storage.listdir(prefix)[1]]
    except (FileNotFoundError, NotImplementedError):
        leftovers = []
    for name in dict.fromkeys([*names, *leftovers]):
        try:
            default_storage.delete(name)
        except OSError:
            log.exception("could not delete %s from storage", name)
    with suppress(OSError, NotImplementedError):
        default_storage.delete(prefix)  # the now-empty folder, where the storage has folders
    shutil.rmtree(_cache_root() / adapter_id, ignore_errors=True)


def _apply(adapter: Adapter, spec: AdapterSpec) -> None:
    adapter.status = Adapter.Status.READY
    adapter.rank, adapter.alpha, adapter.scaling = spec.rank, spec.alpha, spec.scaling
    adapter.target_modules = list(spec.target_modules)
    adapter.num_layers = len(spec.layers)
    adapter.dtype = spec.dtype


# ------------------------------------------------------------------------------------------------ writes
def create_adapter(account: Account, *, name: str, base_model: str, description: str = "") -> Adapter:
    """A new, pending adapter (its files come with add_asset)."""
    _check_fields(name, description)
    _check_model(base_model)
    try:
        with transaction.atomic():
            # Serialises creates per account, so two at once cannot both take the last free place.
            Account.objects.select_for_update().filter(pk=account.pk).first()
            _check_room(account, name)
            return Adapter.objects.create(account=account, name=name, base_model=base_model,
                                          description=description)
    except IntegrityError:
        raise errors.conflict(f"An adapter named {name!r} already exists in this account", "name") from None


def add_asset(adapter: Adapter, file_name: str, upload: UploadedFile) -> Adapter:
    """Store one of the two files. The config alone is checked with check_config, the weights alone for a sane
    safetensors header; whichever completes the pair runs the full inspect_adapter, and is not kept if the pair
    fails it. Returns the adapter as stored now."""
    kind = _kind(file_name)
    file_name = FILE_OF[kind]
    present = {f.kind: f for f in AdapterFile.objects.filter(adapter_id=adapter.pk)}
    if kind in present:
        raise _already(adapter, file_name)
    base = _base_dims(adapter.base_model)
    other = present.get(OTHER[kind])
    with local_copy(upload, limit_bytes() - (other.size_bytes if other else 0)) as local:
        if kind == Kind.CONFIG:
            if local.size > CONFIG_MAX_BYTES:
                raise errors.invalid(f"{CONFIG_FILE} is {local.size:,} bytes; a LoRA config is a small JSON file "
                                     f"(at most {CONFIG_MAX_BYTES:,} bytes)", "file")
            _config_alone(local.path)
        else:
            _weights_alone(local.path)
        stored = _store(adapter, file_name, local.path)
        try:
            _record(adapter, kind, stored, local, base)
        except BaseException:
            default_storage.delete(stored)
            raise
    return Adapter.objects.prefetch_related("files").get(pk=adapter.pk)


def _record(adapter: Adapter, kind: str, stored: str, local: LocalFile, base: BaseDims) -> None:
    with transaction.atomic():
        locked = Adapter.objects.select_for_update().filter(pk=adapter.pk).first()
        if locked is None:
            raise errors.not_found(f"No such LoRA adapter: {adapter.pk} (it was deleted)")
        present = {f.kind: f for f in AdapterFile.objects.filter(adapter=locked)}
        if kind in present:
            raise _already(locked, FILE_OF[kind])
        other = present.get(OTHER[kind])
        if other is not None and other.size_bytes + local.size > limit_bytes():
            raise too_large(limit_bytes())
        AdapterFile.objects.create(adapter=locked, kind=kind, file_name=FILE_OF[kind], storage_name=stored,
                                   size_bytes=local.size, sha256=local.sha256)
        locked.size_bytes = local.size + (other.size_bytes if other else 0)
        if other is not None:
            if kind == Kind.CONFIG:
                spec = _pair(local.path.read_bytes(), other.storage_name, base)
            else:
                spec = _inspect(_stored_config(other.storage_name), local.path, base)
            _apply(locked, spec)
        locked.save()


def _pair(config_raw: bytes, weights_storage_name: str, base: BaseDims) -> AdapterSpec:
    with _stored_path(weights_storage_name) as weights:
        return _inspect(config_raw, weights, base)


def upload_adapter(account: Account, *, name: str, base_model: str, description: str,
                   files: Mapping[str, UploadedFile]) -> Adapter:
    """Create a ready adapter from both files at once; all or nothing: if anything is refused, nothing stays."""
    _check_fields(name, description)
    _check_model(base_model)
    uploads = {_kind(file_name): upload for file_name, upload in files.items()}
    missing = [FILE_OF[kind] for kind in (Kind.CONFIG, Kind.WEIGHTS) if kind not in uploads]
    if missing:
        raise errors.lora_files_missing(f"required files missing: {', '.join(missing)} (upload {CONFIG_FILE} and "
                                        f"{WEIGHTS_FILE} together)", "file")
    _check_room(account, name)
    base = _base_dims(base_model)
    with ExitStack() as stack:
        config = stack.enter_context(local_copy(uploads[Kind.CONFIG], limit_bytes()))
        if config.size > CONFIG_MAX_BYTES:
            raise errors.invalid(f"{CONFIG_FILE} is {config.size:,} bytes; a LoRA config is a small JSON file "
                                 f"(at most {CONFIG_MAX_BYTES:,} bytes)", "file")
        weights = stack.enter_context(local_copy(uploads[Kind.WEIGHTS], limit_bytes() - config.size))
        config_raw = config.path.read_bytes()
        spec = _inspect(config_raw, weights.path, base)
        adapter = create_adapter(account, name=name, base_model=base_model, description=description)
        stored: list[str] = []
        try:
            for kind, local in ((Kind.CONFIG, config), (Kind.WEIGHTS, weights)):
                stored.append(_store(adapter, FILE_OF[kind], local.path))
            with transaction.atomic():
                for kind, local, storage_name in ((Kind.CONFIG, config, stored[0]),
                                                  (Kind.WEIGHTS, weights, stored[1])):
                    AdapterFile.objects.create(adapter=adapter, kind=kind, file_name=FILE_OF[kind],
                                               storage_name=storage_name, size_bytes=local.size,
                                               sha256=local.sha256)
                adapter.size_bytes = config.size + weights.size
                _apply(adapter, spec)
                adapter.save()
        except BaseException:
            for storage_name in stored:
                default_storage.delete(storage_name)
            Adapter.objects.filter(pk=adapter.pk).delete()
            raise
    return Adapter.objects.prefetch_related("files").get(pk=adapter.pk)


def delete_adapter(account_id: str, adapter_id: str) -> None:
    """Remove one of the account's own adapters; its stored files go once the deletion has committed."""
    with transaction.atomic():
        adapter = Adapter.objects.select_for_update().filter(account_id=account_id, pk=adapter_id).first()
        if adapter is None:
            raise errors.not_found(f"No such LoRA adapter: {adapter_id}")
        names = list(adapter.files.values_list("storage_name", flat=True))
        adapter.delete()
        transaction.on_commit(functools.partial(_remove_files, account_id, adapter_id, names))


def set_public(adapter_id: str, public: bool) -> None:
    """Publish an adapter to every account, or withdraw it (operators only: the admin calls this)."""
    Adapter.objects.filter(pk=adapter_id).update(public=public)


# ------------------------------------------------------------------------------------------------ reads
def visible_adapters(account_id: str) -> QuerySet[Adapter]:
    """The account's own adapters and the published ones, newest first."""
    return (Adapter.objects.filter(Q(account_id=account_id) | Q(public=True))
            .prefetch_related("files").order_by("-created_at", "-id"))


def _lookup(account_id: str, ref: str, *, own_only: bool) -> Adapter | None:
    """By id, then by name: the account's own first, then a published one."""
    scope = Adapter.objects.filter(account_id=account_id) if own_only else visible_adapters(account_id)
    found = scope.filter(pk=ref).first() or Adapter.objects.filter(account_id=account_id, name=ref).first()
    if found is not None or own_only:
        return found
    public = list(Adapter.objects.filter(public=True, name=ref).order_by("created_at")[:2])
    if len(public) > 1:
        raise errors.invalid(f"Several published LoRA adapters are named {ref!r}; name one by its id", "lora")
    return public[0] if public else None


def get_adapter(account_id: str, ref: str, *, own_only: bool = False) -> Adapter:
    """An adapter the account may see (or, with own_only, change), by id or name; 404 otherwise."""
    found = _lookup(account_id, ref, own_only=own_only) if ref else None
    if found is None:
        raise errors.not_found(f"No such LoRA adapter: {ref}")
    return found


def find_adapter(account_id: str, ref: str, base_model: str | None = None) -> Adapter:
    """The adapter a request names (`lora`), ready to serve and made for `base_model` when one is given."""
    found = _lookup(account_id, ref, own_only=False) if isinstance(ref, str) and ref else None
    if found is None:
        where = f" for {base_model}" if base_model else ""
        raise ApiError(400, errors.CODE_NO_SUCH_MODEL, f"No LoRA adapter {ref!r}{where} in this account",
                       openai_code="adapter_not_found", param="lora")
    if not found.ready:
        have = {f.kind for f in found.files.all()}
        missing = [FILE_OF[k] for k in (Kind.CONFIG, Kind.WEIGHTS) if k not in have] or [CONFIG_FILE, WEIGHTS_FILE]
        raise errors.lora_files_missing(f"The LoRA adapter {found.name} is not ready: required files missing: "
                                        f"{', '.join(missing)}")
    if base_model is not None and found.base_model != base_model:
        raise errors.invalid(f"The LoRA adapter {found.name} is for {found.base_model}, not {base_model}", "lora")
    return found


def _ready_files(adapter: Adapter) -> dict[str, AdapterFile]:
    files = {f.kind: f for f in adapter.files.all()}
    if not adapter.ready or len(files) != 2:
        raise errors.lora_files_missing(f"The LoRA adapter {adapter.name} is not ready: required files missing")
    return files


def adapter_key(adapter: Adapter) -> str:
    """The engine's cache key: changes if the weights ever do (they cannot, but a key must not assume it)."""
    return f"{adapter.id}:{_ready_files(adapter)[Kind.WEIGHTS].sha256[:16]}"


def _cache_root() -> Path:
    return Path(settings.HEARTH_DATA_DIR) / "adapter-cache"


def adapter_dir(adapter: Adapter) -> Path:
    """A local directory holding exactly the adapter's two files, for the engine: the storage's own folder on a
    filesystem storage, else a copy in the data dir made once (checked against the recorded sha256)."""
    files = _ready_files(adapter)
    paths = {f.file_name: _local_path(f.storage_name) for f in files.values()}
    folders = {p.parent for p in paths.values() if p is not None}
    if len(folders) != 1 or any(p is None or p.name != name for name, p in paths.items()):
        return _cached_copy(adapter, files)
    missing = sorted(name for name, p in paths.items() if not p.is_file())
    if missing:
        raise errors.lora_files_missing(f"The LoRA adapter {adapter.name}'s stored files are missing: "
                                        f"{', '.join(missing)}; delete it and upload it again")
    return folders.pop()


def _complete(folder: Path, files: dict[str, AdapterFile]) -> bool:
    return all((folder / f.file_name).is_file() and (folder / f.file_name).stat().st_size == f.size_bytes
               for f in files.values())


def _cached_copy(adapter: Adapter, files: dict[str, AdapterFile]) -> Path:
    root = _cache_root()
    final = root / adapter.pk
    if _complete(final, files):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{adapter.pk}.", dir=root))
    try:
        for f in files.values():
            try:
                with default_storage.open(f.storage_name, "rb") as src, (tmp / f.file_name).open("wb") as out:
                    _, sha = hash_into(read_chunks(src), f.size_bytes, out)
            except (FileNotFoundError, ApiError):  # gone, or longer than recorded
                sha = None
            if sha != f.sha256:
                raise errors.lora_files_missing(f"The LoRA adapter {adapter.name}'s stored {f.file_name} is missing "
                                                "or damaged; delete it and upload it again")
        if not _complete(final, files):  # another process may have finished its copy meanwhile
            shutil.rmtree(final, ignore_errors=True)
            with suppress(OSError):  # ... or just now
                os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def as_dict(adapter: Adapter) -> dict[str, Any]:
    """The REST representation (Workers AI's finetune fields: id, name, description, model, created_at,
    modified_at; plus what Hearth knows)."""
    files = sorted(adapter.files.all(), key=lambda f: f.kind)
    return {
        "id": adapter.pk, "name": adapter.name, "model": adapter.base_model, "description": adapter.description,
        "public": adapter.public, "status": adapter.status, "rank": adapter.rank, "alpha": adapter.alpha,
        "target_modules": list(adapter.target_modules or []), "size_bytes": adapter.size_bytes,
        "files": [{"file_name": f.file_name, "size_bytes": f.size_bytes, "sha256": f.sha256} for f in files],
        "created_at": adapter.created_at.isoformat(), "modified_at": adapter.updated_at.isoformat(),
    }

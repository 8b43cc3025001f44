"""LoRA adapters for replicas anywhere in the cluster, never through a path of the web server's disk.

The control plane puts an adapter's two files in Ray's object store once, keyed by their digest; a replica
that needs it fetches the bytes, checks the digest, and keeps a copy on its own disk, so later requests (and a
restarted replica on the same node) read it locally. The engine still validates the files as it loads them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference.lora.format import CONFIG_FILE, WEIGHTS_FILE

FILES = (CONFIG_FILE, WEIGHTS_FILE)


class AdapterTransferError(RuntimeError):
    """The bytes that arrived are not the adapter that was sent."""


@dataclass(frozen=True, slots=True)
class AdapterBundle:
    """An adapter as it travels: its engine name, the digest of its files and the object holding them."""

    name: str
    digest: str  # sha256 over (file name, length, bytes) of every file, in FILES order
    ref: Any  # ray.ObjectRef of a {file name: bytes} dict


def digest(files: Mapping[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in FILES:
        data = files[name]
        h.update(name.encode())
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()


def read_files(folder: str | Path) -> dict[str, bytes]:
    return {name: (Path(folder) / name).read_bytes() for name in FILES}


def materialize(bundle: AdapterBundle, root: Path, fetch: Any) -> Path:
    """A local folder holding the bundle's files, verified: the cached copy when it is intact, else fetched
    (`fetch(ref) -> {name: bytes}`), checked and written atomically."""
    folder = root / bundle.digest
    if folder.is_dir():
        try:
            if digest(read_files(folder)) == bundle.digest:
                return folder
        except OSError:
            pass
        shutil.rmtree(folder, ignore_errors=True)  # damaged or partial: fetch it again
    files = fetch(bundle.ref)
    if set(files) != set(FILES) or digest(files) != bundle.digest:
        raise AdapterTransferError(f"adapter {bundle.name}: the bytes received do not match digest {bundle.digest}")
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".incoming-", dir=root))
    for name, data in files.items():
        (staging / name).write_bytes(data)
    try:
        os.rename(staging, folder)
    except OSError:  # another request of this replica won the race: theirs is the same bytes
        shutil.rmtree(staging, ignore_errors=True)
    return folder

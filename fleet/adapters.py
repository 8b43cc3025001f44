"""LoRA adapters for replicas anywhere in the cluster, never through a path of the web server's disk.

The control plane puts an adapter's two files in Ray's object store once, keyed by their digest (`BundleCache`:
the adapters it used last, within a byte budget); a replica that needs it fetches the bytes, checks the digest,
and keeps a copy on its own disk (`LocalAdapters`), so later requests (and a restarted replica on the same node)
read it locally. The engine still validates the files as it loads them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference.lora.format import CONFIG_FILE, WEIGHTS_FILE

FILES = (CONFIG_FILE, WEIGHTS_FILE)
# Budgets, in MiB, an operator can set (docs/deploy.md): what a control plane process keeps in the object store,
# and what a node keeps on disk (the replicas' environment, forwarded by fleet.app).
CACHE_MB_ENV, DISK_MB_ENV = "HEARTH_FLEET_ADAPTER_CACHE_MB", "HEARTH_FLEET_ADAPTER_DISK_MB"


def budget_bytes(variable: str, default_mb: int) -> int:
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return default_mb << 20
    try:
        mb = int(raw)
    except ValueError:
        mb = -1
    if mb < 1:
        raise ValueError(f"{variable} must be a whole number of MiB, at least 1 (got {raw!r})")
    return mb << 20


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


class BundleCache:
    """The adapters this process has put in the object store, the least recently used dropped past
    `capacity_bytes` (Ray frees a dropped one once no call in flight holds it; it is put again if asked for).
    `get` reads and hashes the files, tens of milliseconds for a 40 MB adapter: call it off the event loop. A
    burst of requests for an adapter not yet here builds its bundle once; the others wait for it."""

    def __init__(self, capacity_bytes: int, put: Callable[[dict[str, bytes]], Any]) -> None:
        self.capacity_bytes = capacity_bytes
        self._put = put  # ray.put in the fleet
        self._bundles: OrderedDict[str, tuple[AdapterBundle, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._building: dict[str, threading.Lock] = {}

    def __len__(self) -> int:
        return len(self._bundles)

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def cached(self, name: str) -> AdapterBundle | None:
        """The bundle if this process holds it (a dict lookup: fine on the event loop)."""
        with self._lock:
            hit = self._bundles.get(name)
            if hit is None:
                return None
            self._bundles.move_to_end(name)
            return hit[0]

    def get(self, name: str, folder: str | Path) -> AdapterBundle:
        """The bundle of adapter `name` (the engine's name, which changes with its weights) read from `folder`."""
        bundle = self.cached(name)
        if bundle is not None:
            return bundle
        with self._lock:
            gate = self._building.setdefault(name, threading.Lock())
        with gate:
            bundle = self.cached(name)  # built while this thread waited
            if bundle is not None:
                return bundle
            try:
                files = read_files(folder)
                bundle = AdapterBundle(name, digest(files), self._put(files))
                self._keep(bundle, sum(len(data) for data in files.values()))
            finally:
                with self._lock:
                    self._building.pop(name, None)
            return bundle

    def _keep(self, bundle: AdapterBundle, size: int) -> None:
        with self._lock:
            self._bundles[bundle.name] = (bundle, size)
            self._bytes += size
            while self._bytes > self.capacity_bytes and len(self._bundles) > 1:  # the newest stays, whatever its size
                _, (_, dropped) = self._bundles.popitem(last=False)
                self._bytes -= dropped


def _stamp(folder: Path) -> tuple[tuple[int, int, int, int], ...]:
    """What a write to any of the folder's files changes (the inode's change time cannot be set back)."""
    return tuple((st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                 for st in (os.stat(folder / name) for name in FILES))


class LocalAdapters:
    """Adapters fetched to this node's disk under `root`, one folder per digest. A folder is checked against its
    digest when this process writes it or first finds it, and again only when its files have changed since: a
    stat a request, not a read and hash of the whole adapter (25-45 ms of the replica's core for 40 MB).

    The folders stay within `capacity_bytes`: after each fetch the least recently used go (a folder's mtime is
    its last use, by any replica of the node sharing `root`), but never one used in the last `grace_s`, which a
    request may have been handed and its engine not yet read (the engine reads an adapter once, as the request
    is added). A node busier than that holds more for a while."""

    def __init__(self, root: Path, capacity_bytes: int = 4 << 30, grace_s: float = 600.0) -> None:
        self.root = root
        self.capacity_bytes, self.grace_s = capacity_bytes, grace_s
        self._verified: dict[str, tuple[tuple[int, int, int, int], ...]] = {}  # digest -> stamp when checked
        self._lock = threading.Lock()
        self._gates: dict[str, threading.Lock] = {}

    def _used(self, folder: Path) -> Path:
        with contextlib.suppress(OSError):  # a folder removed meanwhile is fetched again by its next request
            os.utime(folder)
        return folder

    def _trim(self, keep: Path) -> None:
        """Remove the least recently used folders past the budget, and staging folders a crash left behind."""
        now = time.time()
        entries = []
        for entry in self.root.iterdir():
            try:
                used = entry.stat().st_mtime
                size = sum(f.stat().st_size for f in entry.iterdir())
            except OSError:  # removed meanwhile
                continue
            if entry.name.startswith(".incoming-"):
                if now - used > self.grace_s:
                    shutil.rmtree(entry, ignore_errors=True)
                continue
            entries.append((used, size, entry))
        total = sum(size for _, size, _ in entries)
        for used, size, entry in sorted(entries, key=lambda e: e[0]):
            if total <= self.capacity_bytes or now - used < self.grace_s:
                break
            if entry == keep:
                continue
            shutil.rmtree(entry, ignore_errors=True)
            self._verified.pop(entry.name, None)
            total -= size

    def _intact(self, folder: Path, want: str) -> bool:
        try:
            stamp = _stamp(folder)  # before reading: a change during the read shows at the next call
            if self._verified.get(want) == stamp:
                return True
            ok = digest(read_files(folder)) == want
        except OSError:
            ok, stamp = False, ()
        if ok:
            self._verified[want] = stamp
        else:
            self._verified.pop(want, None)
        return ok

    def folder(self, bundle: AdapterBundle, fetch: Callable[[Any], Mapping[str, bytes]]) -> Path:
        """A local folder holding the bundle's files, verified: the copy on disk when it is intact, else fetched
        (`fetch(ref) -> {name: bytes}`), checked and written atomically."""
        with self._lock:
            gate = self._gates.setdefault(bundle.digest, threading.Lock())
        with gate:
            folder = self.root / bundle.digest
            if self._intact(folder, bundle.digest):
                return self._used(folder)
            shutil.rmtree(folder, ignore_errors=True)  # damaged or partial: fetch it again
            files = fetch(bundle.ref)
            if set(files) != set(FILES) or digest(files) != bundle.digest:
                raise AdapterTransferError(
                    f"adapter {bundle.name}: the bytes received do not match digest {bundle.digest}")
            self.root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".incoming-", dir=self.root))
            try:
                for name, data in files.items():
                    (staging / name).write_bytes(data)
                os.rename(staging, folder)
            except OSError:  # another replica on this node won the race (its copy is checked below), or the disk
                shutil.rmtree(staging, ignore_errors=True)
            else:
                self._verified[bundle.digest] = _stamp(folder)  # these are the bytes just checked
            if not self._intact(folder, bundle.digest):
                raise AdapterTransferError(f"adapter {bundle.name}: no intact copy could be written under {self.root}")
            self._trim(keep=folder)
            return folder

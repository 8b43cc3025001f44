"""How adapters travel to replicas: the control plane's bundle cache (built once, bounded by bytes) and a
replica's verified copies on disk (hashed when written or first found, and again only when their files change).
No Ray here: the object store's put and get are plain functions over a dict."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

import fleet.adapters as adapters
from fleet.adapters import (
    FILES,
    AdapterBundle,
    AdapterTransferError,
    BundleCache,
    LocalAdapters,
    digest,
    read_files,
)


def write_adapter(folder: Path, seed: int, size: int = 4096) -> dict[str, bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    files = {FILES[0]: f'{{"r": {seed}}}'.encode(), FILES[1]: os.urandom(size)}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


class Store:
    """The object store's part: put returns a reference, fetch gives the bytes back; both counted."""

    def __init__(self) -> None:
        self.objects: dict[int, dict[str, bytes]] = {}
        self.puts = self.fetches = 0
        self.lock = threading.Lock()

    def put(self, files: dict[str, bytes]) -> int:
        with self.lock:
            self.puts += 1
            ref = len(self.objects)
            self.objects[ref] = dict(files)
            return ref

    def fetch(self, ref: int) -> dict[str, bytes]:
        self.fetches += 1
        return self.objects[ref]


@pytest.fixture
def counted_digest(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = adapters.digest

    def counting(files):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return real(files)

    monkeypatch.setattr(adapters, "digest", counting)
    return calls


def test_a_burst_for_one_adapter_puts_it_once(tmp_path: Path) -> None:
    files = write_adapter(tmp_path / "a", seed=1)
    store = Store()
    cache = BundleCache(1 << 20, store.put)
    start = threading.Barrier(8)
    got: list[AdapterBundle] = []

    def ask() -> None:
        start.wait()
        got.append(cache.get("a:1", tmp_path / "a"))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.puts == 1 and len({id(b) for b in got}) == 1
    bundle = got[0]
    assert bundle.name == "a:1" and bundle.digest == digest(files) and store.objects[bundle.ref] == files
    assert cache.cached("a:1") is bundle and cache.held_bytes == sum(len(d) for d in files.values())


def test_the_least_recently_used_adapter_is_dropped_past_the_budget(tmp_path: Path) -> None:
    sizes = {}
    for i, name in enumerate("abc"):
        sizes[name] = sum(len(d) for d in write_adapter(tmp_path / name, seed=i, size=1000).values())
    store = Store()
    cache = BundleCache(sizes["a"] + sizes["b"] + 10, store.put)  # room for two
    cache.get("a", tmp_path / "a")
    cache.get("b", tmp_path / "b")
    cache.get("a", tmp_path / "a")  # a used after b: b is now the oldest
    cache.get("c", tmp_path / "c")
    assert cache.cached("b") is None and cache.cached("a") is not None and cache.cached("c") is not None
    assert len(cache) == 2 and cache.held_bytes == sizes["a"] + sizes["c"] and store.puts == 3
    cache.get("b", tmp_path / "b")  # asked again: put again, and a (now the oldest) goes
    assert store.puts == 4 and cache.cached("a") is None and len(cache) == 2

    tiny = BundleCache(10, store.put)  # an adapter larger than the whole budget is still kept while it is newest
    tiny.get("a", tmp_path / "a")
    assert tiny.cached("a") is not None
    tiny.get("b", tmp_path / "b")
    assert tiny.cached("a") is None and tiny.cached("b") is not None and tiny.held_bytes == sizes["b"]


def test_a_failed_build_raises_and_the_next_request_builds_again(tmp_path: Path) -> None:
    store = Store()
    cache = BundleCache(1 << 20, store.put)
    with pytest.raises(FileNotFoundError):
        cache.get("late", tmp_path / "late")
    assert cache.cached("late") is None and len(cache) == 0
    write_adapter(tmp_path / "late", seed=5)
    assert cache.get("late", tmp_path / "late").digest == digest(read_files(tmp_path / "late"))


def bundle_of(store: Store, files: dict[str, bytes], name: str = "x:1") -> AdapterBundle:
    return AdapterBundle(name, digest(files), store.put(files))


def test_a_verified_copy_is_read_again_only_when_its_files_change(tmp_path: Path, counted_digest: list[int]) -> None:
    store = Store()
    files = write_adapter(tmp_path / "src", seed=2)
    bundle = bundle_of(store, files)
    local = LocalAdapters(tmp_path / "node")
    folder = local.folder(bundle, store.fetch)
    assert folder == tmp_path / "node" / bundle.digest and read_files(folder) == files
    assert store.fetches == 1
    hashed = counted_digest[0]
    for _ in range(5):  # every later request: a stat, no fetch, no hash
        assert local.folder(bundle, store.fetch) == folder
    assert store.fetches == 1 and counted_digest[0] == hashed

    (folder / FILES[1]).write_bytes(b"\0" * len(files[FILES[1]]))  # same length, damaged
    assert local.folder(bundle, store.fetch) == folder
    assert store.fetches == 2 and read_files(folder) == files  # found out, fetched and written again

    import shutil

    shutil.rmtree(folder)  # removed under the replica (a cleanup, another process)
    assert local.folder(bundle, store.fetch) == folder and read_files(folder) == files and store.fetches == 3
    assert [p.name for p in (tmp_path / "node").iterdir()] == [bundle.digest]  # no staging folders left


def test_a_copy_found_on_disk_is_hashed_once_and_not_fetched(tmp_path: Path, counted_digest: list[int]) -> None:
    """A restarted replica, or another replica on the same node, finds the copy already there."""
    store = Store()
    files = write_adapter(tmp_path / "src", seed=3)
    bundle = bundle_of(store, files)
    LocalAdapters(tmp_path / "node").folder(bundle, store.fetch)
    fresh = LocalAdapters(tmp_path / "node")
    before = counted_digest[0]
    for _ in range(3):
        fresh.folder(bundle, store.fetch)
    assert store.fetches == 1 and counted_digest[0] == before + 1


def test_bytes_that_do_not_match_their_digest_are_refused_and_not_kept(tmp_path: Path) -> None:
    store = Store()
    files = write_adapter(tmp_path / "src", seed=4)
    bundle = bundle_of(store, files)
    store.objects[bundle.ref] = {**files, FILES[1]: files[FILES[1]][:-1] + b"!"}  # altered in transit
    local = LocalAdapters(tmp_path / "node")
    with pytest.raises(AdapterTransferError):
        local.folder(bundle, store.fetch)
    assert not (tmp_path / "node").exists() or not any((tmp_path / "node").iterdir())
    store.objects[bundle.ref] = files  # the next request gets the right bytes
    assert read_files(local.folder(bundle, store.fetch)) == files


def test_the_disk_keeps_the_adapters_used_last_within_its_budget(tmp_path: Path) -> None:
    store = Store()
    bundles = {name: bundle_of(store, write_adapter(tmp_path / "src" / name, seed=i, size=1000), name)
               for i, name in enumerate("abc")}
    size = sum(len(d) for d in store.objects[bundles["a"].ref].values())
    local = LocalAdapters(tmp_path / "node", capacity_bytes=2 * size + 10, grace_s=0.0)
    when = [1_000_000.0]

    def use(name: str) -> Path:
        folder = local.folder(bundles[name], store.fetch)
        when[0] += 60
        os.utime(folder, (when[0], when[0]))  # uses a minute apart, whatever the clock's resolution
        return folder

    use("a")
    use("b")
    use("a")  # b is now the one used longest ago
    use("c")
    assert sorted(p.name for p in (tmp_path / "node").iterdir()) == sorted([bundles["a"].digest, bundles["c"].digest])
    assert store.fetches == 3
    use("b")  # gone from the disk: fetched again, and a goes
    assert sorted(p.name for p in (tmp_path / "node").iterdir()) == sorted([bundles["b"].digest, bundles["c"].digest])
    assert store.fetches == 4


def test_folders_used_within_the_grace_period_stay_past_the_budget(tmp_path: Path) -> None:
    store = Store()
    local = LocalAdapters(tmp_path / "node", capacity_bytes=1, grace_s=600.0)
    for i in range(3):
        local.folder(bundle_of(store, write_adapter(tmp_path / "src" / str(i), seed=i), str(i)), store.fetch)
    assert len(list((tmp_path / "node").iterdir())) == 3  # each may be in a request its engine has not read yet

    left = tmp_path / "node" / ".incoming-crashed"  # a staging folder a killed replica left
    left.mkdir()
    (left / FILES[0]).write_bytes(b"{}")
    fresh = tmp_path / "node" / ".incoming-now"  # one being written right now
    fresh.mkdir()
    os.utime(left, (1_000_000.0, 1_000_000.0))
    local.folder(bundle_of(store, write_adapter(tmp_path / "src" / "3", seed=3), "3"), store.fetch)
    assert not left.exists() and fresh.exists()


def test_budgets_come_from_the_environment_in_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(adapters.DISK_MB_ENV, raising=False)
    assert adapters.budget_bytes(adapters.DISK_MB_ENV, 4096) == 4 << 30
    monkeypatch.setenv(adapters.DISK_MB_ENV, " 300 ")
    assert adapters.budget_bytes(adapters.DISK_MB_ENV, 4096) == 300 << 20
    for bad in ("0", "-5", "1.5", "lots"):
        monkeypatch.setenv(adapters.DISK_MB_ENV, bad)
        with pytest.raises(ValueError, match=adapters.DISK_MB_ENV):
            adapters.budget_bytes(adapters.DISK_MB_ENV, 4096)

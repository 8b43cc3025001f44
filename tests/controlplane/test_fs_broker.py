"""The embedded broker (`filesystem://`): a consumer never takes a message before it is whole, and an unreadable
message file is dropped instead of stopping the worker (stock kombu did both, and the worker died)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from queue import Empty

import pytest
from kombu import Connection

import controlplane.celery  # noqa: F401 - registers our transport for filesystem://
from controlplane.batches import fs_transport


@pytest.fixture
def conn(tmp_path: Path):
    folder = tmp_path / "queue"
    folder.mkdir()
    with Connection("filesystem://", transport_options={
            "data_folder_in": str(folder), "data_folder_out": str(folder), "control_folder": str(tmp_path),
            "store_processed": False, "polling_interval": 0.01}) as connection:
        yield connection


def test_filesystem_urls_use_the_atomic_transport(conn):
    assert isinstance(conn.default_channel, fs_transport.Channel)


def test_a_message_being_written_is_invisible_to_the_consumer(conn, monkeypatch):
    channel = conn.default_channel
    channel.queue_declare("q")
    seen_while_writing = []
    real_replace = os.replace

    def replace(src, dst):
        # The bytes are on disk under their temporary name; the consumer polls now, as it may at any moment.
        assert Path(src).stat().st_size > 0
        try:
            seen_while_writing.append(channel._get("q"))
        except Empty:
            seen_while_writing.append(None)
        real_replace(src, dst)

    monkeypatch.setattr(fs_transport.os, "replace", replace)
    channel._put("q", {"body": "hello"})
    assert seen_while_writing == [None]
    assert channel._get("q") == {"body": "hello"}


def test_an_unreadable_message_file_is_dropped_and_the_next_one_delivered(conn, tmp_path, caplog):
    queue = conn.SimpleQueue("q")
    # What a crash mid-write (or old kombu) leaves, named to sort before any real message (those start with a
    # digit).
    (tmp_path / "queue" / "!broken.q.msg").write_bytes(b"")
    queue.put({"n": 1})
    with caplog.at_level(logging.ERROR, logger="controlplane.batches"):
        message = queue.get(timeout=5)
    assert message.payload == {"n": 1}
    message.ack()
    assert "unreadable message" in caplog.text
    assert not list((tmp_path / "queue").glob("*.msg"))
    queue.close()


def test_messages_stay_in_order_when_the_clock_gains_a_digit(conn, monkeypatch):
    from controlplane.batches import fs_transport

    queue = conn.SimpleQueue("order")
    for n, seconds in enumerate((9.998, 9.999, 10.000, 10.001, 123.4)):  # 9998 ms ... 123400 ms
        monkeypatch.setattr(fs_transport.time, "monotonic", lambda s=seconds: s)
        queue.put({"n": n})
    got = []
    for _ in range(5):
        message = queue.get(timeout=5)
        got.append(message.payload["n"])
        message.ack()
    assert got == [0, 1, 2, 3, 4]
    queue.close()


def test_the_embedded_worker_is_started_again_when_it_stops_by_itself(tmp_path, monkeypatch):
    """Celery's worker exits on a broker error it does not expect; in embedded mode nothing else would run
    batches, so a fresh one starts and takes the queue on (stop() still stops for good)."""
    from controlplane.batches import runtime
    from controlplane.celery import app, use_broker

    previous = (app.conf.broker_url, app.conf.broker_transport_options, app.conf.task_default_queue)
    folder = str(tmp_path / "queue")
    # The queue's name stays: the app's queue table is built once per process, and other tests may have built it.
    use_broker("filesystem://", transport_options={
        "data_folder_in": folder, "data_folder_out": folder, "control_folder": str(tmp_path / "control"),
        "polling_interval": 0.05})
    ran: list[int] = []

    @app.task(name="tests.fs_broker.record")
    def record(n: int) -> None:
        ran.append(n)

    failures = [RuntimeError("the broker broke")]
    real_get = fs_transport.Channel._get

    def get(self, queue):
        if failures:
            raise failures.pop()
        return real_get(self, queue)

    monkeypatch.setattr(fs_transport.Channel, "_get", get)
    monkeypatch.setattr(runtime, "RESTART_DELAY_S", 0.05)
    worker = runtime.EmbeddedWorker(concurrency=2, beat=False, rebuild_queue=False, recover=False)
    try:
        worker.start()
        for n in range(5):
            record.delay(n)
        deadline = time.monotonic() + 30
        while len(ran) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(ran) == [0, 1, 2, 3, 4] and worker.restarts == 1 and not failures
    finally:
        thread = worker._thread
        worker.stop()
        use_broker(previous[0], queue=previous[2], transport_options=previous[1])
    assert thread is not None and not thread.is_alive()

"""Batch benchmark: does batch work leave interactive latency alone, and does it still get the engine's throughput?

One process, as `make run` runs it: uvicorn serving the ASGI app on loopback, the in-process engine, and the
embedded Celery worker (threads, kombu filesystem broker in a scratch dir) running a Workers AI queueRequest.

1. Interactive TTFT idle: streaming POST /ai/run requests one after another; time to the first SSE token.
2. Then, REPEATS times, side by side:
   a. engine idle throughput: a batch's worth of requests sent straight to the engine, all at once, nothing
      else running (generated tokens per second);
   b. the batch: as many requests (other prompts, the same shape) through the API and the worker (BATCH
      priority, capped), with probes running, each starting PROBE_GAP_DURING_S after the previous one ended
      (the probe client is a separate process). Its throughput is its generated tokens over its wall time
      (queued to completed).
   The ratio b/a of each repeat, and its median, is the figure: this machine is shared and drifts, so each
   batch is compared with the engine measured just before it.

Goals: TTFT while batches run <= 1.5x idle; batch throughput >= 80% of the engine's idle throughput.

Run: python -m benchmarks.batch [--quick]   (a throwaway SQLite database; models must be installed)
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MODEL = "@hearth/smollm2-135m-instruct"
TOPICS = ["lighthouses", "tides", "glaciers", "bees", "volcanoes", "libraries", "trains", "coral reefs",
          "bridges", "owls", "deserts", "clocks", "rivers", "comets", "forests", "harbours"]
PROBE_PROMPT = "In one short sentence, what is a lighthouse?"
PROBE_TOKENS = 8
# While the batch runs, one probe starts 1.5 s after the previous one ended: steady, modest interactive traffic.
# Back-to-back probes would make interactive work a fixed share of the engine, and the batch's throughput
# would measure that share rather than the batch path.
PROBE_GAP_DURING_S = 1.5


REPEATS = 3


def _prompt(i: int) -> str:
    return f"Write three sentences about {TOPICS[i % len(TOPICS)]} for reader number {i}."


def _setup(tmp: Path) -> tuple[str, str]:
    os.environ["HEARTH_SQLITE_PATH"] = str(tmp / "bench.sqlite3")
    os.environ["HEARTH_BATCH_WORKER"] = "off"  # started here, after the broker is pointed at the scratch dir
    os.environ.pop("CELERY_BROKER_URL", None)
    os.environ.pop("REDIS_URL", None)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)
    call_command("seed_catalog", stdout=io.StringIO())
    from controlplane.accounts.services import get_or_create_account, issue_key
    from controlplane.celery import use_broker

    folder = str(tmp / "broker")
    use_broker("filesystem://", queue="bench-batches", transport_options={
        "data_folder_in": folder, "data_folder_out": folder, "control_folder": str(tmp / "control"),
        "polling_interval": 0.1})
    account, _ = get_or_create_account("bench-batch")
    # A paid plan: the free daily allocation would refuse the load generator (429, 3036) part way through a run.
    type(account).objects.filter(pk=account.pk).update(paid_plan=True)
    _, secret = issue_key(account, name="bench", requests_per_minute=0, tokens_per_minute=0)
    return account.pk, secret


def _engine_idle_throughput(first: int, count: int, max_tokens: int) -> dict[str, Any]:
    from controlplane.serving.dispatch import get_backend
    from inference import GenerationRequest, Priority, SamplingParams

    engine = get_backend().engine_sync(MODEL)  # type: ignore[attr-defined]

    async def go() -> tuple[int, float]:
        requests = [GenerationRequest(engine.encode(prompt=_prompt(i)), SamplingParams(
            max_tokens=max_tokens, temperature=0), priority=Priority.INTERACTIVE) for i in range(first, first + count)]
        started = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(r) for r in requests))
        return sum(o.usage.completion_tokens for o in outs), time.perf_counter() - started

    tokens, seconds = asyncio.run(go())
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve() -> tuple[str, Any]:
    import uvicorn

    from controlplane.asgi import application

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(application, host="127.0.0.1", port=port, lifespan="off",
                                           log_level="warning", access_log=False))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


def _ttft(url: str, secret: str) -> float:
    import httpx

    started = time.perf_counter()
    with httpx.stream("POST", url, headers={"Authorization": f"Bearer {secret}"}, timeout=120, json={
            "prompt": PROBE_PROMPT, "max_tokens": PROBE_TOKENS, "temperature": 0, "stream": True}) as response:
        if response.status_code != 200:  # say what refused it: the envelope names the cause
            raise RuntimeError(f"probe refused: {response.status_code} {response.read().decode()[:500]}")
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("response"):
                return time.perf_counter() - started
    raise RuntimeError("the probe produced no token")


def _probes(url: str, secret: str, count: int, stop_file: str | None = None, gap: float = 0.2) -> list[float]:
    samples: list[float] = []
    while len(samples) < count and not (stop_file and os.path.exists(stop_file)):
        samples.append(_ttft(url, secret))
        time.sleep(gap)
    return samples


class ProbeClient:
    """The interactive client, in a process of its own as a real client would be: in the server's process its
    HTTP and SSE parsing would hold the server's GIL and be charged to the batch."""

    def __init__(self, url: str, secret: str, count: int, gap: float, scratch: Path) -> None:
        import subprocess
        import sys

        self.stop_file = scratch / f"stop-probes-{time.monotonic_ns()}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.batch", "--probe", url, "--count", str(count), "--gap", str(gap),
             "--stop-file", str(self.stop_file)], env={**os.environ, "HEARTH_PROBE_SECRET": secret},
            cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, text=True)

    def finish(self, timeout: float = 120.0, *, stop: bool = True) -> list[float]:
        """Every sample, once the client has taken its count, or (stop) after the probe in flight."""
        if stop:
            self.stop_file.touch()
        out, _ = self.proc.communicate(timeout=timeout)
        if self.proc.returncode != 0:
            raise RuntimeError(f"the probe client failed ({self.proc.returncode})")
        return json.loads(out.strip().splitlines()[-1])


def _batch_through_api(ctx: Any, first: int, items: int, max_tokens: int, probe: ProbeClient) -> dict[str, Any]:
    """One batch through the API and the worker while the probe client runs; its throughput and the probes."""
    from controlplane.batches import services
    from controlplane.batches.models import Batch, Item

    batch = services.create_native_batch(ctx, MODEL, [
        (None, {"prompt": _prompt(i), "max_tokens": max_tokens, "temperature": 0})
        for i in range(first, first + items)])
    while Batch.objects.get(pk=batch.pk).status not in Batch.TERMINAL:
        time.sleep(0.2)
    during = probe.finish()
    done = Batch.objects.get(pk=batch.pk)
    generated = sum(Item.objects.filter(batch=batch).values_list("output_tokens", flat=True))
    wall = (done.finished_at - done.created_at).total_seconds()
    return {"status": done.status, "completed": done.completed_count, "failed": done.failed_count,
            "tokens": generated, "seconds": wall, "tokens_per_s": generated / wall, "ttft_during": during}


def run(quick: bool = False, items: int | None = None, max_tokens: int | None = None,
        repeats: int | None = None) -> dict[str, Any]:
    items = items or (100 if quick else 1000)
    max_tokens = max_tokens or (16 if quick else 32)
    repeats = repeats or (1 if quick else REPEATS)
    probes = 8 if quick else 30
    with tempfile.TemporaryDirectory(prefix="hearth-bench-batch-") as tmp:
        account_id, secret = _setup(Path(tmp))
        from controlplane.accounts.services import authenticate_key
        from controlplane.batches.runtime import EmbeddedWorker

        base, server = _serve()
        url = f"{base}/client/v4/accounts/{account_id}/ai/run/{MODEL}"
        _engine_idle_throughput(0, 64, 4)  # loads the engine and warms it
        ttft_idle = ProbeClient(url, secret, probes + 1, 0.2, Path(tmp)).finish(600, stop=False)[1:]  # 1st warms
        worker = EmbeddedWorker(beat=False, rebuild_queue=False, recover=False)
        worker.start()
        rounds = []
        try:
            ctx = authenticate_key(secret)
            for repeat in range(repeats):
                first = (2 * repeat + 1) * items  # fresh prompts for every run: no run reuses another's KV
                idle = _engine_idle_throughput(first, items, max_tokens)
                prober = ProbeClient(url, secret, 10**6, PROBE_GAP_DURING_S, Path(tmp))
                batch = _batch_through_api(ctx, first + items, items, max_tokens, prober)
                rounds.append({"engine_idle": idle, "batch": batch,
                               "throughput_ratio": batch["tokens_per_s"] / idle["tokens_per_s"]})
        finally:
            worker.stop()
            server.should_exit = True
        during = [t for r in rounds for t in r["batch"].pop("ttft_during")]
        ttft_ratio = statistics.median(during) / statistics.median(ttft_idle) if during else None
        from django.conf import settings

        return {
            "model": MODEL, "items": items, "max_tokens": max_tokens, "repeats": repeats, "rounds": rounds,
            "completed": sum(r["batch"]["completed"] for r in rounds),
            "failed": sum(r["batch"]["failed"] for r in rounds),
            "worker_threads": settings.HEARTH_BATCH_CONCURRENCY, "engine_batch_cap": settings.HEARTH_BATCH_ENGINE_SEQS,
            "run_items": getattr(settings, "HEARTH_BATCH_RUN_ITEMS", 1),
            "throughput_ratio": statistics.median(r["throughput_ratio"] for r in rounds),
            "ttft_idle_ms": statistics.median(ttft_idle) * 1000,
            "ttft_during_ms": statistics.median(during) * 1000 if during else None,
            "ttft_during_p90_ms": statistics.quantiles(during, n=10)[-1] * 1000 if len(during) >= 10 else None,
            "ttft_samples": [len(ttft_idle), len(during)], "ttft_ratio": ttft_ratio,
            "load_average_before": os.getloadavg()[0],
        }


def markdown(r: dict[str, Any]) -> str:
    def ok(good: bool) -> str:
        return "yes" if good else "no"

    ratio = r["ttft_ratio"]
    during = f"{r['ttft_during_ms']:.0f} ms" if r["ttft_during_ms"] is not None else "n/a"
    rounds = r["rounds"]
    per_round = ", ".join(f"{x['batch']['tokens_per_s']:.0f} vs {x['engine_idle']['tokens_per_s']:.0f} tok/s "
                          f"({x['throughput_ratio']:.0%})" for x in rounds)
    return "\n".join([
        f"`{r['model']}`: {r['repeats']} times, the engine alone on {r['items']} requests ({r['max_tokens']} output "
        f"tokens at most, greedy), then a Workers AI queueRequest of {r['items']} other requests of the same shape "
        f"through the API and the embedded Celery worker ({r['worker_threads']} threads, runs of up to "
        f"{r.get('run_items', 1)} items a message, engine cap "
        f"{r['engine_batch_cap']} BATCH sequences); {r['completed']} items completed, {r['failed']} failed. "
        f"Interactive probes: streaming POST /ai/run from a client process of their own, {PROBE_TOKENS} tokens, "
        "one at a time "
        f"({r['ttft_samples'][0]} idle, {r['ttft_samples'][1]} while batches ran, each {PROBE_GAP_DURING_S} s "
        "after the previous one ended).",
        "",
        "| batch benchmark | result | reference | ratio | goal | met |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| interactive TTFT, median (batch running vs idle) | {during} | {r['ttft_idle_ms']:.0f} ms | "
        f"{ratio:.2f}× | ≤ 1.5× | {ok(ratio is not None and ratio <= 1.5)} |" if ratio is not None else
        "| interactive TTFT | no probe finished during the batch | | | ≤ 1.5× | no |",
        f"| batch throughput vs the engine alone just before it, median of {len(rounds)} | {per_round} | | "
        f"{r['throughput_ratio']:.0%} | ≥ 80% | {ok(r['throughput_ratio'] >= 0.8)} |",
    ])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="100 items and fewer probes (a smoke run)")
    parser.add_argument("--items", type=int, help="batch size (default 1000, quick 100)")
    parser.add_argument("--max-tokens", type=int, help="output tokens per item (default 32, quick 16)")
    parser.add_argument("--repeats", type=int, help=f"engine-then-batch rounds (default {REPEATS}, quick 1)")
    parser.add_argument("--probe", metavar="URL", help=argparse.SUPPRESS)  # the ProbeClient process
    parser.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--gap", type=float, default=0.2, help=argparse.SUPPRESS)
    parser.add_argument("--stop-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(_probes(args.probe, os.environ["HEARTH_PROBE_SECRET"], args.count, args.stop_file,
                                 args.gap)))
    else:
        result = run(quick=args.quick, items=args.items, max_tokens=args.max_tokens, repeats=args.repeats)
        print(json.dumps(result, indent=2, default=str))
        print(markdown(result))

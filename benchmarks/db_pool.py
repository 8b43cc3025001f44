"""PostgreSQL's session pool: request latency with it and without it, side by side.

Under ASGI each request runs its database work on a thread of its own, so without a pool every request that
touches the database opens a new PostgreSQL session (the server starts a process for it) and closes it at the
end. This starts uvicorn on the control plane with DB_POOL off and on in alternating rounds and times
sequential requests (one client, one connection) on three routes: two that read nothing from the database once
the key's context is cached (`/v1/models`, the native model search) and one that does on every call
(`/v1/batches`, the tenant's batches).

    HEARTH_BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:5432/hearth_bench python -m benchmarks.db_pool

It needs a scratch PostgreSQL database (`createdb hearth_bench`; it is migrated and written to here) and says so
without one. It reads its own variable, never DATABASE_URL: `make bench` in an environment set up for a real
control plane must not write benchmark accounts into that database.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/hearth_bench"
ROUNDS = 3
REQUESTS = 200


def _prepare(url: str) -> tuple[str, str] | str:
    """Migrate the scratch database and issue a key: (account id, secret), or why it cannot run."""
    code = ("import django, io; django.setup(); from django.core.management import call_command;"
            "call_command('migrate', verbosity=0, interactive=False);"
            "from controlplane.accounts.services import get_or_create_account, issue_key;"
            "a, _ = get_or_create_account('db-pool-bench'); type(a).objects.filter(pk=a.pk).update(paid_plan=True);"
            "_, s = issue_key(a, name='bench', requests_per_minute=0, tokens_per_minute=0); print('@@', a.pk, s)")
    env = {**os.environ, "DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith("@@ "):
            _, account, secret = line.split()
            return account, secret
    return f"no PostgreSQL scratch database at {url}: {out.stderr.strip().splitlines()[-1:]}"


def _round(url: str, pool: str, account: str, secret: str) -> dict[str, float]:
    import httpx

    from benchmarks.api import uvicorn_server

    env = {**os.environ, "DATABASE_URL": url, "DB_POOL": pool, "HEARTH_BATCH_WORKER": "off"}
    routes = {"/v1/models": "/v1/models", "native model search": f"/client/v4/accounts/{account}/ai/models/search",
              "/v1/batches": "/v1/batches"}
    medians: dict[str, float] = {}
    with uvicorn_server(env) as base, httpx.Client(base_url=base, timeout=30,
                                                   headers={"Authorization": f"Bearer {secret}"}) as client:
        for name, path in routes.items():
            for _ in range(20):  # the key's context cached, the pool filled, the code paths warm
                client.get(path).raise_for_status()
            times = []
            for _ in range(REQUESTS):
                started = time.perf_counter()
                client.get(path).raise_for_status()
                times.append((time.perf_counter() - started) * 1000)
            medians[name] = statistics.median(times)
    return medians


def run(quick: bool = False) -> dict[str, Any]:
    url = os.environ.get("HEARTH_BENCH_DATABASE_URL") or DEFAULT_URL
    prepared = _prepare(url)
    if isinstance(prepared, str):
        return {"skipped": prepared}
    account, secret = prepared
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for _ in range(1 if quick else ROUNDS):
        for pool in ("off", "on"):
            runs[pool].append(_round(url, pool, account, secret))
            print(pool, runs[pool][-1], file=sys.stderr, flush=True)
    return {"rounds": len(runs["on"]), "requests": REQUESTS, "runs": runs}


def markdown(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"Not measured: {r['skipped']}."
    lines = [f"Sequential GETs with a key, one connection, {r['requests']} timed per route and round after 20 "
             f"untimed; uvicorn with DB_POOL off and on in {r['rounds']} alternating rounds, the batch worker off; "
             "medians of each round's median (ms), ratio off / on per round.",
             "", "| route | pool off (ms) | pool on (ms) | off / on [rounds] |", "| --- | --- | --- | --- |"]
    for route in r["runs"]["on"][0]:
        off = [x[route] for x in r["runs"]["off"]]
        on = [x[route] for x in r["runs"]["on"]]
        ratios = [a / b for a, b in zip(off, on, strict=True)]
        lines.append(f"| {route} | {statistics.median(off):.2f} | {statistics.median(on):.2f} | "
                     f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] |")
    return "\n".join(lines)


if __name__ == "__main__":
    result = run("--quick" in sys.argv)
    print(markdown(result))

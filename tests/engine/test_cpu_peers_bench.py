"""The CPU-peers benchmark's harness: a single stream's share of the bandwidth ceiling is taken against the memory
rate measured inside the very process that ran the passes, since a VM's rate swings by 1.7x within minutes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import cpu_peers
from benchmarks.peers import memory_probe

SCRIPT = Path(cpu_peers.__file__).with_name("peers.py")


def test_the_probe_measures_reads_and_copies_and_leaves_the_thread_count_as_it_found_it() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates = memory_probe(threads=2, rounds=2)()
        assert torch.get_num_threads() == 1  # a peer's own setting (vLLM binds its threads) is put back
    finally:
        torch.set_num_threads(before)
    assert set(rates) == {"read", "copy"}
    # Anything from a laptop to a server moves between 1 and 2,000 GB/s; zero or inf would be a broken timer.
    assert all(1.0 < gbs < 2000.0 for gbs in rates.values()), rates


def test_each_process_is_held_against_its_own_rate_not_the_runs_median() -> None:
    # Two processes of one engine: the second ran while the VM gave twice the bandwidth, and ran twice as fast.
    probes = [{"tok_s": 10.0, "read": 20.0, "copy": 16.0}, {"tok_s": 20.0, "read": 40.0, "copy": 32.0}]
    shares = cpu_peers.ceiling_shares(probes, weight_bytes=10**9)
    assert shares is not None
    assert shares["read"] == pytest.approx(0.5) and shares["copy"] == pytest.approx(0.625)
    # Against the run's median rate (30 GB/s) the same processes would read 33% and 67%: the swing, not the engine.
    assert shares["ceiling_tok_s"] == pytest.approx(30.0) and shares["read_gbs"] == pytest.approx(30.0)
    assert cpu_peers.ceiling_shares([], weight_bytes=10**9) is None


def test_a_hearth_process_reports_its_rates_and_the_table_shows_its_share(tiny_llama: Path) -> None:
    env = {**os.environ, "HEARTH_PEERS_PROBE_MIB": "64"}
    out = subprocess.run([sys.executable, str(SCRIPT), "hearth", "single", "--model-dir", str(tiny_llama),
                          "--model-id", str(tiny_llama), "--threads", "1", "--new-tokens", "4"],
                         capture_output=True, text=True, env=env, timeout=300, check=True)
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["tok_s"] > 0 and line["read_gbs"] > 1.0 and line["copy_gbs"] > 1.0, line
    weights = cpu_peers.weight_bytes(str(tiny_llama), "float32")
    row = {"model": "tiny", "dtype": "float32", "workload": "single", "quantization": "none", "versions": {},
           "weight_bytes": weights, "median": {"hearth": line["tok_s"]}, "ratio": None,
           "probes": {"hearth": [{"tok_s": line["tok_s"], "read": line["read_gbs"], "copy": line["copy_gbs"]}],
                      "vllm": []}}
    share = line["tok_s"] * weights / (line["read_gbs"] * 1e9)
    table = cpu_peers.markdown({"rows": [row], "new_tokens": 4, "threads": 1, "flags": "avx2", "pairs": 1,
                                "peer": False, "bandwidth_gbs": 9.9, "malloc": ""})
    cells = table.splitlines()[-1].split(" | ")
    assert f"({share:.0%}; copy " in cells[-1] and f"at {line['read_gbs']:.0f} GB/s" in cells[-1], cells

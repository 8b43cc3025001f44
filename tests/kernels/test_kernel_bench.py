"""The kernel benchmark's harness: every kernel checked against its reference before it is timed.

Without CUDA it runs at toy sizes under TRITON_INTERPRET=1 (its timings mean nothing there); on CUDA this test
runs the real sizes in quick form.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from benchmarks import kernels as bench  # noqa: E402


def test_every_kernel_matches_its_reference_and_is_timed() -> None:
    result = bench.run(quick=True, interpret=True)
    rows = result["rows"]
    assert {r["kernel"] for r in rows} == {"paged decode attention", "received attention (eviction metric)",
                                           "paged extend attention", "cache move (compaction)"}
    for row in rows:
        if row["kernel"] == "cache move (compaction)":
            assert row["rel_error"] == 0.0, row  # exact
        elif row["kernel"].startswith("received"):
            assert row["rel_error"] < 1e-4, row  # fp32 probabilities from bf16 inputs, as the reference
        else:
            assert row["rel_error"] < 2e-2, row  # a bf16 output
        assert row["kernel_ms"] > 0 and row["reference_ms"] > 0 and row["bytes"] > 0
    # The compressed case holds fewer entries than the full one, so it must move fewer bytes.
    decode = [r for r in rows if r["kernel"] == "paged decode attention"]
    assert decode[1]["bytes"] < decode[0]["bytes"]
    table = bench.markdown(result)
    assert table.count("\n| ") == len(rows) + 2  # header, separator, one line per row


def test_compressed_lengths_average_the_rate() -> None:
    lens = bench.compressed_lens(64, 2, 4096, 8, seed=0)
    assert lens.min() >= 1 and lens.max() <= 4096
    assert abs(float(lens.float().mean()) - 512) < 8
    assert lens.max() > 2 * lens.min()  # heads differ, as variable budgets do


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path is what is checked here")
def test_without_cuda_it_says_it_did_not_run() -> None:
    result = bench.run(quick=True)
    assert "no CUDA device" in result["skipped"]
    assert bench.markdown(result).startswith("Not run: no CUDA device")

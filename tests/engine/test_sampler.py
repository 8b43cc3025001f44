"""The batched sampler against a plain per-row reference, on fresh random logits."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from inference.sampler import GREEDY_EPS, SampledToken, Sampler, SamplingRow, make_generator
from inference.sampling_params import SamplingParams


def row(params: SamplingParams, prompt: Sequence[int] = (), output: Sequence[int] = (),
        generator: torch.Generator | None = None) -> SamplingRow:
    if generator is None and params.seed is not None:
        generator = make_generator(params.seed)
    return SamplingRow(params=params, generator=generator, prompt_token_ids=prompt, output_token_ids=output)


# ---------------------------------------------------------------- reference, one row at a time, float64


def ref_penalised(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    x = logits.double().clone()
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def ref_distribution(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    x = ref_penalised(logits, p, prompt, output)
    if p.temperature < GREEDY_EPS:
        out = torch.zeros_like(x)
        out[int(x.argmax())] = 1.0
        return out
    x = x / p.temperature
    order = sorted(range(len(x)), key=lambda i: -float(x[i]))
    allowed = set(order[:p.top_k]) if p.top_k > 0 else set(order)
    probs = torch.zeros_like(x)
    idx = sorted(allowed)
    probs[idx] = torch.softmax(x[idx], dim=0)
    if p.top_p < 1.0:
        nucleus, mass = [], 0.0
        for i in order:
            if i not in allowed or mass >= p.top_p:
                continue
            nucleus.append(i)
            mass += float(probs[i])
        allowed = set(nucleus)
    keep = torch.zeros_like(x, dtype=torch.bool)
    keep[sorted(allowed)] = True
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum()
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs = probs / probs.sum()
    return probs


def chi2_critical(df: int, z: float = 3.29) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.29: about the 99.95th percentile)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.0, 0.3, 0.7, 1.0, 1.5]),
        top_k=rng.choice([0, 0, 1, 5, 40, 200, 300]),
        top_p=rng.choice([1.0, 1.0, 0.5, 0.9]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.2]),
        repetition_penalty=rng.choice([1.0, 1.0, 0.8, 1.3]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.5, -0.7]),
        presence_penalty=rng.choice([0.0, 0.0, 1.0, -0.4]),
        seed=rng.choice([None, rng.randrange(2**31)]),
        logprobs=rng.choice([None, None, 0, 3]),
    )


def random_ids(rng: random.Random, vocab: int, n_max: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(rng.randrange(n_max + 1))]


# ---------------------------------------------------------------- greedy and the fast path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_rows_take_the_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = Sampler()(logits, [row(SamplingParams(temperature=0.0)) for _ in range(16)])
    assert [t.token_id for t in out] == logits.float().argmax(dim=-1).tolist()
    assert all(t.logprob is None and t.top is None for t in out)


def test_greedy_rows_in_a_mixed_batch_take_the_argmax_of_the_penalised_logits() -> None:
    rng = random.Random(2)
    logits = torch.randn(12, 300, generator=torch.Generator().manual_seed(2))
    rows = []
    for i in range(12):
        greedy = i % 2 == 0
        params = SamplingParams(temperature=0.0 if greedy else 0.9, top_p=0.8,
                                repetition_penalty=1.5 if i % 3 else 1.0, presence_penalty=0.5)
        rows.append(row(params, random_ids(rng, 300, 40), random_ids(rng, 300, 40)))
    out = Sampler(seed=0)(logits, rows)
    for i in range(0, 12, 2):
        ref = ref_penalised(logits[i], rows[i].params, list(rows[i].prompt_token_ids),
                            list(rows[i].output_token_ids))
        assert out[i].token_id == int(ref.argmax())


def test_sampler_leaves_the_callers_logits_alone() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    rows = [row(SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.8), [1, 2, 3], [4]),
            row(SamplingParams(frequency_penalty=1.0, top_p=0.5), [], [7, 7]),
            row(SamplingParams(temperature=0.0, min_p=0.3))]
    Sampler()(logits, rows)
    Sampler().probabilities(logits, rows)
    assert torch.equal(logits, before)


def test_wrong_logits_shape_is_rejected() -> None:
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(2, 10), [row(SamplingParams())])


# ---------------------------------------------------------------- distributions


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampled_frequencies_follow_softmax_of_scaled_logits(temperature: float) -> None:
    vocab, n = 8, 24_000
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(4))
    logits = base.expand(n, vocab).contiguous()
    out = Sampler(seed=5)(logits, [row(SamplingParams(temperature=temperature))] * n)
    counts = np.bincount([t.token_id for t in out], minlength=vocab)
    expected = torch.softmax(base.double() / temperature, dim=0).numpy() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < chi2_critical(vocab - 1)
    assert 0.5 * np.abs(counts / n - expected / n).sum() < 0.02


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.7),
    SamplingParams(min_p=0.15),
    SamplingParams(temperature=1.2, top_k=6, top_p=0.9, min_p=0.05, repetition_penalty=1.4,
                   frequency_penalty=0.3, presence_penalty=0.2),
], ids=["top_k", "top_p", "min_p", "everything"])
def test_sampled_frequencies_follow_the_filtered_distribution(params: SamplingParams) -> None:
    vocab, n = 10, 20_000
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(6))
    logits = base.expand(n, vocab).contiguous()
    rows = [row(params, [0, 1], [1, 2, 2])] * n
    sampler = Sampler(seed=7)
    out = sampler(logits, rows)
    expected_p = ref_distribution(base, params, [0, 1], [1, 2, 2])
    assert torch.allclose(sampler.probabilities(logits[:1], rows[:1])[0].double(), expected_p, atol=1e-5)
    counts = np.bincount([t.token_id for t in out], minlength=vocab)
    support = expected_p.numpy() > 0
    assert counts[~support].sum() == 0  # a filtered-out token is never drawn
    expected = expected_p.numpy()[support] * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < chi2_critical(max(int(support.sum()) - 1, 1))


@pytest.mark.parametrize("k", [1, 2, 17, 100, 999, 1000, 5000])
def test_top_k_keeps_exactly_the_k_most_likely(k: int) -> None:
    vocab = 1000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(k))
    probs = Sampler().probabilities(logits, [row(SamplingParams(top_k=k))] * 4)
    for i in range(4):
        kept = set(torch.nonzero(probs[i]).flatten().tolist())
        assert kept == set(logits[i].topk(min(k, vocab)).indices.tolist())
        assert math.isclose(float(probs[i].sum()), 1.0, rel_tol=1e-5)


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.9, 0.99])
def test_top_p_keeps_the_minimal_nucleus(top_p: float) -> None:
    vocab = 500
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(int(top_p * 100))) * 2
    probs = Sampler().probabilities(logits, [row(SamplingParams(top_p=top_p))] * 4)
    for i in range(4):
        full = torch.softmax(logits[i].double(), dim=0)
        kept = torch.nonzero(probs[i]).flatten()
        mass = float(full[kept].sum())
        smallest_kept = float(full[kept].min())
        assert mass >= top_p  # enough mass ...
        assert mass - smallest_kept < top_p  # ... and nothing to spare
        assert smallest_kept >= float(full[probs[i] == 0].max())  # the most likely ones, in order
        assert torch.allclose(probs[i].double()[kept], full[kept] / mass, atol=1e-6)


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_drops_tokens_below_the_scaled_maximum(min_p: float) -> None:
    vocab = 400
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(int(min_p * 100))) * 3
    probs = Sampler().probabilities(logits, [row(SamplingParams(min_p=min_p, temperature=0.9))] * 3)
    for i in range(3):
        full = torch.softmax(logits[i].double() / 0.9, dim=0)
        expected = full >= min_p * full.max()
        assert torch.equal(probs[i] > 0, expected)


# ---------------------------------------------------------------- penalties


@pytest.mark.parametrize("params", [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(frequency_penalty=0.8),
    SamplingParams(frequency_penalty=-1.5),
    SamplingParams(presence_penalty=1.2),
    SamplingParams(presence_penalty=-0.9),
    SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.6),
], ids=["rep>1", "rep<1", "freq", "freq<0", "pres", "pres<0", "all"])
def test_each_penalty_changes_exactly_the_expected_logits(params: SamplingParams) -> None:
    vocab = 200
    prompt = [3, 5, 5, 9, 150]
    output = [5, 11, 11, 11, 42, 199]
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(8)) * 3
    got = torch.log(Sampler().probabilities(logits, [row(params, prompt, output)])[0].double())
    ref = ref_penalised(logits[0], params, prompt, output)
    # A distribution fixes logits up to a constant: compare after log-softmax.
    assert torch.allclose(got, torch.log_softmax(ref, dim=0), atol=1e-5)

    shift = got - torch.log_softmax(logits[0].double(), dim=0)
    untouched = torch.ones(vocab, dtype=torch.bool)
    seen = set(output) | (set(prompt) if params.repetition_penalty != 1.0 else set())
    untouched[sorted(seen)] = False
    # Unpenalised tokens all move by the same normalisation constant; every penalised one moves otherwise.
    assert torch.allclose(shift[untouched], shift[untouched][0].expand(int(untouched.sum())), atol=1e-5)
    assert not torch.isclose(shift[~untouched], shift[untouched][0], atol=1e-4).any()


def test_frequency_and_presence_ignore_the_prompt() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(9))
    params = SamplingParams(frequency_penalty=2.0, presence_penalty=2.0)
    with_prompt = Sampler().probabilities(logits, [row(params, [1, 2, 3, 4] * 10, [])])
    assert torch.allclose(with_prompt, torch.softmax(logits, dim=-1), atol=1e-6)


def test_token_ids_given_as_arrays_penalise_like_lists() -> None:
    import array
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(10))
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5)
    prompt, output = [1, 2, 3, 2], [5, 5, 6]
    as_lists = Sampler().probabilities(logits, [row(params, prompt, output)])
    for wrap in (lambda s: array.array("q", s), lambda s: np.asarray(s, dtype=np.int32), torch.tensor, tuple):
        got = Sampler().probabilities(logits, [row(params, wrap(prompt), wrap(output))])
        assert torch.equal(got, as_lists)


# ---------------------------------------------------------------- mixed batches


def test_mixed_batch_matches_the_per_row_reference() -> None:
    rng = random.Random(11)
    vocab, batch = 257, 48
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(11)) * 2
    rows = [row(random_params(rng), random_ids(rng, vocab, 30), random_ids(rng, vocab, 30)) for _ in range(batch)]
    assert len({(r.params.temperature == 0, r.params.top_k, r.params.top_p) for r in rows}) > 8
    sampler = Sampler(seed=12)
    probs = sampler.probabilities(logits, rows)
    out = sampler(logits, rows)
    for i, r in enumerate(rows):
        prompt, output = list(r.prompt_token_ids), list(r.output_token_ids)
        ref = ref_distribution(logits[i], r.params, prompt, output)
        assert torch.allclose(probs[i].double(), ref, atol=1e-5), i
        assert ref[out[i].token_id] > 0, i
        if r.params.logprobs is None:
            assert out[i].logprob is None and out[i].top is None
        else:
            lp = torch.log_softmax(ref_penalised(logits[i], r.params, prompt, output), dim=0)
            assert math.isclose(out[i].logprob, float(lp[out[i].token_id]), abs_tol=1e-4)
            assert len(out[i].top) == r.params.logprobs


def test_empty_batch() -> None:
    assert Sampler()(torch.zeros(0, 10), []) == []
    assert Sampler().probabilities(torch.zeros(0, 10), []).shape == (0, 10)


# ---------------------------------------------------------------- seeds


def _run_seeded(seed: int, position: int, batch: int, steps: int, vocab: int, noise_seed: int) -> list[int]:
    """Decode `steps` tokens for one seeded request at `position` among random neighbours."""
    logits_gen = torch.Generator().manual_seed(99)  # the seeded request sees the same logits every run
    noise = random.Random(noise_seed)
    target = row(SamplingParams(temperature=1.0, top_p=0.95, seed=seed))
    neighbours = [row(random_params(noise)) for _ in range(batch - 1)]
    sampler = Sampler(seed=noise_seed)
    tokens = []
    for _ in range(steps):
        mine = torch.randn(1, vocab, generator=logits_gen)
        others = torch.randn(batch - 1, vocab, generator=torch.Generator().manual_seed(noise.randrange(2**31)))
        logits = torch.cat([others[:position], mine, others[position:]])
        rows = neighbours[:position] + [target] + neighbours[position:]
        tokens.append(sampler(logits, rows)[position].token_id)
    return tokens


def test_seeded_request_is_reproducible_whatever_shares_its_batch() -> None:
    alone = _run_seeded(seed=1234, position=0, batch=1, steps=25, vocab=1000, noise_seed=1)
    crowded = _run_seeded(seed=1234, position=6, batch=17, steps=25, vocab=1000, noise_seed=2)
    last = _run_seeded(seed=1234, position=31, batch=32, steps=25, vocab=1000, noise_seed=3)
    assert alone == crowded == last
    assert _run_seeded(seed=4321, position=0, batch=1, steps=25, vocab=1000, noise_seed=1) != alone


def test_unseeded_generators_differ() -> None:
    draws = {torch.rand(4, generator=make_generator(None)).tolist()[0] for _ in range(5)}
    assert len(draws) == 5
    assert torch.equal(torch.rand(4, generator=make_generator(3)), torch.rand(4, generator=make_generator(3)))


# ---------------------------------------------------------------- logprobs


@pytest.mark.parametrize("n", [0, 1, 5, 20])
def test_logprobs_are_log_softmax_of_penalised_logits_with_sorted_alternatives(n: int) -> None:
    vocab = 3000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(n)) * 2
    params = [SamplingParams(temperature=0.0, logprobs=n),
              SamplingParams(temperature=0.6, top_k=10, logprobs=n, repetition_penalty=1.2),
              SamplingParams(temperature=1.0, logprobs=None)]
    rows = [row(params[0]), row(params[1], [1, 2], [3]), row(params[2])]
    out: list[SampledToken] = Sampler(seed=13)(logits, rows)
    for i in range(2):
        lp = torch.log_softmax(ref_penalised(logits[i], params[i], list(rows[i].prompt_token_ids),
                                             list(rows[i].output_token_ids)), dim=0)
        assert math.isclose(out[i].logprob, float(lp[out[i].token_id]), abs_tol=1e-4)
        assert len(out[i].top) == n
        assert [t for t, _ in out[i].top] == lp.topk(n).indices.tolist()
        values = [v for _, v in out[i].top]
        assert values == sorted(values, reverse=True)
        for t, v in out[i].top:
            assert math.isclose(v, float(lp[t]), abs_tol=1e-4)
    assert out[2].logprob is None and out[2].top is None


# ---------------------------------------------------------------- devices


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu() -> None:
    rng = random.Random(14)
    vocab, batch = 4096, 64
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(14)) * 2
    rows = [row(random_params(rng), random_ids(rng, vocab, 50), random_ids(rng, vocab, 50)) for _ in range(batch)]
    on_cpu = Sampler().probabilities(logits, rows)
    on_gpu = Sampler().probabilities(logits.cuda(), rows)
    assert on_gpu.is_cuda
    assert torch.allclose(on_gpu.cpu(), on_cpu, atol=1e-5)
    tokens = Sampler()(logits.cuda().to(torch.bfloat16), rows)
    assert all(on_cpu[i, t.token_id] > 0 or rows[i].params.temperature == 0 for i, t in enumerate(tokens))
    # Seeded rows draw the same token on either device.
    seeded = [row(SamplingParams(temperature=1.0, seed=s)) for s in range(batch)]
    on_cpu = [t.token_id for t in Sampler()(logits, seeded)]
    seeded = [row(SamplingParams(temperature=1.0, seed=s)) for s in range(batch)]
    on_gpu = [t.token_id for t in Sampler()(logits.cuda(), seeded)]
    assert on_cpu == on_gpu


def test_logits_from_inference_mode_or_autograd_are_accepted() -> None:
    rows = [row(SamplingParams(top_p=0.5, repetition_penalty=1.2), [1], [2]), row(SamplingParams(top_k=300))]
    base = torch.randn(2, 1000, generator=torch.Generator().manual_seed(15))
    expected = Sampler().probabilities(base, rows)
    with torch.inference_mode():
        assert torch.equal(Sampler().probabilities(base.clone(), rows), expected)
    tracked = base.clone().requires_grad_()
    got = Sampler().probabilities(tracked, rows)
    assert not got.requires_grad and torch.equal(got, expected)
    assert len(Sampler()(tracked, rows)) == 2

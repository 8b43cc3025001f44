"""Verification of draft tokens: greedy matching and speculative rejection sampling.

The statistical tests run speculative decoding of a small Markov "model" (V = 8 tokens, the next-token
distribution depends on the previous token) and compare what it emits with the target's exact
distributions by a chi-square test. Seeds are fixed, so each test is deterministic; the negative controls
show that the same test rejects a verifier that is fed the wrong draft distribution.
"""

from __future__ import annotations

import pytest
import torch

from inference.spec.rejection import rejection_sample, verify_greedy

V = 8
K = 3
N = 40_000  # trials per statistical test: enough that a TV bias of ~0.02 is far beyond the threshold
PASS_P = 1e-3  # a correct verifier must not look this unlikely...
FAIL_P = 1e-6  # ...and a biased one must look at least this unlikely


def _random_dist(shape: tuple[int, ...], gen: torch.Generator, zeros: float = 0.25) -> torch.Tensor:
    """Skewed random distributions over the last dim, with some exact zeros (as top-k/top-p leave)."""
    logits = torch.randn(*shape, generator=gen) * 1.5
    weights = logits.exp() * (torch.rand(*shape, generator=gen) >= zeros)
    weights[..., 0] += (weights.sum(-1) == 0).float()  # never an all-zero row
    return weights / weights.sum(-1, keepdim=True)


class MarkovPair:
    """Target p and draft q as Markov chains: row V of each table is the start distribution."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.p = _random_dist((V + 1, V), gen)
        self.q = _random_dist((V + 1, V), gen)

    def pair_probs(self) -> torch.Tensor:
        """[V, V]: the exact probability of the first two tokens under the target."""
        return self.p[V].unsqueeze(1) * self.p[:V]


def _step(model: MarkovPair, ctx: torch.Tensor, gen: torch.Generator, *, mode: str) -> list[list[int]]:
    """One speculative step for every row from last-token context `ctx` (V = start).

    mode: "sampled" (drafts drawn from q, q passed), "onehot" (deterministic drafts, None passed),
    and the negative controls "wrong_q" (drafts drawn from q, a uniform q claimed) and
    "resample_from_p" (the classic bug: after a rejection, sample from p instead of max(p - q, 0)).
    (Sampled drafts passed as deterministic are no negative control: accepting x with probability p(x),
    else sampling p without x, is lossless whatever distribution x came from, only less efficient.)
    """
    n = ctx.shape[0]
    num_draft = torch.randint(0, K + 1, (n,), generator=gen)
    drafts = torch.zeros(n, K, dtype=torch.long)
    draft_probs = torch.zeros(n, K, V)
    target_probs = torch.zeros(n, K + 1, V)
    prev = ctx.clone()
    for j in range(K):
        target_probs[:, j] = model.p[prev]
        draft_probs[:, j] = model.q[prev]
        if mode == "onehot":
            # A deterministic drafter, a fixed function of the context: greedy decoding of q.
            nxt = model.q[prev].argmax(-1)
        else:
            nxt = torch.multinomial(model.q[prev], 1, generator=gen).squeeze(1)
        drafts[:, j] = nxt
        prev = nxt
    target_probs[:, K] = model.p[prev]
    if mode == "onehot":
        passed = None
    elif mode == "wrong_q":
        passed = torch.full_like(draft_probs, 1.0 / V)
    else:
        passed = draft_probs
    out = rejection_sample(target_probs, drafts, num_draft, passed, [None] * n, fallback=gen)
    if mode == "resample_from_p":
        for row, emitted in enumerate(out):
            at = len(emitted) - 1
            if at < num_draft[row]:
                emitted[-1] = int(torch.multinomial(target_probs[row, at], 1, generator=gen))
    return out


def _first_two_tokens(model: MarkovPair, mode: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative decoding of two tokens in N independent trials: ([N] first, [N] second)."""
    gen = torch.Generator().manual_seed(seed)
    emitted = _step(model, torch.full((N,), V), gen, mode=mode)
    first = torch.tensor([e[0] for e in emitted])
    short = [i for i, e in enumerate(emitted) if len(e) == 1]
    second = torch.tensor([e[1] if len(e) > 1 else -1 for e in emitted])
    if short:
        more = _step(model, first[short], gen, mode=mode)
        second[short] = torch.tensor([e[0] for e in more])
    assert (second >= 0).all()
    return first, second


def chi_square_p_value(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of `samples` (flat category ids) under `probs` (flat); 0 if an impossible category occurs."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    probs = probs.double().flatten()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    keep = probs > 0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


@pytest.mark.parametrize("mode", ["sampled", "onehot"])
@pytest.mark.parametrize("seed", [0, 1])
def test_emitted_tokens_follow_the_target_distribution(mode: str, seed: int) -> None:
    model = MarkovPair(seed)
    first, second = _first_two_tokens(model, mode, seed=100 + seed)
    assert chi_square_p_value(first, model.p[V]) > PASS_P
    assert chi_square_p_value(first * V + second, model.pair_probs()) > PASS_P


@pytest.mark.parametrize("mode", ["wrong_q", "resample_from_p"])
def test_negative_control_a_biased_verifier_is_caught(mode: str) -> None:
    model = MarkovPair(0)
    first, second = _first_two_tokens(model, mode, seed=100)
    p_first = chi_square_p_value(first, model.p[V])
    p_pair = chi_square_p_value(first * V + second, model.pair_probs())
    assert min(p_first, p_pair) < FAIL_P, (p_first, p_pair)


def test_acceptance_rate_matches_theory() -> None:
    # One draft from q at the start: P(accept) = sum_x min(p(x), q(x)) = 1 - TV(p, q).
    model = MarkovPair(3)
    p0, q0 = model.p[V], model.q[V]
    gen = torch.Generator().manual_seed(5)
    drafts = torch.multinomial(q0, N, replacement=True, generator=gen).unsqueeze(1)
    target = torch.stack([p0, model.p[0]]).expand(N, 2, V)  # bonus distribution is irrelevant here
    out = rejection_sample(target, drafts, torch.ones(N, dtype=torch.long), q0.expand(N, 1, V), [None] * N,
                           fallback=gen)
    rate = sum(len(e) == 2 for e in out) / N
    expected = float(torch.minimum(p0, q0).sum())
    assert abs(rate - expected) < 4 * (expected * (1 - expected) / N) ** 0.5 + 1e-9


def test_edge_cases_of_the_ratio() -> None:
    n = 2000
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.0, 0.5, 0.5, 0.0])
    q = torch.tensor([0.5, 0.0, 0.25, 0.25])
    target = p.expand(n, 2, 4).clone()

    def run(token: int, draft_q: torch.Tensor | None) -> list[list[int]]:
        drafts = torch.full((n, 1), token)
        probs = None if draft_q is None else draft_q.expand(n, 1, 4)
        return rejection_sample(target, drafts, torch.ones(n, dtype=torch.long), probs, [None] * n, fallback=gen)

    # q(x) = 0 < p(x): always accepted (the ratio's limit), never a division by zero.
    assert all(e[0] == 1 and len(e) == 2 for e in run(1, q))
    # p(x) = 0: never accepted, whatever q says; the replacement comes from max(p - q, 0) = tokens 1, 2.
    out = run(0, q)
    assert all(len(e) == 1 and e[0] in (1, 2) for e in out)
    assert 0.55 < sum(e[0] == 1 for e in out) / n < 0.78  # residual [0, .5, .25, 0] -> 2/3 on token 1
    out = run(3, None)  # deterministic draft of an impossible token: resample from p itself
    assert all(len(e) == 1 and e[0] in (1, 2) for e in out)
    # p == q: always accepted.
    assert all(len(e) == 2 for e in run(2, p))
    # No residual mass (p <= q everywhere, only possible with rounding; forced here with a
    # sub-normalised p): falls back to p instead of sampling from zeros.
    low = torch.tensor([[[0.0, 0.2, 0.0, 0.0], [0.0, 0.2, 0.0, 0.0]]]).expand(n, 2, 4)
    drafts = torch.full((n, 1), 0)
    out = rejection_sample(low, drafts, torch.ones(n, dtype=torch.long),
                           torch.tensor([0.6, 0.4, 0.0, 0.0]).expand(n, 1, 4), [None] * n, fallback=gen)
    assert all(e == [1] for e in out)
    # The same with a deterministic draft of the only token p allows: rejected with probability 0.8 by
    # the sub-normalised p, after which p without it has no mass, so p itself decides again.
    out = rejection_sample(low, torch.full((n, 1), 1), torch.ones(n, dtype=torch.long), None, [None] * n,
                           fallback=gen)
    assert {tuple(e) for e in out} == {(1,), (1, 1)}


def _greedy_batch(seed: int, n: int = 64, k_max: int = 5, vocab: int = 50):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, k_max + 1, vocab, generator=gen)
    argmax = logits.argmax(-1)
    # Drafts agree with the argmax for a random stretch, then diverge; lengths vary, including 0.
    drafts = torch.where(torch.rand(n, k_max, generator=gen) < 0.8, argmax[:, :k_max],
                         torch.randint(0, vocab, (n, k_max), generator=gen))
    num_draft = torch.randint(0, k_max + 1, (n,), generator=gen)
    num_draft[:4] = torch.tensor([0, k_max, 1, 0])
    return argmax, drafts, num_draft


def reference_greedy(argmax: torch.Tensor, drafts: torch.Tensor, num_draft: torch.Tensor) -> list[list[int]]:
    out = []
    for row in range(argmax.shape[0]):
        emitted = []
        for j in range(int(num_draft[row])):
            if int(drafts[row, j]) != int(argmax[row, j]):
                break
            emitted.append(int(drafts[row, j]))
        emitted.append(int(argmax[row, len(emitted)]))
        out.append(emitted)
    return out


@pytest.mark.parametrize("seed", range(3))
def test_verify_greedy_accepts_the_matching_prefix(seed: int) -> None:
    argmax, drafts, num_draft = _greedy_batch(seed)
    out = verify_greedy(argmax, drafts, num_draft)
    assert out == reference_greedy(argmax, drafts, num_draft)
    assert all(1 <= len(e) <= int(k) + 1 for e, k in zip(out, num_draft, strict=True))
    assert {len(e) for e in out} != {1}  # the batch does accept some drafts


@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_rows_of_rejection_sample_equal_verify_greedy(with_q: bool) -> None:
    argmax, drafts, num_draft = _greedy_batch(7)
    n, k_plus_1 = argmax.shape
    one_hot = torch.nn.functional.one_hot(argmax, 50).float()  # temperature 0 rows arrive like this
    gen = torch.Generator().manual_seed(1)
    q = _random_dist((n, k_plus_1 - 1, 50), gen, zeros=0.0) if with_q else None
    generators = [torch.Generator().manual_seed(i) if i % 2 else None for i in range(n)]
    assert rejection_sample(one_hot, drafts, num_draft, q, generators, fallback=gen) == verify_greedy(
        argmax, drafts, num_draft)


def test_speculative_greedy_decoding_equals_plain_greedy_decoding() -> None:
    """End to end with a deterministic toy target and a drafter that is often but not always right."""
    vocab = 37

    def target_next(prefix: list[int]) -> int:
        return (prefix[-1] * 7 + prefix[-2] * 3 + len(prefix)) % vocab

    plain = [1, 2]
    while len(plain) < 300:
        plain.append(target_next(plain))

    gen = torch.Generator().manual_seed(0)
    spec = [1, 2]
    steps = 0
    while len(spec) < 300:
        k = int(torch.randint(0, 6, (1,), generator=gen))
        drafts, ctx = [], list(spec)
        for _ in range(k):
            guess = target_next(ctx) if torch.rand(1, generator=gen) < 0.7 else int(torch.randint(vocab, (1,), generator=gen))
            drafts.append(guess)
            ctx.append(guess)
        # The target scores every draft position in one pass: argmax after spec + drafts[:j].
        argmax = [target_next(spec + drafts[:j]) for j in range(k + 1)]
        padded = drafts + [0] * (5 - k)
        [emitted] = verify_greedy(torch.tensor([argmax + [0] * (5 - k)]), torch.tensor([padded]), torch.tensor([k]))
        spec += emitted
        steps += 1
    assert spec[:300] == plain
    assert steps < 200  # drafts were accepted along the way


def test_seeded_rows_are_reproducible_and_independent_of_the_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    p = _random_dist((6, 5, V), gen, zeros=0.0)
    q = _random_dist((6, 4, V), gen, zeros=0.0)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=gen).reshape(6, 4)
    num_draft = torch.tensor([4, 0, 2, 3, 1, 4])

    def seeded() -> list[torch.Generator | None]:
        return [torch.Generator().manual_seed(1000 + i) for i in range(6)]

    first = rejection_sample(p, drafts, num_draft, q, seeded())
    assert rejection_sample(p, drafts, num_draft, q, seeded()) == first
    # Row 2 alone, padded to a different k_max, among other neighbours: the same tokens.
    alone = rejection_sample(p[2:3, :3], drafts[2:3, :2], num_draft[2:3], q[2:3, :2],
                             [torch.Generator().manual_seed(1002)])
    assert alone == [first[2]]
    reordered = rejection_sample(p.flip(0), drafts.flip(0), num_draft.flip(0), q.flip(0),
                                 list(reversed(seeded())))
    assert list(reversed(reordered)) == first
    # Each row consumes exactly num_draft + 1 numbers of its stream, whatever it accepted.
    gens = seeded()
    rejection_sample(p, drafts, num_draft, q, gens)
    for i, g in enumerate(gens):
        twin = torch.Generator().manual_seed(1000 + i)
        torch.rand(int(num_draft[i]) + 1, generator=twin)
        assert torch.equal(g.get_state(), twin.get_state())
    # Different seeds do give different samples somewhere.
    outs = {str(rejection_sample(p, drafts, num_draft, q, [torch.Generator().manual_seed(s)] * 6))
            for s in range(20)}
    assert len(outs) > 1


def test_mixed_draft_counts_and_no_drafts_at_all() -> None:
    gen = torch.Generator().manual_seed(2)
    p = _random_dist((5, 4, V), gen)
    drafts = torch.randint(0, V, (5, 3), generator=gen)
    num_draft = torch.tensor([0, 3, 1, 0, 2])
    drafts[0], drafts[2, 1:], drafts[4, 2] = -1, -1, -1  # padding may hold any id
    def gens() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(100 + r) for r in range(5)]

    out = rejection_sample(p, drafts, num_draft, None, gens())
    for row, (emitted, k) in enumerate(zip(out, num_draft.tolist(), strict=True)):
        # Each row decides exactly as it would alone, unpadded, with the same generator.
        alone = rejection_sample(p[row: row + 1, : k + 1], drafts[row: row + 1, :k],
                                 num_draft[row: row + 1], None, [gens()[row]])
        assert emitted == alone[0]
        assert len(emitted) in range(1, k + 2)
        assert emitted[:-1] == drafts[row, : len(emitted) - 1].tolist()
        assert p[row, len(emitted) - 1, emitted[-1]] > 0
    # k_max = 0: plain sampling of one token per row.
    none = rejection_sample(p[:, :1], drafts[:, :0], torch.zeros(5, dtype=torch.long), None, [None] * 5)
    assert [len(e) for e in none] == [1] * 5 and all(p[i, 0, e[0]] > 0 for i, e in enumerate(none))
    assert verify_greedy(p[:, :1].argmax(-1), drafts[:, :0], torch.zeros(5, dtype=torch.long)) == [
        [int(t)] for t in p[:, 0].argmax(-1)]
    assert rejection_sample(p[:0], drafts[:0], num_draft[:0], None, []) == []


def test_rejects_inconsistent_shapes() -> None:
    p = torch.full((2, 3, V), 1.0 / V)
    drafts = torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(ValueError):
        rejection_sample(p, drafts, torch.tensor([1, 3]), None, [None, None])  # more drafts than k_max
    with pytest.raises(ValueError):
        rejection_sample(p, drafts, torch.tensor([1, 1]), None, [None])  # one generator short
    with pytest.raises(ValueError):
        rejection_sample(p, drafts, torch.tensor([1, 1]), torch.zeros(2, 2, V + 1), [None, None])
    with pytest.raises(ValueError):
        verify_greedy(p.argmax(-1), drafts[:, :1], torch.tensor([1, 1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_give_the_cpu_results() -> None:
    gen = torch.Generator().manual_seed(4)
    p = _random_dist((256, 5, 64), gen)
    q = _random_dist((256, 4, 64), gen)
    drafts = torch.multinomial(q.reshape(-1, 64), 1, generator=gen).reshape(256, 4)
    num_draft = torch.randint(0, 5, (256,), generator=gen)

    def gens() -> list[torch.Generator | None]:
        return [torch.Generator().manual_seed(i) for i in range(256)]

    cpu = rejection_sample(p, drafts, num_draft, q, gens())
    cuda = rejection_sample(p.cuda(), drafts.cuda(), num_draft.cuda(), q.cuda(), gens())
    assert cuda == cpu
    argmax = p.argmax(-1)
    assert verify_greedy(argmax.cuda(), drafts.cuda(), num_draft.cuda()) == verify_greedy(argmax, drafts, num_draft)

"""The draft model's reduced-vocabulary head against the full head masked to the same ids (fp32)."""

from __future__ import annotations

import pytest
import torch

from inference import EngineConfig
from inference.models.decoder import DecoderLM
from inference.models.loader import load_model
from inference.spec.draft_head import DraftHead, SequenceVocab


@pytest.fixture(scope="module")
def model(tiny_llama) -> DecoderLM:
    return load_model(str(tiny_llama), EngineConfig(dtype="float32")).model


def _reference(model: DecoderLM, hidden: torch.Tensor, allowed: torch.Tensor) -> tuple[int, float]:
    logits = model.logits(hidden[None])[0]
    masked = torch.full_like(logits, float("-inf"))
    allowed = allowed.to(logits.device)
    masked[allowed] = logits[allowed]
    probs = torch.softmax(masked, dim=-1)
    best = int(masked.argmax())
    return best, float(probs[best])


@pytest.mark.parametrize("common", [64, 1000, 10**9])
def test_choice_matches_the_masked_full_head(model: DecoderLM, common: int) -> None:
    head = DraftHead(model, common)
    generator = torch.Generator().manual_seed(common % 997)
    vocabs, allowed = [], []
    for n in range(4):
        vocab = SequenceVocab()
        seen = torch.randint(0, model.vocab_size, (50 * n,), generator=generator).tolist()
        head.observe(vocab, seen[: len(seen) // 2])
        head.observe(vocab, seen)  # incremental: the second call adds only what is new
        vocabs.append(vocab)
        allowed.append(torch.tensor(sorted(set(range(min(common, model.vocab_size))) | set(seen)), dtype=torch.long))
    # Scale the hidden rows up so the argmax is not decided by rounding between near-equal logits.
    hidden = (torch.randn(4, model.hidden_size, generator=generator) * 4).to(model.device)
    choice = head.choose(hidden, vocabs)
    for row in range(4):
        token, probability = _reference(model, hidden[row], allowed[row])
        assert choice.tokens[row] == token
        assert choice.confidence[row] == pytest.approx(probability, rel=1e-4, abs=1e-6)


def test_common_ids_are_never_added_twice(model: DecoderLM) -> None:
    head = DraftHead(model, 100)
    vocab = SequenceVocab()
    head.observe(vocab, [1, 2, 3, 99])
    assert vocab.ids is None  # every id is already in the common range
    head.observe(vocab, [150, 120, 150, 5])
    assert vocab.ids.tolist() == [120, 150]
    assert torch.equal(vocab.rows, model.head_weight[[120, 150]])
    with pytest.raises(ValueError):
        DraftHead(model, 0)

"""Our BERT forward pass for all-MiniLM-L6-v2 against sentence-transformers on the same converted dir."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference.errors import InvalidRequestError, ModelNotFoundError
from inference.models.bert import Embedder, EmbeddingOutput
from inference.models.catalog import resolve_model

pytestmark = pytest.mark.real_model

MINILM = "@hearth/all-minilm-l6-v2"

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "   leading and trailing whitespace\t\n",
    "Ünïcödé àccents, ß, and œ ligatures in a sentence.",
    "日本語の文章を埋め込みに変換します。",
    "Эмбеддинги для русского текста тоже должны работать.",
    "emoji 🚀🔥 and symbols ∑∫√ mixed with words",
    "def add(a, b):\n    return a + b  # code is text too",
    "a",
    "What is the capital of France? Paris is the capital and most populous city of France.",
    " ".join(f"token{i} sentence number {i} goes on." for i in range(120)),  # far beyond 256 tokens
    "SELECT name, email FROM users WHERE created_at > now() - interval '7 days';",
]


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    try:
        resolve_model(MINILM)
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    return Embedder.from_model(MINILM)


@pytest.fixture(scope="module")
def reference(embedder: Embedder):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedder.path), device="cpu")


def _reference_embeddings(reference, texts: list[str]) -> torch.Tensor:
    return reference.encode(texts, convert_to_tensor=True, normalize_embeddings=True, batch_size=4).float()


def test_properties(embedder: Embedder) -> None:
    assert (embedder.name, embedder.dim, embedder.max_tokens) == (MINILM, 384, 256)


def test_matches_sentence_transformers(embedder: Embedder, reference) -> None:
    out = embedder.embed(TEXTS)
    assert isinstance(out, EmbeddingOutput)
    assert out.embeddings.shape == (len(TEXTS), 384) and out.embeddings.dtype == torch.float32
    expected = _reference_embeddings(reference, TEXTS)
    cosine = F.cosine_similarity(out.embeddings, expected, dim=1)
    assert cosine.min().item() > 0.999, cosine
    torch.testing.assert_close(out.embeddings.norm(dim=1), torch.ones(len(TEXTS)), rtol=0, atol=1e-5)


def test_token_counts_match_sentence_transformers_truncation(embedder: Embedder, reference) -> None:
    out = embedder.embed(TEXTS)
    expected = [int(reference.tokenize([t])["attention_mask"].sum()) for t in TEXTS]
    assert out.token_counts == expected
    assert out.prompt_tokens == sum(expected)
    assert max(out.token_counts) == 256  # the long text is truncated, [CLS] and [SEP] included
    assert min(out.token_counts) == 3  # "a" -> [CLS] a [SEP]


def test_batching_does_not_change_results_or_order(embedder: Embedder) -> None:
    batched = embedder.embed(TEXTS).embeddings
    for i in (0, 4, 10):
        alone = embedder.embed([TEXTS[i]]).embeddings[0]
        torch.testing.assert_close(batched[i], alone, rtol=0, atol=1e-5)
    # Truncated 256-token texts among short ones are encoded in separate padded batches (padding them
    # together would be wasteful); the results still come back in input order.
    many = [TEXTS[i % 10] + f" #{i}" for i in range(40)] + [TEXTS[10]] * 4
    out = embedder.embed(many)
    assert out.embeddings.shape == (44, 384)
    for i in (5, 37, 42):
        torch.testing.assert_close(
            out.embeddings[i], embedder.embed([many[i]]).embeddings[0], rtol=0, atol=1e-5
        )


def test_similar_texts_are_closer(embedder: Embedder) -> None:
    vecs = embedder.embed(
        ["A man is playing a guitar.", "Someone plays the guitar.", "The stock market fell."]
    )
    sims = vecs.embeddings @ vecs.embeddings.T
    assert sims[0, 1] > 0.6 > sims[0, 2]


def test_empty_and_invalid_inputs(embedder: Embedder) -> None:
    empty = embedder.embed([])
    assert empty.embeddings.shape == (0, 384) and empty.prompt_tokens == 0 and empty.token_counts == []
    for bad in (["ok", ""], ["ok", "   "], ["ok", 3], [None], "a single string"):
        with pytest.raises(InvalidRequestError):
            embedder.embed(bad)  # type: ignore[arg-type]


def test_bfloat16_stays_close(embedder: Embedder) -> None:
    low = Embedder.from_model(embedder.path, dtype=torch.bfloat16)
    assert low.name == str(embedder.path)
    out = low.embed(TEXTS[:6])
    assert out.embeddings.dtype == torch.float32
    cosine = F.cosine_similarity(out.embeddings, embedder.embed(TEXTS[:6]).embeddings, dim=1)
    assert cosine.min().item() > 0.99


def test_rejects_a_non_bert_checkpoint() -> None:
    try:
        path = resolve_model("@hearth/smollm2-135m-instruct")
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    with pytest.raises(ModelNotFoundError, match="not a BERT encoder"):
        Embedder.from_model(path)

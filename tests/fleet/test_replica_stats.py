"""What a replica publishes to routers, driven without Ray: the interactive prompt tokens it still has to compute,
stamped with the time of the engine snapshot they come from (not the time Serve asked); and what its streams
send."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from fleet.replica import EngineReplica, model_revision, tokenizer_revision, vocabulary_revision
from inference import GenerationRequest, RequestOutput, SamplingParams
from tests.engine.conftest import build_tiny_model

replica_settings = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_num_batched_tokens": 32}


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory):
    path: Path = build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-replica"))
    rep = EngineReplica(str(path), replica_settings)
    yield rep
    rep.engine.shutdown()


def _gate_steps(engine, count: int) -> tuple[list[threading.Event], list[threading.Event]]:
    """Make each of the engine's next `count` steps wait: (entered[i]: set once the loop is in step i, go[i]: lets
    it run). The loop takes its gauges after every step, so while step i waits they are those of step i - 1."""
    real, calls = engine.engine.step, [0]
    entered = [threading.Event() for _ in range(count)]
    go = [threading.Event() for _ in range(count)]

    def gated():
        i = calls[0]
        calls[0] += 1
        if i < count:
            entered[i].set()
            go[i].wait(10)
        return real()

    engine.engine.step = gated
    return entered, go


def test_the_published_queue_of_prompt_tokens_and_its_stamp(replica: EngineReplica) -> None:
    idle = replica.record_routing_stats()
    assert idle["prefill_tokens"] == 0 and idle["at"] <= time.time()
    engine = replica.engine
    entered, go = _gate_steps(engine, 2)
    outputs: list[RequestOutput] = []
    done = threading.Event()
    prompt = engine.encode(" ".join(f"word {i}" for i in range(40)), raw=True)
    try:
        sent_at = time.time()
        engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)),
                      lambda out: (outputs.append(out), out.finished and done.set()))
        assert entered[0].wait(10)
        # Before the request's first step the snapshot predates it, and so does its stamp: a router adds what it
        # sent since (this request) instead of losing it between the two.
        before = replica.record_routing_stats()
        assert before["prefill_tokens"] == 0 and before["at"] < sent_at
        go[0].set()
        assert entered[1].wait(10)
        # After the first 32-token chunk: the rest, stamped after the request was sent.
        after = replica.record_routing_stats()
        assert (after["prefill_tokens"], after["at"] > sent_at) == (len(prompt) - 32, True)
        go[1].set()
        assert done.wait(30) and outputs[-1].finished
        assert replica.record_routing_stats()["prefill_tokens"] == 0
    finally:
        for event in go:
            event.set()


def test_the_revision_follows_the_checkpoints_files_and_the_engine_settings(replica: EngineReplica,
                                                                           tmp_path: Path) -> None:
    import asyncio
    import json
    import os
    import shutil

    name, _, _, published, _ = asyncio.run(replica.metrics())
    assert name == replica.name and published == replica.revision == model_revision(replica.model, replica_settings)
    tokens = replica.tokenizer_revision
    assert replica.record_routing_stats()["tokenizer_revision"] == tokens  # the router keeps its ids on it
    assert asyncio.run(replica.metrics())[4] == tokens == tokenizer_revision(replica.model)
    revision, tokenizer = asyncio.run(replica.tokenizer_and_revision())  # for a caller of the release before
    assert revision == tokens and tokenizer.encode("a b") == replica.engine.tokenizer.encode("a b")
    vocabulary = replica.vocabulary_revision
    assert vocabulary == vocabulary_revision(replica.model) and vocabulary != tokens
    assert replica.record_routing_stats()["vocabulary_revision"] == vocabulary
    revision, published_vocabulary, tokenizer = asyncio.run(replica.tokenizer_and_revisions())
    assert (revision, published_vocabulary) == (tokens, vocabulary)
    assert tokenizer.encode("a b") == replica.engine.tokenizer.encode("a b")
    settings = {"dtype": "float32"}
    first = model_revision(replica.model, settings)
    assert model_revision(replica.model, dict(settings)) == first  # what it serves, not when it was asked
    assert model_revision(replica.model, {"dtype": "bfloat16"}) != first

    # Another node's copy of the same checkpoint: other times of change, the installer's marker of its own install.
    other = tmp_path / "copy"
    shutil.copytree(replica.model, other, copy_function=shutil.copyfile)
    (other / "hearth.json").write_text(json.dumps({"installed_at": "elsewhere"}))
    tokenizer_file = other / "tokenizer.json"
    os.utime(tokenizer_file, ns=(tokenizer_file.stat().st_atime_ns, tokenizer_file.stat().st_mtime_ns + 10**9))
    assert (model_revision(str(other), settings), tokenizer_revision(str(other))) == (first, tokens)
    assert vocabulary_revision(str(other)) == vocabulary

    # Other weights (of another size: their values alone are nothing a caller keeps) or another config: another
    # revision, the same tokenizer.
    weights = next(p for p in other.iterdir() if p.suffix == ".safetensors")
    with weights.open("ab") as f:
        f.write(b"\0" * 8)
    heavier = model_revision(str(other), settings)
    assert heavier != first and tokenizer_revision(str(other)) == tokens
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    assert model_revision(str(other), settings) not in (first, heavier) and tokenizer_revision(str(other)) == tokens

    vocab = json.loads(tokenizer_file.read_text())  # the tokenizer written again, with one token more
    vocab["added_tokens"] = [*vocab.get("added_tokens", []), {"id": 10**6, "content": "<new>", "single_word": False,
                             "lstrip": False, "rstrip": False, "normalized": False, "special": True}]
    tokenizer_file.write_text(json.dumps(vocab))
    assert tokenizer_revision(str(other)) != tokens and vocabulary_revision(str(other)) != vocabulary


def test_a_new_chat_template_is_another_tokenizer_with_the_same_vocabulary(replica: EngineReplica,
                                                                           tmp_path: Path) -> None:
    """An operator's fix of the chat template (in tokenizer_config.json, or a template file of its own) changes
    the tokenizer a caller keeps and what the replica serves, not what a prompt's ids stand for."""
    import json
    import shutil

    other = tmp_path / "templated"
    shutil.copytree(replica.model, other)
    tokens, vocabulary = replica.tokenizer_revision, replica.vocabulary_revision
    served = model_revision(str(other), replica_settings)
    config_file = other / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    config_file.write_text(json.dumps(config, indent=1))  # laid out otherwise too
    templated = tokenizer_revision(str(other))
    assert templated != tokens and vocabulary_revision(str(other)) == vocabulary
    assert model_revision(str(other), replica_settings) != served
    (other / "chat_template.jinja").write_text("{{ messages[0].content }}")  # a file of its own (new or changed)
    assert tokenizer_revision(str(other)) not in (tokens, templated)
    assert vocabulary_revision(str(other)) == vocabulary
    config["eos_token"] = "<other>"  # the rest of the file still counts
    config_file.write_text(json.dumps(config))
    assert vocabulary_revision(str(other)) != vocabulary
    config_file.write_text("not json")  # counted as it is, as the whole tokenizer's revision counts it
    assert vocabulary_revision(str(other)) not in (vocabulary, vocabulary_revision(replica.model))


def test_a_prompt_encoded_by_another_tokenizer_is_refused_before_it_runs(replica: EngineReplica) -> None:
    """The router keeps a request on replicas with the tokenizer that encoded it; when none is left (an update
    that changed the tokenizer ended before the caller noticed), the replica refuses it rather than read its ids
    as other tokens."""
    import asyncio

    from fleet.routing import RouteHint
    from inference.errors import TokenizerChangedError

    def request() -> GenerationRequest:
        return GenerationRequest([5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))

    async def streamed(route: RouteHint) -> list[RequestOutput]:
        return [out async for out in replica.stream(request(), route=route)]

    prompts_before = replica.engine.metrics().prompt_tokens_total
    other = RouteHint(tokenizer_revision="0" * 16)
    with pytest.raises(TokenizerChangedError, match=replica.tokenizer_revision):
        asyncio.run(replica.generate(request(), route=other))
    with pytest.raises(TokenizerChangedError):
        asyncio.run(streamed(other))
    assert replica.engine.metrics().prompt_tokens_total == prompts_before  # nothing ran
    for route in (RouteHint(tokenizer_revision=replica.tokenizer_revision), RouteHint(), None):
        assert len(asyncio.run(replica.generate(request(), route=route)).token_ids) == 2
    # The vocabulary decides where a caller names it: another chat template (another tokenizer revision) reads the
    # same ids as the same tokens, and another vocabulary does not, whatever the tokenizer revision says.
    same_vocabulary = RouteHint(tokenizer_revision="1" * 16, vocabulary_revision=replica.vocabulary_revision)
    assert len(asyncio.run(replica.generate(request(), route=same_vocabulary)).token_ids) == 2
    other_vocabulary = RouteHint(tokenizer_revision=replica.tokenizer_revision, vocabulary_revision="2" * 16)
    with pytest.raises(TokenizerChangedError, match=f"vocabulary revision {'2' * 16}"):
        asyncio.run(replica.generate(request(), route=other_vocabulary))
    assert asyncio.run(streamed(RouteHint(tokenizer_revision=replica.tokenizer_revision)))[-1].finished


def test_a_stream_sends_each_steps_log_probabilities_text_and_tokens_once(replica: EngineReplica) -> None:
    """Each streamed output carries its own step's log probabilities, text and token ids, not every one so far
    (`all_logprobs`, `text`, `token_ids`, rebuilt by the fleet's client): pickled whole at every step, a long
    stream's would cost the square of its length. Together they are the non-streamed generation's."""
    import asyncio

    def request() -> GenerationRequest:
        return GenerationRequest([5, 6, 7], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                           logprobs=2))

    async def streamed() -> list[RequestOutput]:
        return [out async for out in replica.stream(request())]

    outs = asyncio.run(streamed())
    whole = asyncio.run(replica.generate(request()))
    assert all(out.all_logprobs is None for out in outs)
    # nor the text and token ids so far: each step's deltas add up to the whole generation's
    assert all(out.text == "" and out.token_ids == [] for out in outs)
    assert "".join(out.delta_text for out in outs) == whole.text and whole.text
    assert [t for out in outs for t in out.delta_token_ids] == whole.token_ids and len(whole.token_ids) == 12
    steps = [entry for out in outs for entry in out.logprobs or ()]
    assert whole.all_logprobs is not None and len(whole.all_logprobs) == 12
    assert [(e.token_id, [t for t, _, _ in e.top]) for e in steps] == [
        (e.token_id, [t for t, _, _ in e.top]) for e in whole.all_logprobs]
    assert [e.logprob for e in steps] == pytest.approx([e.logprob for e in whole.all_logprobs], abs=1e-5)

"""What a replica publishes to routers, driven without Ray: the interactive prompt tokens it still has to compute,
stamped with the time of the engine snapshot they come from (not the time Serve asked)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from fleet.replica import EngineReplica, model_revision, tokenizer_revision
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
    revision, tokenizer = asyncio.run(replica.tokenizer_and_revision())
    assert revision == tokens and tokenizer.encode("a b") == replica.engine.tokenizer.encode("a b")
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
    assert tokenizer_revision(str(other)) != tokens


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
    assert asyncio.run(streamed(RouteHint(tokenizer_revision=replica.tokenizer_revision)))[-1].finished

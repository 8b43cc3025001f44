"""The control plane on a fleet of 2 engine replicas on a local Ray (HEARTH_ENGINE=ray), through the openai SDK:
session affinity, prefix-aware routing, the replica header and usage, a replica killed under load, recovery."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from cp_support import CHAT_MODEL, EMBED_MODEL
from test_live_server import client_for, live, wait_for_events  # noqa: F401  (live is a fixture)

from controlplane.usage.models import UsageEvent
from fleet.actors import actor_label
from tests.engine.conftest import build_tiny_model

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.once]

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 12  # ~150 tokens: 9 full blocks


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, live_server_url: str) -> Iterator[object]:
    """2 replicas of a tiny random model, deployed under the chat model's name, behind HearthRouter; the live
    server's backend is the fleet's for the module."""
    ray = pytest.importorskip("ray")
    from ray import serve

    from controlplane.serving.dispatch import set_backend
    from controlplane.serving.fleet_backend import RayBackend
    from fleet.app import ModelDeployment, connect, deploy
    from fleet.client import FleetClient

    tiny = build_tiny_model("llama", tmp_path_factory.mktemp("fleet-tiny"))
    try:
        connect(num_cpus=2)
    except Exception as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"a local Ray cannot start here: {exc}")
    deploy([ModelDeployment(model=CHAT_MODEL, source=str(tiny), replicas=2, num_cpus=0.5,
                            engine_settings={"kv_cache_memory": "64MiB", "max_num_seqs": 8, "dtype": "float32"})])
    backend = RayBackend(FleetClient())
    backend.tiny = tiny  # type: ignore[attr-defined]  (what the replicas load)
    previous = set_backend(backend)
    yield backend
    set_backend(previous)
    backend.shutdown()
    serve.shutdown()
    ray.shutdown()


def chat(client: openai.OpenAI, messages: list[dict], session: str = "", **kw: object) -> tuple[object, str]:
    headers = {"x-session-affinity": session} if session else {}
    raw = client.chat.completions.with_raw_response.create(model=CHAT_MODEL, messages=messages, temperature=0,
                                                           extra_headers=headers, **{"max_tokens": 8, **kw})
    return raw.parse(), raw.headers.get("x-hearth-replica", "")


def running_replicas() -> list[str]:
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::") and "#engine#" in a["name"]]


def kill(replica: str, hearth_routed: bool = True) -> None:
    import ray

    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith("SERVE_REPLICA::") and actor["name"].endswith(f"#{replica}"):
            handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
            # The router of this process has seen it: a retry avoids it even where Ray's error gives only its id.
            assert not hearth_routed or actor_label(handle._actor_id.hex()) == replica
            ray.kill(handle, no_restart=True)
            return
    raise AssertionError(f"no replica actor {replica}")


def serving_replicas(backend, count: int, timeout: float = 90.0) -> set[str]:
    """The replicas answering the model's handle, once there are `count` of them."""
    deadline = time.monotonic() + timeout
    while True:
        backend.client.refresh_metrics()
        replicas = {replica for model, replica, _ in backend.replica_metrics() if model == CHAT_MODEL}
        if len(replicas) >= count or time.monotonic() > deadline:
            return replicas
        time.sleep(0.5)


def test_a_session_stays_on_its_replica_and_reads_its_cache(fleet, live):  # noqa: F811
    url, tenant = live
    client = client_for(url, tenant)
    homes: dict[str, set[str]] = {}
    for s in range(4):
        session = f"conversation-{s}"
        messages = [{"role": "system", "content": f"[{s}] " + SYSTEM}]
        for turn in range(3):
            messages.append({"role": "user", "content": f"Question {turn} of conversation {s}?"})
            reply, replica = chat(client, messages, session)
            assert replica, "every answer names the replica that served it"
            homes.setdefault(session, set()).add(replica)
            if turn:
                # The conversation so far is in that replica's prefix cache.
                assert reply.usage.prompt_tokens_details.cached_tokens >= 16 * 9
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert all(len(replicas) == 1 for replicas in homes.values()), homes
    # Usage records the replica, as the header named it.
    events = [e for e in wait_for_events(12) if e.route == "openai.chat"]
    assert len(events) == 12 and {e.replica for e in events} == set().union(*homes.values())
    assert all(e.session_affinity.startswith("conversation-") for e in events)


def test_without_a_session_the_prompt_goes_where_its_prefix_is_cached(fleet, live):  # noqa: F811
    url, tenant = live
    client = client_for(url, tenant)
    system = {"role": "system", "content": "Shared preamble of a busy app. " * 20}
    first, home = chat(client, [system, {"role": "user", "content": "First user?"}])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    for i in range(4):
        reply, replica = chat(client, [system, {"role": "user", "content": f"Another user, number {i}?"}])
        assert replica == home
        assert reply.usage.prompt_tokens_details.cached_tokens >= 16 * ((first.usage.prompt_tokens - 12) // 16)


def test_a_replica_killed_under_load_gives_clean_answers_and_the_fleet_recovers(fleet, live):  # noqa: F811
    url, tenant = live
    client = client_for(url, tenant)
    _, victim = chat(client, [{"role": "user", "content": "warm up the victim"}], "victim-session")
    outcomes: list[str] = []
    lock = threading.Lock()
    begun = threading.Event()  # a stream on the victim has produced its first chunk

    def one(i: int) -> None:
        messages = [{"role": "user", "content": f"Write a long story number {i}."}]
        headers = {"x-session-affinity": "victim-session" if i % 2 else f"other-{i}"}
        try:
            if i % 3 == 0:
                stream = client.chat.completions.create(model=CHAT_MODEL, messages=messages, max_tokens=400,
                                                        temperature=0, stream=True, extra_headers=headers)
                chunks = []
                for chunk in stream:
                    chunks.append(chunk)
                    if i % 2:
                        begun.set()
                assert chunks[-1].choices[0].finish_reason in ("stop", "length")
                result = "stream-ok"
            else:
                reply = client.chat.completions.create(model=CHAT_MODEL, messages=messages, max_tokens=400,
                                                       temperature=0, extra_headers=headers)
                assert reply.choices[0].finish_reason in ("stop", "length")
                result = "ok"
        except openai.APIStatusError as exc:
            assert exc.status_code == 503, exc
            assert exc.body["type"] == "server_error" and "retry" in exc.body["message"], exc.body
            result = "503"
        except openai.APIError as exc:  # an error event inside a 200 stream, which then ended with [DONE]
            assert "went away" in str(exc.message), exc
            result = "stream-error"
        with lock:
            outcomes.append(result)

    before = len(running_replicas())
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        # Kill once a stream on the victim is under way: a fixed delay raced the requests' arrival, and when no
        # stream had begun there yet, none could end in an error event.
        assert begun.wait(timeout=60)
        kill(victim)
        for f in futures:
            f.result()  # an unexpected exception (a 500, a cut connection) fails the test here
    # Non-streaming requests that lost their replica were retried on the other one, and so were streams that had
    # sent nothing yet (a 503 here was such a stream, queued on the victim); a stream that had begun on it ended
    # with an error event and [DONE] (the SDK raises it as an APIError), never a cut connection.
    assert sorted(outcomes) == sorted(["ok"] * 5 + [o for o in outcomes if o.startswith("stream")])
    assert "stream-error" in outcomes
    # Serve replaces the dead replica; requests flow again, and none goes to the dead one.
    assert before == 2
    replicas = serving_replicas(fleet, 2)
    assert len(replicas) == 2 and victim not in replicas
    for i in range(4):
        reply, replica = chat(client, [{"role": "user", "content": f"after the crash {i}"}], f"after-{i}")
        assert reply.choices[0].finish_reason in ("stop", "length") and replica != victim
    errors = UsageEvent.objects.filter(http_status=500).count()
    assert errors == 0


def test_metrics_and_the_dashboard_show_every_replica(fleet, live):  # noqa: F811
    import httpx

    from controlplane.dashboard import stats

    url, tenant = live
    client = client_for(url, tenant)
    served = {chat(client, [{"role": "user", "content": f"hello {i}"}], f"metrics-{i}")[1] for i in range(6)}
    replicas = serving_replicas(fleet, 2)
    assert len(replicas) == 2 and served <= replicas
    text = httpx.get(f"{url}/metrics").text
    for replica in replicas:
        assert f'hearth_replica_requests_finished_total{{model="{CHAT_MODEL}",replica="{replica}"}}' in text
        assert f'hearth_replica_kv_usage{{model="{CHAT_MODEL}",replica="{replica}"}}' in text
    # The model's own gauges add up its replicas.
    total = sum(m.requests_finished_total for model, _, m in fleet.replica_metrics() if model == CHAT_MODEL)
    assert f'hearth_engine_requests_finished_total{{model="{CHAT_MODEL}"}} {float(total)}' in text
    rows = [e for e in stats.engines() if e["model"] == CHAT_MODEL]
    assert {e["replica"] for e in rows} == replicas
    assert all(0.0 <= e["prefix_cache_hit_rate"] <= 1.0 for e in rows)


@pytest.mark.redis
def test_a_batch_finishes_exactly_once_when_a_replica_dies(fleet, live, batch_worker, caplog):  # noqa: F811
    import io
    import json

    url, tenant = live
    client = client_for(url, tenant)
    rows = [{"custom_id": f"item-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": CHAT_MODEL, "messages": [{"role": "user", "content": f"Tell story {i}."}],
                      "max_tokens": 300, "temperature": 0}} for i in range(12)]
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    file_id = client.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).status != "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    # Kill the busiest replica while it is running items (polled, not after a fixed wait: a fast engine may have
    # finished them all by then, and then nothing is lost mid-item).
    while True:
        fleet.client.refresh_metrics()
        busiest = max((m.running, replica) for model, replica, m in fleet.replica_metrics() if model == CHAT_MODEL)
        if busiest[0] > 0:
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    caplog.set_level("WARNING", logger="fleet.client")
    kill(busiest[1])
    deadline = time.monotonic() + 180
    while (done := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired"):
        assert time.monotonic() < deadline, done.status
        time.sleep(0.25)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (12, 12, 0)
    output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == sorted(r["custom_id"] for r in rows)  # each once
    assert all(o["response"]["status_code"] == 200 for o in output)
    # Billed exactly once per item, whatever ran twice.
    billed = UsageEvent.objects.filter(source="batch", status="ok", route="openai.chat")
    assert billed.count() == 12
    assert len(serving_replicas(fleet, 2)) == 2
    # The kill did land mid-item: items lost their replica and ran again elsewhere.
    assert "lost its replica" in caplog.text


async def test_requests_are_encoded_here_with_the_replicas_tokenizer(fleet):
    """The control plane encodes with a copy of the replicas' tokenizer, so a request costs the fleet one call,
    not two: the same ids as a replica's own encode (prompts, raw prompts, chats, tools) and the same refusals."""
    from fleet.client import LocalTokenizer
    from inference.errors import InvalidRequestError

    client = fleet.client
    weather = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    cases = [{"prompt": "Tell me a story about a lighthouse."}, {"prompt": "plain text, no template", "raw": True},
             {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi there"}]},
             {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [weather]}]
    for kwargs in cases:
        here = await client.encode(CHAT_MODEL, **kwargs)
        there = await client._call_again_if_lost(CHAT_MODEL, "encode", **kwargs)  # on a replica
        assert here == there and len(here) > 3
    assert isinstance(client._tokenizers[CHAT_MODEL][0], LocalTokenizer)
    for bad in ({"messages": [{"role": "wizard", "content": "x"}]}, {"prompt": ""}, {"prompt": "a", "messages": []}):
        with pytest.raises(InvalidRequestError) as here_error:
            await client.encode(CHAT_MODEL, **bad)
        with pytest.raises(InvalidRequestError) as there_error:
            await client._call_again_if_lost(CHAT_MODEL, "encode", **bad)
        assert str(here_error.value) == str(there_error.value)


async def test_an_engine_refusal_on_a_replica_reaches_the_caller_as_itself(fleet):
    """A replica's PromptTooLongError (its context is smaller than the prompt) arrives with its figures, whether
    the request streams (Serve's gRPC path) or not (Ray's task path): a 4xx for the control plane, not a 500."""
    from inference import GenerationRequest, SamplingParams
    from inference.errors import PromptTooLongError

    client = fleet.client
    _, window = await client.char_limit(CHAT_MODEL)  # the replicas' context
    request = GenerationRequest(prompt_token_ids=[100 + i % 200 for i in range(window + 5)],
                                params=SamplingParams(max_tokens=4))
    with pytest.raises(PromptTooLongError) as plain:
        await client.generate(CHAT_MODEL, request)
    with pytest.raises(PromptTooLongError) as streamed:
        async for _ in client.stream(CHAT_MODEL, request):
            pass
    for refused in (plain.value, streamed.value):
        assert refused.prompt_tokens == window + 5 and refused.limit < window + 5


async def test_a_streams_log_probabilities_text_and_tokens_add_up_as_an_engines_do(fleet):
    """Replicas send each step's log probabilities, text and token ids once; the client adds them up, so each
    streamed output's `all_logprobs`, `text` and `token_ids` hold every one so far, as an engine's in process do,
    the last the whole generation's."""
    from inference import GenerationRequest, SamplingParams

    def request() -> GenerationRequest:
        return GenerationRequest(prompt_token_ids=[100 + i for i in range(20)],
                                 params=SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3))

    client = fleet.client
    outs = [out async for out in client.stream(CHAT_MODEL, request())]
    whole = await client.generate(CHAT_MODEL, request())  # one output, its all_logprobs the engine's own
    so_far, text, ids = [], "", []
    for out in outs:
        so_far += out.logprobs or []
        text, ids = text + out.delta_text, ids + out.delta_token_ids
        assert out.all_logprobs == so_far and out.text == text and out.token_ids == ids
    assert text == whole.text and ids == whole.token_ids and len(ids) == 10
    assert whole.all_logprobs is not None and len(so_far) == len(whole.all_logprobs) == 10
    assert [(e.token_id, [t for t, _, _ in e.top]) for e in so_far] == [
        (e.token_id, [t for t, _, _ in e.top]) for e in whole.all_logprobs]
    assert [e.logprob for e in so_far] == pytest.approx([e.logprob for e in whole.all_logprobs], abs=1e-4)


async def test_a_prompt_encoded_by_a_tokenizer_the_fleet_no_longer_has_is_refused_and_encoded_anew(fleet):
    """As at the end of a rolling update that changed the tokenizer's vocabulary, before this process's metrics
    poll noticed: the tokenizer kept here names a vocabulary revision no replica has. The router finds none with
    it and sends the request on; the replica refuses it, on Serve's gRPC path (streams) and Ray's, rather than
    read its ids as other tokens, and the kept tokenizer goes, so the retry is encoded by the replicas' own. After
    an update of the chat template alone the ids read the same everywhere: nothing is refused."""
    from fleet.client import LocalTokenizer
    from inference import GenerationRequest, SamplingParams
    from inference.errors import TokenizerChangedError

    client = fleet.client
    ids = await client.encode(CHAT_MODEL, prompt="a request on its way")
    served = client._tokenizers[CHAT_MODEL][0]

    def request() -> GenerationRequest:
        return GenerationRequest(prompt_token_ids=ids, params=SamplingParams(max_tokens=2, ignore_eos=True))

    async def streamed() -> None:
        async for _ in client.stream(CHAT_MODEL, request()):
            pass

    assert served.vocabulary and served.vocabulary != served.revision
    for call in (lambda: client.generate(CHAT_MODEL, request()), streamed):
        client._tokenizers[CHAT_MODEL] = (LocalTokenizer(served.tokenizer, served.revision, "0" * 16),
                                          time.monotonic())
        with pytest.raises(TokenizerChangedError, match=served.vocabulary):
            await call()
        assert CHAT_MODEL not in client._tokenizers
    assert await client.encode(CHAT_MODEL, prompt="a request on its way") == ids
    kept = client._tokenizers[CHAT_MODEL][0]
    assert (kept.revision, kept.vocabulary) == (served.revision, served.vocabulary)
    assert len((await client.generate(CHAT_MODEL, request())).token_ids) == 2
    templated = LocalTokenizer(served.tokenizer, "1" * 16, served.vocabulary)  # another template, same vocabulary
    client._tokenizers[CHAT_MODEL] = (templated, time.monotonic())
    assert len((await client.generate(CHAT_MODEL, request())).token_ids) == 2
    await streamed()
    assert client._tokenizers[CHAT_MODEL][0] is templated  # nothing refused, nothing dropped
    client._tokenizers[CHAT_MODEL] = (kept, time.monotonic())


async def test_constraints_are_checked_on_the_fleet_before_their_requests(fleet):
    """A bad grammar is refused by a replica's compile, every time it is sent; a good one compiles once for the
    model and then constrains generations wherever they are routed."""
    from inference import GenerationRequest, SamplingParams
    from inference.constrained import Constraint
    from inference.errors import InvalidRequestError

    client = fleet.client
    for _ in range(2):
        with pytest.raises(InvalidRequestError):
            await client.compile(CHAT_MODEL, Constraint.regex("(unclosed"))
    digits = Constraint.regex("[0-9]{4}")
    await client.compile(CHAT_MODEL, digits)
    await client.compile(CHAT_MODEL, digits)  # known: no call
    assert digits.key in client._compiled[CHAT_MODEL]
    outs = [await client.generate(CHAT_MODEL, GenerationRequest(
        prompt_token_ids=list(range(60 + i, 90 + i)), params=SamplingParams(max_tokens=8, temperature=0),
        constraint=digits)) for i in range(4)]
    assert all(out.text.isdigit() and len(out.text) == 4 for out in outs)


async def test_an_adapter_reaches_replicas_through_the_object_store(fleet, tmp_path):
    """No replica reads the web server's disk: the adapter's bytes travel by digest, are verified, cached on the
    replica's node, and give the same greedy tokens as the adapter loaded locally."""
    from fleet.adapters import digest, read_files
    from inference import LLM, EngineConfig, GenerationRequest, LoRARequest, SamplingParams
    from tests.lora_support import make_peft_adapter

    folder = make_peft_adapter(fleet.tiny, tmp_path / "adapter", rank=4, seed=3, strength=2.0)
    lora = LoRARequest("tiny-style:1", folder)
    params = SamplingParams(max_tokens=12, temperature=0)
    prompt = list(range(100, 140))
    reference = LLM(str(fleet.tiny), EngineConfig(dtype="float32", kv_cache_memory="32MiB"))
    want = reference.generate_requests([GenerationRequest(prompt_token_ids=prompt, params=params, lora=lora)])[0]
    base = await fleet.generate(CHAT_MODEL, GenerationRequest(prompt_token_ids=prompt, params=params))
    adapted = [await fleet.generate(CHAT_MODEL, GenerationRequest(prompt_token_ids=prompt, params=params, lora=lora))
               for _ in range(3)]
    assert all(out.token_ids == want.token_ids for out in adapted) and base.token_ids != want.token_ids
    # Later requests found the adapter resident and went where it already was.
    assert len({out.replica for out in adapted[1:]}) == 1
    from fleet.replica import (
        adapter_root,  # the replicas' environment is this process's (HEARTH_DATA_DIR or not)
    )

    cached = [p for p in adapter_root().glob("*") if p.is_dir()]
    assert digest(read_files(folder)) in {p.name for p in cached}


def test_embeddings_on_the_fleet_name_their_replica_and_outlive_one(fleet, live):  # noqa: F811
    """An embedding model deployed on the fleet answers through the API as the engine in this process would, names
    the replica in the response and its usage, and a replica killed between requests costs none of them: a
    request sent to it is tried once more on the other."""
    import numpy as np

    from fleet.app import ModelDeployment, deploy, undeploy
    from inference.models.bert import Embedder

    url, tenant = live
    client = client_for(url, tenant)
    texts = ["a lighthouse keeper", "the sea at night", "copper lanterns"]
    want = Embedder.from_model(EMBED_MODEL).embed(texts).embeddings.numpy()
    deploy([ModelDeployment(model=EMBED_MODEL, embedding=True, replicas=2, num_cpus=0.25)])
    try:
        raw = client.embeddings.with_raw_response.create(model=EMBED_MODEL, input=texts, encoding_format="float")
        got = np.array([row.embedding for row in raw.parse().data])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
        replica = raw.headers.get("x-hearth-replica", "")
        assert replica
        [event] = [e for e in wait_for_events(1) if e.model == EMBED_MODEL]
        assert (event.replica, event.status, event.input_tokens) == (replica, "ok", raw.parse().usage.prompt_tokens)
        # Two long requests in flight (Serve's router puts the second beside the first), then one replica killed.
        many = [f"{texts[i % 3]} number {i}" for i in range(1500)]
        with ThreadPoolExecutor(2) as pool:
            pending = [pool.submit(client.embeddings.with_raw_response.create, model=EMBED_MODEL, input=many)
                       for _ in range(2)]
            time.sleep(0.5)
            kill(replica, hearth_routed=False)  # an embedding model's replicas are placed by Serve's own router
            answers = [p.result() for p in pending]
        assert all(a.http_response.status_code == 200 for a in answers)  # each one answered, none a 503
        assert all(len(a.parse().data) == len(many) for a in answers)
        assert {a.headers["x-hearth-replica"] for a in answers} != {replica}
    finally:
        undeploy([EMBED_MODEL])


async def test_a_redeploy_under_the_same_name_is_learnt_without_a_restart(fleet):
    """The operator redeploys the model under its name with other settings (a smaller context here; another
    checkpoint the same way): this process learns it again from the revisions the replicas report, where it kept
    the old facts until restarted. The tokenizer is the same on both sides of this update, so the one kept here
    stays (and its requests may go to any replica meanwhile). Last of the module's fleet tests: the model stays
    redeployed."""
    import asyncio

    from fleet.app import ModelDeployment, deploy

    client = fleet.client
    _, window = await client.char_limit(CHAT_MODEL)
    assert (await client.info(CHAT_MODEL)).context_window == window
    await asyncio.to_thread(serving_replicas, fleet, 2)
    before = {r.revision for r in client.replica_metrics() if r.model == CHAT_MODEL}
    assert len(before) == 1 and "" not in before
    ids = await client.encode(CHAT_MODEL, prompt="the same ids on either side", raw=True)
    tokenizer = client._tokenizers[CHAT_MODEL][0]
    tokenizers = {r.tokenizer_revision for r in client.replica_metrics() if r.model == CHAT_MODEL}
    assert tokenizers == {tokenizer.revision} and "" not in tokenizers
    smaller = window // 2
    await asyncio.to_thread(deploy, [ModelDeployment(
        model=CHAT_MODEL, source=str(fleet.tiny), replicas=2, num_cpus=0.5,
        engine_settings={"kv_cache_memory": "64MiB", "max_num_seqs": 8, "dtype": "float32",
                         "max_model_len": smaller})])
    deadline = time.monotonic() + 90
    while True:  # the metrics poller does this every 2 s (off the event loop: it waits on Ray)
        await asyncio.to_thread(client.refresh_metrics)
        now = {r.revision for r in client.replica_metrics() if r.model == CHAT_MODEL}
        if len(now) == 1 and now != before:
            break
        assert time.monotonic() < deadline, now
        await asyncio.sleep(0.25)
    assert (await client.char_limit(CHAT_MODEL))[1] == smaller
    assert (await client.info(CHAT_MODEL)).context_window == smaller
    assert {r.tokenizer_revision for r in client.replica_metrics() if r.model == CHAT_MODEL} == tokenizers
    assert client._tokenizers[CHAT_MODEL][0] is tokenizer  # kept across the update: not fetched again
    assert await client.encode(CHAT_MODEL, prompt="the same ids on either side", raw=True) == ids


def test_deploy_specs_size_replicas_that_name_no_cpus(catalog):
    """`make cluster` gives each replica a share of the machine (Ray waits forever on replicas that do not fit);
    a model's own `fleet` settings still win."""
    from controlplane.catalog.models import AiModel
    from controlplane.catalog.services import catalog as fresh_catalog
    from controlplane.catalog.services import invalidate
    from controlplane.serving.fleet_backend import deploy_specs

    AiModel.objects.filter(name=CHAT_MODEL).update(engine_settings={"fleet": {"num_cpus": 2, "replicas": 3}})
    invalidate()
    entries = [e for e in fresh_catalog().values() if e.installed]
    specs = {s.model: s for s in deploy_specs(entries, replicas=2, num_cpus=0.25)}
    assert (specs[CHAT_MODEL].num_cpus, specs[CHAT_MODEL].replicas) == (2.0, 3)
    others = [s for name, s in specs.items() if name != CHAT_MODEL]
    assert others and all((s.num_cpus, s.replicas) == (0.25, 2) for s in others)

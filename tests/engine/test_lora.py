"""LoRA adapters in the engine against PEFT (transformers + PeftModel) on real adapters made with peft: fp32
logits and greedy tokens, adapters mixed with each other and the base model in one batch, slots swapped LRU,
prefix-cache isolation, speculation, KV compression and preemption with adapters, and refusals."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from inference import LLM, EngineConfig, GenerationRequest, InvalidRequestError, LoRARequest, SamplingParams
from tests.engine.conftest import SMOLLM, counting_layer_rows, require_installed
from tests.engine.test_parity import PROMPTS
from tests.lora_support import make_peft_adapter, peft_reference

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
TARGET_SETS = [("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
               ("o_proj", "down_proj")]


def _adapters(base: Path, root: Path, count: int = 3) -> list[LoRARequest]:
    """Adapters of different ranks, targets and scalings (one rsLoRA), each from its own fresh seed."""
    seeds = torch.randint(0, 2**31 - 1, (count,)).tolist()
    out = []
    for i, seed in enumerate(seeds):
        path = make_peft_adapter(base, root / f"adapter{i}", rank=(4, 8, 16)[i % 3], alpha=(8, 16, 8)[i % 3],
                                 targets=TARGET_SETS[i % 3], seed=seed, use_rslora=i % 3 == 2)
        out.append(LoRARequest(f"adapter{i}-{seed}", path))
    return out


def _peft_greedy(base: Path, adapter: LoRARequest, ids: list[int], tokens: int) -> list[int]:
    ref = peft_reference(base, adapter.path)
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    from tests.engine.conftest import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("lora-tiny-llama"))


@pytest.fixture(scope="module")
def tiny_adapters(tiny_base: Path, tmp_path_factory) -> list[LoRARequest]:
    return _adapters(tiny_base, tmp_path_factory.mktemp("lora-tiny-adapters"), count=4)


@pytest.fixture(scope="module")
def tiny_llm(tiny_base: Path) -> LLM:
    return LLM(tiny_base, EngineConfig(dtype="float32", kv_cache_memory="32MiB", max_loras=4))


def test_tiny_logits_match_peft_for_every_architecture(tiny_model: Path, tmp_path: Path) -> None:
    adapter = _adapters(tiny_model, tmp_path, count=2)[1]  # every projection adapted
    llm = LLM(tiny_model, EngineConfig(dtype="float32", kv_cache_memory="32MiB"))
    ref = peft_reference(tiny_model, adapter.path)
    for prompt in PROMPTS[:3] + [" ".join(PROMPTS)]:  # the last is longer than gemma's sliding window
        ids = llm.encode(prompt, raw=True)
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0].float()
            base = ref.get_base_model()
        for size in (None, 7):
            ours = llm.engine.prompt_logits(ids, chunk_size=size, lora=adapter)
            assert (ours - expected).abs().max().item() < 1e-3, (prompt, size)
        plain = llm.engine.prompt_logits(ids)
        assert (plain - expected).abs().max().item() > 1e-2  # the adapter really changes the output
    del base


def test_a_bf16_model_runs_its_adapters_in_bf16_where_the_cpu_multiplies_bf16(tiny_base: Path,
                                                                            tiny_adapters: list[LoRARequest]) -> None:
    """On a CPU with native bf16 a bf16 model's adapters are packed in bf16 (half the bytes a step reads), in fp32
    elsewhere; either way the logits stay as close to PEFT's fp32 ones as the bf16 base's own rounding allows."""
    from inference.config import default_dtype

    adapter = tiny_adapters[1]  # every projection adapted
    bf16 = LLM(tiny_base, EngineConfig(dtype="bfloat16", kv_cache_memory="32MiB", max_loras=2))
    native = default_dtype("cpu") == torch.bfloat16
    assert bf16.engine.lora.packed_dtype == (torch.bfloat16 if native else torch.float32)
    ref = peft_reference(tiny_base, adapter.path)
    for prompt in PROMPTS[:3]:
        ids = bf16.encode(prompt, raw=True)
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0].float()
        ours = bf16.engine.prompt_logits(ids, lora=adapter)
        plain = bf16.engine.prompt_logits(ids)
        error, effect = (ours - expected).abs().mean().item(), (plain - expected).abs().mean().item()
        assert error < effect / 4, (prompt, error, effect)


def test_tiny_greedy_tokens_match_peft(tiny_base: Path, tiny_adapters: list[LoRARequest], tiny_llm: LLM) -> None:
    for adapter, prompt in zip(tiny_adapters[:3], PROMPTS, strict=False):
        ids = tiny_llm.encode(prompt, raw=True)
        ours = tiny_llm.generate_ids([ids], GREEDY, adapter)[0].token_ids
        assert ours == _peft_greedy(tiny_base, adapter, ids, GREEDY.max_tokens)


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(tiny_adapters: list[LoRARequest],
                                                             tiny_llm: LLM) -> None:
    adapters: list[LoRARequest | None] = [*tiny_adapters[:3], None]
    prompts = [tiny_llm.encode(p, raw=True) for p in PROMPTS[:8]]
    choice = [adapters[i % 4] for i in range(len(prompts))]
    alone = [tiny_llm.generate_ids([ids], GREEDY, adapter)[0].token_ids for ids, adapter in zip(prompts, choice,
                                                                                               strict=True)]
    engine = tiny_llm.engine
    requests = [GenerationRequest(ids, GREEDY, lora=adapter) for ids, adapter in zip(prompts, choice, strict=True)]
    for request in requests:
        engine.add_request(request)
    engine.step()
    assert len(engine.scheduler.running) == len(prompts)  # all of them, four adapters' worth, in one batch
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            final[out.request_id] = out.token_ids
    together = [final[r.request_id] for r in requests]
    assert together == alone
    # Different adapters really give different continuations of the same prompt.
    same = [tiny_llm.generate_ids([prompts[0]], GREEDY, a)[0].token_ids for a in adapters]
    assert len({tuple(t) for t in same}) == len(adapters)


@pytest.mark.parametrize("path", ["python", "one_call"])
def test_prompt_tokens_that_sample_nothing_skip_the_last_layers_products_with_adapters(
        tiny_base: Path, tiny_adapters: list[LoRARequest], path: str) -> None:
    """A step's adapters follow the rows its last layer keeps (the rows that sample), in the Python forward and in
    the one-call layers: prompts in chunks beside decodes, adapters mixed with the base model, give at every
    sampled token the logprob that scoring the whole sequence under its adapter at every position gives, with
    the last layer's products on fewer rows."""
    llm = LLM(tiny_base, EngineConfig(dtype="float32", kv_cache_memory="32MiB", max_loras=4, max_num_batched_tokens=16,
                                      enable_prefix_caching=False))
    model = llm.engine.model
    rows = {"first": 0, "last": 0}
    counting_layer_rows(model, path, rows)
    prompts = [llm.encode(p, raw=True) for p in PROMPTS[:6]]
    choice = [[*tiny_adapters[:3], None][i % 4] for i in range(len(prompts))]
    outs = llm.generate_ids(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1),
                            choice)
    assert rows["last"] < rows["first"] - sum(map(len, prompts)) // 2
    for prompt, adapter, out in zip(prompts, choice, outs, strict=True):
        logits = llm.engine.prompt_logits(prompt + out.token_ids[:-1], lora=adapter)[len(prompt) - 1:]
        scored = torch.log_softmax(logits, dim=-1)[torch.arange(len(out.token_ids)), out.token_ids]
        assert [lp.logprob for lp in out.all_logprobs] == pytest.approx(scored.tolist(), abs=1e-4)


def test_more_adapters_than_slots_wait_and_swap(tiny_base: Path, tiny_adapters: list[LoRARequest]) -> None:
    llm = LLM(tiny_base, EngineConfig(dtype="float32", kv_cache_memory="32MiB", max_loras=2))
    ids = llm.encode(PROMPTS[1], raw=True)
    alone = [llm.generate_ids([ids], GREEDY, a)[0].token_ids for a in tiny_adapters]
    loads_before = llm.engine.lora.stats.slot_loads
    engine = llm.engine
    requests = [GenerationRequest(ids, GREEDY, lora=a) for a in tiny_adapters]
    for request in requests:
        engine.add_request(request)
    engine.step()
    running = {s.lora.name for s in engine.scheduler.running}
    assert len(running) == 2 and len(engine.scheduler.waiting) == 2  # two slots: the other two wait
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            final[out.request_id] = out.token_ids
    assert [final[r.request_id] for r in requests] == alone
    assert engine.lora.stats.slot_loads > loads_before
    assert all(slot.pins == 0 for slot in engine.lora.slots)  # every pin released


def test_prefix_cache_never_crosses_adapters(tiny_adapters: list[LoRARequest], tiny_llm: LLM) -> None:
    ids = tiny_llm.encode(" ".join(PROMPTS), raw=True)
    assert len(ids) > 40
    first, second = tiny_adapters[0], tiny_adapters[1]
    params = SamplingParams(max_tokens=2, temperature=0.0)
    assert tiny_llm.generate_ids([ids], params, first)[0].usage.cached_tokens == 0
    again = tiny_llm.generate_ids([ids], params, first)[0]
    assert again.usage.cached_tokens >= 32  # the same adapter reuses its own blocks
    assert tiny_llm.generate_ids([ids], params, second)[0].usage.cached_tokens == 0
    assert tiny_llm.generate_ids([ids], params, None)[0].usage.cached_tokens == 0


def test_speculation_with_an_adapter_keeps_greedy_tokens(tiny_adapters: list[LoRARequest], tiny_llm: LLM) -> None:
    from inference.spec.settings import SpecMode, SpeculationSettings

    prompt = "1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3 4"
    ids = tiny_llm.encode(prompt, raw=True)
    adapter = tiny_adapters[1]
    plain = tiny_llm.generate_ids([ids], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                                  adapter)[0]
    engine = tiny_llm.engine
    request = GenerationRequest(ids, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                                speculation=SpeculationSettings(SpecMode.NGRAM, 4), lora=adapter)
    engine.add_request(request)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
    assert final is not None and final.token_ids == plain.token_ids


def test_kv_compression_with_an_adapter(tiny_base: Path, tiny_adapters: list[LoRARequest]) -> None:
    llm = LLM(tiny_base, EngineConfig(dtype="float32", kv_cache_memory="32MiB", kv_min_prompt_tokens=64))
    ids = llm.encode(" ".join(PROMPTS * 2), raw=True)
    adapter = tiny_adapters[2]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    full = llm.engine
    request = GenerationRequest(ids, params, lora=adapter, kv_compression={"rate": 1.0})
    kept = GenerationRequest(ids, params, lora=adapter, kv_compression={"rate": 2.0})
    outs = {}
    for r in (request, kept):
        full.add_request(r)
        while full.has_unfinished():
            for out in full.step():
                outs[out.request_id] = out
    uncompressed = llm.generate_ids([ids], params, adapter)[0]
    assert outs[request.request_id].token_ids == uncompressed.token_ids  # rate 1 changes nothing
    report = outs[kept.request_id].kv_compression
    assert report is not None and report["evicted_entries"] > 0 and len(outs[kept.request_id].token_ids) == 8


def test_preemption_releases_and_reacquires_slots(tiny_base: Path, tiny_adapters: list[LoRARequest]) -> None:
    roomy = LLM(tiny_base, EngineConfig(dtype="float32", kv_cache_memory="32MiB", max_loras=2))
    prompts = [roomy.encode(p, raw=True) for p in PROMPTS[:6]]
    choice = [tiny_adapters[i % 3] if i % 4 else None for i in range(len(prompts))]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    alone = [roomy.generate_ids([p], params, a)[0].token_ids for p, a in zip(prompts, choice, strict=True)]
    # A pool this small must preempt some of them; a preempted sequence gives back its slot and gets one again.
    tight = LLM(tiny_base, EngineConfig(dtype="float32", kv_cache_memory=_blocks_bytes(roomy, 10),
                                        max_loras=2, enable_prefix_caching=False))
    outs = tight.generate_ids(prompts, params, choice)
    assert tight.engine.metrics().preemptions_total > 0
    assert [o.token_ids for o in outs] == alone
    assert all(slot.pins == 0 for slot in tight.engine.lora.slots)


def _blocks_bytes(llm: LLM, blocks_per_head: int) -> int:
    layout = llm.engine.pool.layout
    per_block = layout.block_size * (2 * layout.head_dim * 4 + 4)
    return blocks_per_head * layout.num_layers * layout.num_kv_heads * per_block


def test_bad_adapters_fail_their_request_alone(tiny_base: Path, tiny_adapters: list[LoRARequest],
                                               tiny_llm: LLM, tmp_path: Path) -> None:
    engine = tiny_llm.engine
    ids = tiny_llm.encode(PROMPTS[0], raw=True)
    with pytest.raises(InvalidRequestError, match="required files missing"):
        engine.add_request(GenerationRequest(ids, GREEDY, lora=LoRARequest("nowhere", tmp_path / "nope")))
    broken = tmp_path / "broken"
    broken.mkdir()
    good = Path(tiny_adapters[0].path)
    config = json.loads((good / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
    (broken / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
    with pytest.raises(InvalidRequestError, match="rank 64 is over the limit of 32"):
        engine.add_request(GenerationRequest(ids, GREEDY, lora=LoRARequest("too-big", broken)))
    with pytest.raises(InvalidRequestError, match="lora must be a LoRARequest"):
        GenerationRequest(ids, GREEDY, lora="adapter0")  # type: ignore[arg-type]
    assert not engine.has_unfinished()  # nothing was queued
    off = LLM(tiny_base, EngineConfig(dtype="float32", kv_cache_memory="32MiB", enable_lora=False))
    with pytest.raises(InvalidRequestError, match="does not serve LoRA"):
        off.engine.add_request(GenerationRequest(ids, GREEDY, lora=tiny_adapters[0]))


@pytest.mark.real_model
def test_smollm2_adapter_matches_peft(tmp_path: Path) -> None:
    base = require_installed(SMOLLM)
    adapters = _adapters(base, tmp_path, count=2)
    llm = LLM(SMOLLM, EngineConfig(dtype="float32", kv_cache_memory="256MiB"))
    ids = llm.encode(PROMPTS[2], raw=True)
    for adapter in adapters:
        ref = peft_reference(base, adapter.path)
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0].float()
        ours = llm.engine.prompt_logits(ids, chunk_size=5, lora=adapter)
        # Logits of SmolLM2 reach ~30; our base forward already differs from transformers' by ~1e-3 here.
        assert (ours - expected).abs().max().item() < 1e-2
        assert ours.argmax(-1).tolist() == expected.argmax(-1).tolist()
        tokens = llm.generate_ids([ids], GREEDY, adapter)[0].token_ids
        assert tokens == _peft_greedy(base, adapter, ids, GREEDY.max_tokens)


def test_an_adapters_cpu_products_lie_in_one_region_in_the_order_a_step_reads_them(
        tiny_adapters: list[LoRARequest], tiny_llm: LLM) -> None:
    """Each slot's packed matrices, one after another in the step's order (layer by layer; q|k|v, o, gate|up,
    down; each projection's shrink, then its expands), so that the kernels' fetches ahead bring in the next."""
    from inference import memory
    from kernels import cpu_decode_layer, cpu_gemv

    slots = tiny_llm.engine.lora
    assert slots is not None
    if not cpu_gemv.supports(torch.empty(0, 2, dtype=slots.packed_dtype)):
        pytest.skip("the adapters' products are not on the CPU kernels here")
    ids = tiny_llm.encode(PROMPTS[0], raw=True)
    for adapter in tiny_adapters[:2]:
        tiny_llm.generate_ids([ids], SamplingParams(max_tokens=2), adapter)
    for adapter in tiny_adapters[:2]:
        index = next(i for i, slot in enumerate(slots.slots) if slot.name == adapter.name)
        keys = sorted((key for key, products in slots.packed.items() if products[index] is not None),
                      key=lambda key: (key[0], cpu_decode_layer.PROJECTIONS.index(key[1])))
        assert keys, adapter.name
        buffers = []
        for key in keys:
            shrink, expands = slots.packed[key][index]
            buffers += [shrink.gemv_weight.packed, *(e.gemv_weight.packed for _, e in expands)]
        for before, after in itertools.pairwise(buffers):
            assert after.data_ptr() == before.data_ptr() + memory.Arena.size(before.nbytes), adapter.name


@pytest.mark.parametrize("forward", ["one-call layers", "python"])
def test_adapters_ride_inside_the_products_where_amx_tiles_carry_them(tiny_base: Path, tmp_path: Path, forward: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """On AMX tiles a bf16 model's rank-32 adapters are summed inside each base product, prompt chunks and decode
    steps alike, on the one-call layers (decode_layer.c's hearth_lora_product) and in the Python forward
    (LoraRows.product), each output rounded once: not the bits of the adapters added after each product
    (HEARTH_LORA_FUSED=off), but logits as close to PEFT's fp32 ones, and every greedy token of a batch within
    bf16 rounding of the top of that path's logits over the same tokens."""
    from inference.config import default_dtype
    from kernels import cpu_decode_layer

    if cpu_decode_layer.lora_gemm(torch.bfloat16) is None or default_dtype("cpu") != torch.bfloat16:
        pytest.skip("bf16 products of many rows are not on AMX tiles here")
    path = make_peft_adapter(tiny_base, tmp_path / "r32", rank=32, alpha=64, targets=TARGET_SETS[1],
                             seed=int(torch.randint(0, 2**31 - 1, ())))
    adapter = LoRARequest("r32", path)
    config = EngineConfig(dtype="bfloat16", kv_cache_memory="32MiB", max_loras=2)
    inside = LLM(tiny_base, config)
    monkeypatch.setenv("HEARTH_LORA_FUSED", "off")
    apart = LLM(tiny_base, config)
    monkeypatch.undo()
    assert inside.engine.runner.model.decode_stack.model.lora_gemm
    assert not apart.engine.runner.model.decode_stack.model.lora_gemm
    if forward == "python":
        inside.engine.runner.model.decode_stack = apart.engine.runner.model.decode_stack = None
    fused: list[tuple[int, bool]] = []  # the inside engine's calls: (rows, whether the adapters rode inside)
    product = cpu_decode_layer.LoraRows.product

    def recorded(self: cpu_decode_layer.LoraRows, layer: int, projection: str, x: torch.Tensor, *args, **kwargs):
        y = product(self, layer, projection, x, *args, **kwargs)
        if self.table.model.lora_gemm:
            fused.append((x.shape[0], y is not None))
        return y

    monkeypatch.setattr(cpu_decode_layer.LoraRows, "product", recorded)
    ref = peft_reference(tiny_base, path)
    for prompt in PROMPTS[:3]:
        ids = inside.encode(prompt, raw=True)
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0].float()
        ours, theirs = inside.engine.prompt_logits(ids, lora=adapter), apart.engine.prompt_logits(ids, lora=adapter)
        assert not torch.equal(ours, theirs), prompt  # another computation: the sums rounded once
        error, error_apart, effect = ((logits - expected).abs().mean().item()
                                      for logits in (ours, theirs, inside.engine.prompt_logits(ids)))
        assert error < effect / 4 and error < 1.5 * error_apart, (prompt, error, error_apart, effect)
    if forward == "python":  # products of more rows than the GEMV's carry them (a last layer's sampled row: not)
        assert fused and all(done for rows, done in fused if rows > cpu_decode_layer.MAX_ROWS), fused
    batch = [inside.encode(prompt, raw=True) for prompt in PROMPTS[:4]]  # decode steps of four rows: the GEMM
    for ids, out in zip(batch, inside.generate_ids(batch, GREEDY, adapter), strict=True):
        logits = apart.engine.prompt_logits(ids + out.token_ids[:-1], lora=adapter)[len(ids) - 1:]
        top = logits.max(dim=-1).values
        chosen = logits.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert bool((chosen >= top - 0.1).all()), (out.token_ids, (top - chosen).tolist())

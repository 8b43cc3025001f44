"""One C call per decoder layer for decode steps (kernels/cpu_decode_layer): the engine's outputs with it against
the Python forward it replaces, on fresh random tiny models, for fp32 and bf16, plain and int8 weights, one, two
and three sequences at a time, on both CPU builds (the AVX2 one widens bf16 activations in a buffer the call
passes and sends bf16 products of many rows to oneDNN; where the layers route products of many rows to the
GEMM, steps of three rows run here too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inference import EngineConfig, SamplingParams
from inference.llm import LLM
from kernels import cpu_decode_layer
from tests.cpu_builds import isa
from tests.engine.conftest import build_tiny_model

pytestmark = pytest.mark.skipif(not cpu_decode_layer.available(), reason="the CPU kernels cannot be built here")
__all__ = ["isa"]  # the fixture, imported: both CPU builds


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    # Fresh weights for this module (a seed of its own): GQA on both, q/k/v biases on qwen2.
    return {arch: build_tiny_model(arch, tmp_path_factory.mktemp(f"decode-layer-{arch}"), seed=7)
            for arch in ("llama", "qwen2")}


PROMPTS = ["The quick brown fox jumps over", "Once upon a time in a small village by the sea, there lived",
           "A third prompt, so that three sequences decode together"]


def _outputs(llm: LLM, prompts: list[str]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=0, ignore_eos=True)
    return [(out.token_ids, [lp.logprob for lp in out.all_logprobs]) for out in llm.generate(prompts, params)]


def _fresh_adapters(base: Path, root: Path, tag: str, shapes: list[tuple[int, tuple[str, ...]]]) -> list:
    """One PEFT adapter per (rank, targets) of `shapes` on `base`, each with fresh random weights."""
    from inference import LoRARequest
    from tests.lora_support import make_peft_adapter

    return [LoRARequest(f"{tag}{i}", make_peft_adapter(base, root / f"{tag}{i}", rank=rank, alpha=2 * rank,
                                                       targets=targets, seed=int(torch.randint(0, 2**31 - 1, ()))))
            for i, (rank, targets) in enumerate(shapes)]


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_one_call_layers_give_the_python_forward_results(isa: str, tiny_models: dict[str, Path], arch: str,
                                                          dtype: str, quantization: str) -> None:
    # No prefix caching: the second run's prompts would start from the first run's cached blocks.
    llm = LLM(tiny_models[arch], EngineConfig(device="cpu", dtype=dtype, quantization=quantization, kv_cache_memory="16MiB",
                                              block_size=8, enable_prefix_caching=False))
    model = llm.engine.runner.model
    stack = model.decode_stack
    assert stack is not None, "every product of these models runs on the CPU kernels"
    # Steps of three rows run here where every product of many rows is a kernel too: int8 on any build, fp32
    # and plain bf16 where the layers route many rows to the GEMM (bf16: AVX-512 BF16 builds).
    assert stack.many_rows == (quantization == "int8" or model.layers[0].qkv.gemm)
    calls: list[int] = []
    run_layer = stack.layer
    stack.layer = lambda step, index: (calls.append(step.struct.rows), run_layer(step, index))[1]
    # One sequence (one row a step), then two at once (two rows a step), then three.
    fused = [_outputs(llm, PROMPTS[:1]), _outputs(llm, PROMPTS[:2]), _outputs(llm, PROMPTS)]
    assert calls.count(1) >= 23 * model.num_layers and calls.count(2) >= 23 * model.num_layers
    assert calls.count(3) == (23 * model.num_layers if stack.many_rows else 0)

    model.decode_stack = None
    python = [_outputs(llm, PROMPTS[:1]), _outputs(llm, PROMPTS[:2]), _outputs(llm, PROMPTS)]
    # Bit for bit: the same kernels on the same buffers in the same order.
    assert fused == python


def test_prompt_passes_and_many_rows_off_the_gemm_keep_the_python_forward(
        tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HEARTH_CPU_GEMM", "off")  # products of many rows on oneDNN, as bf16 on AVX2 builds
    llm = LLM(tiny_models["llama"], EngineConfig(device="cpu", dtype="bfloat16", kv_cache_memory="16MiB", block_size=8))
    model = llm.engine.runner.model
    assert not model.decode_stack.many_rows
    rows: list[int] = []
    run_layer = model.decode_stack.layer
    model.decode_stack.layer = lambda step, index: (rows.append(step.struct.rows), run_layer(step, index))[1]
    outputs = _outputs(llm, PROMPTS)
    assert all(len(tokens) == 24 for tokens, _ in outputs)
    assert rows == [], "three rows a step on oneDNN, and the prompt passes, go through the Python forward"


def test_models_outside_its_shape_keep_the_python_forward(tmp_path: Path) -> None:
    # Gemma's extra norms around each sublayer are not part of the one-call layer.
    llm = LLM(build_tiny_model("gemma3_text", tmp_path / "gemma"), EngineConfig(device="cpu", dtype="float32",
                                                                                kv_cache_memory="16MiB"))
    assert llm.engine.runner.model.decode_stack is None


def test_switch_off_keeps_the_python_forward(tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HEARTH_CPU_DECODE_LAYER", "off")
    llm = LLM(tiny_models["llama"], EngineConfig(device="cpu", dtype="float32", kv_cache_memory="16MiB"))
    assert llm.engine.runner.model.decode_stack is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gate_up_with_silu_in_one_product_gives_the_separate_ops_results(
        isa: str, tiny_models: dict[str, Path], dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the GEMM takes the gate/up weight, products of many rows (prompts; steps of three sequences, in the
    one-call layers too) compute SiLU * up in the same call: the same tokens and logprobs as the product followed
    by the SiLU kernel (HEARTH_CPU_GEMM_SILU=off)."""
    config = EngineConfig(device="cpu", dtype=dtype, kv_cache_memory="16MiB", block_size=8,
                          enable_prefix_caching=False)
    llm = LLM(tiny_models["qwen2"], config)
    model = llm.engine.runner.model
    assert model.gate_up_silu == model.layers[0].gate_up.gemm  # intermediate 128: whole blocks on both builds
    if not model.gate_up_silu:
        pytest.skip("bf16 products of many rows go to oneDNN on this build")
    assert all(spec.gate_up_silu for spec in model.decode_stack.specs)
    fused = _outputs(llm, PROMPTS)
    monkeypatch.setenv("HEARTH_CPU_GEMM_SILU", "off")
    separate = LLM(tiny_models["qwen2"], config)
    assert not separate.engine.runner.model.gate_up_silu
    assert not any(spec.gate_up_silu for spec in separate.engine.runner.model.decode_stack.specs)
    assert fused == _outputs(separate, PROMPTS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_steps_with_adapters_run_here_with_the_python_forward_results(isa: str, tiny_models: dict[str, Path],
                                                                       dtype: str, tmp_path: Path) -> None:
    """Decode steps whose rows use LoRA adapters (mixed with each other and the base model) take the one-call
    layers where every adapter's products are these kernels in the model's dtype (fp32; bf16 where the CPU
    multiplies it natively): the Python forward's tokens and logprobs bit for bit."""
    from inference import LoRARequest
    from inference.config import default_dtype
    from tests.lora_support import make_peft_adapter

    base = tiny_models["llama"]
    shapes = [(4, ("q_proj", "v_proj")), (8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj")), (2, ("o_proj", "down_proj"))]
    adapters = [LoRARequest(f"a{i}", make_peft_adapter(base, tmp_path / f"a{i}", rank=rank, alpha=2 * rank,
                                                        targets=targets, seed=11 + i))
                for i, (rank, targets) in enumerate(shapes)]
    llm = LLM(base, EngineConfig(device="cpu", dtype=dtype, kv_cache_memory="16MiB", block_size=8,
                                 enable_prefix_caching=False, max_loras=4))
    model = llm.engine.runner.model
    prompts = [*PROMPTS, "A fourth prompt on the base model alone"]
    choice = [*adapters, None]
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=0, ignore_eos=True)

    def outputs(count: int) -> list[tuple[list[int], list[float]]]:
        ids = [llm.encode(p, raw=True) for p in prompts[:count]]
        return [(o.token_ids, [lp.logprob for lp in o.all_logprobs])
                for o in llm.generate_ids(ids, params, choice[:count])]

    calls: list[tuple[int, bool]] = []
    run_layer = model.decode_stack.layer
    model.decode_stack.layer = lambda step, index: (calls.append((step.struct.rows, bool(step.struct.lora))),
                                                    run_layer(step, index))[1]
    here = [outputs(1), outputs(2), outputs(4)]
    native = dtype == "float32" or (default_dtype("cpu") == torch.bfloat16 and model.layers[0].qkv.gemm)
    with_adapters = [rows for rows, lora in calls if lora]
    if native:
        assert with_adapters.count(1) >= 15 * model.num_layers and with_adapters.count(2) >= 15 * model.num_layers
        assert with_adapters.count(4) >= 15 * model.num_layers
    else:
        assert not with_adapters, "adapters whose products are not these kernels keep the Python forward"

    model.decode_stack = None
    python = [outputs(1), outputs(2), outputs(4)]
    assert here == python
    choice = [None] * len(prompts)
    plain = outputs(4)
    assert all(plain[i] != here[2][i] for i in range(3)) and plain[3] == here[2][3]  # the adapters change their rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_chunks_with_adapters_add_their_deltas_in_one_call_a_projection(
        isa: str, tiny_models: dict[str, Path], dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt chunks (the Python forward) whose rows use adapters on these kernels add each projection's deltas in
    one C call (LoraRows) instead of lora_apply_packed's torch ops: the same tokens and logprobs, bit for bit."""
    from inference.config import default_dtype
    from inference.lora.slots import LoRABatch

    base = tiny_models["qwen2"]
    shapes = [(8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
              (4, ("q_proj", "v_proj")), (16, ("o_proj", "gate_proj", "down_proj"))]
    adapters = _fresh_adapters(base, tmp_path, "p", shapes)
    config = EngineConfig(device="cpu", dtype=dtype, kv_cache_memory="16MiB", block_size=8,
                          enable_prefix_caching=False, max_loras=4, max_num_batched_tokens=24)
    prompts = [*PROMPTS, "A fourth prompt on the base model alone, long enough to span chunks of the step"]
    choice = [*adapters, None]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)

    llm = LLM(base, config)
    model = llm.engine.runner.model
    model.decode_stack = None  # every step through the Python forward
    ids = [llm.encode(p, raw=True) for p in prompts]

    def outputs() -> list[tuple[list[int], list[float]]]:
        return [(o.token_ids, [lp.logprob for lp in o.all_logprobs]) for o in llm.generate_ids(ids, params, choice)]

    calls: list[int] = []
    add = cpu_decode_layer.LoraRows.add
    monkeypatch.setattr(cpu_decode_layer.LoraRows, "add",
                        lambda self, layer, projection, x, y: (calls.append(x.shape[0]), add(self, layer, projection, x, y))[1])
    here = outputs()
    native = dtype == "float32" or (default_dtype("cpu") == torch.bfloat16 and model.layers[0].qkv.gemm)
    if native:
        assert max(calls) > 3, "prompt chunks of many rows take the one call"
    else:
        assert not calls, "adapters whose products are not these kernels keep lora_apply_packed"
    monkeypatch.setattr(LoRABatch, "cpu_rows", property(lambda self: None))  # lora_apply_packed's torch ops
    assert here == outputs()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_steps_with_prompt_chunks_run_here_with_the_python_forward_results(isa: str, tiny_models: dict[str, Path],
                                                                           arch: str, dtype: str) -> None:
    """Steps that carry prompt chunks (fresh ones, a long prompt's later chunks, prompts after a cached prefix),
    alone or beside decodes, take the one-call layers where every product of many rows is these kernels, the
    last layer's output projection and MLP on the sampled rows alone: the Python forward's tokens and logprobs,
    bit for bit."""
    config = EngineConfig(device="cpu", dtype=dtype, kv_cache_memory="16MiB", block_size=8,
                          max_num_batched_tokens=20)
    opening = "An opening that several requests share, long enough to fill a few blocks of the cache: "
    first = [opening + PROMPTS[0]]
    prompts = [opening + PROMPTS[1], PROMPTS[2], "Short", opening + PROMPTS[2] + " " + PROMPTS[1]]

    def outputs(llm: LLM) -> list[tuple[list[int], list[float]]]:
        return _outputs(llm, first) + _outputs(llm, prompts)  # the second call reuses the first one's blocks

    here = LLM(tiny_models[arch], config)
    stack = here.engine.runner.model.decode_stack
    assert stack.prompts, "these models' prompt chunks run on the C prompt kernels"
    started: list[tuple[int, int, list[cpu_decode_layer.PromptRows], int | None]] = []
    start = stack.start

    def recording(h: torch.Tensor, *args: object, **kwargs: object) -> cpu_decode_layer.DecodeStep:
        step = start(h, *args, **kwargs)
        started.append((h.shape[0], step.struct.decodes, list(kwargs.get("prompts", ())), step.kept))
        return step

    stack.start = recording
    fused = outputs(here)
    with_prompts = [s for s in started if s[2]]
    if stack.many_rows:
        assert any(decodes and rows > decodes for rows, decodes, _, _ in with_prompts), "prompts beside decodes"
        chunks = [p for _, _, ps, _ in with_prompts for p in ps]
        assert any(p.context < 0 for p in chunks) and any(p.context > 0 for p in chunks)
        assert any(kept is not None and kept < rows for rows, _, _, kept in with_prompts)
        assert any(kept == 0 for _, _, _, kept in with_prompts), "a long prompt's early chunk samples nothing"
    else:  # products of many rows on oneDNN: only steps of a few rows come here
        assert all(rows <= cpu_decode_layer.MAX_ROWS for rows, _, _, _ in with_prompts)

    python = LLM(tiny_models[arch], config)
    python.engine.runner.model.decode_stack = None
    assert fused == outputs(python)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_steps_with_prompt_chunks_and_adapters_run_here_with_the_python_forward_results(
        isa: str, tiny_models: dict[str, Path], dtype: str, tmp_path: Path) -> None:
    """Prompt chunks and decodes whose rows use LoRA adapters (and rows on the base model beside them) take the
    one-call layers where the adapters' products are these kernels; in the last layer the sampled rows keep
    their adapters in their new places: the Python forward's tokens and logprobs, bit for bit."""
    from inference.config import default_dtype

    base = tiny_models["qwen2"]
    shapes = [(8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
              (4, ("o_proj", "down_proj")), (16, ("q_proj", "gate_proj", "up_proj"))]
    adapters = _fresh_adapters(base, tmp_path, "m", shapes)
    config = EngineConfig(device="cpu", dtype=dtype, kv_cache_memory="16MiB", block_size=8,
                          enable_prefix_caching=False, max_loras=4, max_num_batched_tokens=20)
    prompts = [*PROMPTS, "A fourth prompt on the base model alone, long enough to span chunks of the step"]
    choice = [*adapters, None]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)

    def outputs(llm: LLM) -> list[tuple[list[int], list[float]]]:
        ids = [llm.encode(p, raw=True) for p in prompts]
        return [(o.token_ids, [lp.logprob for lp in o.all_logprobs]) for o in llm.generate_ids(ids, params, choice)]

    here = LLM(base, config)
    stack = here.engine.runner.model.decode_stack
    started: list[tuple[bool, bool, bool]] = []  # prompts, adapters, kept rows' adapters
    start = stack.start

    def recording(*args: object, **kwargs: object) -> cpu_decode_layer.DecodeStep:
        step = start(*args, **kwargs)
        started.append((bool(kwargs["prompts"]), bool(step.struct.lora), bool(step.struct.lora_kept)))
        return step

    stack.start = recording
    fused = outputs(here)
    native = dtype == "float32" or (default_dtype("cpu") == torch.bfloat16 and here.engine.runner.model.layers[0].qkv.gemm)
    if native and stack.many_rows:
        assert (True, True, True) in started, "prompt chunks beside adapted rows, sampled rows with adapters"
    else:
        assert not any(p and lora for p, lora, _ in started)

    python = LLM(base, config)
    python.engine.runner.model.decode_stack = None
    assert fused == outputs(python)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sequences_being_compressed_decode_here_with_the_python_forward_results(
        isa: str, tiny_models: dict[str, Path], arch: str, dtype: str) -> None:
    """Decodes of sequences whose KV is being compressed (beside one that is not) take the one-call layers, the
    attention kernel giving the scores their entries received from the same pass: the Python forward's tokens,
    logprobs and evictions, bit for bit; and in fp32 the torch reference's (gathered blocks) tokens."""
    from inference import GenerationRequest

    config = EngineConfig(device="cpu", dtype=dtype, kv_cache_memory="16MiB", block_size=8,
                          enable_prefix_caching=False)
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=0, ignore_eos=True)
    seed = int(torch.randint(0, 2**31 - 1, ()))  # fresh prompts each run, the same for every path below

    def outputs(llm: LLM) -> list[tuple[list[int], list[float], dict | None]]:
        vocab = llm.engine.model.vocab_size
        prompts = [torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed + n)).tolist()
                   for n in (300, 410)]
        engine, done = llm.engine, {}
        requests = [GenerationRequest(prompts[0], params, kv_compression={"rate": 4}),
                    GenerationRequest(prompts[1], params, kv_compression={"max_cache_tokens": 64}),
                    GenerationRequest(prompts[1][:280], params)]
        for request in requests:
            engine.add_request(request)
        while engine.has_unfinished():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        return [(done[r.request_id].token_ids, [lp.logprob for lp in done[r.request_id].all_logprobs],
                 done[r.request_id].kv_compression) for r in requests]

    here = LLM(tiny_models[arch], config)
    model = here.engine.runner.model
    observed: list[int] = []
    start = model.decode_stack.start

    def recording(h: torch.Tensor, *args: object, **kwargs: object) -> cpu_decode_layer.DecodeStep:
        step = start(h, *args, **kwargs)
        if kwargs.get("received") is not None:
            observed.append(step.struct.decodes)
        return step

    model.decode_stack.start = recording
    fused = outputs(here)
    assert all(report["compressions"] >= 2 for _, _, report in fused[:2]) and fused[2][2] is None
    # three sequences decoding, two of them observed (steps of three rows come here where many rows do)
    assert observed.count(3) >= (30 if model.decode_stack.many_rows else 0)

    model.decode_stack = None
    assert outputs(here) == fused  # the Python forward, on the same attention kernel
    if dtype == "float32":
        model.cpu_attention = False  # the torch references: gathered blocks, the received scores from them
        reference = outputs(here)
        assert [tokens for tokens, _, _ in reference] == [tokens for tokens, _, _ in fused]
        assert [report for _, _, report in reference] == [report for _, _, report in fused]
        for (_, got, _), (_, want, _) in zip(fused, reference, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)

"""Our own forward pass for decoder-only transformers (Llama, Qwen2, Gemma 3) over the paged KV cache.

Weights come from the Hugging Face checkpoint; q/k/v and gate/up projections are fused into one matrix each
so a layer is five matmuls. Architectures differ only in the switches of ArchSpec.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from inference import memory
from inference.batch import AttentionBatch, DecodeGroup
from inference.kv_cache import KVPool
from inference.models import layers
from kernels import cpu_argmax, cpu_decode_layer, cpu_fused, cpu_gemv, cpu_norm
from kernels import cpu_paged_attention as cpa
from kernels import kv_compress as kc
from kernels import paged_attention as pa


@dataclass(frozen=True, slots=True)
class ArchSpec:
    qkv_bias: bool = False
    qk_norm: bool = False
    norm_offset: bool = False  # Gemma's RMSNorm scales by (1 + w)
    sandwich_norms: bool = False  # Gemma's extra norms after attention and around the MLP
    embed_scale: bool = False  # Gemma multiplies embeddings by sqrt(hidden)


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(),
    "mistral": ArchSpec(),
    "qwen2": ArchSpec(qkv_bias=True),
    "qwen3": ArchSpec(qk_norm=True),
    "gemma3_text": ArchSpec(qk_norm=True, norm_offset=True, sandwich_norms=True, embed_scale=True),
    "gemma3": ArchSpec(qk_norm=True, norm_offset=True, sandwich_norms=True, embed_scale=True),
}


@dataclass(slots=True)
class LayerWeights:
    qkv: layers.LinearLayer
    o: layers.LinearLayer
    gate_up: layers.LinearLayer
    down: layers.LinearLayer
    input_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    pre_ffn_norm: torch.Tensor | None
    post_ffn_norm: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    sliding_window: int | None
    rope: layers.RotaryTable


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass(frozen=True, slots=True)
class TritonKernels:
    decode: Callable[..., torch.Tensor]
    prefill: Callable[..., torch.Tensor]
    received: Callable[..., torch.Tensor]


def triton_kernels(device: torch.device) -> TritonKernels | None:
    """The Triton attention kernels on CUDA, None (the torch references) elsewhere.

    HEARTH_ATTENTION=triton forces the kernels (on CPU only meaningful under TRITON_INTERPRET=1, for tests);
    HEARTH_ATTENTION=torch forces the references.
    """
    choice = os.environ.get("HEARTH_ATTENTION", "auto")
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"HEARTH_ATTENTION must be auto, torch or triton, got {choice!r}")
    if choice == "torch" or (choice == "auto" and device.type != "cuda"):
        return None
    from kernels import triton_kv_compress, triton_paged_attention

    if not triton_paged_attention.available():
        if choice == "triton":
            raise RuntimeError("HEARTH_ATTENTION=triton but Triton is not installed")
        return None
    return TritonKernels(decode=triton_paged_attention.paged_decode_attention,
                         prefill=triton_paged_attention.paged_prefill_attention,
                         received=triton_kv_compress.decode_received_attention)


class DecoderLM:
    """Holds the weights and runs one step's tokens through the model."""

    def __init__(self, config: PretrainedConfig, tensors: dict[str, torch.Tensor],
                 dtype: torch.dtype, device: torch.device, max_positions: int, quantization: str = "none") -> None:
        config = text_config(config)
        self.config = config
        self.model_type = config.model_type
        if self.model_type not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.model_type!r}; supported: {sorted(ARCHITECTURES)}")
        self.spec = ARCHITECTURES[self.model_type]
        self.dtype, self.device = dtype, device
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.hidden_size = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or self.hidden_size // self.num_heads
        self.vocab_size = config.vocab_size
        self.eps = config.rms_norm_eps
        self.act = layers.ACTIVATIONS[getattr(config, "hidden_act", None)
                                      or getattr(config, "hidden_activation", "silu")]
        pre_scalar = getattr(config, "query_pre_attn_scalar", None)
        self.scale = pre_scalar ** -0.5 if pre_scalar else layers.default_attention_scale(self.head_dim)
        self.attn_softcap = getattr(config, "attn_logit_softcapping", None)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.triton = triton_kernels(device)
        # On CPU (fp32 or bf16), decode attention reads the paged blocks in place (kernels/cpu_paged_attention) unless
        # HEARTH_ATTENTION=torch asks for the references.
        self.cpu_attention = (self.triton is None and os.environ.get("HEARTH_ATTENTION", "auto") != "torch"
                              and cpa.supports(torch.empty(1, self.num_heads, self.head_dim, dtype=dtype, device=device),
                                               torch.empty(1, 1, self.head_dim, dtype=dtype, device=device),
                                               self.num_kv_heads))
        # ... and a fresh prompt's causal attention (no window, no softcap) is one C call instead of SDPA.
        prompt_kv = torch.empty(1, self.num_kv_heads, self.head_dim, dtype=dtype, device=device)
        self.cpu_causal = (self.triton is None and os.environ.get("HEARTH_ATTENTION", "auto") != "torch"
                           and cpa.supports_causal(torch.empty(1, self.num_heads, self.head_dim, dtype=dtype,
                                                               device=device), prompt_kv, prompt_kv))
        # Rotary + KV write and SiLU * up as one C call each on CPU (kernels/cpu_fused): the same results.
        self.cpu_fused = self.triton is None and cpu_fused.supports(torch.empty(0, dtype=dtype, device=device))

        def get(name: str) -> torch.Tensor:
            return tensors[name].to(device=device, dtype=dtype)

        prefix = "model." if "model.embed_tokens.weight" in tensors else ""
        self.embed = get(f"{prefix}embed_tokens.weight")
        self.final_norm = get(f"{prefix}norm.weight")
        # The plain (unpacked) head matrix is kept for heads over part of the vocabulary (a draft model's).
        self.head_weight = get("lm_head.weight") if "lm_head.weight" in tensors else self.embed
        # Every packed matrix on huge pages, carved in turn in the order decode reads them (memory.Pool).
        weights = memory.Pool()
        self.lm_head = layers.linear(self.head_weight, quantization=quantization, zeros=weights.zeros)
        self.embed_scale = (torch.tensor(math.sqrt(self.hidden_size), dtype=dtype)
                            if self.spec.embed_scale else None)

        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * self.num_layers
        tables: dict[str | None, layers.RotaryTable] = {}
        self.layers: list[LayerWeights] = []
        for i in range(self.num_layers):
            p = f"{prefix}layers.{i}."
            kind = layer_types[i]
            rope_key = kind if kind in (getattr(config, "rope_parameters", None) or {}) else None
            if rope_key not in tables:
                inv_freq, scaling = layers.rope_inverse_frequencies(config, self.head_dim, rope_key)
                tables[rope_key] = layers.RotaryTable(inv_freq, scaling, max_positions, dtype, device)
            attn, mlp = p + "self_attn.", p + "mlp."
            has_bias = self.spec.qkv_bias or f"{attn}q_proj.bias" in tensors
            self.layers.append(LayerWeights(
                qkv=layers.linear(torch.cat([get(attn + f"{n}_proj.weight") for n in "qkv"]),
                                  torch.cat([get(attn + f"{n}_proj.bias") for n in "qkv"]) if has_bias else None,
                                  quantization, weights.zeros),
                o=layers.linear(get(attn + "o_proj.weight"), quantization=quantization, zeros=weights.zeros),
                gate_up=layers.linear(torch.cat([get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")]),
                                      quantization=quantization, zeros=weights.zeros),
                down=layers.linear(get(mlp + "down_proj.weight"), quantization=quantization, zeros=weights.zeros),
                input_norm=get(p + "input_layernorm.weight"),
                post_attn_norm=get(p + "post_attention_layernorm.weight"),
                pre_ffn_norm=get(p + "pre_feedforward_layernorm.weight") if self.spec.sandwich_norms else None,
                post_ffn_norm=get(p + "post_feedforward_layernorm.weight") if self.spec.sandwich_norms else None,
                q_norm=get(attn + "q_norm.weight") if self.spec.qk_norm else None,
                k_norm=get(attn + "k_norm.weight") if self.spec.qk_norm else None,
                sliding_window=(getattr(config, "sliding_window", None)
                                if kind == "sliding_attention" else None),
                rope=tables[rope_key],
            ))
        self.silu_mul = (self.cpu_fused and self.act is F.silu
                         and cpu_fused.silu_mul_fits(self.layers[0].gate_up.out_features // 2))
        # Products of many rows with a gate/up weight the GEMM takes go straight into SiLU * up
        # (cpu_gemv.gemm_silu: the same bits, without writing both halves out and reading them back).
        self.gate_up_silu = self.silu_mul and os.environ.get("HEARTH_CPU_GEMM_SILU", "auto") != "off" and all(
            isinstance(layer.gate_up, layers.Linear) and layer.gate_up.gemm and layer.gate_up.gemv_weight is not None
            and cpu_gemv.gemm_silu_kernel(layer.gate_up.gemv_weight) is not None for layer in self.layers)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.decode_stack = self._decode_stack()

    def _decode_stack(self) -> cpu_decode_layer.DecodeStack | None:
        """One C call per layer for decode steps (kernels/cpu_decode_layer), where every step of the layer
        already runs one of our CPU kernels: the same results, without Python between them. Steps of more than
        two sequences too where every product of many rows is one of them (fp32 on the GEMM, int8)."""
        if not (self.cpu_fused and self.cpu_attention and self.silu_mul and cpu_decode_layer.available()
                and self.hidden_size % 8 == 0 and not self.spec.qk_norm and not self.spec.sandwich_norms):
            return None
        specs: list[cpu_decode_layer.LayerSpec] = []
        for layer in self.layers:
            products = [cpu_decode_layer.matrix(*linear.kernel_weight(), self.dtype,
                                                gemm=isinstance(linear, layers.Linear) and linear.gemm)
                        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            if any(p is None for p in products) or layer.rope.rotary_dim != self.head_dim:
                return None
            silu = (cpu_decode_layer.silu_entry(layer.gate_up.gemv_weight)
                    if self.gate_up_silu and isinstance(layer.gate_up, layers.Linear) and layer.gate_up.gemv_weight
                    else None)
            specs.append(cpu_decode_layer.LayerSpec(*products, layer.input_norm, layer.post_attn_norm,
                                                    layer.rope.cos, layer.rope.sin, layer.sliding_window, silu))
        return cpu_decode_layer.DecodeStack(
            dtype=self.dtype, hidden=self.hidden_size, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, intermediate=self.layers[0].gate_up.out_features // 2, eps=self.eps,
            norm_offset=self.spec.norm_offset, scale=self.scale, softcap=self.attn_softcap, layers=specs,
            prompts=self.cpu_causal and self.attn_softcap is None and all(s.window is None for s in specs))

    def _decode_step(self, h: torch.Tensor, batch: AttentionBatch, kv: KVPool,
                     keep: torch.Tensor | None) -> cpu_decode_layer.DecodeStep | None:
        """This step on the one-call layers, or None where it needs the Python forward (adapters whose products
        are not on its kernels, prompt chunks off the C prompt kernels or observed for compression, more rows
        than the stack's products take). Decodes of sequences being compressed run here too: the attention
        kernel fills `group.received_layers` with what their entries received, every layer's at once.
        keep: as `forward` takes it, for the last layer."""
        stack = self.decode_stack
        if (stack is None or len(batch.decode_groups) > 1 or (batch.prefills and not stack.prompts)
                or (h.shape[0] > cpu_decode_layer.MAX_ROWS and not stack.many_rows)
                or kv.k.shape[1] > cpa.MAX_BLOCK):
            return None
        group = batch.decode_groups[0] if batch.decode_groups else None
        prompts = self._prompt_rows(batch)
        if prompts is None or not (group or prompts) or (keep is not None and not bool((keep[1:] > keep[:-1]).all())):
            return None  # (the layers move kept rows forward in place: ascending only)
        lora = batch.lora
        adapters = kept_adapters = None
        if lora is not None:
            adapters = lora.slots.one_call(lora)
            kept = lora.kept(keep) if keep is not None else None
            kept_adapters = kept.slots.one_call(kept) if kept is not None else None
            if adapters is None or (kept is not None and kept_adapters is None):
                return None
        received = None
        if group is not None and group.observers is not None:  # sequences being compressed: every layer's scores
            tables = group.block_tables
            received = group.received_layers = torch.empty(*tables.shape[:3], tables.shape[3] * kv.k.shape[1],
                                                            dtype=torch.float32)
        return stack.start(h, batch.positions, batch.slots, group.block_tables if group else None,
                           group.kv_lens if group else None, kv.k, kv.v, kv.pos, adapters, prompts=prompts,
                           keep=keep, kept_adapters=kept_adapters, received=received)

    @staticmethod
    def _prompt_rows(batch: AttentionBatch) -> list[cpu_decode_layer.PromptRows] | None:
        """The step's prompt chunks as the one-call layers take them: each one's attention on the C prompt kernels
        as `_attention` runs it (fresh, or after keys that every head holds in order), in every layer; None where
        some chunk needs the other paths (a compressor observing it, entries evicted)."""
        prompts = []
        for seg in batch.prefills:
            if seg.observer is not None:
                return None
            if seg.fresh:
                prompts.append(cpu_decode_layer.PromptRows(seg.start, seg.end))
                continue
            assert seg.kv_lens is not None and seg.block_table is not None
            last = int(batch.positions[seg.end - 1])
            if not int(seg.kv_lens.min()) == int(seg.kv_lens.max()) == last + 1:
                return None
            prompts.append(cpu_decode_layer.PromptRows(seg.start, seg.end, last + 1 - (seg.end - seg.start),
                                                       seg.block_table))
        return prompts

    # ------------------------------------------------------------------ forward
    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return layers.rms_norm(x, weight, self.eps, offset=self.spec.norm_offset)

    def _add_norm(self, h: torch.Tensor, x: torch.Tensor | None,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + x, its norm); x None adds nothing. One fused call on CPU in fp32 (h is updated in place there:
        it is this pass's own residual stream)."""
        if cpu_norm.supports(h):
            return cpu_norm.add_rms_norm(h, x, weight, self.eps, self.spec.norm_offset)
        if x is not None:
            h = h + x
        return h, self._norm(h, weight)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch, kv: KVPool,
                between_layers: Callable[[], None] | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden] (normed), or only the rows `keep` lists, in its order.

        between_layers: called before each layer; the engine serves newly arrived interactive prompts there
        (a pass of their own over other sequences' blocks), so they need not wait for this pass to end.
        keep: the rows whose hidden states the caller reads (a prompt chunk's last token, decodes). Every row
        still writes its keys and values in every layer, but the last layer's output projection and MLP, which
        only feed the final states, run on the kept rows alone: a prompt's other tokens skip ~1/num_layers of
        their products."""
        h = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        step = self._decode_step(h, batch, kv, keep)
        if step is not None:
            for index in range(self.num_layers):
                if between_layers is not None:
                    between_layers()
                self.decode_stack.layer(step, index)
            if step.kept is not None:  # the last layer ran its output projection and MLP on the kept rows alone
                if not step.kept:
                    return step.h[:0]
                return self._add_norm(step.h[: step.kept], step.x[: step.kept], self.final_norm)[1]
            return self._add_norm(step.h, step.x, self.final_norm)[1]
        residual: torch.Tensor | None = None  # the last sublayer's output, added to h with the next norm
        for index, layer in enumerate(self.layers):
            if between_layers is not None:
                between_layers()
            h, x = self._add_norm(h, residual, layer.input_norm)
            lora = batch.lora  # the adapters of the rows this layer's output projection and MLP run on
            if keep is not None and index == self.num_layers - 1:
                x = self._attention(index, layer, x, batch, kv, keep)
                h = h.index_select(0, keep)
                lora = lora.kept(keep) if lora is not None else None
                if not keep.numel():  # no row samples (a prompt's early chunk): its keys and values are written
                    return h
            else:
                x = self._attention(index, layer, x, batch, kv)
            if layer.pre_ffn_norm is not None:
                h, x = self._add_norm(h, self._norm(x, layer.post_attn_norm), layer.pre_ffn_norm)
            else:
                h, x = self._add_norm(h, x, layer.post_attn_norm)
            if (self.gate_up_silu and x.shape[0] > cpu_gemv.MAX_ROWS
                    and (lora is None or not lora.touches(index, "gate_up"))):
                x = cpu_gemv.gemm_silu(x, *layer.gate_up.kernel_weight())
            elif self.gate_up_silu and lora is not None:  # silu(gate) * up, the adapters inside where they can be
                x = lora.product(index, "gate_up", x, layer.gate_up, silu=True)
            else:
                gate_up = lora.product(index, "gate_up", x, layer.gate_up) if lora is not None else layer.gate_up(x)
                if self.silu_mul:
                    x = cpu_fused.silu_mul(gate_up)
                else:
                    gate, up = gate_up.chunk(2, dim=-1)
                    x = self.act(gate) * up
            x = lora.product(index, "down", x, layer.down) if lora is not None else layer.down(x)
            if layer.post_ffn_norm is not None:
                x = self._norm(x, layer.post_ffn_norm)
            residual = x
        final = self._add_norm(h, residual, self.final_norm)[1]
        return final

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> fp32 logits [N, vocab]."""
        return self.finish_logits(self.lm_head.fp32(hidden))

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> int64 [N]: argmax(self.logits(hidden), dim=-1), the tokens of rows that sample
        greedily with nothing else to read from their logits; on the GEMM without storing them where the head
        takes it. A soft-capped head goes through its logits: the cap can round distinct outputs to one value."""
        if self.final_softcap:
            return cpu_argmax.argmax(self.logits(hidden))
        return self.lm_head.argmax(hidden)

    def finish_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Raw head outputs (any subset of the vocabulary) -> fp32 logits, soft-capped where the model caps."""
        out = out.float()
        if self.final_softcap:
            out = torch.tanh(out / self.final_softcap) * self.final_softcap
        return out

    @staticmethod
    def _rope_rows(table: layers.RotaryTable, batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        key = ("rope", id(table))
        if key not in batch.memo:
            batch.memo[key] = table.rows(batch.positions)
        return batch.memo[key]

    @staticmethod
    def _decode_mask(index: int, window: int | None, group: DecodeGroup, tables: torch.Tensor,
                     batch: AttentionBatch, kv: KVPool) -> torch.Tensor:
        positions = batch.positions[group.start: group.end]
        lens = group.kv_lens[index]
        if not batch.dense:
            return pa.decode_mask(kv.pos, tables, lens, positions, window)
        key = ("decode_mask", group.start, window)
        if key not in batch.memo:
            width = tables.shape[-1] * kv.k.shape[1]
            batch.memo[key] = pa.dense_decode_mask(lens[:, 0], positions, width, window)
        return batch.memo[key]

    @staticmethod
    def _whole_context(kv_lens: torch.Tensor, positions: torch.Tensor, start: int, end: int) -> int | None:
        """How many of a prompt chunk's keys precede it, where every kv head still holds each of its positions in
        order (entry t at position t: nothing evicted), so the C prompt kernel can read them; else None."""
        last = int(positions[end - 1])
        lens = kv_lens.tolist()
        return last + 1 - (end - start) if min(lens) == max(lens) == last + 1 else None

    def _attention(self, index: int, layer: LayerWeights, x: torch.Tensor,
                   batch: AttentionBatch, kv: KVPool, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The attention sublayer's output for every row, or for the rows `keep` lists (every row's keys and
        values are written either way)."""
        tokens = x.shape[0]
        qkv = batch.lora.product(index, "qkv", x, layer.qkv) if batch.lora is not None else layer.qkv(x)
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(tokens, heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        if layer.q_norm is not None:
            qk = torch.cat([self._norm(qk[:, : self.num_heads], layer.q_norm),
                            self._norm(qk[:, self.num_heads:], layer.k_norm)], dim=1)
        # q and k rotate together: one pass over both instead of one per tensor.
        if not (self.cpu_fused and layer.rope.rotary_dim == self.head_dim
                and cpu_fused.rope_write_kv(qk, v, layer.rope.cos, layer.rope.sin, batch.positions,
                                            batch.slots[index], kv.k, kv.v, kv.pos, self.num_heads)):
            cos, sin = self._rope_rows(layer.rope, batch)
            qk = layer.rope.apply(qk, cos, sin)
            pa.write_kv(kv.k, kv.v, kv.pos, batch.slots[index], qk[:, self.num_heads:], v, batch.positions)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous: kernels write rows in place
        window, softcap = layer.sliding_window, self.attn_softcap
        for group in batch.decode_groups:
            tables = group.block_tables[index]
            rows, lens = slice(group.start, group.end), group.kv_lens[index]
            if self.triton is not None:
                out[rows] = self.triton.decode(q[rows], kv.k, kv.v, kv.pos, tables, lens, batch.positions[rows],
                                               self.scale, window, softcap)
                if group.observers is not None:
                    received = self.triton.received(q[rows], kv.k, kv.pos, tables, lens, batch.positions[rows],
                                                    self.scale, window, softcap)
            elif self.cpu_attention and kv.k.shape[1] <= cpa.MAX_BLOCK:
                # (sequences being compressed: the scores their entries received, from the same pass)
                received = (None if group.observers is None else
                            torch.empty(*tables.shape[:2], tables.shape[2] * kv.k.shape[1], dtype=torch.float32))
                out[rows] = cpa.paged_decode_attention(q[rows], kv.k, kv.v, kv.pos, tables, lens,
                                                       batch.positions[rows], self.scale, window, softcap,
                                                       received=received)
            else:
                mask = self._decode_mask(index, window, group, tables, batch, kv)
                if group.observers is None:
                    out[rows] = pa.paged_decode_attention_ref(q[rows], kv.k, kv.v, tables, mask, self.scale, softcap)
                else:  # one pass gives the output and the scores of the sequences being compressed
                    out[rows], received = kc.paged_decode_attention_received_ref(q[rows], kv.k, kv.v, tables, mask,
                                                                                 self.scale, softcap)
            if group.observers is not None:
                group.received.append(received)  # added to each sequence's scores after the last layer
        for seg in batch.prefills:
            s, e = seg.start, seg.end
            if seg.observer is not None:
                o = e - seg.observe
                if self.cpu_attention and kv.k.shape[1] <= cpa.MAX_BLOCK:
                    received = cpa.prefill_received_attention(
                        q[o:e], kv.k, kv.v, kv.pos, seg.block_table[index], seg.kv_lens[index],
                        batch.positions[o:e], self.scale, window, softcap)
                else:
                    received = kc.prefill_received_attention_ref(
                        q[o:e], kv.k, kv.pos, seg.block_table[index], seg.kv_lens[index], batch.positions[o:e],
                        self.scale, window, softcap)
                seg.observer.add(index, received)
            if seg.fresh and self.cpu_causal and window is None and softcap is None:
                cpa.causal_attention(q[s:e], k[s:e], v[s:e], self.scale, out=out[s:e])
            elif seg.fresh:
                out[s:e] = pa.causal_attention_ref(q[s:e], k[s:e], v[s:e], batch.positions[s:e],
                                                   self.scale, window, softcap)
            elif self.cpu_causal and window is None and softcap is None \
                    and (context := self._whole_context(seg.kv_lens[index], batch.positions, s, e)) is not None:
                cpa.prefill_attention(q[s:e], kv.k, kv.v, seg.block_table[index], context, self.scale, out=out[s:e])
            else:
                extend = self.triton.prefill if self.triton is not None else pa.paged_prefill_attention_ref
                out[s:e] = extend(q[s:e], kv.k, kv.v, kv.pos, seg.block_table[index], seg.kv_lens[index],
                                  batch.positions[s:e], self.scale, window, softcap)
        out = out.view(tokens, self.q_size)
        if keep is not None:
            out = out.index_select(0, keep)
            if not keep.numel():
                return out.new_empty(0, self.hidden_size)
        lora = batch.lora if keep is None or batch.lora is None else batch.lora.kept(keep)
        return lora.product(index, "o", out, layer.o) if lora is not None else layer.o(out)

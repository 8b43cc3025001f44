"""The synchronous engine: submit requests, call step(), read outputs. Everything else wraps this."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from xgrammar import CompiledGrammar

from inference.block_manager import BlockManager
from inference.compression import CompressionConfig, KVCompressor, ScoreSpread
from inference.config import EngineConfig
from inference.constrained.constraint import Constraint
from inference.constrained.decoding import ConstrainedDecoding
from inference.constrained.state import GrammarStep
from inference.counters import EngineCounters
from inference.detokenizer import IncrementalDetokenizer, StopStringMatcher
from inference.errors import InvalidRequestError, PromptTooLongError
from inference.kv_cache import KVLayout, KVPool
from inference.lora.format import LORA_ARCHITECTURES, BaseDims
from inference.lora.slots import LoRARequest, LoRASlots
from inference.model_runner import ModelRunner, StepResult
from inference.models.loader import LoadedModel, load_model
from inference.outputs import EngineMetrics, FinishReason, RequestOutput, TokenLogprob, Usage
from inference.sampler import SampledToken, Sampler, SamplingRow, make_generator
from inference.sampling_params import SamplingParams
from inference.scheduler import ScheduledChunk, Scheduler
from inference.sequence import GenerationRequest, Sequence, SequenceStatus
from inference.spec.controller import AdaptivePolicy, SpecController, Verified
from inference.spec.drafter import Drafter
from inference.spec.hybrid import LOOKUP_FIRST_MIN_N, LookupFirst
from inference.spec.ngram import ENGINE_MIN_N, NgramDrafter
from inference.spec.settings import MAX_SPECULATIVE_TOKENS, SpecMode, SpeculationSettings

log = logging.getLogger(__name__)


class FrontEnd(Protocol):
    """What the engine needs from whoever feeds it while a step runs (AsyncEngine)."""

    def has_arrivals(self) -> bool:
        """Interactive requests are waiting to be added."""

    def take_arrivals(self) -> None:
        """Add waiting requests (engine.add_request); hold back anything that would touch running sequences."""

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs produced mid-step to their callers now."""


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.info = loaded.info
        layout = KVLayout(self.model.num_layers, self.model.num_kv_heads, self.model.head_dim,
                          self.config.block_size, self.model.dtype)
        self.pool = KVPool.from_budget(layout, int(self.config.kv_cache_memory), self.model.device)
        self.blocks = BlockManager(layout, self.pool.num_blocks, self.config.enable_prefix_caching)
        self.lora: LoRASlots | None = None
        if self.config.enable_lora and self.model.model_type in LORA_ARCHITECTURES:
            self.lora = LoRASlots(BaseDims.from_config(self.model.config.to_dict()), self.model.num_layers,
                                  self.config.max_loras, self.config.max_lora_rank, self.model.dtype,
                                  self.model.device, stacked=self.model.triton is not None)
        self.scheduler = Scheduler(self.blocks, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                   self.config.max_batch_class_seqs, self.lora,
                                   batch_admission_group=self.config.batch_admission_group)
        self.runner = ModelRunner(self.model, self.pool, self.lora)
        self.compressor = KVCompressor(CompressionConfig(
            enabled=self.config.kv_compression, default=self.config.default_kv_compression(),
            sink_tokens=self.config.kv_sink_tokens, recent_tokens=self.config.kv_recent_tokens,
            prefix_tokens=self.config.kv_prefix_tokens, prefix_share=self.config.kv_prefix_share,
            protected_share=self.config.kv_protected_share,
            min_prompt_tokens=self.config.kv_min_prompt_tokens,
            observation_window=self.config.kv_observation_window,
            spread=ScoreSpread(self.config.kv_spread_before, self.config.kv_spread_after,
                               self.config.kv_spread_skip_prefix)), self.pool, self.blocks)
        self.sampler = Sampler()
        self.constrained = ConstrainedDecoding(self.tokenizer, self.model.vocab_size, self.info.eos_token_ids,
                                               cache_memory=int(self.config.grammar_cache_memory),
                                               jump_forward=self.config.grammar_jump_forward)
        self.max_model_len = min(self.config.max_model_len or self.info.context_window,
                                 self.info.context_window)
        drafters: dict[SpecMode, Drafter] = {SpecMode.NGRAM: NgramDrafter(min_n=ENGINE_MIN_N)}
        if self.config.draft_model:
            from inference.spec.draft_model import DraftModelDrafter

            model_drafter: Drafter = DraftModelDrafter.for_target(
                self.config.draft_model, self, vocab=self.config.draft_vocab,
                min_confidence=self.config.draft_min_confidence)
            if self.config.draft_lookup_first:
                model_drafter = LookupFirst(NgramDrafter(min_n=LOOKUP_FIRST_MIN_N), model_drafter)
            drafters[SpecMode.DRAFT] = model_drafter
        self.spec = SpecController(
            default=SpeculationSettings(SpecMode(self.config.speculation), self.config.num_speculative_tokens),
            drafters=drafters, sampler=self.sampler,
            policy=AdaptivePolicy(min_acceptance=self.config.spec_min_acceptance,
                                  max_batch=self.config.spec_max_batch))
        self._sequences: dict[str, Sequence] = {}
        self._finished_outputs: list[RequestOutput] = []
        self.counters = EngineCounters()
        # A front end that hears of requests while a step runs (AsyncEngine): between the layers of each pass
        # the engine asks it for interactive arrivals and starts them at once (see _admit_arrivals).
        self.front: FrontEnd | None = None

    @classmethod
    def from_model(cls, name_or_path: str | Path, config: EngineConfig | None = None) -> LLMEngine:
        config = config or EngineConfig()
        return cls(load_model(name_or_path, config), config)

    # ----------------------------------------------------------------- requests
    @property
    def token_limit(self) -> int:
        """Most tokens (prompt + output) one sequence may hold: the context window or the whole KV pool."""
        return min(self.max_model_len, self.pool.capacity_tokens)

    def validate(self, request: GenerationRequest) -> None:
        """Every check a request must pass before it is queued; raises InvalidRequestError."""
        prompt_len = len(request.prompt_token_ids)
        if prompt_len >= self.token_limit:
            raise PromptTooLongError(
                f"the prompt has {prompt_len} tokens but at most {self.token_limit - 1} fit "
                f"(context window {self.max_model_len}, KV cache {self.pool.capacity_tokens} tokens)",
                prompt_tokens=prompt_len, limit=self.token_limit - 1)
        vocab = self.model.vocab_size
        if any(t < 0 or t >= vocab for t in request.prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t in request.forced_output or ()):
            raise InvalidRequestError(f"forced_output token ids must be in [0, {vocab})")
        spec = request.speculation
        if spec is not None and spec.enabled and spec.mode not in self.spec.drafters:
            raise InvalidRequestError(f"speculation {spec.mode.value!r} is not available on this model")
        if request.lora is not None and self.lora is None:
            raise InvalidRequestError("this engine does not serve LoRA adapters")
        if request.constraint is not None and request.forced_output is not None:
            raise InvalidRequestError("forced_output cannot be combined with a constraint")

    def compile_constraint(self, constraint: Constraint) -> CompiledGrammar:
        """The constraint's compiled grammar, from the cache or compiled now in this thread (InvalidRequestError
        names what is wrong with it). AsyncEngine calls this off its loop thread."""
        return self.constrained.grammars.compile(constraint)

    def add_request(self, request: GenerationRequest, grammar: CompiledGrammar | None = None) -> Sequence:
        """grammar: the request's constraint already compiled (AsyncEngine compiles before the loop sees it)."""
        if request.request_id in self._sequences:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self.validate(request)
        if request.constraint is not None and grammar is None:
            grammar = self.compile_constraint(request.constraint)  # a bad one fails here, before it is queued
        params = request.params
        seq = Sequence(
            request=request,
            blocks=self.blocks.new_sequence(),
            generator=make_generator(params.seed) if not params.greedy else None,
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                               skip_special_tokens=params.skip_special_tokens),
            stop_matcher=StopStringMatcher(params.stop, params.include_stop_str_in_output),
        )
        if request.lora is not None:
            assert self.lora is not None
            seq.lora = self.lora.prepare(request.lora)  # a bad adapter fails here, before it is queued
        if grammar is not None:
            seq.grammar = self.constrained.start(grammar)
        settings = self.compressor.settings_for(request.kv_compression)
        if settings is not None and seq.prompt_len >= self.compressor.config.min_prompt_tokens:
            # Entries per head never exceed the tokens the sequence can hold, drafts included.
            limit = min(seq.prompt_len + params.max_tokens, self.token_limit) + MAX_SPECULATIVE_TOKENS + 1
            seq.compression = self.compressor.start(settings, limit)
        self._sequences[request.request_id] = seq  # type: ignore[index]
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        seq = self._sequences.get(request_id)
        if seq is None or seq.finished:
            return False
        self._finish(seq, FinishReason.ABORT)
        self._finished_outputs.append(self._output(seq))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._finished_outputs)

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """Draft, schedule, run the model once, verify or sample, and report what each request produced."""
        outputs, self._finished_outputs = self._finished_outputs, []
        decoding = [s for s in self.scheduler.running if s.num_uncomputed == 1 and s.next_forced is None]
        self.constrained.propose_jumps(decoding, self.token_limit)  # a grammar's forced text drafts first
        self.spec.propose([s for s in decoding if not s.draft], self.token_limit, load=self.scheduler.num_unfinished)
        self.constrained.check_drafts(decoding)  # no pass on draft tokens the grammar refuses
        plan = self.scheduler.schedule()
        self.counters.preemptions += len(plan.preempted)
        if not plan:
            return outputs
        now = time.monotonic()
        for chunk in plan.chunks:
            if chunk.seq.metrics.first_scheduled_time is None:
                chunk.seq.metrics.first_scheduled_time = now
        between_layers = self._admit_arrivals if self.front is not None else None
        for chunks, result in self._run_isolated(plan.chunks, outputs, between_layers):
            for chunk in chunks:
                if chunk.num_draft == 0:
                    self._computed(chunk.seq, chunk.num_tokens)
            self._sample_and_append(result, outputs)
        self._compress(plan.chunks)
        return outputs

    def _compress(self, chunks: list[ScheduledChunk]) -> None:
        """Compress the KV of sequences that finished their prompt or grew past their budget this step."""
        for chunk in chunks:
            seq = chunk.seq
            state = seq.compression
            if state is None or seq.finished or seq.status is not SequenceStatus.RUNNING:
                continue
            blocks = seq.blocks
            if self.compressor.due(state, blocks.num_entries, seq.num_computed, seq.prompt_len, blocks.compressed):
                self.compressor.compress(blocks, state, seq.num_computed)

    def _computed(self, seq: Sequence, count: int) -> None:
        seq.num_computed += count
        blocks = seq.blocks
        # Most steps complete no block; skip building the token list unless one did.
        if self.blocks.enable_prefix_caching and blocks.num_cached // self.config.block_size > len(blocks.hashes):
            self.blocks.commit_full_blocks(blocks, seq.token_ids(), seq.request.extra_keys)

    def _append_argmax(self, chunks: list[ScheduledChunk], tokens: list[int], outputs: list[RequestOutput]) -> None:
        """A greedy step's tokens (one per row as _sample_and_append lays them out): a plain chunk's is its
        next token; a drafted chunk's verify its draft."""
        spec, best, row = [], [], 0
        for chunk in chunks:
            if chunk.num_draft:
                spec.append(chunk)
                best.append(tokens[row: row + chunk.num_draft + 1])
            else:
                outputs.append(self._append_tokens(chunk.seq, [SampledToken(token_id=tokens[row], logprob=None,
                                                                             top=None)]))
            row += chunk.num_draft + 1
        if spec:
            self._keep_verified(spec, self.spec.verify_argmax([c.seq for c in spec], best), outputs)

    def _keep_verified(self, spec: list[ScheduledChunk], verified: list[Verified],
                       outputs: list[RequestOutput]) -> None:
        for chunk, result in zip(spec, verified, strict=True):
            rejected = chunk.num_draft - result.accepted
            chunk.seq.blocks.lens -= rejected  # roll back the rejected drafts' KV entries
            if chunk.seq.draft_forced:
                self.constrained.record_jump(chunk.seq, result.proposed, result.accepted)
            chunk.seq.draft, chunk.seq.draft_probs, chunk.seq.draft_forced = [], None, False
            self._computed(chunk.seq, chunk.num_tokens - rejected)
            outputs.append(self._append_tokens(chunk.seq, result.tokens))

    def _sample_and_append(self, result: StepResult, outputs: list[RequestOutput]) -> None:
        chunks, logits = result.sampled_chunks, result.logits
        if result.tokens is not None:
            self._append_argmax(chunks, result.tokens.tolist(), outputs)
            return
        self.constrained.mask(chunks, logits)  # constrained rows only: free ones are untouched
        plain, plain_rows, spec, spec_rows = [], [], [], []
        row = 0
        for chunk in chunks:
            width = chunk.num_draft + 1
            (spec if chunk.num_draft else plain).append(chunk)
            (spec_rows if chunk.num_draft else plain_rows).extend(range(row, row + width))
            row += width
        if plain:
            rows = [SamplingRow(c.seq.params, c.seq.generator, c.seq.request.prompt_token_ids,
                                c.seq.output_token_ids) for c in plain]
            plain_logits = logits[plain_rows] if spec else logits
            sampled = self.sampler(plain_logits, rows)
            forced = [i for i, c in enumerate(plain) if c.seq.next_forced is not None]
            if forced:
                given = self.sampler.score(plain_logits[forced], [rows[i] for i in forced],
                                           [plain[i].seq.next_forced for i in forced])
                for i, token in zip(forced, given, strict=True):
                    sampled[i] = token
            for chunk, token in zip(plain, sampled, strict=True):
                outputs.append(self._append_tokens(chunk.seq, [token]))
        if spec:
            self._keep_verified(spec, self.spec.verify([c.seq for c in spec], logits[spec_rows]), outputs)

    def _admit_arrivals(self) -> None:
        """Called between two layers of the pass in flight. Interactive requests that arrived since it began
        get their first prompt chunk computed now, in a pass of their own, and their first token delivered,
        instead of waiting for the whole step: time to first token stays near idle however full the batch is.
        The pass in flight is untouched: only free blocks are used, nothing running is preempted, and
        aborts wait for the step's end (the front end defers them)."""
        front = self.front
        if front is None or not front.has_arrivals():
            return
        front.take_arrivals()
        plan = self.scheduler.schedule_arrivals()
        if not plan:
            return
        self.counters.mid_step_admissions += len(plan.chunks)
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        for chunk in plan.chunks:
            if chunk.seq.metrics.first_scheduled_time is None:
                chunk.seq.metrics.first_scheduled_time = now
        for chunks, result in self._run_isolated(plan.chunks, outputs):
            for chunk in chunks:
                self._computed(chunk.seq, chunk.num_tokens)
            self._sample_and_append(result, outputs)
        self._compress(plan.chunks)
        front.deliver(outputs)

    def _run_isolated(self, chunks: list[ScheduledChunk], outputs: list[RequestOutput],
                      between_layers: Callable[[], None] | None = None
                      ) -> list[tuple[list[ScheduledChunk], StepResult]]:
        """Run the batch; if it fails, run each sequence alone so one bad request fails alone."""
        try:
            return [(chunks, self.runner.execute(chunks, between_layers=between_layers,
                                                 greedy=all(c.argmax_only for c in chunks)))]
        except Exception:
            log.exception("a batched step failed; retrying its sequences one by one")
        results = []
        for chunk in chunks:
            try:
                results.append(([chunk], self.runner.execute([chunk], greedy=chunk.argmax_only)))
            except Exception as exc:  # noqa: BLE001 - this request fails, the engine goes on
                log.exception("request %s failed", chunk.seq.request_id)
                self._finish(chunk.seq, FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}")
                outputs.append(self._output(chunk.seq))
        return results

    # ----------------------------------------------------------------- outputs
    def _append_tokens(self, seq: Sequence, tokens: list) -> RequestOutput:
        """Append this step's tokens (one, or several after speculation) and report them as one delta."""
        emitted = []
        try:
            for token in tokens:
                emitted.append(self._process_token(seq, token))
                if seq.finished:
                    break
        except Exception as exc:  # noqa: BLE001 - e.g. a detokenizer failure fails this request only
            log.exception("post-processing failed for request %s", seq.request_id)
            self._finish(seq, FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}")
        return self._output(seq, "".join(emitted))

    def _process_token(self, seq: Sequence, token) -> str:
        now = time.monotonic()
        token_id = int(token.token_id)
        seq.output_token_ids.append(token_id)
        first = seq.metrics.first_token_time is None
        if first:
            seq.metrics.first_token_time = now
        self.counters.token(now, seq.prompt_len if first else None)
        params = seq.params
        if params.logprobs is not None:
            seq.logprobs.append(self._logprob(token_id, token))

        finish: FinishReason | None = None
        grammar = seq.grammar.advance(token_id) if seq.grammar is not None else GrammarStep.OPEN
        if (not params.ignore_eos and token_id in self.info.eos_token_ids) or token_id in params.stop_token_ids \
                or grammar is GrammarStep.STOP_TOKEN:
            finish = FinishReason.STOP
            piece = ""
        else:
            piece = seq.detokenizer.push(token_id)
            if grammar is GrammarStep.COMPLETE:
                finish = FinishReason.STOP
        emit, stopped = seq.stop_matcher.feed(piece)
        if stopped:
            finish = FinishReason.STOP
        elif finish is None and (len(seq.output_token_ids) >= params.max_tokens
                                 or seq.num_tokens >= self.token_limit):
            finish = FinishReason.LENGTH
        if finish is not None and not stopped:
            emit += seq.stop_matcher.feed(seq.detokenizer.flush())[0] + seq.stop_matcher.flush()
        seq.text += emit
        if finish is not None:
            self._finish(seq, finish)
        return emit

    def _logprob(self, token_id: int, token) -> TokenLogprob:
        def decode(token_id: int) -> str:  # the token's text, not its vocabulary entry ("Ġthe")
            return self.tokenizer.decode([token_id], skip_special_tokens=False)

        top = [(int(t), decode(int(t)), float(lp)) for t, lp in (token.top or [])]
        return TokenLogprob(token_id, decode(token_id), float(token.logprob), top)

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        seq.metrics.finished_time = time.monotonic()
        if seq.compression is not None and seq.blocks.num_entries:
            seq.compression.observe_size(seq.blocks.num_entries, seq.num_computed * seq.blocks.lens.size)
        self.scheduler.remove(seq)
        self.spec.release(seq)
        self._sequences.pop(seq.request_id, None)
        self.counters.request_finished(seq.metrics.ttft_s,
                                       seq.metrics.time_per_output_token_s(len(seq.output_token_ids)))

    def _output(self, seq: Sequence, delta_text: str = "") -> RequestOutput:
        new_ids = seq.output_token_ids[seq.emitted_tokens:]
        seq.emitted_tokens = len(seq.output_token_ids)
        logprobs = all_logprobs = None
        if seq.params.logprobs is not None:
            all_logprobs = list(seq.logprobs)
            logprobs = all_logprobs[len(all_logprobs) - len(new_ids):]
        return RequestOutput(
            request_id=seq.request_id,
            delta_text=delta_text,
            delta_token_ids=new_ids,
            text=seq.text,
            token_ids=list(seq.output_token_ids),
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            usage=Usage(prompt_tokens=seq.prompt_len, cached_tokens=seq.cached_prompt_tokens or 0,
                        completion_tokens=len(seq.output_token_ids)),
            metrics=seq.metrics,
            logprobs=logprobs,
            all_logprobs=all_logprobs,
            speculation=seq.spec_stats.as_dict() if seq.spec_stats.proposed else None,
            kv_compression=self._compression_report(seq),
            stop_str=seq.stop_matcher.stop_str if seq.finished and seq.stop_matcher is not None else None,
            constrained=self.constrained.report(seq),
            error=seq.error,
        )

    @staticmethod
    def _compression_report(seq: Sequence) -> dict | None:
        state = seq.compression
        if state is None:
            return None
        if seq.blocks.num_entries:  # while it runs; a finished sequence keeps what it held last
            state.observe_size(seq.blocks.num_entries, seq.num_computed * seq.blocks.lens.size)
        return {**state.settings.as_dict(), **state.stats.as_dict()}

    def prompt_logits(self, token_ids: list[int], chunk_size: int | None = None,
                      lora: LoRARequest | None = None) -> torch.Tensor:
        """Next-token logits at every position of token_ids, fp32 [T, vocab] on the host, through the paged cache.

        The prompt is computed in chunks of chunk_size tokens (default: the step token budget), exactly as
        chunked prefill runs it. For evaluation and tests; call it while the engine is otherwise idle. The
        result is on the CPU wherever the engine runs, so callers compare it with references computed there.
        """
        request = GenerationRequest(prompt_token_ids=list(token_ids), params=SamplingParams(max_tokens=1),
                                    lora=lora)
        self.validate(request)
        seq = Sequence(request=request, blocks=self.blocks.new_sequence(), generator=None,
                       detokenizer=None, stop_matcher=None)
        size = chunk_size or self.config.max_num_batched_tokens
        pieces = []
        if lora is not None:
            assert self.lora is not None
            seq.lora = self.lora.prepare(lora)
            seq.lora_slot = self.lora.acquire(seq.lora)
            if seq.lora_slot is None:
                raise InvalidRequestError("every LoRA slot is in use; score the prompt when the engine is idle")
        try:
            while seq.num_computed < seq.num_tokens:
                count = min(size, seq.num_tokens - seq.num_computed)
                if not self.blocks.allocate(seq.blocks, count):
                    raise PromptTooLongError("not enough free KV blocks to score this prompt",
                                             prompt_tokens=seq.num_tokens, limit=self.token_limit - 1)
                pieces.append(self.runner.execute_all_logits(ScheduledChunk(seq, count)))
                seq.num_computed += count
        finally:
            self.blocks.free(seq.blocks)
            if seq.lora_slot is not None:
                self.lora.release(seq.lora_slot)  # type: ignore[union-attr]
        return torch.cat(pieces).cpu()

    # ----------------------------------------------------------------- metrics
    def metrics(self) -> EngineMetrics:
        total, free = self.blocks.num_blocks, self.blocks.num_free_blocks
        spec = self.spec.stats.as_dict()
        return EngineMetrics(
            queue_depth=len(self.scheduler.waiting),
            interactive_waiting=self.scheduler.num_waiting_interactive,
            interactive_prefill_tokens=self.scheduler.interactive_prefill_tokens(),
            running=len(self.scheduler.running),
            kv_blocks_total=total,
            kv_blocks_free=free,
            kv_usage=(total - free) / total if total else 0.0,
            prefix_cache_hit_rate=self.blocks.hit_rate,
            prefix_cache_hit_tokens=self.blocks.hit_tokens,
            spec_proposed=spec["proposed"],
            spec_accepted=spec["accepted"],
            spec_acceptance_rate=spec["acceptance_rate"],
            spec_mean_accepted_length=spec["mean_accepted_length"],
            spec_per_position_acceptance=spec["per_position_acceptance"],
            kv_compressions_total=self.compressor.stats.compressions,
            kv_evicted_entries_total=self.compressor.stats.evicted_entries,
            kv_freed_blocks_total=self.compressor.stats.freed_blocks,
            **self.counters.metrics(time.monotonic()),
            **(self.lora.metrics() if self.lora is not None else {}),
            **self.constrained.metrics(),
        )

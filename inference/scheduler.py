"""Continuous batching: which sequences run this step, and how many tokens each computes.

Each step:
1. Running sequences, best priority and oldest first, get the tokens they still need (1 when decoding, a
   chunk of the prompt while prefilling) from the step's token budget. When blocks run out, the newest
   sequence of the worst priority class is preempted: its blocks are released (its full blocks stay in the
   prefix cache) and it waits to be recomputed.
2. Waiting sequences are admitted in (priority, arrival) order while budget, sequence slots and blocks last.
   On first admission a sequence adopts the longest cached prefix of its prompt.

While an interactive request has prompt tokens to compute, batch-class sequences sit the step out: the step
then costs what the interactive prefill costs, so time to first token stays near idle however many batch
sequences are decoding. They resume at the next step; interactive decodes alone never pause them.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from inference.block_manager import BlockManager
from inference.lora.slots import LoRASlots
from inference.sampler import GREEDY_EPS
from inference.sequence import Priority, Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens to compute this step, starting at seq.num_computed (draft tokens included)
    num_draft: int = 0  # the last num_draft of them are speculative, to be verified

    @property
    def completes(self) -> bool:
        """After this chunk every known token is computed, so the step samples a new token."""
        return self.seq.num_computed + self.num_tokens - self.num_draft == self.seq.num_tokens

    @property
    def argmax_only(self) -> bool:
        """Whether every token this chunk samples or verifies is the argmax of its row's raw logits and nothing
        else reads them (no logprobs, penalties, grammar or forced token): a step of such chunks asks the model
        for those argmax tokens alone (ModelRunner.execute's greedy), which the LM head computes without storing
        the [rows, vocab] logits."""
        if not self.completes:
            return True
        seq, params = self.seq, self.seq.params
        return not (seq.grammar is not None or seq.next_forced is not None or params.logprobs is not None
                    or params.needs_penalties or params.temperature >= GREEDY_EPS
                    or (self.num_draft and not params.greedy))  # the verifier's own rule for greedy rows


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


def _prompt_chunk(seq: Sequence, budget: int) -> int:
    """Tokens of a prompt to compute this step: all that fit, but never leave a final chunk shorter than the
    sequence needs (KV compression observes its final queries), unless the whole rest fits now."""
    rest = seq.num_uncomputed
    if rest <= budget:
        return rest
    keep_for_last = min(seq.final_chunk_min, rest)
    return max(1, min(budget, rest - keep_for_last)) if rest - budget < keep_for_last else budget


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_batch_class_seqs: int | None = None, lora: LoRASlots | None = None, *,
                 batch_admission_group: int = 1) -> None:
        self.blocks = blocks
        self.lora = lora
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_batch_class_seqs = max_batch_class_seqs
        self.batch_admission_group = batch_admission_group
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival)
        self.running: list[Sequence] = []  # sorted by (priority, arrival)

    # ----------------------------------------------------------------- queue
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.blocks)
        self._unpin(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_waiting_interactive(self) -> int:
        """Waiting INTERACTIVE sequences: the queue a new interactive request joins (BATCH ones wait behind it;
        `waiting` is kept in priority order)."""
        return bisect.bisect_left(self.waiting, int(Priority.BATCH), key=lambda s: int(s.request.priority))

    def interactive_prefill_tokens(self, lookups: int = 8) -> int:
        """Prompt tokens interactive sequences still have to compute: the rest of those running, and of those
        waiting the uncached rest (the prefix cache looked up, not adopted) for the first `lookups` and the
        whole prompt for the others, so the count costs little after every step however long the queue."""
        running = sum(s.num_uncomputed for s in self.running
                      if s.priority is Priority.INTERACTIVE and s.num_uncomputed > 1)
        waiting = 0
        for i, seq in enumerate(self.waiting):
            if seq.priority is not Priority.INTERACTIVE:
                break  # the queue is in priority order
            cached = self.blocks.cached_prefix(seq.token_ids(), seq.request.extra_keys, seq.final_chunk_min) \
                if i < lookups and seq.num_computed == 0 else 0
            waiting += seq.num_uncomputed - cached
        return running + waiting

    # ----------------------------------------------------------------- step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        hold_batch = self._interactive_prefill_pending()
        hold_batch_prompts = hold_batch or self._batch_admission_waits()

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if hold_batch and seq.priority is Priority.BATCH:
                index += 1
                continue
            want = _prompt_chunk(seq, budget) if seq.num_uncomputed > 1 else min(1 + len(seq.draft), budget)
            if want < seq.num_uncomputed + len(seq.draft):  # the budget cuts the draft short
                seq.draft = seq.draft[: max(0, want - seq.num_uncomputed)]
                if seq.draft_probs is not None:  # one row per draft token, always
                    seq.draft_probs = seq.draft_probs[: len(seq.draft)] if seq.draft else None
            while not self.blocks.allocate(seq.blocks, want):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            out.chunks.append(ScheduledChunk(seq, want, len(seq.draft)))
            scheduled.add(id(seq))
            budget -= want
            index += 1

        def next_waiting() -> Sequence | None:
            seq = self._next_admissible()
            return None if seq is None or (hold_batch_prompts and seq.priority is Priority.BATCH) else seq

        self._admit_waiting(out, budget, next_waiting)
        return out

    def _batch_admission_waits(self) -> bool:
        """Whether waiting BATCH prompts wait for more free slots: while BATCH sequences run, new ones join in
        groups (batch_admission_group, or every BATCH sequence waiting if fewer). A step that computes prompts
        costs a fixed extra (the Python forward instead of the one-call decode layers: ~8 ms of a SmolLM2 step),
        and items that arrive one by one, as a batch worker sends them, would otherwise make about half the steps
        pay it. Interactive prompts never wait for this."""
        group = self.batch_admission_group
        if group <= 1:
            return False
        running_batch = sum(1 for s in self.running if s.priority is Priority.BATCH)
        if running_batch == 0:
            return False
        free = self.max_num_seqs - len(self.running)
        if self.max_batch_class_seqs is not None:
            free = min(free, self.max_batch_class_seqs - running_batch)
        waiting_batch = len(self.waiting) - self.num_waiting_interactive
        return free < min(group, waiting_batch)

    def schedule_arrivals(self) -> SchedulerOutput:
        """Interactive sequences at the head of the queue, started while another step's pass is in flight: the
        first prompt chunk of each, from free blocks only. Nothing running is touched or preempted.

        While another interactive prompt is being computed, only arrivals whose uncached rest fits one chunk
        start this way (their first token comes out of this very pass). A longer one would gain nothing from
        starting now, as its first token needs its later chunks anyway, and would split the core with the prompt
        in flight until both finished late; it waits for the next step and its prompt follows in arrival order.
        Short ones jumping ahead is shortest-first, which keeps mean time to first token low."""
        def fresh_interactive() -> Sequence | None:
            seq = self.waiting[0]
            # A preempted sequence (some tokens computed) waits for a regular step.
            fresh = seq.priority is Priority.INTERACTIVE and seq.num_computed == 0
            if not (fresh and self._adapter_ready(seq)):
                return None
            return seq if self._fits_one_chunk(seq) or not self._interactive_prefilling() else None

        out = SchedulerOutput()
        self._admit_waiting(out, self.max_num_batched_tokens, fresh_interactive)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int, pick: Callable[[], Sequence | None]) -> None:
        """Admit waiting sequences chosen by `pick` while budget, slots and blocks last."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = pick()
            if seq is None:
                break
            want = self._admit(seq, budget)
            if want is None:
                break
            out.chunks.append(ScheduledChunk(seq, want))
            budget -= want

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """Move a waiting sequence to running with blocks for its next prompt chunk (reusing cached prefix
        blocks first); the chunk's size, or None when the blocks are not there."""
        if seq.num_computed == 0 and seq.blocks.num_columns == 0:
            reused = self.blocks.match_prefix(seq.blocks, seq.token_ids(), seq.request.extra_keys,
                                              min_uncached=seq.final_chunk_min)
            seq.num_computed = reused
            if seq.cached_prompt_tokens is None:
                seq.cached_prompt_tokens = min(reused, seq.prompt_len)
        want = _prompt_chunk(seq, budget)
        if not self.blocks.allocate(seq.blocks, want):
            # Keep FCFS: nobody jumps the queue head. Give back what it adopted so it can be evicted.
            self.blocks.free(seq.blocks)
            seq.num_computed = 0
            return None
        if seq.lora is not None and seq.lora_slot is None:
            seq.lora_slot = self.lora.acquire(seq.lora) if self.lora is not None else None
            if seq.lora_slot is None:  # pickers check _adapter_ready first; never run it without its adapter
                self.blocks.free(seq.blocks)
                seq.num_computed = 0
                return None
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.sort_key)
        return want

    def _interactive_prefilling(self) -> bool:
        return any(s.priority is Priority.INTERACTIVE and s.num_uncomputed > 1 for s in self.running)

    def _fits_one_chunk(self, seq: Sequence) -> bool:
        """Whether a waiting prompt's uncached rest fits one step's budget (the prefix cache looked up, not
        adopted: a whole prompt that fits needs no lookup)."""
        budget = self.max_num_batched_tokens
        if seq.num_tokens <= budget:
            return True
        cached = self.blocks.cached_prefix(seq.token_ids(), seq.request.extra_keys, seq.final_chunk_min)
        return seq.num_tokens - cached <= budget

    def _interactive_prefill_pending(self) -> bool:
        """An interactive prompt will be computed this step. A waiting one counts only if it can be admitted now:
        holding batch work for one that cannot would stall the very sequences whose blocks it waits for."""
        if self._interactive_prefilling():
            return True
        head = self.waiting[0] if self.waiting else None
        if head is None or head.priority is not Priority.INTERACTIVE or len(self.running) >= self.max_num_seqs \
                or not self._adapter_ready(head):
            return False
        first_chunk = min(head.num_uncomputed, self.max_num_batched_tokens)
        return self.blocks.num_free_blocks >= self.blocks.blocks_for_tokens(first_chunk)

    def _next_admissible(self) -> Sequence | None:
        """The first waiting sequence that may start now. Those over the batch-class cap, or whose adapter has no
        free slot, are passed over (they keep their place): a slot frees only when a sequence holding it ends."""
        cap = self.max_batch_class_seqs
        batch_running = sum(1 for s in self.running if s.priority is Priority.BATCH) if cap is not None else 0
        for seq in self.waiting:
            if cap is not None and seq.priority is Priority.BATCH and batch_running >= cap:
                continue
            if not self._adapter_ready(seq):
                continue
            return seq
        return None

    def _adapter_ready(self, seq: Sequence) -> bool:
        return seq.lora is None or seq.lora_slot is not None or (
            self.lora is not None and self.lora.can_acquire(seq.lora.name))

    def _unpin(self, seq: Sequence) -> None:
        if seq.lora_slot is not None and self.lora is not None:
            self.lora.release(seq.lora_slot)
        seq.lora_slot = None

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute later: drop the KV (full blocks stay cached) and requeue in arrival order."""
        self.running.remove(seq)
        self.blocks.free(seq.blocks)
        self._unpin(seq)
        seq.num_computed = 0
        seq.draft, seq.draft_probs, seq.draft_forced = [], None, False  # the grammar state stays: tokens were kept
        seq.metrics.preemptions += 1
        out.preempted.append(seq)
        self.add(seq)

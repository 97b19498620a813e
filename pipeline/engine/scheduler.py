"""Continuous-batching scheduler (CPU only: no CUDA, no model).

Every sequence is a token list (prompt + outputs so far) and a count of tokens whose K/V
are already in the cache (`num_computed`). A step schedules, per sequence, the next
`num_new` uncomputed tokens: a whole or partial (chunked) prompt, a recompute after
preemption, or a single decode token. There is no separate prefill/decode phase, so one
step mixes them. A sequence samples a token when the step reaches its last token.

Policy of `schedule()`, under `max_num_seqs` and `max_num_batched_tokens`:
  1. Running sequences first, oldest first. One that needs more blocks than are free
     preempts the newest running sequence (its blocks are freed, it goes back to the head
     of the waiting queue and is recomputed later), repeatedly; if it is itself the newest,
     it is preempted and the pass stops.
  2. Then waiting sequences, FIFO: admitted while the token budget, `max_num_seqs` and
     free blocks allow; a prompt longer than the remaining budget is chunked. The queue
     head blocks everything behind it (no overtaking).
`postprocess(plan, sampled)` advances the counts, appends sampled tokens, finishes
sequences on a stop id or max_tokens, and frees their blocks.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

import torch

from pipeline.engine.kv_cache import BlockManager
from pipeline.handoff import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity semantics: sequences hold tensors and are unique
class Sequence:
    """One request's generation state."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    # Multimodal rows: mm_embeds[i] replaces the token embedding at prompt position
    # mm_positions[i] (sorted ascending). CPU tensors; the runner moves what it needs.
    mm_positions: torch.Tensor | None = None  # (P,) int64
    mm_embeds: torch.Tensor | None = None  # (P, H)
    return_hidden: bool = False
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_hidden_emitted: int = 0  # position up to which decode hidden rows were returned
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_preemptions: int = 0
    generator: torch.Generator | None = None  # per-request RNG (seeded sampling)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + outputs."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED


@dataclass
class ScheduledSeq:
    """One sequence's share of a step."""

    seq: Sequence
    start: int  # first position computed this step (= seq.num_computed when scheduled)
    num_new: int  # tokens computed this step: positions [start, start + num_new)
    sample: bool  # the step reaches the last token: sample the next one

    @property
    def is_decode(self) -> bool:
        """A single new token that is an output token fed back in."""
        return self.num_new == 1 and self.start >= self.seq.num_prompt


@dataclass
class StepPlan:
    """What the runner computes in one step (scheduler -> runner)."""

    # Sequences of this step, in flat-batch order: running ones first, then newly admitted.
    seqs: list[ScheduledSeq] = field(default_factory=list)
    # Sequences preempted while planning (blocks freed; recomputed when readmitted).
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.seqs)

    @property
    def is_decode_only(self) -> bool:
        """Every sequence computes exactly one token (CUDA-graph eligible)."""
        return bool(self.seqs) and all(s.num_new == 1 for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class SeqUpdate:
    """What postprocess did to one sequence that sampled."""

    seq: Sequence
    token_id: int
    finished: bool


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order, oldest first

    # -- queue ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is, freeing all its blocks at once."""
        for seq in list(self.waiting) + self.running:
            if seq.request_id == request_id:
                if seq in self.running:
                    self.running.remove(seq)
                else:
                    self.waiting.remove(seq)
                self.blocks.free(seq.block_table)
                seq.status = SeqStatus.FINISHED
                seq.finish_reason = "abort"
                return seq
        return None

    # -- planning ------------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop the cache, keep the tokens."""
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens

        # 1) Running sequences, oldest first; make blocks by preempting the newest.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            need = self.blocks.extra_blocks(seq.block_table, seq.num_computed + n)
            while not self.blocks.can_allocate(need) and self.running[-1] is not seq:
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
            if not self.blocks.can_allocate(need):
                self._preempt(seq)  # it is the newest left: give up its blocks too
                plan.preempted.append(seq)
                break
            self.blocks.allocate(seq.block_table, seq.num_computed + n)
            plan.seqs.append(
                ScheduledSeq(seq, seq.num_computed, n, seq.num_computed + n == seq.num_tokens)
            )
            budget -= n
            i += 1

        # 2) Waiting sequences, FIFO (a preempted one was put back at the head).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if plan.preempted:
                break  # memory is short this step: do not admit what we just evicted
            seq = self.waiting[0]
            n = min(seq.num_uncomputed, budget)
            need = self.blocks.extra_blocks(seq.block_table, seq.num_computed + n)
            if not self.blocks.can_allocate(need):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq.block_table, seq.num_computed + n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            plan.seqs.append(
                ScheduledSeq(seq, seq.num_computed, n, seq.num_computed + n == seq.num_tokens)
            )
            budget -= n
        return plan

    # -- after the step ------------------------------------------------------------------
    def postprocess(self, plan: StepPlan, sampled: list[int]) -> list[SeqUpdate]:
        """`sampled` has one token per `plan.seqs` entry with `sample=True`, in order."""
        updates: list[SeqUpdate] = []
        it = iter(sampled)
        for s in plan.seqs:
            seq = s.seq
            seq.num_computed = s.start + s.num_new
            if not s.sample:
                continue
            tok = int(next(it))
            seq.output_ids.append(tok)
            sp = seq.sampling
            if not sp.ignore_eos and tok in sp.stop_ids:
                self._finish(seq, "stop")
            elif len(seq.output_ids) >= sp.max_tokens:
                self._finish(seq, "length")
            updates.append(SeqUpdate(seq, tok, seq.is_finished))
        return updates

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.running.remove(seq)
        self.blocks.free(seq.block_table)

"""Continuous-batching scheduler (CPU only: no CUDA, no model).

Every sequence is a token list (prompt + outputs so far) and a count of tokens whose K/V
are already in the cache (`num_computed`). A step schedules, per sequence, the next
`num_new` uncomputed tokens: a whole or partial (chunked) prompt, a recompute after
preemption, or a single decode token. There is no separate prefill/decode phase, so one
step mixes them. A sequence samples a token when the step reaches its last token.

Policy of `schedule()`, under `max_num_seqs` and `max_num_batched_tokens`:
  1. Running sequences first, oldest first. Every running decode gets its token: budget for
     the decodes behind a prefill chunk is held back before the chunk is sized. One that
     needs more blocks than are free preempts the newest running sequence (its blocks are
     freed, it goes back to the head of the waiting queue and is recomputed later),
     repeatedly; if it is itself the newest, it is preempted and the pass stops.
  2. Then waiting sequences, FIFO: admitted while the token budget, `max_num_seqs` and
     free blocks allow; a prompt longer than the remaining budget is chunked. The queue
     head blocks everything behind it (no overtaking). With prefix caching, admission
     first takes the longest run of cached full blocks matching the sequence's hash chain
     (at most num_tokens - 1 tokens, so at least one token is computed and yields logits)
     and starts computing after it: `num_computed` = the cached length.
No share computes at or past `Sequence.num_ready`: the positions whose input embeddings do
not exist yet (media still being encoded). A sequence with nothing ready waits; at the head
of the waiting queue it holds the queue.
After the step, in two halves (`postprocess(plan, sampled)` is both at once):
`advance(plan)`, once the step is launched, counts its tokens as computed and gives every
sequence that samples a PENDING_ID output (the id its step is drawing); `resolve(plan,
sampled)`, once the ids are on the host, writes them in, publishes every block that became
full and computed to the prefix cache, finishes sequences on a stop id or max_tokens, and
frees their blocks. Between the halves the next step may be planned and launched (the
engine's launch-ahead): a pending id is fed to it from the device. A sequence whose pending
id turns out to stop it had one more row in that next step; that row's token is dropped
(`resolve` skips finished sequences), and the K/V it writes into the freed blocks lands
before any later step's, since every step runs in order on one stream. A sequence whose
pending id is its `max_tokens`-th is not scheduled again and holds no slot of `max_num_seqs`,
so steps that end sequences by length batch the same rows either way.

Blocks are published only once the step that writes their K/V is launched, never at
allocation: a chunked prefill's later blocks do not exist yet when another sequence is
admitted. A block of prompt tokens is published at `advance` (every step runs in order on one
stream, so a later step that reads it runs after the one that writes it: a request that
comes while a prefill of its prefix is in flight reuses it), a block holding an output token
at `resolve` (its id may still be pending before). A sequence never writes into a block it
took from the cache: the cached length is a whole number of blocks, and computing starts in
a fresh one.
"""

from __future__ import annotations

import bisect
import enum
import sys
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from pipeline.thinker.llm_engine.kv_cache import ROOT_HASH, BlockHash, BlockManager, hash_block
from pipeline.thinker.llm_engine.sampling import PENDING_ID
from pipeline.handoff import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class MediaSpan:
    """Prompt positions [start, end) filled by consecutive embedding rows of one media item.

    `key` names those rows' content: position start + i holds row i of the rows `key`
    names (e.g. "image:<content hash>:<first row>"). Two spans with equal keys must
    carry equal rows; that is what lets their K/V be shared by the prefix cache."""

    start: int
    end: int
    key: str


def extend_hashes(
    hashes: list[BlockHash],
    token_ids: Seq[int],
    spans: Seq[MediaSpan],
    block_size: int,
    num_blocks: int,
) -> None:
    """Extend the chain `hashes` (of the first len(hashes) blocks) to `num_blocks` full
    blocks of `token_ids`; `spans` (sorted, disjoint) key the media rows inside them."""
    ends = [sp.end for sp in spans]
    for b in range(len(hashes), num_blocks):
        lo, hi = b * block_size, (b + 1) * block_size
        media = []
        i = bisect.bisect_right(ends, lo)  # first span ending after lo
        while i < len(spans) and spans[i].start < hi:
            sp = spans[i]
            a, z = max(sp.start, lo), min(sp.end, hi)
            media.append((sp.key, a - sp.start, a - lo, z - a))
            i += 1
        hashes.append(hash_block(hashes[-1] if hashes else ROOT_HASH, token_ids[lo:hi], media))


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
    # Content keys of the multimodal rows (sorted, disjoint), for the prefix cache's hashes;
    # `mm_missing` lists the spans whose rows are not in mm_embeds yet (left out because
    # they were inside a cached prefix): the engine loads them before a step computes them.
    mm_spans: list[MediaSpan] = field(default_factory=list)
    mm_missing: list[MediaSpan] = field(default_factory=list)
    # Blocks ending after this position hold rows with no content key: never cached.
    cacheable_until: int = sys.maxsize
    # Positions [0, num_ready) have their input rows; a step computes nothing past it (the
    # caller raises it as its encoders finish the media of later positions).
    num_ready: int = sys.maxsize
    return_hidden: bool = False
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_hidden_emitted: int = 0  # position up to which decode hidden rows were returned
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_preemptions: int = 0
    generator: torch.Generator | None = None  # per-request RNG (seeded sampling)
    block_hashes: list[BlockHash] = field(default_factory=list)  # chain of the first full blocks
    num_cached_blocks: int = 0  # leading blocks taken from or published to the prefix cache
    num_cached_tokens: int = 0  # prefix-cache hit of the last admission

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

    def prefix_hashes(self, block_size: int, num_blocks: int) -> list[BlockHash]:
        """Hashes of the first `num_blocks` full blocks (computed once, then kept: the
        tokens of a sequence only ever grow)."""
        if len(self.block_hashes) < num_blocks:
            ids = self.prompt_ids if num_blocks * block_size <= self.num_prompt else self.all_ids
            extend_hashes(self.block_hashes, ids, self.mm_spans, block_size, num_blocks)
        return self.block_hashes[:num_blocks]


@dataclass
class ScheduledSeq:
    """One sequence's share of a step."""

    seq: Sequence
    start: int  # first position computed this step (= seq.num_computed when scheduled)
    num_new: int  # tokens computed this step: positions [start, start + num_new)
    sample: bool  # the step reaches the last token: sample the next one
    out_index: int = -1  # where its sampled id goes in seq.output_ids (set by `advance`)

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
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order, oldest first
        self.num_prefix_queries = 0  # tokens of admitted sequences (readmissions count again)
        self.num_prefix_hits = 0  # of those, tokens taken from the prefix cache

    # -- queue ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_decodes(self) -> bool:
        """Some running sequence has an output token to feed: it waits for the next step."""
        return any(is_decoding(s) for s in self.running)

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
        seq.num_cached_blocks = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    @staticmethod
    def _share(seq: Sequence, start: int, budget: int) -> int:
        """Tokens `seq` computes this step from `start`: all it has left, cut to what is
        ready and to the token budget."""
        return min(_ready(seq) - start, budget)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens

        # 1) Running sequences, oldest first; make blocks by preempting the newest.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # Hold back one token for every single-token share behind this one.
            later = sum(
                1 for s in self.running[i + 1 :] if _ready(s) - s.num_computed == 1 and _wants(s)
            )
            n = self._share(seq, seq.num_computed, budget) if _wants(seq) else 0
            if n > 1:
                n = min(n, max(budget - later, 1))
            if n <= 0:
                i += 1  # nothing ready to compute (media still encoding)
                continue
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
        # A sequence whose pending id is its last holds no slot: it ends when that id lands.
        active = sum(1 for s in self.running if _wants(s))
        while self.waiting and budget > 0 and active < self.max_num_seqs:
            if plan.preempted:
                break  # memory is short this step: do not admit what we just evicted
            seq = self.waiting[0]  # num_computed == 0, empty block table
            hit = self._match_prefix(seq)
            cached = len(hit) * self.blocks.block_size
            n = self._share(seq, cached, budget)
            if n <= 0:
                break  # its first rows are still being encoded: the queue waits with it
            # Fresh blocks for the computed part, plus the cached hits that leave the free
            # pool (ref count 0 until now).
            need = self.blocks.blocks_for(cached + n) - len(hit) + self.blocks.hit_cost(hit)
            if not self.blocks.can_allocate(need):
                break
            self.waiting.popleft()
            self.blocks.take_cached(seq.block_table, hit)
            seq.num_computed = seq.num_cached_tokens = cached
            seq.num_cached_blocks = len(hit)
            if self.blocks.enable_caching:
                self.num_prefix_queries += seq.num_tokens
                self.num_prefix_hits += cached
            self.blocks.allocate(seq.block_table, cached + n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            active += 1
            plan.seqs.append(
                ScheduledSeq(seq, seq.num_computed, n, seq.num_computed + n == seq.num_tokens)
            )
            budget -= n
        return plan

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks for the longest matching prefix of `seq`, leaving at least its last
        token to compute."""
        if not self.blocks.enable_caching:
            return []
        bs = self.blocks.block_size
        n = min((seq.num_tokens - 1) // bs, seq.cacheable_until // bs)
        return self.blocks.match_prefix(seq.prefix_hashes(bs, n))

    def _publish(self, seq: Sequence, upto: int = sys.maxsize) -> None:
        """Offer every block that is now full and computed (of the first `upto` tokens) to
        the prefix cache."""
        if not self.blocks.enable_caching:
            return
        bs = self.blocks.block_size
        n = min(seq.num_computed, seq.cacheable_until, upto) // bs
        if n <= seq.num_cached_blocks:
            return
        hashes = seq.prefix_hashes(bs, n)
        for i in range(seq.num_cached_blocks, n):
            self.blocks.register(seq.block_table[i], hashes[i])
        seq.num_cached_blocks = n

    # -- after the step ------------------------------------------------------------------
    def postprocess(self, plan: StepPlan, sampled: list[int]) -> list[SeqUpdate]:
        """`advance` then `resolve`: a step whose ids are already on the host."""
        self.advance(plan)
        return self.resolve(plan, sampled)

    def advance(self, plan: StepPlan) -> None:
        """The step is launched: its tokens count as computed, and every sequence that
        samples holds a PENDING_ID output until `resolve`. Blocks of prompt tokens it
        fills are published now (their ids are known; the step writes their K/V before any
        later step reads them)."""
        for s in plan.seqs:
            seq = s.seq
            seq.num_computed = s.start + s.num_new
            if s.start < seq.num_prompt:
                self._publish(seq, seq.num_prompt)
            if s.sample:
                s.out_index = len(seq.output_ids)
                seq.output_ids.append(PENDING_ID)

    def resolve(self, plan: StepPlan, sampled: list[int]) -> list[SeqUpdate]:
        """`sampled` has one token per `plan.seqs` entry with `sample=True`, in order. A
        sequence that finished since the step was planned (a stop id drawn by the step
        before, or an abort) is skipped: its token is dropped."""
        updates: list[SeqUpdate] = []
        it = iter(sampled)
        for s in plan.seqs:
            seq = s.seq
            tok = int(next(it)) if s.sample else None
            if seq.is_finished:
                continue
            if tok is not None:
                seq.output_ids[s.out_index] = tok
            self._publish(seq)
            if tok is None:
                continue
            sp = seq.sampling
            reason = None
            if not sp.ignore_eos and tok in sp.stop_ids:
                reason = "stop"
            elif s.out_index + 1 >= sp.max_tokens:
                reason = "length"
            if reason is not None:
                del seq.output_ids[s.out_index + 1 :]  # the next step's pending id, if any
                self._finish(seq, reason)
            updates.append(SeqUpdate(seq, tok, seq.is_finished))
        return updates

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        else:  # preempted while its last id was pending
            self.waiting.remove(seq)
        self.blocks.free(seq.block_table)


def _ready(seq: Sequence) -> int:
    """Tokens of `seq` that a step may compute up to."""
    return min(seq.num_tokens, seq.num_ready)


def _wants(seq: Sequence) -> bool:
    """It may still draw: its pending id (if any) is not its `max_tokens`-th."""
    return len(seq.output_ids) < seq.sampling.max_tokens


def is_decoding(seq: Sequence) -> bool:
    """An output token to feed, and more to draw after it."""
    return bool(seq.output_ids) and _ready(seq) - seq.num_computed == 1 and _wants(seq)

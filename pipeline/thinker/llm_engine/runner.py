"""Executes a `StepPlan` on the model.

`launch(plan)` enqueues the whole step on the device and returns; `finish` waits for the
step's device->host copy (its sampled ids and hidden rows, one event). Steps of `launch`:
  1. Flatten the plan: token ids, positions and KV slot ids of every scheduled token,
     plus per-sequence query offsets, KV lengths and block tables (`AttnMetadata`).
  2. One branch: a step the graphs can run (`LLMGraphRunner.can_run`) replays one, any
     other runs eagerly. A pure decode step's graph samples inside: the host only stages
     inputs, with no sync. Otherwise:
  3. Embed the ids, then overwrite the rows at multimodal positions with the sequence's
     `mm_embeds` (only the rows inside this step's chunk).
  4. The model's forward: a whole-step graph's replay, or attention planned once and the
     model run inside the scoped forward context.
  5. Logits for the last row of every sequence that reached its last token, sampled by
     the batched sampler (`sampling.sample_batch`), eagerly.
  6. Hidden rows for `return_hidden` sequences: the final-norm hidden state of every
     output token fed as input (one row per decode step), each returned once.

Guest rows (`GuestRows`, `launch(plan, guests)`): decode rows of sequences the engine does
not schedule but keeps in its KV pool (a server's duplex sessions), one token each, in the
step's forward after the plan's rows: a decode step's graph takes both (their hidden rows
and logits out of it), an eager step computes them in the same forward, and a step for the
whole-step graphs leaves them to a decode step of their own right after it (`run_guests`,
also what runs them when the engine plans nothing).

Launching ahead (the engine's `launch_ahead`). The engine launches step N+1 before it
finishes step N, so that the host plans N+1 while the GPU runs N; step N+1's inputs need
not wait for step N's ids on the host: a sequence that samples in step N carries PENDING_ID
as its last output id (the token step N is drawing), and the runner feeds that token, and
the penalty history's newest id, from the ids step N left on the device. A graph step's
one wait is for the previous graph step's staged inputs to have been read (the first
thing that step does on the GPU); eager steps still make blocking input copies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.thinker.llm_engine.attention import (
    AttentionBackend,
    AttnMetadata,
    ForwardBatch,
    forward_batch,
)
from pipeline.thinker.llm_engine.graphs import LLMGraphRunner, Staging
from pipeline.thinker.llm_engine.kv_cache import KVCache
from pipeline.thinker.llm_engine.sampling import (
    PENDING_ID,
    SamplingTensors,
    draw_noise,
    pack_rows,
    sample_batch,
    sampling_fields,
    widened_history,
)
from pipeline.thinker.llm_engine.scheduler import ScheduledSeq, Sequence, StepPlan


@dataclass
class RunnerOutput:
    sampled: list[int]  # one id per plan entry with sample=True, in plan order
    hidden: dict[str, torch.Tensor] = field(default_factory=dict)  # request id -> (n, H), CPU


@dataclass
class GuestRows:
    """Decode rows a step runs beside its plan's sequences, for a caller that keeps its own
    sequences in the engine's KV pool (the duplex sessions, pipeline/duplex/kv.py): row i
    feeds `tokens[i]` at `positions[i]`, its K/V written and read through `tables[i]`.
    After the launch, `hidden` (n, H) holds each row's final-norm hidden state and, where a
    decode graph ran them, `logits` (n, V) their logits (None: the caller computes those
    it wants); device tensors of their own, in stream order (the step need not be done)."""

    tokens: list[int]
    positions: list[int]
    tables: list[list[int]]
    hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class LaunchedStep:
    """A step in flight: what `finish` reads once `done` has fired."""

    ids: torch.Tensor | list[int]  # host copy of the device ids ([] when none sampled)
    keep: list[int] | None  # the entries of `ids` that are sampling plan entries (None: all)
    hidden: torch.Tensor | None  # host copy of the hidden rows `spans` point into
    spans: list[tuple[str, int, int]]  # request id, rows [start, end) of `hidden`
    done: torch.cuda.Event | None  # the copies have landed (None: synchronous device)
    # timed decode steps (DecodeTimes): an event recorded before the step's first GPU work,
    # and whether a step was in flight when it was launched (its GPU gap is the host's)
    started: torch.cuda.Event | None = None
    behind: bool = False


class DecodeTimes:
    """GPU time of the pure-decode steps and the GPU's idle time before each: what tells a
    decode step slowed on the GPU (other processes' kernels time-sliced in, slower kernels)
    from one the host did not launch in time (its planning, the GIL, the replica's event
    loop). From CUDA events with timing; `elapsed(a, b)` is `a.elapsed_time(b)` in ms.

    A step's GPU span runs from an event recorded before its first GPU work to the event
    that says its outputs landed; its idle gap from the previous step's `done` to its
    start, counted only when it was launched with that step still in flight (launching
    ahead), so an idle engine's pauses between requests are not the host's."""

    def __init__(self, elapsed: Callable[[Any, Any], float] | None = None) -> None:
        self._elapsed = elapsed or (lambda a, b: a.elapsed_time(b))
        self.steps = 0  # decode steps timed
        self.gpu_ms = 0.0  # their GPU spans
        self.gaps = 0  # ... of them launched behind another
        self.idle_ms = 0.0  # the GPU's idle time before those
        self.max_idle_ms = 0.0
        self._last_done: torch.cuda.Event | None = None

    def finished(self, step: LaunchedStep, decode: bool) -> None:
        """After `step.done` fired (steps finish in launch order): its times if it is a
        decode step."""
        elapsed = self._elapsed
        last, self._last_done = self._last_done, step.done
        if not decode or step.started is None or step.done is None:
            return
        self.steps += 1
        self.gpu_ms += elapsed(step.started, step.done)
        if step.behind and last is not None:
            gap = max(0.0, elapsed(last, step.started))
            self.gaps += 1
            self.idle_ms += gap
            self.max_idle_ms = max(self.max_idle_ms, gap)


@dataclass
class _FlatBatch:
    ids: list[int]
    positions: list[int]
    slots: list[int]
    qo_indptr: list[int]
    kv_lens: list[int]
    sample_rows: list[int]  # row index of the last token of each sampling sequence
    pending: list[tuple[int, Sequence]]  # rows whose token is PENDING_ID, with their sequence


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        backend: AttentionBackend,
        device: torch.device,
        dtype: torch.dtype,
        graphs: LLMGraphRunner | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.graphs = graphs
        self.decode_times = DecodeTimes()
        self._in_flight = 0  # launched, not finished
        self.block_size = kv_cache.block_size
        self.scale = model.cfg.head_dim**-0.5
        self.vocab = model.cfg.vocab_size
        self._cuda = device.type == "cuda"
        # Eager steps' sampling rows (grown on demand; the graphs own theirs).
        self._staging: Staging | None = None
        self._noise: torch.Tensor | None = None
        # The ids the last launched step sampled, on the device, and each sequence's row.
        self._prev_ids: torch.Tensor | None = None
        self._prev_rows: dict[Sequence, int] = {}

    # -- 1) flatten --------------------------------------------------------------------
    def _flatten(self, plan: StepPlan, guests: GuestRows | None = None) -> _FlatBatch:
        """The plan's rows, then the guests' (one a row, after every sequence)."""
        fb = _FlatBatch([], [], [], [0], [], [], [])
        bs = self.block_size
        for s in plan.seqs:
            seq = s.seq
            lo, hi = s.start, s.start + s.num_new
            fb.ids += seq.token_ids(lo, hi)
            fb.positions += range(lo, hi)
            fb.slots += [seq.block_table[p // bs] * bs + p % bs for p in range(lo, hi)]
            fb.qo_indptr.append(fb.qo_indptr[-1] + s.num_new)
            fb.kv_lens.append(hi)
            if hi == seq.num_tokens and seq.output_ids and seq.output_ids[-1] == PENDING_ID:
                fb.pending.append((fb.qo_indptr[-1] - 1, seq))
            if s.sample:
                fb.sample_rows.append(fb.qo_indptr[-1] - 1)
        for tok, p, table in zip(*_guest_columns(guests), strict=True):
            fb.ids.append(tok)
            fb.positions.append(p)
            fb.slots.append(table[p // bs] * bs + p % bs)
            fb.qo_indptr.append(fb.qo_indptr[-1] + 1)
            fb.kv_lens.append(p + 1)
        return fb

    def _meta(self, tables: list[list[int]], fb: _FlatBatch, is_decode: bool) -> AttnMetadata:
        width = max(len(t) for t in tables)
        bt = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return AttnMetadata(
            qo_indptr=torch.tensor(fb.qo_indptr, dtype=torch.int32),
            kv_lens=torch.tensor(fb.kv_lens, dtype=torch.int32),
            block_tables=bt.to(self.device),
            block_tables_cpu=bt,
            slot_mapping=torch.tensor(fb.slots, dtype=torch.long).to(self.device),
            is_decode=is_decode,
            block_size=self.block_size,
        )

    @staticmethod
    def _mm_rows(s: ScheduledSeq) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows within this chunk, embeds) of the multimodal slots inside the chunk."""
        seq = s.seq
        if seq.mm_positions is None or seq.mm_positions.numel() == 0:
            return None
        pos = seq.mm_positions
        inside = (pos >= s.start) & (pos < s.start + s.num_new)
        if not bool(inside.any()):
            return None
        return pos[inside] - s.start, seq.mm_embeds[inside]

    def _pending_sources(self, fb: _FlatBatch) -> list[int]:
        """Rows of `_prev_ids` holding the tokens of `fb.pending`."""
        try:
            return [self._prev_rows[seq] for _, seq in fb.pending]
        except KeyError as e:
            raise RuntimeError(
                f"sequence {e.args[0].request_id!r} has a pending token that the previous "
                "launched step did not sample"
            ) from None

    # -- run ---------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, plan: StepPlan, guests: GuestRows | None = None) -> LaunchedStep:
        """The plan's step, with `guests` (if any) in its forward: one decode graph for
        both when the step is a decode, else eagerly in the same forward, or (a step for
        the whole-step graphs) in a decode step of their own right after it."""
        started = None
        if self._cuda:  # before the step's first GPU work (its inputs' copies)
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        step = self._launch(plan, guests or None)
        step.started, step.behind = started, self._in_flight > 0
        self._in_flight += 1
        return step

    @torch.inference_mode()
    def run_guests(self, guests: GuestRows) -> None:
        """A decode step of `guests` alone. The ids the last launched step left on the
        device for its pending rows stay the next step's to read."""
        prev = self._prev_ids, self._prev_rows
        try:
            self._launch(StepPlan(), guests)
        finally:
            self._prev_ids, self._prev_rows = prev

    def _launch(self, plan: StepPlan, guests: GuestRows | None = None) -> LaunchedStep:
        mm = [self._mm_rows(s) for s in plan.seqs]
        media = any(m is not None for m in mm)
        g = self.graphs
        extra = len(guests) if guests else 0
        if extra and plan.seqs and g is not None and g.can_run(plan, media) \
                and not g.is_decode(plan, media, extra):
            # a whole-step graph's step: the guests go in a decode step of their own
            step = self._launch(plan)
            self.run_guests(guests)
            return step
        fb = self._flatten(plan, guests)
        src = self._pending_sources(fb)
        tables = [s.seq.block_table for s in plan.seqs] + (guests.tables if extra else [])
        if g is not None and g.is_decode(plan, media, extra):
            return self._decode_replay(plan, fb, src, tables, guests)
        if g is not None and not extra and g.can_run(plan, media):
            ids, embeds = self._embed(plan, fb, mm, src)
            hidden = g.forward(plan, embeds, fb.qo_indptr, fb.positions, fb.slots, fb.kv_lens)
            return self._sample_step(plan, fb, ids, hidden)
        return self._eager_step(plan, fb, mm, src, tables, guests)

    def finish(self, step: LaunchedStep, decode: bool = False) -> RunnerOutput:
        """Wait for a launched step's copy; its ids in plan order and its hidden rows.
        decode: a pure-decode step, timed in `decode_times` (CUDA)."""
        if step.done is not None:
            step.done.synchronize()
        self._in_flight -= 1
        self.decode_times.finished(step, decode)
        ids = step.ids.tolist() if isinstance(step.ids, torch.Tensor) else step.ids
        if step.keep is not None:
            ids = [ids[i] for i in step.keep]
        hidden = {rid: step.hidden[a:b].clone() for rid, a, b in step.spans}
        return RunnerOutput(ids, hidden)

    # -- 2) a decode graph ----------------------------------------------------------------
    def _decode_replay(
        self,
        plan: StepPlan,
        fb: _FlatBatch,
        src: list[int],
        tables: list[list[int]],
        guests: GuestRows | None,
    ) -> LaunchedStep:
        """The plan's rows and then the guests' (their params None: the graph's draws for
        them are not read) in one replay."""
        g = self.graphs.decode
        n = len(plan.seqs)
        bucket = g.stage(fb.ids, fb.positions, fb.slots, fb.kv_lens, tables)
        params = [s.seq.sampling if s.sample else None for s in plan.seqs]
        outputs = [s.seq.output_ids for s in plan.seqs]
        pad = bucket - n
        host = g.staging.host
        packed = pack_rows(host, params + [None] * pad, outputs + [()] * pad, self.vocab)
        host["pending_rows"][: len(src)] = [row for row, _ in fb.pending]  # row == plan index
        host["pending_src"][: len(src)] = src
        g.staging.upload()
        if src:
            g.fill_pending(len(src), self._prev_ids)
        draw_noise(g.noise, params, [s.seq.generator for s in plan.seqs])
        g.replay(bucket, packed.sampled)
        if guests:  # the graph's outputs are overwritten by its next replay
            m = n + len(guests)
            guests.hidden, guests.logits = g.hidden[n:m].clone(), g.logits[n:m].clone()

        keep = [i for i, s in enumerate(plan.seqs) if s.sample]
        spans = self._hidden_spans(plan, fb)
        ids = g.next_ids[:n]
        if packed.wide:  # a penalty history wider than the graph's: sample again, eagerly
            t = g.sampling_tensors(n)
            wide = widened_history(t.history, host["history"], packed.wide, self.vocab)
            ids = sample_batch(g.logits[:n], t.with_history(wide), packed.sampled)
        self._prev_ids, self._prev_rows = ids, {plan.seqs[i].seq: i for i in keep}
        return self._copy_out(ids, None if len(keep) == n else keep, g.hidden[:n], spans, False)

    # -- 3-5) eager --------------------------------------------------------------------
    def _embed(
        self,
        plan: StepPlan,
        fb: _FlatBatch,
        mm: list[tuple[torch.Tensor, torch.Tensor] | None],
        src: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's ids on the device (pending ones from the previous step) and their
        embeddings with the multimodal rows spliced in."""
        ids = torch.tensor(fb.ids, dtype=torch.long).to(self.device)
        if src:
            rows = torch.tensor([row for row, _ in fb.pending], device=self.device)
            ids[rows] = self._prev_ids[torch.tensor(src, device=self.device)]
        embeds = self.model.embed(ids)  # (T, H)
        for m, lo in zip(mm, fb.qo_indptr):
            if m is not None:
                rows, vals = m
                embeds[lo + rows.to(self.device)] = vals.to(self.device, embeds.dtype)
        return ids, embeds

    def _eager_step(
        self,
        plan: StepPlan,
        fb: _FlatBatch,
        mm: list[tuple[torch.Tensor, torch.Tensor] | None],
        src: list[int],
        tables: list[list[int]],
        guests: GuestRows | None = None,
    ) -> LaunchedStep:
        ids, embeds = self._embed(plan, fb, mm, src)
        positions = torch.tensor(fb.positions, dtype=torch.long).to(self.device)
        decode = all(b - a == 1 for a, b in zip(fb.qo_indptr, fb.qo_indptr[1:]))
        meta = self._meta(tables, fb, decode)
        self.backend.prepare(meta)
        batch = ForwardBatch(self.backend, meta, self.kv_cache.layers, self.scale)
        with forward_batch(batch):
            hidden = self.model(embeds, positions)  # (T, H)
        if guests:  # the last rows; their logits are the caller's to compute
            guests.hidden, guests.logits = hidden[hidden.shape[0] - len(guests) :], None
        return self._sample_step(plan, fb, ids, hidden)

    def _sample_step(
        self, plan: StepPlan, fb: _FlatBatch, ids: torch.Tensor, hidden: torch.Tensor
    ) -> LaunchedStep:
        """Sample the last row of every sampling sequence; the step's outputs."""
        spans = self._hidden_spans(plan, fb)
        sampling = [s for s in plan.seqs if s.sample]
        self._prev_ids, self._prev_rows = None, {}
        if not sampling:
            return self._copy_out([], None, hidden, spans, gather=True)
        rows = torch.tensor(fb.sample_rows, device=self.device)
        logits = self.model.compute_logits(hidden[rows])  # (N, V)
        pending = {seq for _, seq in fb.pending}
        newest = [j for j, s in enumerate(sampling) if s.seq in pending]
        out = self._sample_eager(logits, sampling, ids[rows], newest)
        self._prev_ids, self._prev_rows = out, {s.seq: j for j, s in enumerate(sampling)}
        return self._copy_out(out, None, hidden, spans, gather=True)

    def _sample_eager(
        self,
        logits: torch.Tensor,
        sampling: list[ScheduledSeq],
        last_ids: torch.Tensor,
        newest: list[int],
    ) -> torch.Tensor:
        """`sample_batch` over the sampling rows. last_ids: each row's input token (its
        sequence's newest id); `newest`: the rows whose newest id is pending on the host."""
        n = len(sampling)
        if self._noise is None or self._noise.shape[0] < n:
            rows = 1 << (n - 1).bit_length()
            self._staging = Staging(sampling_fields(rows, self.vocab), self.device)
            self._noise = torch.ones(rows, self.vocab, dtype=torch.float32, device=self.device)
        st = self._staging
        params = [s.seq.sampling for s in sampling]
        st.wait_consumed()
        packed = pack_rows(st.host, params, [s.seq.output_ids for s in sampling], self.vocab)
        st.upload()
        st.mark_consumed()
        t = SamplingTensors.view(st.dev, self._noise, n)
        if newest:
            j = torch.tensor(newest, device=self.device)
            t.history[:, -1].index_copy_(0, j, last_ids[j])
        draw_noise(self._noise, params, [s.seq.generator for s in sampling])
        if packed.wide:
            t = t.with_history(
                widened_history(t.history, st.host["history"], packed.wide, self.vocab)
            )
        return sample_batch(logits, t, packed.sampled)

    # -- 6) outputs ----------------------------------------------------------------------
    @staticmethod
    def _hidden_spans(plan: StepPlan, fb: _FlatBatch) -> list[tuple[str, int, int]]:
        """Flat rows [start, end) of the output tokens fed as input, per `return_hidden`
        sequence, each emitted once."""
        spans = []
        for s, lo in zip(plan.seqs, fb.qo_indptr):
            seq = s.seq
            if not seq.return_hidden:
                continue
            first = max(s.start, seq.num_prompt, seq.num_hidden_emitted)
            last = s.start + s.num_new
            if first < last:
                spans.append((seq.request_id, lo + first - s.start, lo + last - s.start))
                seq.num_hidden_emitted = last
        return spans

    def _copy_out(
        self,
        ids: torch.Tensor | list[int],
        keep: list[int] | None,
        hidden: torch.Tensor,
        spans: list[tuple[str, int, int]],
        gather: bool,
    ) -> LaunchedStep:
        """Enqueue the step's device->host copies (device ids, hidden rows) into pinned
        memory, and the event that says they landed. gather=False copies the hidden rows
        between the spans too (a few rows of a decode batch: no index tensor to build)."""
        host_ids = ids
        if isinstance(ids, torch.Tensor):
            host_ids = self._host_like(ids)
            host_ids.copy_(ids, non_blocking=True)
        host_hidden = None
        if spans:
            if gather:
                idx = [r for _, a, b in spans for r in range(a, b)]
                rows = hidden.index_select(0, torch.tensor(idx, device=hidden.device))
                starts = [0]
                for _, a, b in spans:
                    starts.append(starts[-1] + b - a)
                spans = [(rid, lo, hi) for (rid, _, _), lo, hi in zip(spans, starts, starts[1:])]
            else:
                first = min(a for _, a, _ in spans)
                rows = hidden[first : max(b for _, _, b in spans)]
                spans = [(rid, a - first, b - first) for rid, a, b in spans]
            host_hidden = self._host_like(rows)
            host_hidden.copy_(rows, non_blocking=True)
        done = None
        if self._cuda:
            done = torch.cuda.Event(enable_timing=True)  # DecodeTimes reads it
            done.record()
        return LaunchedStep(host_ids, keep, host_hidden, spans, done)

    def _host_like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=self._cuda)


def _guest_columns(guests: GuestRows | None) -> tuple[list, list, list]:
    if not guests:
        return [], [], []
    if not len(guests.positions) == len(guests.tables) == len(guests):
        raise ValueError("guest rows need one token, position and block table each")
    return guests.tokens, guests.positions, guests.tables

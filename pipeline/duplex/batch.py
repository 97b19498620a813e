"""The units of many duplex sessions, run together: one LLM forward a step for all of them.

`run_units(requests)` does what `DuplexSession.unit` does for each request's session, in
lockstep across the sessions:

1. each session plans its unit's input (`DuplexThinker.plan_prefill`: its audio through its
   own streaming encoder, its frames through the vision encoder), then all the planned rows
   go through the LLM in one forward, and the last row of each through `lm_head` in one
   matmul (the decisions' logits);
2. the decode loop runs every session's `DuplexThinker.unit_steps` side by side: each step
   appends one token to every session still decoding, in one forward, and computes the
   logits of the sessions that want them in one matmul. A session leaves the loop at its
   own chunk terminator; its decisions, repetition window, generator, turn state and
   sliding window stay its own (the steps run on its DuplexThinker, as alone);
3. the speech side (Talker chunk, Token2Wav) runs per session, after the Thinker batch.

Attention is per session: the rows of each session attend over that session's own KV
(`SessionKV`, one block of the paged layout, each of its own length) with the same layout
and the same backend call as the session alone (`SessionKV.metadata`); the batch shares
the matmuls, the norms and the MLPs. A layer writes its new K/V into a staging block of
the step's rows (the layout the fused QK-norm + RoPE + K/V kernel writes into), and each
session's rows are copied from there into its own KV before it attends.

Exactness: one session alone through `run_units` computes what `DuplexSession.unit`
computes (the same ops on the same rows). Across sessions only the batched matmuls' row
count differs, which moves values in their last bits (fp32: about 1e-6 in the K/V on the
duplex test checkpoint); the decisions, tokens and codes are the same as each session
alone (tests/test_duplex_batch.py).

A request that fails (bad input, a context over the model's length) fails alone: the
others of the batch go on. A failure of the shared forward fails every session in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.duplex.kv import SessionKV
from pipeline.duplex.session import DuplexSession, UnitResult
from pipeline.duplex.thinker import FORCE_CHOICES, ThinkerUnit, UnitPrefill, UnitSteps
from pipeline.thinker.llm import Qwen3LM
from pipeline.thinker.llm_engine.attention import (
    AttnMetadata,
    ForwardBatch,
    forward_batch,
    write_new_kv,
)


@dataclass
class UnitRequest:
    """One unit of one session: the arguments of `DuplexSession.unit`."""

    session: DuplexSession
    audio: np.ndarray | None
    frames: list | None = None
    force: str | None = None
    max_slice_nums: int | list[int] = 1


@dataclass
class _Part:
    kv: SessionKV
    meta: AttnMetadata  # the session's own layout for its rows (SessionKV.metadata)
    lo: int  # its rows in the step's flat batch
    hi: int


class _SessionsForward(ForwardBatch):
    """The forward context of one step over several sessions' rows. `kv_layers` are the
    staging blocks every layer writes the step's new K/V into (by the rows of `meta`, a
    single block holding the step's rows in order); `attend` copies each session's rows
    into its own KV and attends them over it."""

    def __init__(self, parts: list[_Part], staging: list[torch.Tensor], rows: int):
        meta = AttnMetadata(
            qo_indptr=torch.tensor([0, rows], dtype=torch.int32),
            kv_lens=torch.tensor([rows], dtype=torch.int32),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=staging[0].device),
            block_tables_cpu=torch.zeros(1, 1, dtype=torch.int32),
            slot_mapping=torch.arange(rows, device=staging[0].device),
            is_decode=False,
            block_size=rows,
        )
        super().__init__(parts[0].kv.backend, meta, staging, parts[0].kv.scale)
        self.parts = parts

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None,
               v: torch.Tensor | None) -> torch.Tensor:
        stage = self.kv_layers[layer_idx]
        write_new_kv(stage, self.meta, self.rows, k, v)  # k None: the layer wrote them
        out = torch.empty_like(q)
        for p in self.parts:
            start, n = p.kv.length, p.hi - p.lo  # the length moves on after the forward
            kv = p.kv.kv[layer_idx]
            kv[0, :, start : start + n] = stage[0, :, p.lo : p.hi]
            out[p.lo : p.hi] = p.kv.backend.forward(kv, q[p.lo : p.hi], None, None, p.meta,
                                                    p.kv.scale)
        return out


@torch.inference_mode()
def forward_sessions(llm: Qwen3LM,
                     items: list[tuple[SessionKV, torch.Tensor]]) -> list[torch.Tensor]:
    """Append each session's rows (T_i, H) to its KV in one forward; returns each one's
    final-norm hidden rows (T_i, H), as `SessionKV.forward` does for one. Every KV must
    have room (`SessionKV.ensure`) and appear once."""
    if len(items) == 1:
        kv, embeds = items[0]
        return [kv.forward(embeds)]
    parts, positions, lo = [], [], 0
    w = llm.lm_head.weight
    for kv, embeds in items:
        t = embeds.shape[0]
        parts.append(_Part(kv, kv.metadata(t), lo, lo + t))
        positions.append(torch.arange(kv.length, kv.length + t, device=w.device))
        lo += t
    c = llm.cfg
    staging = torch.empty(c.num_hidden_layers, 1, 2, lo, c.num_key_value_heads, c.head_dim,
                          device=w.device, dtype=w.dtype)
    embeds = torch.cat([e.to(w.dtype) for _, e in items], dim=0)
    with forward_batch(_SessionsForward(parts, list(staging.unbind(0)), lo)):
        hidden = llm(embeds, torch.cat(positions))
    for p in parts:
        p.kv.length += p.hi - p.lo
    return [hidden[p.lo : p.hi] for p in parts]


def _logits(llm: Qwen3LM, rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each final hidden row [H] -> its logits (1, V), in one matmul."""
    if len(rows) == 1:
        return [llm.compute_logits(rows[0].reshape(1, -1))]
    logits = llm.compute_logits(torch.stack(rows))
    return [logits[i : i + 1] for i in range(len(rows))]


class _Run:
    """One request's progress through the batch."""

    def __init__(self, req: UnitRequest):
        self.req = req
        self.thinker = req.session.thinker
        self.plan: UnitPrefill | None = None
        self.steps: UnitSteps | None = None
        self.token: tuple[int, bool] | None = None  # the step it waits on: (token, wants logits)
        self.unit: ThinkerUnit | None = None
        self.error: BaseException | None = None

    def fail(self, e: BaseException) -> None:
        self.error = e
        if self.steps is not None:
            self.steps.close()
        self.steps = self.token = None

    def advance(self, sent: tuple | None) -> None:
        """Start (sent None) or resume its steps; records the next step or the unit."""
        try:
            self.token = next(self.steps) if sent is None else self.steps.send(sent)
        except StopIteration as done:
            self.unit, self.steps, self.token = done.value, None, None
        except Exception as e:  # noqa: BLE001 - this session's unit fails, not the batch's
            self.fail(e)


def _forward(llm: Qwen3LM, runs: list[_Run],
             rows: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The rows of `runs` in one forward. A session whose KV has no room fails alone; a
    failed forward fails them all. Returns the hidden rows of the runs still alive."""
    live = []
    for run, r in zip(runs, rows):
        kv = run.thinker.kv
        try:
            kv.ensure(kv.length + r.shape[0])
        except ValueError as e:
            run.fail(e)
            continue
        live.append((run, r))
    runs[:] = [run for run, _ in live]
    if not live:
        return None
    try:
        return forward_sessions(llm, [(run.thinker.kv, r) for run, r in live])
    except Exception as e:  # noqa: BLE001 - every session of the forward is left mid-unit
        for run in runs:
            run.fail(e)
        runs.clear()
        return None


@torch.inference_mode()
def run_units(requests: list[UnitRequest]) -> list[UnitResult | BaseException]:
    """Each request's unit, batched; per request its UnitResult or the exception that
    failed it. The sessions share one Thinker model and appear once each."""
    if not requests:
        return []
    llm = requests[0].session.thinker.model.llm
    ids = [id(r.session) for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("a session may have one unit in a batch")
    if any(r.session.thinker.model.llm is not llm for r in requests):
        raise ValueError("the sessions of a batch must share one Thinker model")
    runs = [_Run(r) for r in requests]

    # 1. the unit's input rows, planned per session, in one forward
    planned = []
    for run in runs:
        r = run.req
        if r.force not in FORCE_CHOICES:
            run.fail(ValueError(f"force must be one of {FORCE_CHOICES}, got {r.force!r}"))
            continue
        try:
            run.plan = run.thinker.plan_prefill(r.audio, r.frames, r.max_slice_nums)
        except Exception as e:  # noqa: BLE001 - bad input fails its own unit
            run.fail(e)
            continue
        if run.plan is not None:
            planned.append(run)
    hidden = _forward(llm, planned, [run.plan.rows for run in planned])
    if hidden is not None:
        ok = [(run, h) for run, h in zip(planned, hidden) if run.plan.ok]
        logits = _logits(llm, [h[-1] for _, h in ok]) if ok else []
        for run in planned:
            if not run.plan.ok:
                run.thinker.finish_prefill(run.plan, None)  # a short audio: nothing pends
        for (run, _), lg in zip(ok, logits):
            run.thinker.finish_prefill(run.plan, lg)

    # 2. the decode loop in lockstep
    for run in runs:
        if run.error is None:
            try:
                run.steps = run.thinker.unit_steps(run.req.force)
            except Exception as e:  # noqa: BLE001
                run.fail(e)
                continue
            run.advance(None)
    while True:
        active = [run for run in runs if run.token is not None]
        if not active:
            break
        embeds = llm.embed(torch.tensor([run.token[0] for run in active], dtype=torch.long,
                                        device=llm.lm_head.weight.device))
        rows = [embeds[i : i + 1] for i in range(len(active))]
        fed = list(active)
        hidden = _forward(llm, fed, rows)
        if hidden is None:
            continue
        want = [i for i, run in enumerate(fed) if run.token[1]]
        logits = dict(zip(want, _logits(llm, [hidden[i][-1] for i in want]))) if want else {}
        for i, run in enumerate(fed):
            run.advance((hidden[i][-1], logits.get(i)))

    # 3. the speech side: the speak units' Talker draws in lockstep, Token2Wav per session
    done = [run for run in runs if run.error is None]
    results = DuplexSession.finish_units([(run.req.session, run.unit) for run in done])
    result = dict(zip(map(id, done), results, strict=True))
    return [run.error if run.error is not None else result[id(run)] for run in runs]

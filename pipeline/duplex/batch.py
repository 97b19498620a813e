"""The units of many duplex sessions, run together: one LLM forward a step for all of them.

`unit_batch(requests)` does what `DuplexSession.unit` does for each request's session, in
lockstep across the sessions, as a generator that yields after each GPU step and returns
the per-request results; `run_units(requests)` runs it to its end with nothing between the
steps. A server advances it one step at a time between the Thinker engine's steps
(deployments/stages/loop.py `EngineLoop.call_steps`), so chat turns keep stepping while a
batch runs. The steps:

1. the sessions plan their units' input together (`plan_prefill_batch`: every session's
   audio through the streaming audio encoder in one pass, each over its own encoder K/V,
   and every frame through the vision encoder in one call), then all the planned rows
   go through the LLM in one forward, and the last row of each through `lm_head` in one
   matmul (the decisions' logits);
2. the decode loop runs every session's `DuplexThinker.unit_steps` side by side: each step
   appends one token to every session still decoding, in one forward, computes the
   logits of the sessions that want them in one matmul, and draws the next id of every
   session that asks one in one `decode_batch` (each from its own generator; the host
   reads the device two or three times a step, not a few times a session). A session
   leaves the loop at its own chunk terminator; its decisions, repetition window,
   generator, turn state and sliding window stay its own (the steps run on its
   DuplexThinker, as alone). One step a forward and the draws of its logits (the
   prefill's step ends with the draws of the prefill's logits);
3. the speech side (`DuplexSession.finish_units_steps`): the speak units' Talker draws in
   lockstep, one decode a step over every drawing session's row of the shared TalkerPool
   (`speech.speak_steps`: the prefill one step, then one step a draw), then their
   Token2Wav windows in rounds, one flow chunk and one vocoder call per group of sessions
   in equal state (`speech._token2wav_steps`: one step a round).

Between two steps nothing of the batch is held in a buffer another forward overwrites (the
decode graphs' outputs are cloned, kv.py), and every session's state is its own, so a
step of the engine in between changes nothing the batch computes. What must not run in
between is what frees a session of the batch (its close): the server waits for the batch
first (deployments/stages/duplex.py `UnitBatcher.idle`).

Attention: the sessions' K/V are blocks of one paged pool (pipeline/duplex/kv.py), so a
step over many sessions is one forward with one attention call a layer over their block
tables (FlashInfer on CUDA; the torch backend, a loop over the sequences, elsewhere), as
the Thinker engine runs a step over its sequences.

Exactness: one session alone through `unit_batch` computes what `DuplexSession.unit`
computes (the same ops on the same rows). Across sessions only the batched matmuls' row
count differs, which moves values in their last bits (fp32: about 1e-6 in the K/V on the
duplex test checkpoint); the decisions, tokens and codes are the same as each session
alone, the PCM within 1 LSB of its int16 round trip (Token2Wav groups;
tests/test_duplex_batch.py).

A request that fails (bad input, a context over the model's length) fails alone: the
others of the batch go on. A failure of the shared forward, or of a step's draws, fails
every session in it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.duplex.decoder import decode_batch
from pipeline.duplex.kv import SessionKV
from pipeline.duplex.session import DuplexSession, UnitResult
from pipeline.duplex.thinker import (
    FORCE_CHOICES,
    Draw,
    ThinkerUnit,
    UnitPrefill,
    UnitSteps,
    plan_prefill_batch,
)
from pipeline.thinker.llm import Qwen3LM
from pipeline.utils import drain


@dataclass
class UnitRequest:
    """One unit of one session: the arguments of `DuplexSession.unit`."""

    session: DuplexSession
    audio: np.ndarray | None
    frames: list | None = None
    force: str | None = None
    max_slice_nums: int | list[int] = 1


@torch.inference_mode()
def forward_sessions(llm: Qwen3LM,
                     items: list[tuple[SessionKV, torch.Tensor]]) -> list[torch.Tensor]:
    """Append each session's rows (T_i, H) to its KV in one forward; returns each one's
    final-norm hidden rows (T_i, H), as `SessionKV.forward` does for one. The sessions share
    one pool, every KV has room (`SessionKV.ensure`) and appears once."""
    pages = items[0][0].pages
    if any(kv.pages is not pages for kv, _ in items) or pages.llm is not llm:
        raise ValueError("the sessions of a batch must share one KV pool of one model")
    return pages.forward(items)


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
        # the step it waits on: (token, wants logits) or a Draw; None: done or failed
        self.ask: tuple[int, bool] | Draw | None = None
        self.unit: ThinkerUnit | None = None
        self.error: BaseException | None = None

    def fail(self, e: BaseException) -> None:
        self.error = e
        if self.steps is not None:
            self.steps.close()
        self.steps = self.ask = None

    def advance(self, sent: tuple | int | None) -> None:
        """Start (sent None) or resume its steps; records the next step or the unit."""
        try:
            self.ask = next(self.steps) if sent is None else self.steps.send(sent)
        except StopIteration as done:
            self.unit, self.steps, self.ask = done.value, None, None
        except Exception as e:  # noqa: BLE001 - this session's unit fails, not the batch's
            self.fail(e)


def _step(runs: list[_Run], sizes: list[int], fn):
    """`fn(live, kept)` over the runs whose KV has room for their `sizes` more tokens (`kept`:
    their indices in `runs`); a session without room fails alone, a failed step fails them
    all (None). `runs` is left holding the runs still alive."""
    kept = []
    for i, (run, n) in enumerate(zip(runs, sizes, strict=True)):
        kv = run.thinker.kv
        try:
            kv.ensure(kv.length + n)
        except ValueError as e:
            run.fail(e)
            continue
        kept.append(i)
    runs[:] = live = [runs[i] for i in kept]
    if not live:
        return None
    try:
        return fn(live, kept)
    except Exception as e:  # noqa: BLE001 - every session of the step is left mid-unit
        for run in live:
            run.fail(e)
        runs.clear()
        return None


def _forward(llm: Qwen3LM, runs: list[_Run],
             rows: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The rows of `runs` in one forward (`_step`); the hidden rows of the runs still alive."""
    return _step(runs, [r.shape[0] for r in rows], lambda live, kept: forward_sessions(
        llm, [(run.thinker.kv, rows[i]) for run, i in zip(live, kept)]))


def _decode(runs: list[_Run]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One decode step of `runs` (their pending tokens; `_step`): the hidden rows, and the
    logits where a graph computed them, of the runs still alive."""
    return _step(runs, [1] * len(runs), lambda live, _: live[0].thinker.kv.pages.decode(
        [run.thinker.kv for run in live], [run.ask[0] for run in live]))


def _draw(runs: list[_Run]) -> None:
    """Answers the Draw of every run in one `decode_batch`; a failure fails them all (their
    generators may have drawn)."""
    try:
        ids = decode_batch([run.thinker.decoder for run in runs],
                           [run.ask.logits for run in runs],
                           [run.thinker.decode_params for run in runs])
    except Exception as e:  # noqa: BLE001 - every session of the draws is left mid-unit
        for run in runs:
            run.fail(e)
        return
    for run, token in zip(runs, ids, strict=True):
        run.advance(token)


def run_units(requests: list[UnitRequest]) -> list[UnitResult | BaseException]:
    """`unit_batch` run to its end, with nothing between its steps."""
    return drain(unit_batch(requests))


@torch.inference_mode()
def unit_batch(
    requests: list[UnitRequest],
    on_decided: Callable[[list[ThinkerUnit | BaseException]], None] | None = None,
) -> Generator[None, None, list[UnitResult | BaseException]]:
    """Each request's unit, batched, one GPU step a `next()` (module docstring); returns per
    request its UnitResult or the exception that failed it. The sessions share one Thinker
    model and appear once each. `on_decided`, when given, gets per request its ThinkerUnit
    (decision, text, ids) or the exception that failed it once the Thinker's part is done,
    before the speech side runs (a server sends the decisions ahead of the audio)."""
    if not requests:
        return []
    llm = requests[0].session.thinker.model.llm
    ids = [id(r.session) for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("a session may have one unit in a batch")
    if any(r.session.thinker.model.llm is not llm for r in requests):
        raise ValueError("the sessions of a batch must share one Thinker model")
    runs = [_Run(r) for r in requests]

    # 1. the unit's input rows, every session's audio and frames through the encoders
    # together (plan_prefill_batch), then all the rows in one forward
    todo = []
    for run in runs:
        if run.req.force not in FORCE_CHOICES:
            run.fail(ValueError(f"force must be one of {FORCE_CHOICES}, got {run.req.force!r}"))
        else:
            todo.append(run)
    plans = plan_prefill_batch([(run.thinker, run.req.audio, run.req.frames,
                                 run.req.max_slice_nums) for run in todo])
    planned = []
    for run, plan in zip(todo, plans):
        if isinstance(plan, BaseException):  # bad input fails its own unit
            run.fail(plan)
        elif plan is not None:
            run.plan = plan
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
        drawing = [run for run in runs if isinstance(run.ask, Draw)]
        if drawing:
            _draw(drawing)
            continue
        yield  # a step: the prefill or one decode forward, and the draws of its logits
        active = [run for run in runs if run.ask is not None]
        if not active:
            break
        fed = list(active)
        out = _decode(fed)
        if out is None:
            continue
        hidden, all_logits = out
        want = [i for i, run in enumerate(fed) if run.ask[1]]
        if all_logits is not None:
            logits = {i: all_logits[i : i + 1] for i in want}
        else:
            logits = dict(zip(want, _logits(llm, [hidden[i] for i in want]))) if want else {}
        for i, run in enumerate(fed):
            run.advance((hidden[i], logits.get(i)))

    if on_decided is not None:
        on_decided([run.error if run.error is not None else run.unit for run in runs])

    # 3. the speech side: the speak units' Talker draws in lockstep, Token2Wav per session
    done = [run for run in runs if run.error is None]
    results = yield from DuplexSession.finish_units_steps(
        [(run.req.session, run.unit) for run in done])
    result = dict(zip(map(id, done), results, strict=True))
    return [run.error if run.error is not None else result[id(run)] for run in runs]

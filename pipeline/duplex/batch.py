"""The units of many duplex sessions, run together: one LLM forward a step for all of them.

`UnitScheduler` does what `DuplexSession.unit` does for each unit added to it, continuously
batched across the sessions, one GPU step a `step()`: a unit added between two steps joins
at the next, and its decision and result go to its callbacks. `unit_batch(requests)` adds
requests at once and yields after each step; `run_units(requests)` runs it to its end. A
server advances the scheduler one step at a time between the Thinker engine's steps
(deployments/stages/loop.py `EngineLoop.call_steps`), so chat turns keep stepping beside
the units. A unit's way through it:

1. prefill: the units new since the last Thinker step plan their input together
   (`plan_prefill_batch`: every session's audio through the streaming audio encoder in one
   pass, each over its own encoder K/V, and every frame through the vision encoder in one
   call), then all the planned rows go through the LLM in one forward, and the last row of
   each through `lm_head` in one matmul (the decisions' logits, drawn in the same step,
   or, for a unit whose session's last unit still speaks, once that speech is done: a
   prefill draws nothing, so it runs ahead of that speech);
2. decode: every unit's `DuplexThinker.unit_steps` side by side: each step appends one
   token to every unit still decoding, in one forward, computes the logits of those that
   want them in one matmul, and draws the next id of every one that asks one in one
   `decode_batch` (each from its own generator; the host reads the device once a step,
   not a few times a session); a speak unit's spoken ids are told as they
   are drawn (`on_text`, for a server to stream its text). A unit leaves at its own chunk
   terminator, with its decision; its repetition window, generator, turn state and sliding window
   stay its session's own (the steps run on its DuplexThinker, as alone);
3. speech (`DuplexSession.finish_units_steps`), over the speak units done with 2 since the
   last speech batch began: their Talker draws in lockstep, one decode a step over every
   drawing session's row of the shared TalkerPool (`speech.speak_steps`: the prefill one
   step, then one step a draw), then their Token2Wav windows in rounds, a round one step
   of the Code2Wav engine over every session's window, each a slot of its pool
   (`speech._token2wav_steps`).

1 and 2 are the Thinker lane, 3 the speech lane. While both have work they share the
thread: the lane that has run less since both had work steps next (a Talker step is a few
ms, a Thinker decode step ~10, so strict turns would hold one lane to the other's pace). A
Token2Wav round is launched on a CUDA stream of its own (speech.py `_token2wav_steps`) and
not waited for: while it runs (a whole flow step over every session's window, the longest
GPU work of all), the Thinker lane's steps go on the thread's stream beside it, and the
speech lane resumes once it has landed.

Between two steps nothing of a unit is held in a buffer another forward overwrites (the
decode graphs' outputs are cloned, kv.py), and every session's state is its own, so a
step of the engine or of the other lane in between changes nothing a unit computes. What
must not run in between is what frees a session with a unit in flight (its close): the
server waits for the unit first (deployments/stages/duplex.py `UnitBatcher.idle`).

Attention: the sessions' K/V are blocks of one paged pool (pipeline/duplex/kv.py), so a
step over many sessions is one forward with one attention call a layer over their block
tables (FlashInfer on CUDA; the torch backend, a loop over the sequences, elsewhere), as
the Thinker engine runs a step over its sequences.

Exactness: one session alone through the scheduler computes what `DuplexSession.unit`
computes (the same ops on the same rows). Across sessions only the batched matmuls' row
count differs, which moves values in their last bits (fp32: about 1e-6 in the K/V on the
duplex test checkpoint); the decisions, tokens and codes are the same as each session
alone, the PCM within a few LSB of its int16 round trip (the Token2Wav
engine's padded rows; tests/test_duplex_batch.py, tests/test_duplex_speech_batch.py).

A unit that fails (bad input, a context over the model's length) fails alone: the
others go on. A failure of the shared forward, or of a step's draws, fails
every session in it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.code2wav.engine import Landing
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


# With only a Token2Wav round in flight and nothing else to step, `UnitScheduler.step`
# waits this long for it and returns (a server's loop comes back at once).
SPEECH_POLL_S = 0.002


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
    """One unit's progress through the scheduler."""

    def __init__(self, req: UnitRequest):
        self.req = req
        self.thinker = req.session.thinker
        self.plan: UnitPrefill | None = None
        self.steps: UnitSteps | None = None
        # the step it waits on: (token, wants logits) or a Draw; None: done or failed
        self.ask: tuple[int, bool] | Draw | None = None
        self.unit: ThinkerUnit | None = None
        self.error: BaseException | None = None
        self.on_decided: Callable | None = None  # UnitScheduler.add's callbacks
        self.on_done: Callable | None = None
        self.on_text: Callable | None = None
        self.told = 0  # the spoken ids on_text has had

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


def unit_batch(requests: list[UnitRequest]
               ) -> Generator[None, None, list[UnitResult | BaseException]]:
    """Each request's unit, all arriving at once, one GPU step a `next()` (a UnitScheduler's
    steps); returns per request its UnitResult or the exception that failed it."""
    ids = [id(r.session) for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("a session may have one unit in a batch")
    out: list[UnitResult | BaseException | None] = [None] * len(requests)
    sched = UnitScheduler()
    for i, req in enumerate(requests):
        sched.add(req, on_done=lambda r, i=i: out.__setitem__(i, r))
    yield from sched.steps()
    return out


class UnitScheduler:
    """Units of many sessions as they come (continuous batching), in two lanes that share
    the GPU's time, one GPU step a `step()`:

    - the Thinker lane: the units added since its last step are prefilled together
      (`plan_prefill_batch`, one LLM forward, their decisions drawn) and join the units
      decoding, which step together (one decode forward and one `decode_batch` a step); a
      unit whose chunk ends leaves it, and its decision goes out (`on_decided`);
    - the speech lane: the speak units whose Thinker part is done run their speech side
      together (`DuplexSession.finish_units_steps`: the Talker's lockstep, Token2Wav's
      rounds); the units done while it runs go as its next batch. A listen unit has no
      speech: it is done with its decision.

    While both lanes have work, the one that has spent less time in its steps since then
    steps next (`clock`), so each gets half the thread whatever its steps' lengths; a lane
    alone builds no credit. While the speech lane's Token2Wav round is on the GPU it has no
    step to take: the Thinker lane steps beside it, and with nothing else to step, `step()`
    waits for it up to SPEECH_POLL_S and returns (a server's loop steps its engine between).

    A new unit's prefill goes ahead of the decoding units' next step, but not twice in a row
    while units decode (arrivals as fast as the steps must not starve them). So a unit's
    prefill waits for a step or two of the lanes, never for another unit's speech, and its
    decision for its own decode. A session has one unit in the Thinker lane at a time, and
    its next unit draws nothing until its last one is done (the reference draws a unit's
    Thinker ids and Talker codes from one generator, in unit order): a unit that arrives
    while its session's last unit speaks is prefilled at once (a prefill draws nothing) and
    held; its steps start when that speech is done. `on_done` gets per unit its UnitResult
    or the exception that failed it; a unit that fails alone (bad input, no KV room) leaves
    the others going, a failed shared step fails the units in it. Each session's computation
    is what it is alone; only the rows batched beside it vary (module docstring)."""

    def __init__(self) -> None:
        self._new: list[_Run] = []  # added, waiting for their prefill
        self._held: list[_Run] = []  # prefilled while their session's last unit speaks
        self._thinking: list[_Run] = []  # decoding in lockstep
        self._ready: list[_Run] = []  # speak units past the Thinker, for the next speech batch
        self._speaking: list[_Run] = []  # the speech batch in flight
        self._speech: Generator | None = None
        self._landing: Landing | None = None  # the speech lane's Token2Wav step in flight
        # per session (id): its unit prefilled and not yet out of the Thinker lane, and its
        # unit whose speech is not yet done
        self._in_thinker: dict[int, _Run] = {}
        self._in_speech: dict[int, _Run] = {}
        self._spent = [0.0, 0.0]  # the Thinker's, the speech lane's step time, both busy
        self.clock: Callable[[], float] = time.perf_counter
        self._prefilled_last = False  # the Thinker lane's last step was a prefill
        self.prefills = 0  # the Thinker lane's prefill steps (units joined in each)

    def add(self, req: UnitRequest, on_decided: Callable | None = None,
            on_done: Callable | None = None, on_text: Callable | None = None) -> None:
        """Queue a unit. `on_text` gets a speak unit's spoken ids so far (a list that grows)
        after each Thinker step that drew more of them, before its decision; `on_decided`
        its ThinkerUnit once its Thinker part is done; `on_done` its UnitResult; either of
        the last two the exception that failed it instead."""
        run = _Run(req)
        run.on_decided, run.on_done, run.on_text = on_decided, on_done, on_text
        self._new.append(run)

    def has_work(self) -> bool:
        return bool(self._new or self._held or self._thinking or self._ready
                    or self._speech is not None)

    def steps(self, others: Callable[[], bool] | None = None) -> Generator[None, None, None]:
        """`step()` until no unit is left; yields after each. `others()`: whether the
        caller has work of its own to step between (a server's engine), which a Token2Wav
        round in flight then does not wait for."""
        while self.has_work():
            self.step(others is not None and others())
            yield

    @torch.inference_mode()
    def step(self, others: bool = False) -> None:
        """One step of a lane. With only a Token2Wav round in flight, it waits for the round
        up to SPEECH_POLL_S (not at all when `others`: the caller has its own work to step)
        and takes the speech lane's next step if it has landed."""
        self._release()
        admitted, taken = [], set(self._in_thinker)  # a session's first unit waiting, if free
        for run in self._new:
            if id(run.req.session) not in taken:
                admitted.append(run)
                taken.add(id(run.req.session))
        thinker = bool(admitted or self._thinking)
        # a Token2Wav step on the GPU (its own stream): the speech lane waits for it, and the
        # Thinker lane's steps run beside it meanwhile
        landing = self._landing
        if landing is not None and landing.ready():
            landing = self._landing = None
        speech = (self._speech is not None or bool(self._ready)) and landing is None
        if not (thinker or speech):
            if landing is not None and landing.wait(0.0 if others else SPEECH_POLL_S):
                self._speech_step()  # its result, at once
            return
        if not (thinker and speech):
            self._spent = [0.0, 0.0]
        lane = 0 if thinker and not (speech and self._spent[1] < self._spent[0]) else 1
        start = self.clock()
        if lane == 0:
            # a new unit's prefill goes first (it decides a listen at once), but never twice
            # in a row over units decoding: arrivals as fast as steps must not starve them
            if admitted and not (self._thinking and self._prefilled_last):
                self._prefilled_last = True
                self._prefill(admitted)
            else:
                self._prefilled_last = False
                self._decode_step()
        else:
            self._speech_step()
        if thinker and speech:
            self._spent[lane] += self.clock() - start

    def fail_all(self, e: BaseException) -> None:
        """Every unit in flight fails with `e` (a step failed outside the units' own
        handling)."""
        runs = self._new + self._held + self._thinking + self._ready + self._speaking
        self._new, self._held, self._thinking, self._ready, self._speaking = [], [], [], [], []
        if self._speech is not None:
            self._speech.close()  # a step in flight: its engine waits for it before the next
            self._speech = self._landing = None
        for run in runs:
            if run.steps is not None:
                run.steps.close()
            self._finish(run, e, decided=run.unit is not None)

    # -- the Thinker lane -------------------------------------------------------------
    def _prefill(self, admitted: list[_Run]) -> None:
        self.prefills += 1
        picked = set(map(id, admitted))
        self._new = [run for run in self._new if id(run) not in picked]
        self._in_thinker.update((id(run.req.session), run) for run in admitted)
        todo = []
        for run in admitted:
            if run.req.force not in FORCE_CHOICES:
                run.fail(ValueError(f"force must be one of {FORCE_CHOICES}, "
                                    f"got {run.req.force!r}"))
            else:
                todo.append(run)
        try:
            plans = plan_prefill_batch([(run.thinker, run.req.audio, run.req.frames,
                                         run.req.max_slice_nums) for run in todo])
        except Exception as e:  # noqa: BLE001 - a shared encoder call failed them all
            plans = [e] * len(todo)
        planned = []
        for run, plan in zip(todo, plans, strict=True):
            if isinstance(plan, BaseException):  # bad input fails its own unit
                run.fail(plan)
            elif plan is not None:
                run.plan = plan
                planned.append(run)
        llm = admitted[0].thinker.model.llm
        hidden = _forward(llm, planned, [run.plan.rows for run in planned])
        if hidden is not None:
            ok = [(run, h) for run, h in zip(planned, hidden) if run.plan.ok]
            logits = _logits(llm, [h[-1] for _, h in ok]) if ok else []
            for run in planned:
                if not run.plan.ok:
                    run.thinker.finish_prefill(run.plan, None)  # a short audio: nothing pends
            for (run, _), lg in zip(ok, logits):
                run.thinker.finish_prefill(run.plan, lg)
        for run in admitted:
            if run.error is None and id(run.req.session) in self._in_speech:
                self._held.append(run)  # its steps draw: after its session's last unit
            else:
                self._start(run)
        self._after_draws()

    def _start(self, run: _Run) -> None:
        """The unit's steps begin (its first yield may ask a draw: `_after_draws`)."""
        if run.error is None:
            try:
                run.steps = run.thinker.unit_steps(run.req.force)
            except Exception as e:  # noqa: BLE001
                run.fail(e)
            else:
                run.advance(None)
        self._thinking.append(run)

    def _release(self) -> None:
        """The held units whose session's last unit is done start their steps."""
        free = [run for run in self._held if id(run.req.session) not in self._in_speech]
        if free:
            self._held = [run for run in self._held if run not in free]
            for run in free:
                self._start(run)
            self._after_draws()

    def _decode_step(self) -> None:
        fed = [run for run in self._thinking if run.ask is not None]
        out = _decode(fed)  # fed: left holding the runs still alive
        if out is not None:
            hidden, all_logits = out
            llm = fed[0].thinker.model.llm
            want = [i for i, run in enumerate(fed) if run.ask[1]]
            if all_logits is not None:
                logits = {i: all_logits[i : i + 1] for i in want}
            else:
                logits = dict(zip(want, _logits(llm, [hidden[i] for i in want]))) if want else {}
            for i, run in enumerate(fed):
                run.advance((hidden[i], logits.get(i)))
        self._after_draws()

    def _after_draws(self) -> None:
        """The draws the step's logits asked for, then the units whose Thinker part is done
        leave the lane."""
        while drawing := [run for run in self._thinking if isinstance(run.ask, Draw)]:
            _draw(drawing)
        still = []
        for run in self._thinking:
            if run.ask is not None:
                still.append(run)
                spoken = run.thinker.speaking
                if run.on_text is not None and len(spoken) > run.told:
                    run.told = len(spoken)
                    run.on_text(list(spoken))
            elif run.error is not None:
                self._finish(run, run.error, decided=False)
            else:
                _tell(run.on_decided, run.unit)
                if run.unit.is_listen or run.req.session.speech is None:
                    self._finish_now(run)
                else:
                    self._leave_thinker(run)
                    self._in_speech[id(run.req.session)] = run
                    self._ready.append(run)
        self._thinking = still

    # -- the speech lane --------------------------------------------------------------
    def _speech_step(self) -> None:
        self._landing = None
        if self._speech is None:
            self._speaking, self._ready = self._ready, []
            self._speech = DuplexSession.finish_units_steps(
                [(run.req.session, run.unit) for run in self._speaking])
        try:
            self._landing = next(self._speech)  # a Landing while its Token2Wav is in flight
            return
        except StopIteration as done:
            results = done.value
        except Exception as e:  # noqa: BLE001 - every unit of the speech batch fails
            results = [e] * len(self._speaking)
        runs, self._speaking, self._speech = self._speaking, [], None
        for run, r in zip(runs, results, strict=True):
            self._finish(run, r, decided=True)

    def _finish_now(self, run: _Run) -> None:
        """A unit with no speech side to run: its result at once."""
        try:
            (r,) = drain(DuplexSession.finish_units_steps([(run.req.session, run.unit)]))
        except Exception as e:  # noqa: BLE001
            r = e
        self._finish(run, r, decided=True)

    def _leave_thinker(self, run: _Run) -> None:
        if self._in_thinker.get(id(run.req.session)) is run:
            del self._in_thinker[id(run.req.session)]

    def _finish(self, run: _Run, result: UnitResult | BaseException, decided: bool) -> None:
        self._leave_thinker(run)
        if self._in_speech.get(id(run.req.session)) is run:
            del self._in_speech[id(run.req.session)]
        if not decided:
            _tell(run.on_decided, result)
        _tell(run.on_done, result)


def _tell(fn: Callable | None, value: object) -> None:
    if fn is not None:
        fn(value)

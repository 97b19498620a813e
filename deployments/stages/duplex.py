"""Full-duplex sessions resident in the Thinker stage, over the engine's own model.

A session (pipeline.duplex.session.DuplexSession) keeps its Thinker state (KV, streaming
audio encoder, decisions) and its speech state (the Talker's per-turn KV, the Token2Wav
stream) between units. Units run on the engine loop's worker thread beside engine steps,
so the sessions' GPU work never races the engine's graphs and the Thinker's weights are
shared with the turn-based engine (one copy), as is its KV pool: a session's Thinker K/V
are blocks of the engine's pool, taken as its context grows and given back at its close.
The speech side's Talker and Token2Wav weights are loaded once: on a GPU by the first ask
of what the stage holds (`memory_holds`, with a warm-up), else by the first session that
speaks.

Units of many sessions run together (pipeline.duplex.batch.UnitScheduler, continuous
batching): `UnitBatcher` (event-loop side) adds each unit to the scheduler as it arrives,
and it joins the units in flight at their next step; a unit's decision and text go back as
soon as its Thinker part is done (`duplex_unit`), its audio once its speech is
(`duplex_speech`). The scheduler's steps run as a side job of the engine loop
(`EngineLoop.call_steps`): one GPU step of the units, then one step of the engine's chat
turns, and so on, so chat streams keep stepping beside the units; a decode step of the
units is that iteration's engine step itself (`EngineLoop.guest_step`): their rows and the
chat turns' decodes in one forward, one read of the weights for both; the loop's commands
(opens, closes, stats, new units) run between the steps too. A close that comes while its
session's unit is in flight waits for the unit's end (`UnitBatcher.idle`): its later
steps still use the session's KV blocks and Talker row. Chat turns take KV blocks between
the steps too: a unit that finds none free at a step fails alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)

# Served sessions slide: the reference's basic window (its own thresholds) keeps a session's
# K/V under a bound, so the sessions a KV pool holds follow from its size (`sessions_held`).
# The wires offer no other mode (the official protocol has no such option).
SERVED = {"sliding_window_mode": "basic"}


def sessions_held(llm: Any, chat_turns: int, turn_tokens: int, query_num: int) -> dict[str, Any]:
    """The duplex sessions an engine's KV pool holds beside `chat_turns` chat turns of
    `turn_tokens` each, at the served session's bound (`session_tokens_max`: the basic window's
    high mark and one unit of one frame, 1 slice, `max_new_speak_tokens_per_chunk` tokens). A
    session that asks for more slices or speak tokens may hold more; the pool is shared, so
    a unit that finds no free block fails alone, with that said."""
    from pipeline.duplex.config import DuplexConfig, session_tokens_max

    blocks, block = llm.block_manager.num_blocks, llm.config.block_size
    session = session_tokens_max(DuplexConfig(**SERVED), query_num)
    session_blocks = -(-session // block)
    chat_blocks = chat_turns * -(-turn_tokens // block)
    free = max(0, blocks - chat_blocks)
    return {"sessions": free // session_blocks, "session_tokens": session,
            "pool_tokens": blocks * block, "chat_tokens": chat_blocks * block}


def sessions_in_memory(cap: int, held: int, per_session: int) -> int:
    """The sessions whose speak batch fits a cap of `cap` bytes beside `held` (the stage's
    peak without them and the speech weights), at `per_session` bytes each at the peak."""
    return max(0, (cap - held) // max(1, per_session))


# The warm-up's sessions and speak units: after one session's unit alone, a turn's start
# (force-flushed windows) and units inside it (full windows over trimmed caches), so that
# the peak is a steady one.
WARMUP_SESSIONS, WARMUP_UNITS, WARMUP_ROWS = 2, 3, 18


class DuplexSessions:
    """The stage's sessions by id; every method runs on the engine loop's worker thread."""

    def __init__(self, source: Any, device: Any, n_timesteps: int, streams: int = 4,
                 prompt_frames: int = 500, precision: str = "fp32",
                 guest_step: Callable[[Any], None] | None = None):
        self.source = source
        self.device = device
        # runs the units' decode rows in the engine's step (EngineLoop.guest_step): one
        # forward with the chat turns' decodes; None: eager forwards of their own
        self.guest_step = guest_step
        # Token2Wav's Euler steps and precision (DuplexSettings)
        self.n_timesteps, self.precision = n_timesteps, precision
        # Token2Wav's slots at load (turns at once: duplex.max_sessions; more grow the pool)
        # and the longest voice prompt a slot holds (code2wav.engine.slot_prompt_frames)
        self.streams, self.prompt_frames = streams, prompt_frames
        self._sessions: dict[str, tuple[Any, Any]] = {}
        self._speech_models: Any = None
        self._memory: dict[str, Any] | None = None  # memory_holds' measurement
        self._pages: Any = None
        self._special: set[str] | None = None
        self._scheduler: Any = None  # their units' UnitScheduler
        self.units = 0  # units run

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, engine: Any, sid: str, init: Any) -> None:
        from pipeline.duplex.config import DuplexConfig, session_tokens_max
        from pipeline.duplex.session import DuplexSession
        from pipeline.duplex.thinker import DuplexThinker, reference_special_tokens

        if sid in self._sessions:
            raise ValueError(f"duplex session {sid!r} is already open")
        opts = dict(init.options or {})
        seed = opts.pop("seed", None)
        cfg = DuplexConfig(**{**SERVED, **opts})  # ValueError for a bad option
        slices = init.max_slice_nums
        max_tokens = session_tokens_max(cfg, engine.model.cfg.query_num, slices)
        if self._special is None:
            self._special = reference_special_tokens(self.source.tokenizer_dir)
        if self._pages is None:  # the engine's own KV pool: one budget with chat turns
            from pipeline.duplex.kv import KVPages

            self._pages = KVPages.of_engine(engine.llm, self.guest_step)
        thinker = DuplexThinker(engine.model, engine.tokenizer, cfg, seed=seed,
                                special_tokens=self._special, pages=self._pages,
                                max_tokens=max_tokens)
        speech = self._speech(cfg, seed) if init.audio_out else None
        session = DuplexSession(thinker, speech)
        try:
            session.prepare(prefix=init.system_prompt, ref_audio=init.ref_audio,
                            prompt_wav=init.prompt_wav)
        except BaseException:
            session.close()
            raise
        self._sessions[sid] = (session, init.max_slice_nums)

    def _speech(self, cfg: Any, seed: int | None) -> Any:
        from pipeline.duplex.speech import DuplexSpeech

        return DuplexSpeech(self.speech_models(), seed=0 if seed is None else int(seed),
                            temperature=cfg.tts_temperature,
                            repetition_penalty=cfg.tts_repetition_penalty)

    def speech_models(self) -> Any:
        """The sessions' Talker and Token2Wav, loaded once (by `memory_holds` on a GPU, else
        by the first session that speaks)."""
        from pipeline.duplex.speech import SpeechModels

        if self._speech_models is None:
            t0 = time.perf_counter()
            models = SpeechModels.from_source(self.source, str(self.device), self.n_timesteps,
                                              self.streams, self.prompt_frames, self.precision)
            # on CUDA: the flow's graphs per batch size and the compiled blocks, before a
            # session's first unit waits for them
            models.token2wav.warmup(last_chunks=False)
            self._speech_models = models
            log.info("duplex speech models loaded and warmed up on %s in %.1f s (Token2Wav "
                     "%s, %d steps, %d slots)", self.device, time.perf_counter() - t0,
                     self.precision, self.n_timesteps, self.streams)
        return self._speech_models

    def memory_holds(self, cap: int) -> dict[str, Any] | None:
        """On CUDA, the sessions whose speak batches fit this process's cap of `cap` bytes
        (`sessions_in_memory`): beside the stage's peak so far (the turn-based engine's, from
        its start) and the speech weights, at a session's Token2Wav slot (allocated with the
        models, one a session) and its peak over a warm-up speak batch (WARMUP_SESSIONS
        throwaway sessions, WARMUP_UNITS units, their peak over what was allocated before
        them: the Talker rows, a step's activations), which also compiles and captures what
        a first unit would. Measured once; None on a CPU (no cap)."""
        import torch

        if torch.device(self.device).type != "cuda":
            return None
        if self._memory is None:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()  # before the warm-up resets it
            loaded = self._speech_models is not None
            before = torch.cuda.memory_allocated()
            models = self.speech_models()
            torch.cuda.synchronize()
            engine = models.token2wav
            slot = int(engine.capacity()["stream_bytes"])
            slots = slot * engine.pool.slots  # counted per session, not as weights
            # the speech weights on top of the peak (in it already if loaded before it)
            weights = 0 if loaded else torch.cuda.memory_allocated() - before - slots
            per_session = self._warm_up(models) + slot
            held = peak + weights - (slots if loaded else 0)
            self._memory = {"per_session_bytes": per_session, "held_bytes": held,
                            "speech_weight_bytes": weights, "token2wav_slot_bytes": slot}
        m = self._memory
        m["sessions"] = sessions_in_memory(cap, m["held_bytes"], m["per_session_bytes"])
        m["cap_bytes"] = cap
        return dict(m)

    def _warm_up(self, models: Any) -> int:
        """A session's peak bytes over a warm-up speak batch (`memory_holds`)."""
        import torch

        from pipeline.duplex.speech import DuplexSpeech, speak_batch

        g = torch.Generator().manual_seed(0)
        width = models.talker.model.cfg.llm_dim
        speeches = [DuplexSpeech(models, seed=i) for i in range(WARMUP_SESSIONS)]
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        try:
            for s in speeches:
                s.prepare(None)
            # one session alone first (a batch of one compiles its own shapes), then all
            for u in range(WARMUP_UNITS + 1):
                some = speeches[:1] if u == 0 else speeches
                rows = [[(int(i), torch.randn(width, generator=g))
                         for i in torch.randint(0, 1000, (WARMUP_ROWS,), generator=g)]
                        for _ in some]
                last = u == WARMUP_UNITS
                with torch.inference_mode():
                    out = speak_batch([(s, r, last) for s, r in zip(some, rows, strict=True)])
                bad = [o for o in out if isinstance(o, BaseException)]
                if bad:
                    raise bad[0]
            torch.cuda.synchronize()
            return -(-(torch.cuda.max_memory_allocated() - before) // WARMUP_SESSIONS)
        finally:
            for s in speeches:
                s.close()

    def unit(self, sid: str, audio: Any, frames: Any, force: str | None) -> dict[str, Any]:
        """One unit of one session, run alone; raises what failed it."""
        out = self.units_batch([(sid, audio, frames, force)])[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def units_batch(self, items: list[tuple[str, Any, Any, str | None]]
                    ) -> list[dict[str, Any] | BaseException]:
        """Units (sid, audio, frames, force) added at once and run to their end, with
        nothing between the steps; per unit what `add`'s `on_done` gets."""
        from pipeline.utils import drain

        out: list[Any] = [None] * len(items)
        for i, (sid, audio, frames, force) in enumerate(items):
            self.add(sid, audio, frames, force, on_done=lambda r, i=i: out.__setitem__(i, r))
        drain(self.steps())
        return out

    def add(self, sid: str, audio: Any, frames: Any, force: str | None,
            on_decided: Callable[[Any], None] | None = None,
            on_done: Callable[[Any], None] | None = None,
            on_text: Callable[[str], None] | None = None) -> None:
        """Queue one unit of session `sid` for the scheduler's next steps (`steps`).
        `on_text` gets a speak unit's text as it is drawn, piece by piece (`text_pieces`),
        `on_decided` its decision (the `DECISION` fields, its whole text) once its Thinker
        part is done, `on_done` its whole result (the fields of UnitResult +
        prefill_tokens) once its speech is; either of the last two gets the exception that
        failed it (KeyError: no such session; ValueError: a bad input) instead."""
        from pipeline.duplex.batch import UnitRequest, UnitScheduler

        entry = self._sessions.get(sid)
        if entry is None:
            e = KeyError(f"no duplex session {sid!r}")
            for fn in (on_decided, on_done):
                if fn is not None:
                    fn(e)
            return
        if self._scheduler is None:
            self._scheduler = UnitScheduler()

        def decided(u: Any) -> None:
            if on_decided is not None:
                on_decided(u if isinstance(u, BaseException) else {
                    "is_listen": u.is_listen, "end_of_turn": u.end_of_turn, "text": u.text,
                    "token_ids": u.token_ids, "prefill_tokens": _prefill_tokens(u.prefill)})

        def done(r: Any) -> None:
            if not isinstance(r, BaseException):
                self.units += 1
                r = dataclasses.asdict(r)
                r["prefill_tokens"] = _prefill_tokens(r.pop("prefill", None))
            if on_done is not None:
                on_done(r)

        session, slices = entry
        pieces = text_pieces(session.thinker.tokenizer, on_text) if on_text else None
        self._scheduler.add(UnitRequest(session, audio, frames, force, slices), decided, done,
                            pieces)

    def steps(self, others: Callable[[], bool] | None = None) -> Generator[None, None, None]:
        """The scheduler's steps (pipeline.duplex.batch.UnitScheduler), one GPU step a
        `next()`, until no unit added is left; `others()`: whether the engine has steps of
        its own to take between (UnitScheduler.steps)."""
        if self._scheduler is not None:
            yield from self._scheduler.steps(others)

    def fail_all(self, e: BaseException) -> None:
        if self._scheduler is not None:
            self._scheduler.fail_all(e)

    def frame_options(self, sid: str) -> tuple[Any, Any] | None:
        """What slicing a unit's frames needs (`prepare_frames`): the model's slicing config
        and the session's max_slice_nums; None: no such session. A dict read: safe from
        the event loop while the worker thread runs."""
        entry = self._sessions.get(sid)
        if entry is None:
            return None
        session, slices = entry
        return session.thinker.model.cfg.slicing, slices

    def close(self, sid: str) -> bool:
        entry = self._sessions.pop(sid, None)
        if entry is None:
            return False
        entry[0].close()
        return True

    def close_all(self) -> None:
        for sid in list(self._sessions):
            self.close(sid)

    def stats(self) -> dict[str, int]:
        # read from the event loop while units run: a snapshot of the sessions
        held = sum(len(s.thinker.kv.table) for s, _ in list(self._sessions.values()))
        models = self._speech_models
        rows = models.pool.rows_in_use if models is not None else 0
        streams = len(models.token2wav.streams) if models is not None else 0
        prefills = self._scheduler.prefills if self._scheduler is not None else 0
        return {"sessions": len(self._sessions), "units": self.units, "prefills": prefills,
                "kv_blocks": held, "talker_rows": rows, "token2wav_streams": streams}


def text_pieces(tokenizer: Any, on_piece: Callable[[str], None]) -> Callable[[list[int]], None]:
    """A unit's spoken ids as they grow -> each new piece of its text (`on_piece`), through
    the turn-based engine's IncrementalDetokenizer (special tokens skipped as in the unit's
    text; a character split over ids waits for its last). The pieces join into a prefix of
    the unit's text."""
    from pipeline.tokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tokenizer)

    def push(ids: list[int]) -> None:
        if piece := detok.push(ids[len(detok.ids):]):
            on_piece(piece)

    return push


# A unit's fields known once the Thinker's part is done (the rest: codes, pcm)
DECISION = ("is_listen", "end_of_turn", "text", "token_ids", "prefill_tokens")


def _prefill_tokens(schema: Any) -> int:
    """The positions a unit's prefill schema fed: a token id, or ("audio", n) / ("img", n)
    for n embedded rows."""
    return sum(x[1] if isinstance(x, tuple) else 1 for x in schema or ())


class UnitBatcher:
    """Event-loop side of the stage's duplex units. `submit` hands one unit to the sessions'
    scheduler on the engine loop's thread (`DuplexSessions.add`, as a command) and returns
    its decision (the `DECISION` fields) as soon as its Thinker part is done; `speech(sid)`
    returns the whole result of the session's last unit (its codes and PCM too) once its
    speech is. The scheduler's steps run as a side job of the loop (`EngineLoop.call_steps`)
    while any unit is in flight: a unit added while they run joins at the next step, one
    added after they ended starts them again. A unit whose caller goes away still runs to
    its end (as a command does), its result dropped. `idle(sid)` waits until the session
    has no unit in flight; `forget(sid)` drops a closed session's last result."""

    def __init__(self, loop: Any, sessions: Callable[[], Any]):
        self._loop = loop  # the stage's EngineLoop
        self._sessions = sessions  # the DuplexSessions, made on first use
        self._results: dict[str, asyncio.Future] = {}  # each session's last unit's result
        self._in_flight: set[tuple[asyncio.Future, asyncio.Future]] = set()  # (decided, done)
        self._task: asyncio.Task | None = None

    async def submit(self, sid: str, audio: Any, frames: Any, force: str | None,
                     on_text: Callable[[str], None] | None = None) -> Any:
        """The unit's decision; `on_text` (called on the event loop) gets a speak unit's
        text piece by piece before it. Its frames go to the scheduler as a future of their
        slicing (`prepare_frames`, in a worker thread: the images' resize runs beside the
        loop's steps, not on the thread that steps the GPU), the unit itself at once."""
        aloop = asyncio.get_running_loop()
        options = self._sessions().frame_options(sid) if frames else None
        if options is not None:
            from pipeline.duplex.thinker import prepare_frames

            frames = _FRAME_SLICING.submit(prepare_frames, options[0], frames, options[1])
        unit = decided, done = aloop.create_future(), aloop.create_future()
        self._results[sid] = done
        self._in_flight.add(unit)

        def on_decided(r: Any) -> None:
            aloop.call_soon_threadsafe(_settle, decided, r)

        def on_done(r: Any) -> None:
            aloop.call_soon_threadsafe(self._done, unit, r)

        def text(piece: str) -> None:
            aloop.call_soon_threadsafe(_tell_unless_done, decided, on_text, piece)

        self._loop.post(lambda e: self._sessions().add(
            sid, audio, frames, force, on_decided, on_done, text if on_text else None))
        if self._task is None:
            self._task = asyncio.create_task(self._drive())
        return await decided

    def _done(self, unit: tuple[asyncio.Future, asyncio.Future], r: Any) -> None:
        self._in_flight.discard(unit)
        _settle(unit[1], r)
        if isinstance(r, BaseException):
            unit[1].exception()  # retrieved: its decision told its caller already

    async def speech(self, sid: str) -> Any:
        """The whole result of `sid`'s last submitted unit, once its speech is done."""
        fut = self._results.get(sid)
        if fut is None:
            raise KeyError(f"duplex session {sid!r} has no unit")
        return await asyncio.shield(fut)

    def forget(self, sid: str) -> None:
        self._results.pop(sid, None)

    async def idle(self, sid: str) -> None:
        """Return once `sid` has no unit in flight. A command sent to the engine loop right
        after (no await in between) runs before any later unit of `sid` is added."""
        fut = self._results.get(sid)
        if fut is not None and not fut.done():
            await asyncio.wait([fut])

    async def _drive(self) -> None:
        """The scheduler's steps while units are in flight. Every unit's result is settled
        (call_soon_threadsafe) before its steps' end is: when they end with units left,
        those were added after, and the steps start again."""
        try:
            while self._in_flight:
                try:
                    await self._loop.call_steps(lambda e: self._sessions().steps(e.has_work))
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # a step failed outside the units' own handling
                    log.exception("duplex units' steps failed")
                    await self._loop.call(lambda _, e=e: self._sessions().fail_all(e))
        except asyncio.CancelledError:  # the stage is going away
            for unit in self._in_flight:
                for fut in unit:
                    fut.cancel()
            self._in_flight.clear()
            raise
        finally:
            self._task = None


# The units' frames are sliced here (PIL's resize releases the GIL: frames of many sessions
# side by side), each unit's frames a future its prefill reads.
_FRAME_SLICING = ThreadPoolExecutor(max_workers=8, thread_name_prefix="duplex-frames")


def _tell_unless_done(decided: asyncio.Future, fn: Callable[[str], None], piece: str) -> None:
    if not decided.done():  # nobody waits for a unit's text past its decision
        fn(piece)


def _settle(fut: asyncio.Future, r: Any) -> None:
    if fut.done():
        return
    if isinstance(r, BaseException):
        fut.set_exception(r)
    else:
        fut.set_result(r)

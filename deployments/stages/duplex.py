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

Units of many sessions run together (pipeline.duplex.batch): `UnitBatcher` (event-loop
side) gathers the units that arrive while a batch runs and hands them to
`DuplexSessions.units_steps` as the next batch, one Thinker forward a step for all of them.
It never waits for a unit that has not arrived: a lone unit runs at once, as a batch of one.
A unit's decision and text go back as soon as the Thinker's part of its batch is done
(`duplex_unit`), its audio once the batch's speech side is (`duplex_speech`).
A batch runs as a side job of the engine loop (`EngineLoop.call_steps`): one GPU step of the
batch, then one step of the engine's chat turns, and so on, so chat streams keep stepping
while a batch runs; the loop's commands (opens, closes, stats) run between the steps too.
A close that comes while its session's unit is in the batch waits for the batch's end
(`UnitBatcher.idle`): the batch's later steps still use the session's KV blocks and Talker
row. Chat turns take KV blocks between the batch's steps too: a session that finds none
free at a step fails its unit alone, as at the batch's start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Generator
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

    def __init__(self, source: Any, device: Any, n_timesteps: int):
        self.source = source
        self.device = device
        self.n_timesteps = n_timesteps  # Token2Wav's Euler steps (DuplexSettings)
        self._sessions: dict[str, tuple[Any, Any]] = {}
        self._speech_models: Any = None
        self._memory: dict[str, Any] | None = None  # memory_holds' measurement
        self._pages: Any = None
        self._special: set[str] | None = None
        self.units = 0  # units run
        self.batches = 0  # batches they ran in

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

            self._pages = KVPages.of_engine(engine.llm)
            # the decode step's graphs, captured here rather than inside a session's unit
            self._pages.decode_graphs()
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
            models = SpeechModels.from_source(self.source, str(self.device))
            models.set_n_timesteps(self.n_timesteps)
            self._speech_models = models
            log.info("duplex speech models loaded on %s (Token2Wav %d steps)", self.device,
                     self.n_timesteps)
        return self._speech_models

    def memory_holds(self, cap: int) -> dict[str, Any] | None:
        """On CUDA, the sessions whose speak batches fit this process's cap of `cap` bytes
        (`sessions_in_memory`): beside the stage's peak so far (the turn-based engine's, from
        its start) and the speech weights, at a session's peak measured by a warm-up speak
        batch (WARMUP_SESSIONS throwaway sessions, WARMUP_UNITS units, their peak over what
        was allocated before them: the held state, the flow caches of a batched chunk, every
        Euler step's DiT cache), which also compiles and captures what a first unit would.
        Measured once; None on a CPU (no cap)."""
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
            # the speech weights on top of the peak (in it already if loaded before it)
            weights = 0 if loaded else torch.cuda.memory_allocated() - before
            per_session = self._warm_up(models)
            self._memory = {"per_session_bytes": per_session, "held_bytes": peak + weights,
                            "speech_weight_bytes": weights}
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
        """One unit of one session (a batch of one); raises what failed it."""
        out = self.units_batch([(sid, audio, frames, force)])[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def units_batch(self, items: list[tuple[str, Any, Any, str | None]]
                    ) -> list[dict[str, Any] | BaseException]:
        """`units_steps` run to its end, with nothing between its steps."""
        from pipeline.utils import drain

        return drain(self.units_steps(items))

    def units_steps(self, items: list[tuple[str, Any, Any, str | None]],
                    on_decided: Callable[[list], None] | None = None,
                    ) -> Generator[None, None, list[dict[str, Any] | BaseException]]:
        """(sid, audio, frames, force) per unit, at most one per session, run as one batch
        (pipeline.duplex.batch.unit_batch), one GPU step a `next()`; returns per unit the
        fields of UnitResult (+ prefill_tokens), or the exception that failed it (KeyError:
        no such session; ValueError: a bad input). The sessions are looked up at the first
        step. `on_decided` gets per unit its decision (`DECISION` fields) or exception once
        the Thinker's part of the batch is done, before its speech side runs."""
        from pipeline.duplex.batch import UnitRequest, unit_batch

        out: list[dict[str, Any] | BaseException] = []
        requests, where = [], []
        for sid, audio, frames, force in items:
            entry = self._sessions.get(sid)
            if entry is None:
                out.append(KeyError(f"no duplex session {sid!r}"))
                continue
            session, slices = entry
            if any(r.session is session for r in requests):
                out.append(ValueError(f"duplex session {sid!r} has two units in one batch"))
                continue
            where.append(len(out))
            out.append(None)  # its result, below
            requests.append(UnitRequest(session, audio, frames, force, slices))
        if not requests:
            return out

        def decided(units: list) -> None:
            early = list(out)
            for i, u in zip(where, units, strict=True):
                early[i] = u if isinstance(u, BaseException) else {
                    "is_listen": u.is_listen, "end_of_turn": u.end_of_turn, "text": u.text,
                    "token_ids": u.token_ids, "prefill_tokens": _prefill_tokens(u.prefill)}
            on_decided(early)

        self.batches += 1
        results = yield from unit_batch(requests, decided if on_decided else None)
        for i, r in zip(where, results, strict=True):
            if isinstance(r, BaseException):
                out[i] = r
                continue
            self.units += 1
            d = dataclasses.asdict(r)
            d["prefill_tokens"] = _prefill_tokens(d.pop("prefill", None))
            out[i] = d
        return out

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
        rows = self._speech_models.pool.rows_in_use if self._speech_models is not None else 0
        return {"sessions": len(self._sessions), "units": self.units, "batches": self.batches,
                "kv_blocks": held, "talker_rows": rows}


# A unit's fields known once the Thinker's part is done (the rest: codes, pcm)
DECISION = ("is_listen", "end_of_turn", "text", "token_ids", "prefill_tokens")


def _prefill_tokens(schema: Any) -> int:
    """The positions a unit's prefill schema fed: a token id, or ("audio", n) / ("img", n)
    for n embedded rows."""
    return sum(x[1] if isinstance(x, tuple) else 1 for x in schema or ())


class UnitBatcher:
    """Event-loop side of the stage's duplex units: `submit` queues one unit and returns its
    decision (the `DECISION` fields) as soon as the Thinker's part of its batch is done;
    `speech(sid)` returns the whole result of the session's last unit (its codes and PCM too)
    once the batch ends. While a batch runs (`run(items, on_decided)`, on the engine loop;
    `on_decided` may be called from another thread) the units that arrive wait, and all of
    them run as the next batch. A session's second unit (the wire sends one at a time)
    waits for the batch after its first. `idle(sid)` waits until no batch in flight holds a
    unit of `sid`; `forget(sid)` drops a closed session's last result."""

    def __init__(self, run: Callable[[list[tuple], Callable[[list], None]], Awaitable[list]]):
        self._run = run
        # per unit: (sid, audio, frames, force), its decision's future, its result's
        self._pending: list[tuple[tuple, asyncio.Future, asyncio.Future]] = []
        self._results: dict[str, asyncio.Future] = {}  # each session's last unit's result
        self._task: asyncio.Task | None = None
        self._running: set[str] = set()  # the sessions of the batch in flight
        self._batch_over = asyncio.Event()  # set whenever no batch is in flight
        self._batch_over.set()

    async def submit(self, sid: str, audio: Any, frames: Any, force: str | None) -> Any:
        loop = asyncio.get_running_loop()
        decided, done = loop.create_future(), loop.create_future()
        self._pending.append(((sid, audio, frames, force), decided, done))
        if self._task is None:
            self._task = asyncio.create_task(self._drain())
        return await decided  # a caller that goes away cancels it: its unit is dropped

    async def speech(self, sid: str) -> Any:
        """The whole result of `sid`'s last submitted unit, once its batch is over."""
        fut = self._results.get(sid)
        if fut is None:
            raise KeyError(f"duplex session {sid!r} has no unit")
        return await asyncio.shield(fut)

    def forget(self, sid: str) -> None:
        self._results.pop(sid, None)

    async def idle(self, sid: str) -> None:
        """Return once no batch in flight holds a unit of `sid`. A command sent to the
        engine loop right after (no await in between) runs before any later batch looks its
        sessions up (at its first step)."""
        while sid in self._running:
            await self._batch_over.wait()

    @staticmethod
    def _settle(fut: asyncio.Future, r: Any) -> None:
        if fut.done():
            return
        if isinstance(r, BaseException):
            fut.set_exception(r)
        else:
            fut.set_result(r)

    def _decide(self, batch: list, results: list) -> None:
        for (_, decided, _), r in zip(batch, results, strict=True):
            self._settle(decided, r)

    async def _drain(self) -> None:
        batch: list[tuple[tuple, asyncio.Future, asyncio.Future]] = []
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch, later, sids = [], [], set()
                for entry in self._pending:
                    item, decided, _ = entry
                    if decided.done():
                        continue
                    (later if item[0] in sids else batch).append(entry)
                    sids.add(item[0])
                self._pending = later
                if not batch:
                    continue
                for item, _, done in batch:
                    self._results[item[0]] = done
                self._running = {item[0] for item, _, _ in batch}
                self._batch_over.clear()

                def on_decided(results: list, batch=batch) -> None:
                    loop.call_soon_threadsafe(self._decide, batch, results)

                try:
                    results = await self._run([item for item, _, _ in batch], on_decided)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - the whole batch failed
                    results = [e] * len(batch)
                finally:
                    self._running = set()
                    self._batch_over.set()
                # decisions not sent ahead (the batch failed, or no Thinker part ran)
                self._decide(batch, [r if isinstance(r, BaseException)
                                     else {k: r[k] for k in DECISION} for r in results])
                for (_, _, done), r in zip(batch, results, strict=True):
                    self._settle(done, r)
                    if isinstance(r, BaseException) and not done.cancelled():
                        done.exception()  # retrieved: its decision told its caller already
        except asyncio.CancelledError:  # the stage is going away
            for _, decided, done in batch + self._pending:
                decided.cancel()
                done.cancel()
            self._pending = []
            raise
        finally:
            self._task = None

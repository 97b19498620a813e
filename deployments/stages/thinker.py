"""Thinker deployment: a ThinkerEngine behind the shared StageServer.

`generate(req)` streams text back to its caller (the ingress); `prefetch(items)` hands over
a request's media ahead of it (a video's frames, an audio clip, while the ingress decodes the
rest). When
the request asks for speech, the spoken span (token ids + final-norm hidden states, numpy)
goes straight to the Talker through `talker.feed`, in order, so the ingress never carries
hidden states.
In `full_span` mode the span is sent once, when the Thinker finishes. A feed that fails
(the Talker died, refused the span or did not answer in `timeouts.hop_s`) ends the stream
with a StageFailure: the turn cannot speak any more.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import numpy as np

from deployments.config import GIB, AppConfig
from deployments.stages.forward import Forwarder
from deployments.stages.server import StageServer
from deployments.wire import Heartbeat, TextOut, via
from pipeline.handoff import StageFailure


class ThinkerServer(StageServer):
    stage = "thinker"
    announces_open = False
    tombstones = False  # its stream is the turn's own: no abort comes before it
    next_stage, next_title, hands_on = "talker", "Talker", "the spoken text"

    def __init__(
        self,
        app: AppConfig | dict,
        talker: Any = None,
        *,
        engine_cls: Any = None,
        source: Any = None,
    ):
        super().__init__(app, engine_cls=engine_cls, source=source)
        self.talker = talker
        self.hold_forward = self.cfg.talker_mode == "full_span"  # the span goes once, whole
        # streaming: the spoken rows go in the Talker's text chunks (a unit starts with one)
        self.forward_at_least = self.model_config.talker.streaming_text_chunk
        self.forward_size = lambda chunk: len(chunk[0])  # (spoken ids, hidden rows)
        self._duplex: Any = None  # DuplexSessions, made by the first duplex session
        self._duplex_units: Any = None  # its UnitBatcher

    def _default_engine(self, device: str, settings: dict[str, Any]) -> tuple[Any, dict]:
        from pipeline.thinker.engine import ThinkerEngine

        own = self.cfg.thinker
        kv = own.kv_cache_gib if device == "cuda" else own.cpu_kv_cache_gib
        if kv is not None:  # one config for GPU and CPU: the budget follows the device
            settings["llm"] = {"kv_cache_bytes": int(kv * GIB), **settings.get("llm", {})}
        return ThinkerEngine, settings

    def _holds(self, engine: Any) -> dict[str, Any] | None:
        """The turns its KV cache holds: a running turn grows to at least its answer, so
        the cache holds as many turns as it has room for `limits.default_max_tokens` tokens
        each, and never more than the scheduler runs at once (max_num_seqs). A prompt longer
        than its share is still served: the scheduler preempts and recomputes instead of
        failing a turn."""
        llm = getattr(engine, "llm", None)
        if llm is None:
            return super()._holds(engine)
        kv, blocks = llm.kv_cache.kv, llm.block_manager.num_blocks
        block_bytes = kv.numel() * kv.element_size() // (blocks + 1)  # + its scratch block
        block = llm.config.block_size
        turn_blocks = -(-self.cfg.limits.default_max_tokens // block)
        return {"streams": min(llm.config.max_num_seqs, blocks // turn_blocks),
                "stream_bytes": turn_blocks * block_bytes, "budget_bytes": blocks * block_bytes,
                "holder": f"KV cache of {blocks * block} tokens, "
                          f"{self.cfg.limits.default_max_tokens} a turn"}

    async def generate(self, req: Any) -> AsyncIterator[TextOut | Heartbeat | StageFailure]:
        speaks = req.return_hidden and self.talker is not None
        async with aclosing(self._serve(req.request_id, req, forward=speaks)) as items:
            async for item in items:
                yield item

    async def prefetch(self, items: list[Any]) -> None:
        """Media (pipeline.handoff.ImageInput / AudioInput) of a request still being
        prepared: the engine encodes them ahead of it (a video's frames, an audio part's
        clip, while the rest decodes)."""
        await self.loop.call(lambda e: e.prefetch(items))

    def _refused(self, e: Exception) -> StageFailure | None:
        if isinstance(e, ValueError):  # the engine refused this request (e.g. over the context)
            return StageFailure("thinker", str(e), 400, "invalid_request")
        return None

    def _emit(self, rid: str, deltas: list[Any], fwd: Forwarder | None) -> tuple[list, bool]:
        """Deltas that piled up during one hop, as one TextOut; spoken spans to the Talker."""
        out = TextOut("")
        for d in deltas:
            if fwd is not None and d.spoken_ids:
                fwd.push((list(d.spoken_ids), _numpy(d.spoken_hidden)))
            out.text += d.text
            out.prompt_tokens = d.num_prompt_tokens or out.prompt_tokens
            out.completion_tokens = d.num_output_tokens or out.completion_tokens
            if d.timings:
                out.timings = {**(out.timings or {}), **d.timings}
            if d.finished:
                out.finished, out.finish_reason = True, d.finish_reason
        return [out], out.finished

    async def _send(self, rid: str, chunks: list[tuple[list, np.ndarray]], final: bool) -> bool:
        ids = [i for c, _ in chunks for i in c]
        hidden = np.concatenate([h for _, h in chunks]) if chunks else None
        talker = via(self.talker, self.grpc, 0 if hidden is None else hidden.nbytes)
        return await talker.feed.remote(rid, ids, hidden, final)

    # -- full duplex: sessions resident here, over the engine's model (stages/duplex.py) --

    async def duplex_open(self, session_id: str, init: Any) -> None:
        """Open and prepare a duplex session (ValueError: a bad option or input)."""
        await self.loop.call(lambda e: self._duplex_sessions().open(e, session_id, init))

    async def duplex_holds(self) -> dict[str, Any]:
        """The duplex sessions this replica holds: those its KV pool holds beside the group's
        window of chat turns (`capacity`, `limits.default_max_tokens` each), and on a GPU
        those whose speak batches fit its memory cap (stages/duplex.py `sessions_held`,
        `DuplexSessions.memory_holds`: the first ask loads the speech models and warms them
        up): `sessions`, the fewer, and what each follows from."""
        from deployments.stages.duplex import sessions_held

        engine = self.engine
        llm = getattr(engine, "llm", None)
        if llm is None or not hasattr(llm, "block_manager"):  # an engine without a KV pool
            return {"sessions": None}
        held = sessions_held(llm, self.cfg.capacity, self.cfg.limits.default_max_tokens,
                             engine.model.cfg.query_num)
        if self.cfg.duplex.max_sessions and str(engine.device).startswith("cuda"):
            import torch

            total = torch.cuda.get_device_properties(engine.device).total_memory
            cap = int((self.cfg.thinker.memory_fraction or 1.0) * total)
            memory = await self.loop.call(lambda e: self._duplex_sessions().memory_holds(cap))
            if memory is not None:
                held["memory"] = memory
                held["sessions"] = min(held["sessions"], memory["sessions"])
        return held

    async def duplex_unit(self, session_id: str, audio: np.ndarray, frames: list | None,
                          force: str | None) -> AsyncIterator[dict[str, Any]]:
        """One 1 s unit of a session, streamed (call with `stream=True`): a speak unit's text
        piece by piece as its tokens are drawn (`{"text": piece}`), then its decision
        (`{"decision": ...}`, stages/duplex.py `DECISION`: listen or speak, the turn's end,
        the whole text, ids, prefill size) once its Thinker part is done; a speak unit's
        audio then comes from `duplex_speech`. The units of all sessions run in one scheduler
        (pipeline.duplex.batch.UnitScheduler: a unit joins at its next step), step by step
        beside the engine's steps (deployments/stages/duplex.py UnitBatcher,
        EngineLoop.call_steps)."""
        if self._duplex_units is None:
            from deployments.stages.duplex import UnitBatcher

            self._duplex_units = UnitBatcher(self.loop, self._duplex_sessions)
        pieces: asyncio.Queue = asyncio.Queue()
        unit = asyncio.ensure_future(self._duplex_units.submit(
            session_id, audio, frames, force, pieces.put_nowait))
        unit.add_done_callback(lambda _: pieces.put_nowait(None))  # after its last piece
        try:
            while (piece := await pieces.get()) is not None:
                yield {"text": piece}
            yield {"decision": unit.result()}  # raises what failed it
        finally:
            unit.cancel()  # the caller went away: the unit runs on, its result dropped

    async def duplex_speech(self, session_id: str) -> dict[str, Any]:
        """The speech of a session's last unit (`codes`, 24 kHz float32 `pcm` or None), once
        it is done (KeyError: no unit)."""
        if self._duplex_units is None:
            raise KeyError(f"duplex session {session_id!r} has no unit")
        r = await self._duplex_units.speech(session_id)
        return {"codes": r["codes"], "pcm": r["pcm"]}

    async def duplex_close(self, session_id: str) -> bool:
        # shielded: a close whose caller goes away still runs, as a command would
        return await asyncio.shield(self._duplex_close(session_id))

    async def _duplex_close(self, session_id: str) -> bool:
        if self._duplex_units is not None:
            # the unit in flight of the session still steps over its KV blocks and
            # Talker row between the engine's commands
            await self._duplex_units.idle(session_id)
            self._duplex_units.forget(session_id)
        return await self.loop.call(lambda e: self._duplex_sessions().close(session_id))

    def _duplex_sessions(self) -> Any:
        if self._duplex is None:
            from deployments.stages.duplex import DuplexSessions

            self._duplex = DuplexSessions(
                self.source, self.engine.device, self.cfg.duplex.n_timesteps,
                max(1, self.cfg.duplex.max_sessions),
                self.cfg.code2wav.engine.get("slot_prompt_frames", 500),
                self.cfg.duplex.token2wav_precision, self.loop.guest_step)
        return self._duplex

    def _extra_stats(self) -> dict[str, Any]:
        if self._duplex is None:
            return {"duplex": {"sessions": 0, "kv_blocks": 0, "talker_rows": 0,
                               "token2wav_streams": 0}}
        return {"duplex": self._duplex.stats()}

    def _leaks(self, engine: dict[str, Any]) -> list[str]:
        total = engine.get("num_total_blocks")
        free = engine.get("num_free_blocks")
        d = self._duplex.stats() if self._duplex is not None else {}
        held = d.get("kv_blocks", 0)
        leaks = []
        if not int(engine["open_streams"]) and total is not None and free + held != total:
            leaks.append(f"{total - free - held} KV blocks in use with no request or duplex "
                         "session")
        if not d.get("sessions") and d.get("talker_rows"):
            leaks.append(f"{d['talker_rows']} duplex Talker rows held with no session")
        if not d.get("sessions") and d.get("token2wav_streams"):
            leaks.append(f"{d['token2wav_streams']} duplex Token2Wav streams open with no "
                         "session")
        return leaks


def _numpy(h: Any) -> np.ndarray:
    """Hidden states cross Ray as float32 numpy (read zero-copy from the object store)."""
    if isinstance(h, np.ndarray):
        return h.astype(np.float32, copy=False)
    return h.detach().float().cpu().numpy()

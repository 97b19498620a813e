"""Test support: small fake engines of the StageEngine protocol (pipeline/stage_engine.py),
and an in-process
stand-in for DeploymentHandle so the whole app runs without Ray (as Ray Serve LLM ships
its MockVLLMEngine). Fakes are deterministic and cheap:

- FakeThinkerEngine: one token per step per request from a fixed reply; spoken ids +
  random hidden states when the request asks for speech.
- FakeTalkerEngine:  3 codes per spoken id; 25-code chunks (+3 lookahead), like TalkerEngine.
- FakeCode2WavEngine: 960 samples (40 ms at 24 kHz) per code of one continuous sine, so a
  stream's pieces join without a seam; `fail_on_step=N` raises once at the N-th step;
  `reject_voices` refuses reference audio as a checkpoint without the voice models does
  (its `voices` stand in for the VoiceCache).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import time
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pipeline.handoff import CodeChunk, PcmChunk, SpokenChunk, ThinkerDelta, ThinkerRequest

REPLY = "Hello there! This reply comes from the fake thinker engine."


def own_settings(fake: type, config: dict, real_config: type) -> dict:
    """The `engine:` settings a fake engine takes: the real engine config's knobs (the app
    ships its fast paths on) mean nothing to a fake and are dropped; the rest are the fake's
    own (`step_delay_s`, ...), and a key neither knows still fails in the fake's constructor."""
    knobs = {f.name for f in dataclasses.fields(real_config)}
    knobs -= set(inspect.signature(fake).parameters)
    return {k: v for k, v in config.items() if k not in knobs}


class FakeThinkerEngine:
    config_cls = None  # the `engine:` dict is passed through as keyword arguments

    def __init__(self, hidden_size: int = 16, step_delay_s: float = 0.0, vocab: int = 1000):
        self.hidden_size = hidden_size
        self.step_delay_s = step_delay_s
        self.words = [w + " " for w in REPLY.split()]
        self.running: dict[str, tuple[ThinkerRequest, int]] = {}
        self.aborted = 0
        self.prefetched: list[str] = []  # content hashes of the media sent ahead

    @classmethod
    def from_source(cls, source: Any, config: dict, device: str) -> FakeThinkerEngine:
        from pipeline.thinker.engine import ThinkerEngineConfig

        return cls(**own_settings(cls, config, ThinkerEngineConfig))

    def open(self, rid: str, spec: ThinkerRequest) -> None:
        self.running[rid] = (spec, 0)

    def prefetch(self, items: list[Any]) -> None:
        self.prefetched.extend(m.content_hash for m in items)

    def feed(self, rid: str, msg: Any) -> None:
        raise ValueError("the Thinker takes its whole prompt at open()")

    def abort(self, rid: str) -> None:
        self.aborted += rid in self.running
        self.running.pop(rid, None)

    def has_work(self) -> bool:
        return bool(self.running)

    def step(self) -> list[ThinkerDelta]:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        out = []
        for rid, (req, n) in list(self.running.items()):
            n += 1
            limit = min(req.sampling.max_tokens, len(self.words))
            done = n >= limit
            kw = {}
            if req.return_hidden:
                g = torch.Generator().manual_seed(n)
                kw = {
                    "spoken_ids": [1000 + n],
                    "spoken_hidden": torch.randn(1, self.hidden_size, generator=g),
                }
            out.append(
                ThinkerDelta(
                    rid,
                    [1000 + n],
                    self.words[n - 1],
                    finished=done,
                    finish_reason=("length" if n >= req.sampling.max_tokens else "stop")
                    if done
                    else None,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_output_tokens=n,
                    **kw,
                )
            )
            if done:
                del self.running[rid]
            else:
                self.running[rid] = (req, n)
        return out

    def stats(self) -> dict[str, float]:
        return {
            "open_streams": len(self.running),
            "num_running": len(self.running),
            "num_waiting": 0,
        }


class FakeTalkerEngine:
    config_cls = None
    CHUNK, AHEAD = 25, 3

    def __init__(self, codes_per_id: int = 3, step_delay_s: float = 0.0):
        self.codes_per_id = codes_per_id
        self.step_delay_s = step_delay_s
        self.streams: dict[str, dict[str, Any]] = {}

    @classmethod
    def from_source(cls, source: Any, config: dict, device: str) -> FakeTalkerEngine:
        from pipeline.talker.engine import TalkerEngineConfig

        return cls(**own_settings(cls, config, TalkerEngineConfig))

    def open(self, rid: str, spec: Any = None) -> None:
        if rid in self.streams:
            raise ValueError(f"stream {rid!r} is already open")
        self.streams[rid] = {
            "pending": 0,
            "codes": [],
            "released": 0,
            "sent": 0,
            "finished": False,
            "text_done": False,
            "done_sent": False,
        }

    def feed(self, rid: str, msg: SpokenChunk) -> None:
        s = self.streams[rid]
        assert (0 if msg.hidden is None else msg.hidden.shape[0]) == len(msg.ids)
        s["pending"] += len(msg.ids)
        s["text_done"] = msg.finished

    def has_work(self) -> bool:
        return any(
            s["pending"] or (s["text_done"] and not s["done_sent"]) for s in self.streams.values()
        )

    def step(self) -> list[CodeChunk]:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        out = []
        for sid, s in self.streams.items():
            if s["pending"]:
                s["pending"] -= 1
                base = len(s["codes"])
                s["codes"].extend((base + k) % 6561 for k in range(self.codes_per_id))
            if s["text_done"] and not s["pending"]:
                s["finished"] = True
            while len(s["codes"]) - s["released"] >= self.CHUNK + self.AHEAD:
                a = s["released"]
                out.append(
                    CodeChunk(
                        sid,
                        tuple(s["codes"][a : a + self.CHUNK]),
                        False,
                        tuple(s["codes"][a + self.CHUNK : a + self.CHUNK + self.AHEAD]),
                        s["sent"],
                    )
                )
                s["released"] += self.CHUNK
                s["sent"] += 1
            if s["finished"] and not s["done_sent"]:
                out.append(CodeChunk(sid, tuple(s["codes"][s["released"] :]), True, (), s["sent"]))
                s["released"] = len(s["codes"])
                s["done_sent"] = True
        return out

    def abort(self, rid: str) -> None:
        self.streams.pop(rid, None)

    def stats(self) -> dict[str, float]:
        return {"open_streams": len(self.streams)}


class FakeVoices:
    """The VoiceCache calls the Code2Wav deployment makes; a prompt is a content key."""

    def __init__(self, reject: bool = False):
        self.reject = reject

    def default(self) -> str:
        return "default"

    def from_audio(self, samples: np.ndarray, sample_rate: int) -> str:
        if self.reject:
            raise FileNotFoundError("missing voice front-end models")
        return f"audio:{zlib.crc32(np.asarray(samples).tobytes())}"

    def frontend(self) -> None:
        """Reference audio is refused per request (at open), as the real cache does."""


class FakeCode2WavEngine:
    config_cls = None
    SAMPLES_PER_CODE = 960
    CHUNK = 25
    FREQ_HZ = 220.0

    def __init__(
        self, step_delay_s: float = 0.0, fail_on_step: int = 0, reject_voices: bool = False
    ):
        self.step_delay_s = step_delay_s
        self.fail_on_step = fail_on_step
        self.voices = FakeVoices(reject_voices)  # like a checkpoint without the voice front-end
        self.pinned: set[str] = set()
        self.steps = 0
        self.streams: dict[str, dict[str, Any]] = {}

    @classmethod
    def from_source(cls, source: Any, config: dict, device: str) -> FakeCode2WavEngine:
        from pipeline.code2wav.engine import Code2WavEngineConfig

        return cls(**own_settings(cls, config, Code2WavEngineConfig))

    def pin_voice(self, voice: str) -> None:
        self.pinned.add(voice)

    def unpin_voice(self, voice: str) -> None:
        self.pinned.discard(voice)

    def open(self, rid: str, spec: str | None = None) -> None:
        if rid in self.streams:
            raise ValueError(f"stream {rid!r} is already open")
        self.streams[rid] = {"pending": 0, "final": False, "done": False, "t": 0}

    def feed(self, rid: str, msg: CodeChunk) -> None:
        s = self.streams[rid]
        s["pending"] += len(msg.codes)
        s["final"] = msg.finished

    def has_work(self) -> bool:
        return any(
            not s["done"] and (s["pending"] >= self.CHUNK or s["final"])
            for s in self.streams.values()
        )

    def step(self) -> list[PcmChunk]:
        self.steps += 1
        if self.fail_on_step and self.steps == self.fail_on_step:
            raise RuntimeError("injected Code2Wav fault")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        out = []
        for sid, s in self.streams.items():
            if s["done"]:
                continue
            if s["pending"] >= self.CHUNK or s["final"]:
                n = min(s["pending"], self.CHUNK)
                last = s["final"] and s["pending"] <= self.CHUNK
                s["pending"] -= n
                t = s["t"] + np.arange(n * self.SAMPLES_PER_CODE)
                s["t"] += n * self.SAMPLES_PER_CODE
                pcm = (0.5 * np.sin(2 * math.pi * self.FREQ_HZ * t / 24000)).astype(np.float32)
                out.append(PcmChunk(sid, pcm, last))
                s["done"] = last
        return out

    def abort(self, rid: str) -> None:
        self.streams.pop(rid, None)

    def stats(self) -> dict[str, float]:
        return {"open_streams": len(self.streams)}


# ---------------------------------------------------------------------------------------
# In-process handles


class LocalHandle:
    """Mimics DeploymentHandle over a local object: `.method.remote(...)` returns an
    awaitable that starts at once; `.options(stream=True).method.remote(...)` an async
    iterator with `cancel()`, which cancels the generator like Serve does."""

    def __init__(self, target: Any, stream: bool = False):
        self._target = target
        self._stream = stream

    def options(self, stream: bool = False, **_: Any) -> LocalHandle:
        return LocalHandle(self._target, stream)

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self._target, name), self._stream)


class _LocalMethod:
    def __init__(self, fn: Any, stream: bool):
        self._fn, self._stream = fn, stream

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if self._stream:
            return _LocalStream(self._fn(*args, **kwargs))
        result = self._fn(*args, **kwargs)
        if asyncio.iscoroutine(result):
            return asyncio.ensure_future(result)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(result)
        return fut


class _LocalStream:
    def __init__(self, agen: Any):
        self._q: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run(agen))

    async def _run(self, agen: Any) -> None:
        try:
            async for item in agen:
                self._q.put_nowait(("item", item))
            self._q.put_nowait(("end", None))
        except asyncio.CancelledError:
            await agen.aclose()
            self._q.put_nowait(("error", asyncio.CancelledError()))
            raise
        except Exception as e:  # noqa: BLE001
            self._q.put_nowait(("error", e))

    def cancel(self) -> None:
        self._task.cancel()

    def __aiter__(self) -> _LocalStream:
        return self

    async def __anext__(self) -> Any:
        kind, value = await self._q.get()
        if kind == "item":
            return value
        if kind == "end":
            raise StopAsyncIteration
        raise value


class HandleCaller:
    """A second app's deployment that talks to omniray only through its app handle (the
    documented way other Ray apps use it); returns the event kinds of one turn."""

    def __init__(self, app_name: str = "omniray"):
        self.app_name = app_name

    async def __call__(self, body: dict) -> list[str]:
        from ray import serve

        omni = serve.get_app_handle(self.app_name)
        return [type(ev).__name__ async for ev in omni.options(stream=True).chat.remote(body)]


@dataclass
class LocalApp:
    ingress: Any
    thinker: Any
    talker: Any
    code2wav: Any


def build_local_app(
    cfg: dict,
    source: Any,
    *,
    thinker_engine_cls: Any = FakeThinkerEngine,
    talker_engine_cls: Any = FakeTalkerEngine,
    code2wav_engine_cls: Any = FakeCode2WavEngine,
) -> LocalApp:
    """The four servers in this process, wired with LocalHandles (call inside a loop)."""
    from deployments.ingress.server import IngressServer
    from deployments.stages.code2wav import Code2WavServer
    from deployments.stages.talker import TalkerServer
    from deployments.stages.thinker import ThinkerServer

    c2w = Code2WavServer(cfg, engine_cls=code2wav_engine_cls, source=source)
    talker = TalkerServer(cfg, LocalHandle(c2w), engine_cls=talker_engine_cls, source=source)
    thinker = ThinkerServer(cfg, LocalHandle(talker), engine_cls=thinker_engine_cls, source=source)
    ingress = IngressServer(
        cfg, LocalHandle(thinker), LocalHandle(talker), LocalHandle(c2w), source=source
    )
    return LocalApp(ingress, thinker, talker, c2w)


# ---------------------------------------------------------------------------------------
# Full duplex (deployments/duplex): a scripted backend (tests/duplex_app.py serves it)


class FakeDuplexBackend:
    """Scripted duplex sessions: of every `period` units the last `speak` speak (the
    last of them ends the turn), the others listen; a forced unit does as forced. A speak
    unit's text is "u<index> " and its PCM (from `speech`) 1 s of a 440 Hz tone at 24 kHz;
    every unit "prefills" 30 positions. Records each session's init and units for the tests, and can
    fail at a unit (`fail_at`) or take `unit_delay_s` per unit. With `text_pieces`, a speak
    unit hands `on_text` its text's first piece ("u") before that delay, as a backend that
    streams its text does."""

    def __init__(self, period: int = 4, speak: int = 2, unit_delay_s: float = 0.0,
                 fail_at: int | None = None, speech_delay_s: float = 0.0,
                 text_pieces: bool = False):
        self.text_pieces = text_pieces
        self.period, self.speak = period, speak
        self.unit_delay_s, self.fail_at = unit_delay_s, fail_at
        self.speech_delay_s = speech_delay_s
        self.sessions: set[str] = set()              # open now
        self.units: dict[str, list] = {}             # every session's units, kept
        self.inits: dict[str, Any] = {}
        self.speeches: dict[str, tuple] = {}       # a speaking unit's codes and PCM, once
        self.opened = 0
        self.closed = 0

    async def open(self, session_id: str, init: Any) -> None:
        assert session_id not in self.units, "opened twice"
        self.sessions.add(session_id)
        self.units[session_id] = []
        self.inits[session_id] = init
        self.opened += 1

    async def unit(self, session_id: str, audio: np.ndarray, frames: list | None,
                   force: str | None, on_text: Any = None) -> Any:
        from deployments.duplex.backend import UnitResult

        assert session_id in self.sessions, "unit of a session that is not open"
        units = self.units[session_id]
        i = len(units)
        units.append((len(audio), len(frames or ()), force))
        phase = i % self.period
        speak = phase >= self.period - self.speak
        if force is not None:
            speak = force == "speak"
        if speak and self.text_pieces and on_text is not None and self.fail_at != i:
            on_text("u")
        if self.unit_delay_s:
            await asyncio.sleep(self.unit_delay_s)
        if self.fail_at == i:
            raise RuntimeError("scripted unit failure")
        if not speak:
            return UnitResult(True, False, "", [1], [], None, prefill_tokens=30)
        end = force is None and phase == self.period - 1
        t = np.arange(24000, dtype=np.float32) / 24000
        pcm = (0.25 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
        self.speeches[session_id] = (list(range(25)), pcm)
        return UnitResult(False, end, f"u{i} ", [2, 3, 4], [], None, prefill_tokens=30)

    async def speech(self, session_id: str) -> tuple[list[int], np.ndarray | None]:
        assert session_id in self.sessions, "speech of a session that is not open"
        if self.speech_delay_s:
            await asyncio.sleep(self.speech_delay_s)
        return self.speeches.pop(session_id)  # KeyError: no speaking unit to voice

    async def close(self, session_id: str) -> None:
        self.sessions.remove(session_id)
        self.closed += 1

    def stats(self) -> dict[str, int]:
        return {"sessions": len(self.sessions), "opened": self.opened, "closed": self.closed}


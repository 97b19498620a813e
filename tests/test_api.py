"""The ingress API in-process (no Ray): the four servers wired with LocalHandles over fake
engines (tests/fakes.py), the real Processor, HTTP through Starlette's TestClient.

Covers: the SSE and non-streamed shapes, audio formats, the active stream window, the
engine loop's batching, a stage fault, and the config checks. The bad-input table lives in
test_bad_inputs.py.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import tempfile
import time
import wave
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
from PIL import Image
from starlette.testclient import TestClient

from deployments.config import AppConfig, MemoryBudgetError, check_memory_budget
from deployments.ingress.window import ActiveStreamWindow
from deployments.stages.loop import EngineLoop
from deployments.wire import AudioChunk, Done, Error, TextDelta
from fakes import FakeCode2WavEngine, FakeThinkerEngine, build_local_app
from pipeline.handoff import SamplingParams, ThinkerRequest

URL = "/v1/chat/completions"


# ---------------------------------------------------------------------------------------
# Media helpers (also used by test_serve.py)


def png_bytes(w: int = 64, h: int = 48, seed: int = 0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def wav_bytes(seconds: float = 0.5, rate: int = 16000, freq: float = 440.0) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


def data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def user(content) -> list[dict]:
    return [{"role": "user", "content": content}]


def sse_events(lines) -> list:
    """SSE `data:` payloads as objects; the final [DONE] as the string "[DONE]"."""
    out = []
    for line in lines:
        if isinstance(line, bytes):
            line = line.decode()
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def decode_wav(b64: str) -> tuple[np.ndarray, int]:
    with wave.open(io.BytesIO(base64.b64decode(b64))) as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
        return pcm.astype(np.float32) / 32767.0, w.getframerate()


GOOD_AUDIO = base64.b64encode(wav_bytes()).decode()


# ---------------------------------------------------------------------------------------
# Fixtures


def light_source():
    """Config + tokenizer of the tiny preset, no weights (fake engines need none)."""
    from pipeline.checkpoint import write_tokenizer
    from pipeline.config import (
        Code2WavConfig,
        ModelConfig,
        talker_config_from_hf,
        thinker_config_from_hf,
    )
    from pipeline.presets import tiny_hf_config

    hf = tiny_hf_config()
    cfg = ModelConfig(thinker_config_from_hf(hf), talker_config_from_hf(hf), Code2WavConfig(), hf)
    path = Path(tempfile.mkdtemp(prefix="omniray-tok-"))
    write_tokenizer(path, cfg.thinker.llm.vocab_size)
    return SimpleNamespace(config=cfg, path=path, tensors=None)


@pytest.fixture(scope="module")
def source():
    return light_source()


@pytest.fixture(scope="module")
def allowed_dir():
    d = Path(tempfile.mkdtemp(prefix="omniray-media-"))
    (d / "cat.png").write_bytes(png_bytes(40, 30))
    return d


@pytest.fixture(scope="module")
def app_cfg(allowed_dir):
    return {"capacity": 2, "allowed_local_media_path": str(allowed_dir),
            "limits": {"max_images": 4, "max_tokens": 64},
            "code2wav": {"engine": {"step_delay_s": 0.005}}}


@pytest.fixture(scope="module")
def client(app_cfg, source):
    local = build_local_app(app_cfg, source)
    with TestClient(local.ingress.__serve_build_asgi_app__()) as c:
        c.local = local
        yield c


# ---------------------------------------------------------------------------------------
# HTTP


def test_oversized_body_is_413(client):
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * 300 + b'"}]}'
    cfg = client.local.ingress.cfg
    object.__setattr__(cfg.limits, "max_body_bytes", 100)  # frozen settings: test-only poke
    try:
        r = client.post(URL, content=big, headers={"content-type": "application/json"})
    finally:
        object.__setattr__(cfg.limits, "max_body_bytes", 256 * 1024 * 1024)
    assert r.status_code == 413 and "error" in r.json()


def test_unknown_route_and_method_are_openai_errors(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = client.get(URL)
    assert r.status_code == 405 and "error" in r.json()


def test_models_and_health(client):
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "omniray"


def test_stream_shape_text_then_audio_then_usage(client, allowed_dir):
    body = {"messages": user([
        {"type": "text", "text": "Describe both."},
        {"type": "image_url", "image_url": {"url": f"file://{allowed_dir}/cat.png"}},
        {"type": "input_audio", "input_audio": {"data": GOOD_AUDIO, "format": "wav"}}]),
        "modalities": ["text", "audio"], "stream": True, "max_tokens": 32,
        "omniray": {"stream_format": "vllm-omni"}}
    with client.stream("POST", URL, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    modalities = [c["modality"] for c in chunks if c["choices"]]
    assert modalities[0] == "text" and "audio" in modalities
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                   if c.get("modality") == "text" and c["choices"])
    assert text.startswith("Hello there!")
    pieces = []
    for c in chunks:
        if c.get("modality") == "audio":
            pcm, rate = decode_wav(c["choices"][0]["delta"]["content"])
            meta = c["choices"][0]["audio_metadata"]
            assert rate == 24000 and meta["sample_rate_hz"] == 24000
            assert meta["frame_count"] == len(pcm) and meta["format"] == "wav"
            pieces.append(pcm)
    joined = np.concatenate(pieces)
    ref = (0.5 * np.sin(2 * np.pi * FakeCode2WavEngine.FREQ_HZ * np.arange(len(joined)) / 24000))
    err = np.abs(joined - ref).max()
    assert err < 1e-3, f"joined audio is not one continuous stream: max diff {err:.2e}"
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == "stop" and all(f is None for f in finish[:-1])


def test_openai_stream_shape_is_delta_audio_with_transcript(client):
    """OpenAI's streamed audio (the default shape): the text arrives as delta.audio.transcript,
    the audio as delta.audio.data (pcm16 here: the pieces join into one stream), the last
    audio update carries expires_at; no top-level `modality`."""
    body = {"messages": user("hi"), "modalities": ["text", "audio"], "stream": True,
            "max_tokens": 32, "audio": {"format": "pcm16", "voice": "alloy"}}
    with client.stream("POST", URL, json=body) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and not any("modality" in e for e in events[:-1])
    deltas = [c["choices"][0]["delta"] for c in events[:-1] if c["choices"]]
    audio = [d["audio"] for d in deltas if "audio" in d]
    assert {a["id"] for a in audio} == {audio[0]["id"]} and audio[0]["id"].startswith("audio-")
    transcript = "".join(a.get("transcript", "") for a in audio)
    assert transcript.startswith("Hello there!") and not any(d.get("content") for d in deltas)
    pcm = np.frombuffer(b"".join(base64.b64decode(a["data"]) for a in audio if "data" in a),
                        dtype="<i2").astype(np.float32) / 32767.0
    ref = 0.5 * np.sin(2 * np.pi * FakeCode2WavEngine.FREQ_HZ * np.arange(len(pcm)) / 24000)
    assert len(pcm) > 0 and np.abs(pcm - ref).max() < 1e-3
    assert "expires_at" in audio[-1] and set(audio[-1]) == {"id", "expires_at"}
    assert deltas[0].get("role") == "assistant" and events[-2]["usage"]["completion_tokens"] > 0


def test_non_stream_with_audio(client):
    body = {"messages": user("hi"), "modalities": ["text", "audio"], "max_tokens": 32,
            "ref_audio": data_uri(wav_bytes(0.3), "audio/wav")}
    r = client.post(URL, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    assert choice["message"]["content"].startswith("Hello there!")
    pcm, rate = decode_wav(choice["message"]["audio"]["data"])
    assert rate == 24000 and len(pcm) == choice["audio_metadata"]["frame_count"] > 0
    assert out["usage"]["completion_tokens"] > 0


def test_pcm_audio_format_and_audio_only(client):
    body = {"messages": user("hi"), "modalities": ["audio"], "audio": {"format": "pcm"},
            "stream": True, "max_tokens": 32, "omniray": {"stream_format": "vllm-omni"}}
    with client.stream("POST", URL, json=body) as r:
        events = sse_events(r.iter_lines())
    audio = [c for c in events[:-1] if c.get("modality") == "audio"]
    text = [c for c in events[:-1] if c.get("modality") == "text" and c["choices"]
            and c["choices"][0]["delta"].get("content")]
    assert audio and not text
    raw = base64.b64decode(audio[0]["choices"][0]["delta"]["content"])
    assert len(raw) == 2 * audio[0]["choices"][0]["audio_metadata"]["frame_count"]


def test_text_only_non_stream_length(client):
    r = client.post(URL, json={"messages": user("hi"), "max_tokens": 3})
    assert r.status_code == 200
    out = r.json()
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 3 and "audio" not in out["choices"][0]["message"]


# ---------------------------------------------------------------------------------------
# Handle API, window, faults (in-process)


async def _collect(ingress, body):
    return [ev async for ev in ingress.chat(body)]


def test_handle_events_and_concurrent_window(app_cfg, source):
    async def main():
        local = build_local_app(app_cfg, source)
        body = {"messages": user("hi"), "modalities": ["text", "audio"], "max_tokens": 32}
        runs = await asyncio.gather(*[_collect(local.ingress, body) for _ in range(4)])
        stats = [await s.stats() for s in (local.thinker, local.talker, local.code2wav)]
        return runs, local.ingress.groups[0].window.stats(), stats

    runs, window, stats = asyncio.run(main())
    for evs in runs:
        kinds = [type(e) for e in evs]
        assert kinds[0] is TextDelta and AudioChunk in kinds and kinds[-1] is Done
        assert sum(k in (Done, Error) for k in kinds) == 1
        idx = [e.index for e in evs if isinstance(e, AudioChunk)]
        assert idx == list(range(len(idx)))
    assert window["peak_active"] == 2 and window["peak_waiting"] >= 1, window
    assert window["active"] == 0 and window["waiting"] == 0
    assert all(s["open"] == 0 for s in stats), stats


def test_invalid_request_via_handle_is_one_error_event(app_cfg, source):
    async def main():
        local = build_local_app(app_cfg, source)
        return await _collect(local.ingress, {"messages": []})

    evs = asyncio.run(main())
    assert len(evs) == 1 and isinstance(evs[0], Error) and evs[0].status == 400


def test_stage_fault_becomes_error_event_and_next_request_succeeds(app_cfg, source):
    cfg = {**app_cfg, "code2wav": {"engine": {"fail_on_step": 1}}}

    async def main():
        local = build_local_app(cfg, source)
        body = {"messages": user("hi"), "modalities": ["text", "audio"], "max_tokens": 32}
        first = await _collect(local.ingress, body)
        second = await _collect(local.ingress, body)
        await asyncio.sleep(0.05)  # let fire-and-forget aborts land
        stats = [await s.stats() for s in (local.thinker, local.talker, local.code2wav)]
        return first, second, stats

    first, second, stats = asyncio.run(main())
    assert isinstance(first[-1], Error) and "injected Code2Wav fault" in first[-1].message
    assert sum(isinstance(e, (Done, Error)) for e in first) == 1
    assert isinstance(second[-1], Done) and any(isinstance(e, AudioChunk) for e in second)
    assert all(s["open"] == 0 for s in stats), stats


def test_a_fault_mid_stream_ends_the_sse_with_an_error_and_frees_the_stages(
    app_cfg, source, monkeypatch
):
    """A fault of ours after the stream's headers are out (here the audio encoder): the client
    gets an error event of type server_error and [DONE], not a stream cut off, and the turn
    is ended in every stage and the window."""
    from deployments.ingress import formats

    def broken(self, ev):
        raise ValueError("encoder broke")

    monkeypatch.setattr(formats.ChunkWriter, "audio", broken)

    async def main():
        local = build_local_app(app_cfg, source)
        req = local.ingress.parse({"messages": user("hi"), "modalities": ["text", "audio"],
                                   "stream": True, "max_tokens": 32})
        turn = await local.ingress.prepare(req)
        lines = [line async for line in local.ingress.sse(req, turn)]
        await asyncio.sleep(0.05)  # let fire-and-forget aborts land
        stats = [await s.stats() for s in (local.thinker, local.talker, local.code2wav)]
        return lines, stats, local.ingress.groups[0].window.stats()

    lines, stats, window = asyncio.run(main())
    events = sse_events("".join(lines).splitlines())
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["type"] == "server_error" and "ValueError: encoder broke" in err["message"]
    assert all(s["open"] == 0 for s in stats), stats
    assert window["active"] == 0 and window["waiting"] == 0


def test_unusable_voice_is_one_error_event_and_frees_the_stages(app_cfg, source):
    cfg = {**app_cfg, "code2wav": {"engine": {"reject_voices": True}}}

    async def main():
        local = build_local_app(cfg, source)
        body = {"messages": user("hi"), "modalities": ["text", "audio"], "max_tokens": 8,
                "ref_audio": data_uri(wav_bytes(0.3), "audio/wav")}
        evs = await _collect(local.ingress, body)
        await asyncio.sleep(0.05)
        stats = [await s.stats() for s in (local.thinker, local.talker, local.code2wav)]
        return evs, stats, local.ingress.groups[0].window.stats()

    evs, stats, window = asyncio.run(main())
    assert len(evs) == 1 and isinstance(evs[0], Error) and "voice front-end" in evs[0].message
    assert all(s["open"] == 0 for s in stats) and stats[1]["engine"]["open_streams"] == 0
    assert window["active"] == 0


def test_timeout_is_one_504_and_frees_the_stages(app_cfg, source):
    cfg = {**app_cfg, "request_timeout_s": 0.15, "thinker": {"engine": {"step_delay_s": 0.05}}}

    async def main():
        local = build_local_app(cfg, source)
        body = {"messages": user("hi"), "modalities": ["text", "audio"], "max_tokens": 32}
        evs = await _collect(local.ingress, body)
        await asyncio.sleep(0.2)
        stats = [await s.stats() for s in (local.thinker, local.talker, local.code2wav)]
        return evs, stats

    evs, stats = asyncio.run(main())
    assert isinstance(evs[-1], Error) and evs[-1].status == 504
    assert sum(isinstance(e, (Done, Error)) for e in evs) == 1
    assert all(s["open"] == 0 for s in stats), stats
    assert stats[0]["engine"]["num_running"] == 0


def test_timeout_while_waiting_for_the_window(app_cfg, source):
    cfg = {**app_cfg, "capacity": 1, "request_timeout_s": 0.3,
           "thinker": {"engine": {"step_delay_s": 0.05}}}

    async def main():
        local = build_local_app(cfg, source)
        body = {"messages": user("hi"), "modalities": ["text", "audio"], "max_tokens": 32}
        runs = await asyncio.gather(_collect(local.ingress, body), _collect(local.ingress, body))
        await asyncio.sleep(0.2)  # the timed-out turn's slot comes back once its aborts land
        return runs, local.ingress.groups[0].window.stats()

    runs, window = asyncio.run(main())
    second = runs[1]
    assert len(second) == 1 and isinstance(second[0], Error) and second[0].status == 504
    assert window["active"] == 0 and window["waiting"] == 0 and window["peak_waiting"] == 1


def test_cancel_mid_stream_frees_every_stage(app_cfg, source):
    cfg = {**app_cfg, "thinker": {"engine": {"step_delay_s": 0.01}}}

    async def main():
        local = build_local_app(cfg, source)
        body = {"messages": user("hi"), "modalities": ["text", "audio"], "max_tokens": 32}
        agen = local.ingress.chat(body)
        async for ev in agen:
            if isinstance(ev, TextDelta):
                break
        await agen.aclose()  # what Serve does when the HTTP client goes away
        await asyncio.sleep(0.1)
        return [await s.stats() for s in (local.thinker, local.talker, local.code2wav)], \
            local.ingress.groups[0].window.stats()

    stats, window = asyncio.run(main())
    thinker, talker, code2wav = stats
    assert thinker["open"] == 0 and thinker["engine"]["num_running"] == 0, thinker
    assert talker["open"] == 0 and talker["engine"]["open_streams"] == 0, talker
    assert code2wav["open"] == 0 and code2wav["engine"]["open_streams"] == 0, code2wav
    assert window["active"] == 0


def test_full_span_mode_feeds_the_talker_once(app_cfg, source):
    """full_span: the spoken span goes to the Talker once, whole; streaming: in text chunks
    (3 rows here, so the fake Thinker's 10 words make several)."""
    cfg = source.config
    small = SimpleNamespace(**{**vars(source), "config": dataclasses.replace(
        cfg, talker=dataclasses.replace(cfg.talker, streaming_text_chunk=3))})

    async def run(mode):
        slow = {"engine": {"step_delay_s": 0.01}}  # spread the spoken span over time
        local = build_local_app({**app_cfg, "talker_mode": mode, "thinker": slow}, small)
        body = {"messages": user("hi"), "modalities": ["text", "audio"], "max_tokens": 32}
        evs = await _collect(local.ingress, body)
        return evs, await local.talker.stats()

    evs, stats = asyncio.run(run("full_span"))
    assert isinstance(evs[-1], Done) and any(isinstance(e, AudioChunk) for e in evs)
    assert stats["feeds"] == 1, stats
    _, stats = asyncio.run(run("streaming"))
    assert stats["feeds"] >= 2, stats


# ---------------------------------------------------------------------------------------
# Building blocks


def test_stage_metrics_read_engine_stats():
    from deployments.metrics import StageMetrics

    m = StageMetrics("thinker")
    m.record_stats({"num_free_blocks": 3, "num_total_blocks": 4, "num_running": 1,
                    "num_waiting": 2, "encoder_cache_hits": 5, "graph_replays": 7,
                    "eager_steps": 1, "note": "ignored"})
    m.record_stats({"encoder_cache_hits": 9, "graph_replays": 7})
    assert m._counters == {"encoder_cache_hits": 9, "graph_replays": 7, "eager_steps": 1}


def test_window_is_fifo_and_cancel_safe():
    async def main():
        w = ActiveStreamWindow(1)
        order = []
        first = await w.acquire("a")

        async def take(name):
            slot = await w.acquire(name)
            order.append(name)
            return slot

        tb = asyncio.ensure_future(take("b"))
        tc = asyncio.ensure_future(take("c"))
        td = asyncio.ensure_future(take("d"))
        await asyncio.sleep(0)
        assert w.waiting == 3
        tc.cancel()
        await asyncio.sleep(0)
        first.release()
        first.release()  # idempotent
        sb = await tb
        assert w.active == 1
        sb.release()
        sd = await td
        sd.release()
        return order, w.stats()

    order, stats = asyncio.run(main())
    assert order == ["b", "d"]
    assert stats["peak_active"] == 1 and stats["active"] == 0 and stats["waiting"] == 0


def test_a_stage_builds_its_engine_on_the_thread_that_serves_it():
    """The engine is built (its warm-up included) on the EngineLoop's worker thread, the one
    that runs its commands and steps, so what CUDA keeps per thread exists before the first
    request. A build that fails raises from the stage's constructor and leaves no thread."""
    import threading

    from deployments.stages.code2wav import Code2WavServer

    class Recording(FakeCode2WavEngine):
        @classmethod
        def from_source(cls, source, config, device):
            engine = super().from_source(source, config, device)
            engine.built_on = threading.get_ident()
            return engine

    srv = Code2WavServer({}, engine_cls=Recording, source=light_source())
    served_on = asyncio.run(srv.loop.call(lambda e: threading.get_ident()))
    assert srv.engine.built_on == served_on == srv.loop._thread.ident != threading.get_ident()
    srv.loop.stop()

    class Broken(FakeCode2WavEngine):
        @classmethod
        def from_source(cls, source, config, device):
            raise RuntimeError("no weights here")

    def engine_threads():
        return {t for t in threading.enumerate() if t.name == "code2wav-engine"}

    before = engine_threads()  # other tests' stages may still be stopping: only new ones count
    with pytest.raises(RuntimeError, match="no weights here"):
        Code2WavServer({}, engine_cls=Broken, source=light_source())
    time.sleep(0.05)
    assert not engine_threads() - before


def test_engine_loop_batches_concurrent_requests():
    async def main():
        engine = FakeThinkerEngine(step_delay_s=0.01)
        loop = EngineLoop(engine, name="t", route=lambda d: (d.request_id, d))
        batches = []
        orig = engine.step
        engine.step = lambda: batches.append(len(engine.running)) or orig()
        reqs = [ThinkerRequest(f"r{i}", [1, 2, 3], sampling=SamplingParams(max_tokens=5))
                for i in range(4)]

        async def run(req):
            q = loop.open(req.request_id)
            await loop.call(lambda e: e.open(req.request_id, req))
            n = 0
            while True:
                d = await q.get()
                n += 1
                if d.finished:
                    return n

        counts = await asyncio.gather(*[run(r) for r in reqs])
        loop.stop()
        return counts, batches

    counts, batches = asyncio.run(main())
    assert counts == [5, 5, 5, 5]
    assert max(batches) == 4, f"requests never shared a step: {batches}"


def test_engine_loop_steps_without_pause_while_there_is_work():
    """Steps that emit nothing (a Talker drawing codes mid-chunk) are progress too: the
    loop takes the next one at once, and blocks on its commands only once has_work() ends."""

    class Silent:
        def __init__(self):
            self.left, self.waits = 0, []

        def has_work(self):
            return self.left > 0

        def step(self):
            self.left -= 1
            return [] if self.left else [TextDelta("done")]

    async def main():
        engine = Silent()
        loop = EngineLoop(engine, name="t", route=lambda d: ("r", d))
        run = loop._run_commands

        def recording(block, timeout):
            engine.waits.append((engine.left, block))
            return run(block, timeout)

        loop._run_commands = recording
        q = loop.open("r")
        await loop.call(lambda e: setattr(e, "left", 30))
        out = await asyncio.wait_for(q.get(), 5)
        loop.stop()
        return out, engine.waits

    out, waits = asyncio.run(main())
    assert out.text == "done"
    assert [left for left, block in waits if block and left > 0] == []
    assert sum(1 for left, _ in waits if left > 0) == 30  # one command poll per step


def test_engine_loop_survives_cancelled_calls_and_failed_steps():
    async def main():
        engine = FakeThinkerEngine()
        loop = EngineLoop(engine, name="t", route=lambda d: (d.request_id, d))
        ran = []

        def slow(e):
            time.sleep(0.05)
            ran.append("slow")

        task = asyncio.ensure_future(loop.call(slow))
        await asyncio.sleep(0.01)
        task.cancel()  # the caller goes away while its command runs
        queued = asyncio.ensure_future(loop.call(lambda e: ran.append("queued")))
        await asyncio.sleep(0)
        queued.cancel()  # ... or before it runs
        assert await loop.call(lambda e: 42) == 42
        q = loop.open("r")
        engine.step = lambda: 1 / 0  # a broken step: the request gets a StageFailure
        await loop.call(lambda e: e.open("r", ThinkerRequest("r", [1])))
        failure = await asyncio.wait_for(q.get(), 5)
        alive = loop.alive
        loop.stop()
        return ran, failure, alive

    ran, failure, alive = asyncio.run(main())
    assert ran == ["slow", "queued"] and alive
    assert failure.stage == "t" and "ZeroDivisionError" in failure.message


def test_memory_budget_check_names_the_numbers():
    cfg = AppConfig()
    plan = check_memory_budget(cfg, 141 * 2**30, free_bytes=140 * 2**30, stage="thinker")
    assert plan["need"] < plan["total"]
    with pytest.raises(MemoryBudgetError, match=r"GiB > device 8.00 GiB"):
        check_memory_budget(cfg.model_copy(update={"cuda_context_gib": 2.0}), 8 * 2**30)
    with pytest.raises(MemoryBudgetError, match="only 1.00 GiB"):
        check_memory_budget(cfg, 141 * 2**30, free_bytes=2**30, stage="thinker")


def test_shipped_serve_config_is_valid_for_the_real_engines():
    import yaml

    from deployments.config import dataclass_from_dict
    from pipeline.code2wav.engine import Code2WavEngineConfig
    from pipeline.talker.engine import TalkerEngineConfig
    from pipeline.thinker.engine import ThinkerEngineConfig

    root = Path(__file__).resolve().parents[1]
    doc = yaml.safe_load((root / "serve_config.yaml").read_text())
    app = doc["applications"][0]
    assert app["import_path"] == "deployments.app:build_app" and app["name"] == "omniray"
    cfg = AppConfig.model_validate(app["args"])
    assert cfg.model is None and cfg.device == "auto"  # runs on a CPU-only machine as is
    for name, cls in (("thinker", ThinkerEngineConfig), ("talker", TalkerEngineConfig),
                      ("code2wav", Code2WavEngineConfig)):
        dataclass_from_dict(cls, cfg.stages()[name].engine, name)
    plan = check_memory_budget(cfg, 141 * 2**30)  # fits one H200
    assert plan["need"] < plan["total"]


def test_config_is_validated():
    with pytest.raises(ValueError, match="add up"):
        AppConfig.model_validate({"thinker": {"memory_fraction": 0.9},
                                  "talker": {"memory_fraction": 0.2}})
    with pytest.raises(ValueError):
        AppConfig.model_validate({"no_such_knob": 1})
    from deployments.stages.server import build_engine
    from pipeline.talker.engine import TalkerEngine, TalkerEngineConfig

    with pytest.raises(ValueError, match="unknown engine settings"):
        build_engine(TalkerEngine, None, {"max_streamz": 2}, "cpu", TalkerEngineConfig)


async def _drain(agen) -> list[str]:
    """Item kinds of a stage stream until it ends; a refused open as 'error: ...'."""
    items = []
    try:
        async for x in agen:
            items.append(type(x).__name__)
    except RuntimeError as e:
        items.append(f"error: {e}")
    return items


def test_abort_that_overtakes_open_still_wins(app_cfg, source):
    """Abort and open of one turn are concurrent calls: an abort that lands first, or while
    the engine is opening the stream, must leave no stream behind in either speech stage."""
    async def main():
        local = build_local_app(app_cfg, source)
        await local.talker.abort("r1")
        await local.code2wav.abort("r1")
        early = [await _drain(local.talker.session("r1")), await _drain(local.code2wav.stream("r1"))]
        # abort while the opens are in flight
        opening = [asyncio.ensure_future(_drain(local.talker.session("r2"))),
                   asyncio.ensure_future(_drain(local.code2wav.stream("r2")))]
        await asyncio.sleep(0)
        await asyncio.gather(local.talker.abort("r2"), local.code2wav.abort("r2"))
        late = await asyncio.wait_for(asyncio.gather(*opening), 5)
        await asyncio.sleep(0.05)  # posted closes land
        stats = [await s.stats() for s in (local.talker, local.code2wav)]
        return early, late, stats

    early, late, stats = asyncio.run(main())
    assert all(len(e) == 1 and "aborted" in e[0] for e in early), early
    # Each stream ends on its own (no Opened left dangling): the Talker's open is in flight
    # when the abort lands; Code2Wav queues a default-voice open, so it may answer Opened first
    # and then end on the abort.
    assert all(not items or items[-1] == "StageFailure" for items in late), late
    talker, c2w = stats
    assert talker["open"] == 0 and talker["sessions"] == 0 and talker["idle"], talker
    assert c2w["open"] == 0 and c2w["streams"] == 0 and c2w["idle"], c2w
    assert not talker["leaks"] and not c2w["leaks"]


def test_default_voice_open_does_not_wait_for_a_running_chunk(app_cfg, source):
    """The ingress awaits the speech stages' Opened before it starts the Thinker: a Code2Wav
    open with the default voice must not wait for the chunk the engine is decoding."""
    cfg = {**app_cfg, "code2wav": {"engine": {"step_delay_s": 0.5}}}

    async def main():
        c2w = build_local_app(cfg, source).code2wav
        busy = c2w.stream("busy")
        await busy.__anext__()
        await c2w.push("busy", np.arange(25), False)  # the engine now decodes for 0.5 s
        await asyncio.sleep(0.05)
        t = time.perf_counter()
        new = c2w.stream("new")
        opened = await new.__anext__()
        waited = time.perf_counter() - t
        await c2w.push("new", np.arange(25), True)
        piece = await new.__anext__()
        while type(piece).__name__ == "Heartbeat":
            piece = await new.__anext__()
        await busy.aclose()
        await new.aclose()
        return waited, opened, piece

    waited, opened, piece = asyncio.run(main())
    assert waited < 0.1 and type(opened).__name__ == "Opened", waited
    assert len(piece.pcm) == 25 * FakeCode2WavEngine.SAMPLES_PER_CODE and piece.is_last

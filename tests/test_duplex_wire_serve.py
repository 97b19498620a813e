"""Full duplex through Serve's proxy, on the session's Ray (conftest.py `ray_http`): the
official `openbmb-realtime` SDK (an audio session and a video session end to end,
queueing past capacity and refusal past the queue, interrupt = force_listen, a forced
speak, close) and vLLM-Omni's `?duplex=1` with raw websockets (a session, a dropped socket,
bad events). The ingress's duplex sessions run on tests/fakes.py's FakeDuplexBackend
(tests/duplex_app.py); after each scenario no slot, queue entry or backend session is left.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import io
import json
import time

import numpy as np
import pytest

pytest.importorskip("ray.serve")
websockets = pytest.importorskip("websockets")
obr = pytest.importorskip("openbmb_realtime")

from ray import serve  # noqa: E402

APP = "duplex"
CONFIG = {"capacity": 2, "duplex": {"max_sessions": 2, "max_queue": 1}}
UNIT = 16000  # a unit's samples: 1 s at 16 kHz, the first one too
FIRST = UNIT


@pytest.fixture(scope="module")
def duplex_app(ray_http):
    from duplex_app import build_duplex_app

    serve.run(build_duplex_app(CONFIG), name=APP, route_prefix=f"/{APP}")
    yield f"{ray_http}/{APP}"
    serve.delete(APP)


def _stats() -> dict:
    return serve.get_app_handle(APP).stats.remote().result()


def _log() -> dict:
    return serve.get_app_handle(APP).duplex_backend_log.remote().result()


def wait_free(timeout: float = 30.0) -> dict:
    deadline = time.time() + timeout
    while True:
        st = _stats()
        d = st["duplex"]
        if (d["idle"] and not st["leaks"] and d["backend"]["sessions"] == 0) \
                or time.time() > deadline:
            break
        time.sleep(0.2)
    assert d["idle"] and not st["leaks"] and d["backend"]["sessions"] == 0, st
    return st


def f32(n: int, value: float = 0.01) -> bytes:
    return np.full(n, value, "<f4").tobytes()


def jpeg() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 24), (10, 120, 200)).save(buf, "JPEG")
    return buf.getvalue()


def client(base: str, factory=None):
    return obr.RealtimeClient(api_key="unused", base_url=f"{base}/v1", connect_timeout=60,
                              websocket_factory=factory)


async def events_until(session, done, timeout: float = 60.0) -> list:
    """The SDK's events until `done(events)` holds."""
    events: list = []

    async def read():
        async for ev in session:
            events.append(ev)
            if done(events):
                return

    await asyncio.wait_for(read(), timeout)
    return events


def turn_ended(events: list) -> bool:
    return any(isinstance(e, obr.TextDelta) and e.end_of_turn for e in events) and \
        isinstance(events[-1], obr.TurnCompleted)


def test_sdk_audio_session_end_to_end(duplex_app):
    async def main():
        session = await client(duplex_app).audio.connect(
            model="omniray", system_prompt="You are a helpful voice assistant.",
            config=obr.RealtimeConfig(temperature=0.5))
        audio = f32(FIRST + 3 * UNIT)
        step = 1600 * 4  # 100 ms appends, as a microphone sends them
        for i in range(0, len(audio), step):
            await session.send_audio(audio[i:i + step])
        events = await events_until(session, turn_ended)
        await session.close()
        return session, events

    session, events = asyncio.run(main())
    kinds = [type(e).__name__ for e in events]
    assert kinds[:2] == ["WorkerAssigned", "SessionReady"]
    # listen, listen, speak, speak + turn end: a TurnCompleted per listen, audio per speak
    assert kinds[2:4] == ["TurnCompleted", "TurnCompleted"]
    assert kinds.count("AudioDelta") == 2
    texts = [e for e in events if isinstance(e, obr.TextDelta)]
    assert [(t.text, t.end_of_turn) for t in texts] == [("u2 ", False), ("u3 ", True)]
    audio = next(e for e in events if isinstance(e, obr.AudioDelta)).audio
    assert len(np.frombuffer(audio, "<f4")) == 24000
    assert session.state == obr.SessionState.CLOSED
    assert session.usage is not None and session.usage.completion_tokens == 8
    log = _log()
    init = log["inits"][session.id]
    assert init["system_prompt"] == "You are a helpful voice assistant."
    assert init["options"] == {"temperature": 0.5} and init["mode"] == "audio"
    assert [u[0] for u in log["units"][session.id]] == [FIRST, UNIT, UNIT, UNIT]
    wait_free()


def test_sdk_video_session_one_frame_a_unit(duplex_app):
    async def main():
        session = await client(duplex_app).video.connect(model="omniray", max_slice_nums=1)
        frame = jpeg()
        await session.send_audio_video(f32(FIRST), frame)
        for _ in range(3):
            await session.send_audio_video(f32(UNIT), frame)
        events = await events_until(session, turn_ended)
        await session.close()
        return session, events

    session, events = asyncio.run(main())
    assert any(isinstance(e, obr.AudioDelta) for e in events)
    log = _log()
    assert log["inits"][session.id]["mode"] == "video"
    assert [u[1] for u in log["units"][session.id]] == [1, 1, 1, 1]
    wait_free()


def _force_speak_factory():
    """The SDK's socket with `duplex_force: "speak"` added to its session.init config (the
    SDK's RealtimeConfig has no field for omniray's key)."""
    from openbmb_realtime.transport import default_websocket_factory

    async def factory(url, **kwargs):
        sock = await default_websocket_factory(url, **kwargs)
        send = sock.send

        async def patched(message):
            obj = json.loads(message)
            if obj["type"] == "session.init":
                obj["payload"].setdefault("config", {})["duplex_force"] = "speak"
                message = json.dumps(obj)
            await send(message)

        sock.send = patched
        return sock

    return factory


def test_sdk_forced_speak_then_interrupt_listens(duplex_app):
    async def main():
        session = await client(duplex_app, _force_speak_factory()).audio.connect(
            model="omniray")
        await session.send_audio(f32(FIRST))
        first = await events_until(session, lambda ev: isinstance(ev[-1], obr.AudioDelta))
        session.interrupt()  # the next input.append carries force_listen
        await session.send_audio(f32(UNIT))
        second = await events_until(session, lambda ev: isinstance(ev[-1], obr.TurnCompleted))
        await session.close()
        return session, first, second

    session, first, second = asyncio.run(main())
    assert [e.text for e in first if isinstance(e, obr.TextDelta)] == ["u0 "]
    assert any(isinstance(e, obr.Interrupted) for e in second)
    assert not any(isinstance(e, obr.AudioDelta) for e in second)
    assert [u[2] for u in _log()["units"][session.id]] == ["speak", "listen"]
    wait_free()


def test_sdk_queue_past_capacity_then_refusal_past_the_queue(duplex_app):
    async def main():
        c = client(duplex_app)
        a = await c.audio.connect(model="omniray")
        b = await c.audio.connect(model="omniray")
        waiting = asyncio.ensure_future(c.audio.connect(model="omniray"))
        handle = serve.get_app_handle(APP)
        for _ in range(200):  # the third waits in the queue
            queued = (await handle.stats.remote())["duplex"]["queued"]
            if queued == 1:
                break
            await asyncio.sleep(0.1)
        with pytest.raises(obr.RealtimeError) as refused:  # the queue holds one
            await c.audio.connect(model="omniray")
        assert not waiting.done()
        await a.close()
        third = await asyncio.wait_for(waiting, 30)
        events = []
        while not third._events.empty():
            events.append(third._events.get_nowait())
        await b.close()
        await third.close()
        return queued, refused.value, events

    queued, refused, events = asyncio.run(main())
    assert queued == 1
    assert refused.code == "server_busy"
    kinds = [type(e).__name__ for e in events]
    assert kinds[:3] == ["SessionQueued", "WorkerAssigned", "SessionReady"], kinds
    assert events[0].position == 1 and events[0].estimated_wait_seconds > 0
    assert wait_free()["duplex"]["refused"] >= 1


async def _raw(url: str):
    return await websockets.connect(url, max_size=None)


async def _recv_until(ws, kind: str, limit: int = 100) -> list[dict]:
    out = []
    for _ in range(limit):
        ev = json.loads(await asyncio.wait_for(ws.recv(), 30))
        out.append(ev)
        if ev["type"] == kind:
            return out
    raise AssertionError(f"no {kind} in {[e['type'] for e in out]}")


def test_vllm_omni_duplex_shape_with_raw_websockets(duplex_app):
    url = duplex_app.replace("http", "ws") + "/v1/realtime?duplex=1&model=omniray"
    pcm16 = base64.b64encode(np.zeros(FIRST + 3 * UNIT, "<i2").tobytes()).decode()

    async def main():
        ws = await _raw(url)
        created = json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "session.update", "session": {
            "instructions": "Be brief.", "omniray": {"duplex_force": None},
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}}))
        updated = json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": pcm16}))
        events = await _recv_until(ws, "response.done")
        await ws.close()
        return created, updated, events

    created, updated, events = asyncio.run(main())
    assert created["type"] == "session.created" and created["session"]["omniray"]["duplex"]
    assert updated["type"] == "session.updated"
    assert [e["type"] for e in events][0] == "response.created"
    assert events[-1]["response"]["status"] == "completed"
    assert events[-1]["response"]["output"][0]["content"][0]["transcript"] == "u2 u3 "
    wait_free()


def test_socket_drop_and_bad_events_leave_nothing(duplex_app):
    base = duplex_app.replace("http", "ws") + "/v1/realtime"

    async def drop():
        ws = await _raw(base + "?mode=audio")
        assert json.loads(await ws.recv())["type"] == "session.queue_done"
        await ws.send(json.dumps({"type": "session.init", "payload": {}}))
        assert json.loads(await ws.recv())["type"] == "session.created"
        audio = base64.b64encode(f32(FIRST + UNIT)).decode()
        await ws.send(json.dumps({"type": "input.append", "input": {"audio": audio}}))
        await ws.recv()
        ws.transport.abort()  # no close frame: the socket just goes

    async def bad():
        ws = await _raw(base + "?mode=audio")
        await ws.recv()
        await ws.send("{not json")
        err = json.loads(await ws.recv())
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                await ws.recv()
        return err, closed.value.rcvd.code

    asyncio.run(drop())
    wait_free()
    err, code = asyncio.run(bad())
    assert err["type"] == "error" and err["error"]["code"] == "invalid_json" and code == 1008
    wait_free()


def test_openai_sdk_with_extra_query_duplex(duplex_app):
    openai = pytest.importorskip("openai")
    pcm16 = base64.b64encode(np.zeros(2 * 24000 + 4800, "<i2").tobytes()).decode()

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{duplex_app}/v1", api_key="unused",
                                    max_retries=0)
        async with client.realtime.connect(model="omniray",
                                           extra_query={"duplex": "1"}) as conn:
            created = await conn.recv()
            await conn.send({"type": "session.update",
                             "session": {"omniray": {"duplex_force": "speak"}}})
            await conn.input_audio_buffer.append(audio=pcm16)  # 24 kHz: two units
            events = []
            async for ev in conn:
                events.append(ev)
                if [e.type for e in events].count("response.output_audio.delta") == 2:
                    break
            await conn.response.cancel()
            await conn.input_audio_buffer.append(audio=pcm16[:len(pcm16) // 2])
            async for ev in conn:
                events.append(ev)
                if ev.type == "response.done":
                    break
        return created, events

    created, events = asyncio.run(main())
    assert created.type == "session.created"
    kinds = [e.type for e in events]
    assert kinds.count("response.created") == 1 and kinds[-1] == "response.done"
    assert events[-1].response.status == "cancelled"
    wait_free()


def test_bench_duplex_paces_sessions_and_counts_every_unit(duplex_app):
    from bench.duplex import run

    r = asyncio.run(run(duplex_app, sessions=2, seconds=3, pattern="SL", mode="video",
                        model="omniray"))
    # units 0 and 2 forced to speak, unit 1 to listen, in both sessions
    assert (r["sessions"], r["units"], r["decided"], r["spoke"]) == (2, 6, 6, 4)
    assert r["errors"] == [] and r["decision_ms"]["p50"] is not None
    assert sum(len(u) for u in _log()["units"].values()) >= 6
    wait_free()


def test_bench_duplex_warms_up_before_it_measures(duplex_app, tmp_path):
    """`--warmup S`: one session and then the largest count run S seconds each first, kept
    apart from the measured runs in the report; `--spread` staggers the sessions' starts."""
    from bench.duplex import main

    out = tmp_path / "r.json"
    assert main(["--url", duplex_app, "--sessions", "1,2", "--seconds", "2", "--warmup", "2",
                 "--mode", "audio", "--pattern", "S", "--model", "omniray", "--spread",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["spread"] is True
    assert [r["sessions"] for r in report["warmup"]] == [1, 2]
    assert [r["sessions"] for r in report["runs"]] == [1, 2]
    assert all(r["units"] == 2 * r["sessions"] and r["errors"] == []
               for r in report["warmup"] + report["runs"])
    wait_free()


@pytest.mark.skipif(importlib.util.find_spec("deployments.stages.duplex") is None,
                    reason="the Thinker stage holds no duplex sessions in this tree")
def test_sdk_against_the_real_app_on_the_tiny_default(serve_app):
    """The app as it ships (conftest.py `serve_app`: real engines, the tiny default): the
    official SDK's session resident in the Thinker stage, forced to speak, then closed; the
    app's invariants after."""
    from test_serve import wait_free as app_free

    async def main():
        session = await client(serve_app, _force_speak_factory()).audio.connect(
            model="omniray", system_prompt="You are kind.")
        rng = np.random.default_rng(0)
        for _ in range(2):
            await session.send_audio((0.1 * rng.standard_normal(UNIT)).astype("<f4").tobytes())
        events = await events_until(
            session, lambda ev: sum(isinstance(e, obr.AudioDelta) for e in ev) == 2, 300)
        await session.close()
        return session, events

    session, events = asyncio.run(main())
    # each unit's text in pieces as the Thinker draws it, before its audio
    kinds = [type(e).__name__ for e in events if isinstance(e, (obr.TextDelta, obr.AudioDelta))]
    assert kinds[0] == "TextDelta" and kinds.count("AudioDelta") == 2
    first, second = "".join(kinds).split("AudioDelta")[:2]
    assert first.count("TextDelta") >= 2 and second.count("TextDelta") >= 1
    for e in events:
        if isinstance(e, obr.AudioDelta):
            assert len(np.frombuffer(e.audio, "<f4")) == 24000
    assert session.usage is not None and session.usage.completion_tokens > 0
    st = app_free()
    assert st["stages"]["thinker"]["duplex"]["sessions"] == 0


@pytest.mark.skipif(importlib.util.find_spec("deployments.stages.duplex") is None,
                    reason="the Thinker stage holds no duplex sessions in this tree")
def test_bench_duplex_runs_chat_turns_beside_the_sessions(serve_app):
    """`bench.duplex --chat`: chat turns answered in speech, closed-loop, beside a session
    resident in the real app's Thinker stage (the tiny default); both complete."""
    from bench.duplex import run
    from test_serve import wait_free as app_free

    r = asyncio.run(run(serve_app, sessions=1, seconds=3, pattern="SL", mode="audio",
                        model="omniray", chat=2))
    assert (r["units"], r["decided"]) == (3, 3) and r["errors"] == []
    chat = r["chat"]
    assert chat["turns"] >= 2 and chat["failed"] == 0 and chat["req_s"] > 0
    assert chat["ttfp_p50_ms"] is not None
    app_free()

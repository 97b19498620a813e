"""The official `openai` SDK's realtime client against the app on the session's Ray Serve
(tests/apps.py: real engines, tiny default), through Serve's proxy: a text turn, an audio
turn in 100 ms appends with commit, a server-VAD turn from speech-like bursts, a cancel
mid-response, a truncate, a dropped socket, and 8 sessions at once; after each, the app's
invariants hold (no window slot, stage stream or KV block left, no session left open)."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
from bench.speech import bursts, speech_like

openai = pytest.importorskip("openai")
pytest.importorskip("websockets")
pytest.importorskip("ray.serve")

from test_serve import wait_free

RATE = 24000
NO_VAD = {"type": "realtime", "output_modalities": ["audio"],
          "audio": {"input": {"turn_detection": None}}}


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


def connect(base: str):
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    return client.realtime.connect(model="omniray")


async def until_done(conn, n: int = 1, timeout: float = 120.0) -> list:
    """Events (the SDK's parsed models) until the n-th response.done."""
    events, dones = [], 0

    async def read():
        nonlocal dones
        async for ev in conn:
            events.append(ev)
            if ev.type == "response.done":
                dones += 1
                if dones == n:
                    return

    await asyncio.wait_for(read(), timeout)
    return events


def check(events: list) -> None:
    """Exactly one done per response, nothing of a response after it, one transcript
    delta per audio delta, no error events."""
    types = [e.type for e in events]
    assert "error" not in types, [e for e in events if e.type == "error"]
    done = set()
    for e in events:
        rid = getattr(e, "response_id", None) or getattr(getattr(e, "response", None), "id",
                                                         None)
        if rid is None:
            continue
        assert rid not in done, f"{e.type} after response.done"
        if e.type == "response.done":
            done.add(rid)
    assert types.count("response.output_audio.delta") == types.count(
        "response.output_audio_transcript.delta")


def finished(resp) -> bool:
    """Ran to its end: the tiny default's random weights stop at max tokens, not at EOS."""
    return resp.status == "completed" or (
        resp.status == "incomplete" and resp.status_details.reason == "max_output_tokens")


def test_text_turn_and_truncate(serve_app):
    async def main():
        async with connect(serve_app) as conn:
            created = await conn.recv()
            await conn.session.update(session=NO_VAD)
            await conn.conversation.item.create(item={
                "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "Say something."}]})
            await conn.response.create()
            events = await until_done(conn)
            done = events[-1].response
            item = done.output[0]
            await conn.conversation.item.truncate(item_id=item.id, content_index=0,
                                                  audio_end_ms=100)
            truncated = await conn.recv()
            return created, events, done, item, truncated

    created, events, done, item, truncated = asyncio.run(main())
    assert created.type == "session.created"
    check(events)
    assert finished(done) and done.usage.output_tokens > 0
    audio = b"".join(base64.b64decode(e.delta) for e in events
                     if e.type == "response.output_audio.delta")
    assert len(audio) > 2 * RATE * 0.1  # pcm16 at 24 kHz, over 100 ms of it
    assert item.role == "assistant" and item.content[0].type == "output_audio"
    assert truncated.type == "conversation.item.truncated" and truncated.audio_end_ms == 100
    wait_free()


def test_audio_turn_in_100ms_appends_with_commit(serve_app):
    speech = pcm16(speech_like(1.5, RATE, seed=3))

    async def main():
        async with connect(serve_app) as conn:
            await conn.recv()
            await conn.session.update(session=NO_VAD)
            step = RATE // 10 * 2
            for i in range(0, len(speech), step):
                await conn.input_audio_buffer.append(
                    audio=base64.b64encode(speech[i:i + step]).decode())
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            return await until_done(conn)

    events = asyncio.run(main())
    check(events)
    types = [e.type for e in events]
    assert types.index("input_audio_buffer.committed") < types.index("response.created")
    user = next(e.item for e in events if e.type == "conversation.item.added"
                and e.item.role == "user")
    assert user.content[0].type == "input_audio"
    assert finished(events[-1].response)
    wait_free()


def test_server_vad_turn_from_speech_like_bursts(serve_app):
    audio = pcm16(bursts([(0.4, False), (1.2, True), (1.0, False)], RATE, seed=1))

    async def main():
        async with connect(serve_app) as conn:
            await conn.recv()
            await conn.session.update(session={
                "type": "realtime", "audio": {"input": {"turn_detection": {
                    "type": "server_vad", "silence_duration_ms": 400}}}})
            step = RATE // 10 * 2
            for i in range(0, len(audio), step):
                await conn.input_audio_buffer.append(
                    audio=base64.b64encode(audio[i:i + step]).decode())
            return await until_done(conn)

    events = asyncio.run(main())
    check(events)
    vad = [e.type for e in events if e.type.startswith("input_audio_buffer.")]
    assert vad == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                   "input_audio_buffer.committed"]
    assert finished(events[-1].response)
    wait_free()


def test_cancel_mid_response_and_a_dropped_socket(serve_app):
    async def main():
        async with connect(serve_app) as conn:
            await conn.recv()
            await conn.session.update(session=NO_VAD)
            await conn.conversation.item.create(item={
                "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "Talk."}]})
            await conn.response.create()
            first = None
            while first is None or first.type != "response.created":
                first = await conn.recv()
            await conn.response.cancel()
            cancelled = await until_done(conn)
            # a second response, then the socket drops while it runs
            await conn.response.create()
            while (await conn.recv()).type != "response.created":
                pass
        return cancelled

    cancelled = asyncio.run(main())
    check(cancelled)
    done = cancelled[-1].response
    assert done.status == "cancelled" or finished(done)  # the tiny model may finish first
    if done.status == "cancelled":
        assert done.status_details.reason == "client_cancelled"
    st = wait_free()
    assert st["realtime"]["sessions"] == 0


def test_eight_sessions_at_once(serve_app):
    async def one(i: int):
        async with connect(serve_app) as conn:
            await conn.recv()
            await conn.session.update(session=NO_VAD)
            await conn.conversation.item.create(item={
                "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": f"Hello number {i}."}]})
            await conn.response.create()
            return await until_done(conn, timeout=240)

    async def main():
        return await asyncio.gather(*(one(i) for i in range(8)))

    for events in asyncio.run(main()):
        check(events)
        assert finished(events[-1].response)
        assert any(e.type == "response.output_audio.delta" for e in events)
    st = wait_free()
    assert st["realtime"]["sessions"] == 0


def test_wrong_model_and_unknown_event(serve_app):
    import websockets

    url = serve_app.replace("http://", "ws://") + "/v1/realtime"

    async def main():
        async with websockets.connect(f"{url}?model=nope") as ws:
            refused = json.loads(await ws.recv())
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
        async with websockets.connect(f"{url}?model=omniray") as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps({"type": "bogus.event", "event_id": "e1"}))
            unknown = json.loads(await ws.recv())
        return refused, unknown

    refused, unknown = asyncio.run(main())
    assert refused["type"] == "error" and refused["error"]["code"] == "model_not_found"
    assert unknown["error"]["code"] == "unknown_event" and unknown["error"]["event_id"] == "e1"


def test_replicas_froze_their_startup_objects(serve_app):
    """Each Serve replica moved its start-up objects out of full collections."""
    from ray import serve

    st = serve.get_app_handle("omniray").stats.remote().result(timeout_s=30)
    for name in ("thinker", "talker", "code2wav"):
        assert st["stages"][name]["gc"]["frozen"] > 10_000, st["stages"][name]["gc"]

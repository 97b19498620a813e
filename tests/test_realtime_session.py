"""The realtime session in-process, over a scripted chat turn: every server event validated
against the `openai` package's own realtime models, and the ordering rules (created ->
deltas -> exactly one done; one transcript delta per audio delta; nothing after done;
nothing from a cancelled response after its done; speech_started -> speech_stopped ->
committed), barge-in, truncation, the history a response sends, and the session's bounds."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
import wave

import numpy as np
import pytest
from bench.speech import bursts
from pydantic import TypeAdapter

from deployments.realtime.session import RealtimeSession, SessionLimits
from deployments.wire import AudioChunk, Done, Error, TextDelta, Usage

openai_rt = pytest.importorskip("openai.types.realtime")
GA = TypeAdapter(openai_rt.RealtimeServerEvent)


class Chat:
    """A scripted turn: `words` text deltas, then `chunks` audio pieces of `piece_s` each,
    `delay` apart; records each request and whether the turn was closed early."""

    def __init__(self, words: int = 3, chunks: int = 4, piece_s: float = 0.2,
                 delay: float = 0.0, error: Error | None = None):
        self.words, self.chunks, self.piece_s, self.delay = words, chunks, piece_s, delay
        self.error = error
        self.requests: list[dict] = []
        self.closed_early = 0
        self.running = 0

    async def __call__(self, request: dict):
        self.requests.append(request)
        self.running += 1
        finished = False
        try:
            for i in range(self.words):
                yield TextDelta(f"w{i} ")
                await asyncio.sleep(self.delay)
            if self.error is not None:
                finished = True
                yield self.error
                return
            if "audio" in request["modalities"]:
                for i in range(self.chunks):
                    n = int(24000 * self.piece_s)
                    yield AudioChunk(np.full(n, 0.1 * (i + 1), np.float32), i)
                    await asyncio.sleep(self.delay)
            finished = True
            yield Done(Usage(10, self.words), "stop", self.chunks * self.piece_s)
        finally:
            self.running -= 1
            if not finished:
                self.closed_early += 1


class Client:
    """A session driven in-process: `events` are the server events sent, in order."""

    def __init__(self, chat: Chat, **kw):
        self.events: list[dict] = []
        self.chat = chat

        async def send(text: str) -> None:
            ev = json.loads(text)
            GA.validate_python(ev)  # every server event is the API's own shape
            self.events.append(ev)

        self.session = RealtimeSession(chat, send, **kw)

    async def __call__(self, **event) -> None:
        await self.session.handle(json.dumps(event))

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    async def response_done(self, n: int = 1, timeout: float = 10.0) -> None:
        for _ in range(int(timeout / 0.01)):
            if self.types().count("response.done") >= n and self.session.running is None:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"no response.done: {self.types()}")


def check_response_order(events: list[dict]) -> None:
    """created -> deltas -> one done per response; one transcript delta per audio delta;
    nothing of a response after its done."""
    done: set[str] = set()
    created: set[str] = set()
    for ev in events:
        rid = ev.get("response_id") or (ev.get("response") or {}).get("id")
        if rid is None:
            continue
        assert rid not in done, f"{ev['type']} after response.done of {rid}"
        if ev["type"] == "response.created":
            created.add(rid)
        else:
            assert rid in created, f"{ev['type']} before response.created"
        if ev["type"] == "response.done":
            done.add(rid)
    for rid in created:
        mine = [e["type"] for e in events if e.get("response_id") == rid]
        assert mine.count("response.output_audio.delta") == mine.count(
            "response.output_audio_transcript.delta")
    assert created == done


def text_item(text: str) -> dict:
    return {"type": "conversation.item.create",
            "item": {"type": "message", "role": "user",
                     "content": [{"type": "input_text", "text": text}]}}


NO_VAD = {"type": "session.update", "session": {
    "type": "realtime", "audio": {"input": {"turn_detection": None}}}}


def test_a_text_turn_gives_the_apis_events_in_order():
    async def main():
        c = Client(Chat())
        await c(**NO_VAD)
        await c(**text_item("hello"))
        await c(type="response.create")
        await c.response_done()
        return c

    c = asyncio.run(main())
    t = c.types()
    assert t[:5] == ["session.updated", "conversation.item.added", "conversation.item.done",
                     "response.created", "response.output_item.added"]
    assert t[-1] == "response.done"
    check_response_order(c.events)
    deltas = [e for e in c.events if e["type"] == "response.output_audio.delta"]
    assert len(deltas) == 4
    pcm = np.frombuffer(base64.b64decode(deltas[0]["delta"]), "<i2")
    assert len(pcm) == 4800 and abs(int(pcm[0]) - round(0.1 * 32767)) <= 1
    transcript = [e["delta"] for e in c.events
                  if e["type"] == "response.output_audio_transcript.delta"]
    assert "".join(transcript) == "w0 w1 w2 "  # all text went out with the audio
    done = c.events[-1]["response"]
    assert done["status"] == "completed" and done["usage"]["output_tokens"] == 3
    assert done["output"][0]["content"][0]["transcript"] == "w0 w1 w2 "
    report = done["omniray"]  # the session's own clock, and the turn's metrics
    assert 0 <= report["first_text_s"] <= report["first_audio_s"] and "metrics" in report
    req = c.chat.requests[0]
    assert req["modalities"] == ["text", "audio"] and req["audio"]["format"] == "pcm16"
    assert req["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]


def test_history_instructions_and_text_only_responses():
    async def main():
        c = Client(Chat())
        await c(type="session.update", session={
            "type": "realtime", "instructions": "Be brief.", "output_modalities": ["text"],
            "audio": {"input": {"turn_detection": None}}, "omniray": {"return_timings": True, "fixed_speech_codes": 30}})
        await c(**text_item("one"))
        await c(type="response.create")
        await c.response_done(1)
        await c(**text_item("two"))
        await c(type="response.create", response={"max_output_tokens": 5})
        await c.response_done(2)
        return c

    c = asyncio.run(main())
    check_response_order(c.events)
    assert "response.output_audio.delta" not in c.types()
    assert c.types().count("response.output_text.delta") == 6
    second = c.chat.requests[1]
    assert second["modalities"] == ["text"] and second["max_tokens"] == 5
    assert second["omniray"] == {"return_timings": True, "fixed_speech_codes": 30}
    assert second["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "one"}]},
        {"role": "assistant", "content": "w0 w1 w2 "},
        {"role": "user", "content": [{"type": "text", "text": "two"}]}]


def test_cancel_ends_the_response_once_and_closes_the_turn():
    async def main():
        c = Client(Chat(chunks=50, delay=0.02))
        await c(**NO_VAD)
        await c(**text_item("talk"))
        await c(type="response.create")
        for _ in range(500):
            if "response.output_audio.delta" in c.types():
                break
            await asyncio.sleep(0.01)
        await c(type="response.create")  # one at a time
        await c(type="response.cancel")
        n = len(c.events)
        await asyncio.sleep(0.1)
        after = c.events[n:]
        await c(type="response.cancel")  # nothing to cancel now
        return c, after

    c, after = asyncio.run(main())
    check_response_order(c.events)
    assert after == []  # nothing after the cancelled response's done
    codes = [e["error"]["code"] for e in c.events if e["type"] == "error"]
    assert codes == ["conversation_already_has_active_response", "response_cancel_not_active"]
    done = next(e for e in c.events if e["type"] == "response.done")["response"]
    assert done["status"] == "cancelled"
    assert done["status_details"]["reason"] == "client_cancelled"
    assert c.chat.closed_early == 1 and c.chat.running == 0


def test_server_vad_commits_speech_responds_and_barges_in():
    rate = 24000
    audio = bursts([(0.5, False), (1.0, True), (1.0, False), (1.0, True), (1.0, False)],
                   rate, seed=1)
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()

    async def main():
        c = Client(Chat(chunks=200, delay=0.01))  # a long reply: still running at speech 2
        step = rate // 10 * 2  # 100 ms of pcm16
        for i in range(0, len(pcm), step):
            await c(type="input_audio_buffer.append",
                    audio=base64.b64encode(pcm[i:i + step]).decode())
            await asyncio.sleep(0.005)
        await c.response_done(2)
        return c

    c = asyncio.run(main())
    check_response_order(c.events)
    vad = [e for e in c.events if e["type"].startswith("input_audio_buffer.")]
    assert [e["type"] for e in vad] == [
        "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed"] * 2
    first = vad[0]["audio_start_ms"], vad[1]["audio_end_ms"]
    assert 0 <= first[0] <= 500 and 1400 <= first[1] <= 1700, first
    assert vad[0]["item_id"] == vad[1]["item_id"] == vad[2]["item_id"]
    dones = [e["response"] for e in c.events if e["type"] == "response.done"]
    # the second speech cut the first response (barge-in), then got its own
    assert dones[0]["status"] == "cancelled"
    assert dones[0]["status_details"]["reason"] == "turn_detected"
    assert dones[1]["status"] == "completed"
    # the committed audio went to the model as 24 kHz WAV: about the speech's second
    part = c.chat.requests[0]["messages"][-1]["content"][0]
    with wave.open(io.BytesIO(base64.b64decode(part["input_audio"]["data"]))) as w:
        assert w.getframerate() == rate and 0.9 < w.getnframes() / rate < 1.6


def test_truncate_keeps_what_was_heard():
    async def main():
        c = Client(Chat(words=4, chunks=4, piece_s=0.5))
        await c(**NO_VAD)
        await c(**text_item("hi"))
        await c(type="response.create")
        await c.response_done()
        item = next(e for e in c.events if e["type"] == "response.done")["response"]["output"][0]
        bad = [{"type": "conversation.item.truncate", "item_id": item["id"], "content_index": 0,
                "audio_end_ms": 5000},
               {"type": "conversation.item.truncate", "item_id": "nope", "content_index": 0,
                "audio_end_ms": 10}]
        for ev in bad:
            await c(**ev)
        await c(type="conversation.item.truncate", item_id=item["id"], content_index=0,
                audio_end_ms=400)
        await c(**text_item("again"))
        await c(type="response.create")
        await c.response_done(2)
        return c, item

    c, item = asyncio.run(main())
    errors = [e["error"]["code"] for e in c.events if e["type"] == "error"]
    assert errors == ["invalid_value", "item_not_found"]
    assert {"type": "conversation.item.truncated", "item_id": item["id"], "content_index": 0,
            "audio_end_ms": 400}.items() <= next(
        e for e in c.events if e["type"] == "conversation.item.truncated").items()
    # only the first audio piece (0-500 ms) was heard: its transcript is all text so far
    assistant = c.chat.requests[1]["messages"][1]
    assert assistant == {"role": "assistant", "content": "w0 w1 w2 w3 "}


def test_manual_commit_delete_and_the_sessions_bounds():
    async def main():
        c = Client(Chat(), limits=SessionLimits(max_buffer_s=1.0, max_items=3,
                                               idle_timeout_s=0.2))
        await c(**NO_VAD)
        await c(type="input_audio_buffer.commit")  # empty
        one_s = base64.b64encode(b"\0\0" * 24000).decode()
        await c(type="input_audio_buffer.append", audio=one_s)
        await c(type="input_audio_buffer.append", audio=one_s)  # past max_buffer_s
        await c(type="input_audio_buffer.commit")
        committed = [e for e in c.events if e["type"] == "input_audio_buffer.committed"]
        await c(type="conversation.item.delete", item_id=committed[0]["item_id"])
        for t in ("a", "b", "c", "d"):  # the fourth is past max_items
            await c(**text_item(t))
        await c(type="no.such.event")
        await c.session.handle("{not json")

        async def silent():
            await asyncio.sleep(10)

        await c.session.run(silent)  # idle: closed after 0.2 s
        return c

    c = asyncio.run(main())
    codes = [e["error"]["code"] for e in c.events if e["type"] == "error"]
    assert codes == ["input_audio_buffer_commit_empty", "input_audio_buffer_full",
                     "conversation_full", "unknown_event", "invalid_event", "idle_timeout"]
    assert "conversation.item.deleted" in c.types()
    assert c.session.items == [] and c.session.running is None  # closed: nothing held


def test_a_failed_turn_fails_its_response():
    async def main():
        c = Client(Chat(error=Error(400, "prompt too long", "context_length_exceeded")))
        await c(**NO_VAD)
        await c(**text_item("x"))
        await c(type="response.create")
        await c.response_done()
        return c

    c = asyncio.run(main())
    check_response_order(c.events)
    done = c.events[-1]["response"]
    assert done["status"] == "failed"
    assert done["status_details"]["error"]["code"] == "context_length_exceeded"


def test_the_socket_route_bounds_sessions_and_checks_the_model():
    from starlette.testclient import TestClient
    from test_api import light_source

    from fakes import build_local_app

    local = build_local_app({"realtime": {"max_sessions": 1}}, light_source())
    with TestClient(local.ingress.__serve_build_asgi_app__()) as client:
        page = client.get("/realtime")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        with client.websocket_connect("/v1/realtime?model=omniray",
                                      subprotocols=["realtime"]) as ws:
            assert ws.accepted_subprotocol == "realtime"
            assert ws.receive_json()["type"] == "session.created"
            assert len(local.ingress.realtime_sessions) == 1
            with client.websocket_connect("/v1/realtime") as second:  # past max_sessions
                err = second.receive_json()
                assert err["error"]["code"] == "session_limit_reached"
        with client.websocket_connect("/v1/realtime?model=other") as ws:
            assert ws.receive_json()["error"]["code"] == "model_not_found"
        # beta clients get the beta names
        with client.websocket_connect("/v1/realtime",
                                      headers={"OpenAI-Beta": "realtime=v1"}) as ws:
            assert ws.receive_json()["type"] == "session.created"
            ws.send_text(json.dumps(text_item("hi")))
            assert ws.receive_json()["type"] == "conversation.item.created"
        for _ in range(100):
            if not local.ingress.realtime_sessions:
                break
            time.sleep(0.02)
        assert local.ingress.realtime_sessions == {}


def test_a_session_that_fails_on_our_side_says_so_and_closes(monkeypatch):
    """The server VAD's model missing at the start (the host lacks silero-vad), or a fault
    while handling an event: the client gets a server_error event and a 1011 close, not a
    socket left open and silent, and the session is dropped."""
    from importlib import metadata

    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect
    from test_api import light_source

    from fakes import build_local_app
    from pipeline.processing import vad

    def no_model():
        raise metadata.PackageNotFoundError("silero-vad")

    local = build_local_app({}, light_source())
    assert local.ingress.server_vad_problem is None  # this host has the model
    with TestClient(local.ingress.__serve_build_asgi_app__()) as client:
        with monkeypatch.context() as m:
            m.setattr(vad, "_silero_session", no_model)
            # what a replica reports at its start (and in stats) on such a host
            assert vad.silero_problem().startswith("PackageNotFoundError: ")
            with client.websocket_connect("/v1/realtime") as ws:
                err = ws.receive_json()["error"]
                assert (err["type"], err["code"]) == ("server_error", "server_error")
                assert "PackageNotFoundError" in err["message"] and "silero-vad" in err[
                    "message"]
                with pytest.raises(WebSocketDisconnect) as closed:
                    ws.receive_json()
                assert closed.value.code == 1011

        async def broken(self, frame):
            raise ValueError("a bug")

        with monkeypatch.context() as m:
            m.setattr(RealtimeSession, "handle", broken)
            with client.websocket_connect("/v1/realtime") as ws:
                assert ws.receive_json()["type"] == "session.created"
                ws.send_text(json.dumps(text_item("hi")))
                err = ws.receive_json()["error"]
                assert err["type"] == "server_error" and "ValueError: a bug" in err["message"]
                with pytest.raises(WebSocketDisconnect) as closed:
                    ws.receive_json()
                assert closed.value.code == 1011
        for _ in range(100):
            if not local.ingress.realtime_sessions:
                break
            time.sleep(0.02)
        assert local.ingress.realtime_sessions == {}


def test_speech_longer_than_the_buffer_is_committed_as_it_is():
    from bench.speech import speech_like

    from deployments.realtime.listener import Listener, SpeechStarted, SpeechStopped
    from deployments.realtime.protocol import TurnDetection

    rate = 24000
    listener = Listener(rate, TurnDetection(), max_buffer_s=1.0)
    pcm = (np.clip(speech_like(2.5, rate, seed=1), -1, 1) * 32767).astype("<i2").tobytes()
    heard = []
    step = rate // 10 * 2
    for i in range(0, len(pcm), step):
        heard += listener.append(pcm[i:i + step])
    assert isinstance(heard[0], SpeechStarted)
    stops = [h for h in heard if isinstance(h, SpeechStopped)]
    assert stops and stops[0].item_id == heard[0].item_id
    assert 0.5 * rate * 2 <= len(stops[0].audio) <= 1.0 * rate * 2  # at most the buffer
    assert listener.buffer.ms <= 1000

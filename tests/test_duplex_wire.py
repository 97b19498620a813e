"""The duplex wires without Ray: the `/v1/realtime` route of a bare FastAPI app over a
stand-in server whose DuplexManager runs tests/fakes.py's FakeDuplexBackend (Starlette's
test client). The official Realtime V1 events and vLLM-Omni's `?duplex=1` shape, units
cut at the reference's sizes, forcing, queueing past capacity, refusal past the queue,
the session limits, bad events; after each, no slot, queue entry or backend session left.
The SDK and the app on Serve: test_duplex_wire_serve.py."""

from __future__ import annotations

import base64
import io
import json
import time
from types import SimpleNamespace

import numpy as np
import pytest
from fakes import FakeDuplexBackend
from fastapi import FastAPI, WebSocket
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from deployments.config import AppConfig
from deployments.duplex.manager import DuplexManager, Refused
from deployments.duplex.session import UnitAssembler

UNIT = 16000  # a unit's samples: 1 s at 16 kHz, the first one too
FIRST = UNIT


def f32(n: int, value: float = 0.01) -> str:
    return base64.b64encode(np.full(n, value, "<f4").tobytes()).decode()


def pcm16(n: int) -> str:
    return base64.b64encode(np.zeros(n, "<i2").tobytes()).decode()


def jpeg(w: int = 32, h: int = 24) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, "JPEG")
    return base64.b64encode(buf.getvalue()).decode()


def make(duplex: dict | None = None, **backend: object):
    cfg = AppConfig.model_validate({"duplex": duplex or {}})
    server = SimpleNamespace(cfg=cfg, model_names={"omniray"})
    server.duplex = DuplexManager(cfg.duplex, FakeDuplexBackend(**backend))
    app = FastAPI()

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket) -> None:
        from deployments.realtime.socket import serve_websocket

        await serve_websocket(server, ws)

    # Entered: every socket of the test runs on one event loop, as in a replica (without
    # it each socket gets a loop of its own, and one session's release could not wake a
    # session queued on another loop).
    client = TestClient(app).__enter__()
    _clients.append(client)
    return server, client


_clients: list[TestClient] = []


@pytest.fixture(autouse=True)
def _close_clients():
    yield
    while _clients:
        _clients.pop().__exit__(None, None, None)


def free(server) -> None:
    st = server.duplex.stats()
    assert st["idle"] and not st["leaks"] and st["backend"]["sessions"] == 0, st


def until(ws, kind: str, limit: int = 200) -> list[dict]:
    events = []
    for _ in range(limit):
        ev = ws.receive_json()
        events.append(ev)
        if ev["type"] == kind:
            return events
    raise AssertionError(f"no {kind} in {[e['type'] for e in events]}")


def official_start(ws, **payload) -> dict:
    assert ws.receive_json()["type"] == "session.queue_done"
    ws.send_json({"type": "session.init", "payload": payload})
    created = ws.receive_json()
    assert created["type"] == "session.created", created
    return created


# -- the unit cutter ---------------------------------------------------------------------


def test_units_are_one_second_whatever_the_chunking():
    # the demo's server hands the reference 1 s a unit, the first too (the reference pads
    # its first unit to 1035 ms itself)
    a = UnitAssembler()
    audio = np.arange(3 * UNIT + 123, dtype=np.float32)
    units = []
    for i in range(0, len(audio), 777):  # chunks that straddle every boundary
        units += a.push(audio[i:i + 777])
    assert [len(u.audio) for u in units] == [UNIT, UNIT, UNIT]
    assert np.array_equal(np.concatenate([u.audio for u in units]), audio[:3 * UNIT])
    assert a.pending_samples == 123


def test_frame_and_force_go_with_the_unit_being_filled():
    a = UnitAssembler()
    a.frame("f0")
    a.frame("f1")  # the latest frame of a unit is its frame
    a.force("listen")
    first = a.push(np.zeros(FIRST, np.float32))
    second = a.push(np.zeros(UNIT, np.float32))
    assert first[0].frames == ["f1"] and first[0].force == "listen"
    assert second[0].frames is None and second[0].force is None


# -- the official wire -------------------------------------------------------------------


def test_official_audio_session_listens_speaks_and_ends_turns():
    server, client = make()
    with client.websocket_connect("/v1/realtime?mode=audio&model=omniray",
                                  subprotocols=["map.realtime"]) as ws:
        assert ws.accepted_subprotocol == "map.realtime"
        created = official_start(ws, system_prompt="You are kind.",
                                 config={"temperature": 0.5, "tts_enabled": True},
                                 max_slice_nums=2)
        sid = created["session_id"]
        # 4 units in 100 ms appends: listen, listen, speak, speak + turn end
        audio = np.full(FIRST + 3 * UNIT, 0.01, "<f4")
        for i in range(0, len(audio), 1600):
            ws.send_json({"type": "input.append",
                          "input": {"audio": base64.b64encode(audio[i:i + 1600].tobytes())
                                    .decode()}})
        events = until(ws, "response.done")
        ws.send_json({"type": "session.close", "reason": "user_stop"})
        closed = until(ws, "session.closed")[-1]
    kinds = [e["type"] for e in events]
    assert kinds == ["response.listen", "response.listen", "response.output_text.delta",
                     "response.output_audio.delta", "response.output_text.delta",
                     "response.output_audio.delta", "response.done"]
    texts = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [(t["text"], t["end_of_turn"]) for t in texts] == [("u2 ", False), ("u3 ", True)]
    pcm = np.frombuffer(base64.b64decode(events[3]["audio"]), "<f4")
    assert len(pcm) == 24000 and abs(pcm).max() == pytest.approx(0.25, abs=1e-3)
    assert closed["reason"] == "user_stop"
    assert closed["usage"]["output_tokens"] == 2 * 1 + 2 * 3
    assert closed["usage"]["input_tokens"] == 4 * 30
    backend = server.duplex.backend
    init = backend.inits[sid]
    assert (init.system_prompt, init.max_slice_nums, init.options) == (
        "You are kind.", 2, {"temperature": 0.5})
    assert [u[0] for u in backend.units[sid]] == [FIRST, UNIT, UNIT, UNIT]
    free(server)


def test_official_text_goes_out_before_the_audio_is_made():
    """A speaking unit's text delta leaves as soon as the backend has decided; its audio
    delta when the audio is made (here 0.5 s later)."""
    server, client = make(speech_delay_s=0.5)
    with client.websocket_connect("/v1/realtime?mode=audio") as ws:
        official_start(ws, config={"duplex_force": "speak"})
        ws.send_json({"type": "input.append", "input": {"audio": f32(FIRST)}})
        text = until(ws, "response.output_text.delta")[-1]
        t_text = time.monotonic()
        audio = until(ws, "response.output_audio.delta")[-1]
        t_audio = time.monotonic()
        ws.send_json({"type": "session.close"})
        until(ws, "session.closed")
    assert text["unit"] == audio["unit"] == 0
    assert t_audio - t_text >= 0.4
    free(server)


def test_official_text_pieces_go_out_before_the_decision():
    """A backend that streams a speaking unit's text: its first piece leaves at once, as a
    text delta of its unit without the turn's end; the rest of the text goes with the
    decision (here 0.5 s later), carrying the turn's end; the pieces join into the text."""
    server, client = make(period=2, speak=1, unit_delay_s=0.5, text_pieces=True)
    with client.websocket_connect("/v1/realtime?mode=audio") as ws:
        official_start(ws)
        ws.send_json({"type": "input.append", "input": {"audio": f32(FIRST)}})
        ws.send_json({"type": "input.append", "input": {"audio": f32(UNIT)}})
        until(ws, "response.listen")
        t0 = time.monotonic()
        first = until(ws, "response.output_text.delta")[-1]
        t_first = time.monotonic()
        rest = until(ws, "response.output_text.delta")[-1]
        t_rest = time.monotonic()
        done = until(ws, "response.done")
        ws.send_json({"type": "session.close"})
        until(ws, "session.closed")
    assert (first["unit"], first["text"], first["end_of_turn"]) == (1, "u", False)
    assert (rest["unit"], rest["text"], rest["end_of_turn"]) == (1, "1 ", True)
    assert t_first - t0 < 0.3 <= t_rest - t0  # the piece did not wait for the decision
    assert not [e for e in done if e["type"] == "response.output_text.delta"]
    free(server)


def openai_speaking(ws, units: int) -> None:
    """An OpenAI-shaped session forced to speak, sent `units` units of audio at once."""
    ws.receive_json()
    ws.send_json({"type": "session.update", "session": {"omniray": {"duplex_force": "speak"}}})
    ws.receive_json()
    ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16(units * 24000 + 1200)})


def test_openai_shape_text_pieces_go_out_before_the_decision():
    """The OpenAI shape: a streamed piece opens the response and goes as a transcript delta
    at once; the rest of the unit's text follows with its decision, and the response's
    transcript is the whole text."""
    server, client = make(unit_delay_s=0.5, text_pieces=True)
    with client.websocket_connect("/v1/realtime?duplex=1") as ws:
        openai_speaking(ws, 1)
        said = until(ws, "response.output_audio_transcript.delta")
        t_first = time.monotonic()
        more = until(ws, "response.output_audio_transcript.delta")
        t_more = time.monotonic()
        ws.send_json({"type": "response.cancel"})
        until(ws, "response.done")
    assert [e["type"] for e in said][-2:] == ["response.created",
                                              "response.output_audio_transcript.delta"]
    assert said[-1]["delta"] == "u" and more[-1]["delta"] == "0 "
    assert t_more - t_first >= 0.3
    free(server)


def test_official_video_session_one_frame_per_unit_and_force_listen():
    server, client = make()
    with client.websocket_connect("/v1/realtime?mode=video") as ws:
        sid = official_start(ws)["session_id"]
        ws.send_json({"type": "input.append", "input": {"audio": f32(FIRST),
                                                        "video_frames": [jpeg()]}})
        for _ in range(3):
            ws.send_json({"type": "input.append", "input": {
                "audio": f32(UNIT), "video_frames": [jpeg(), jpeg(40, 30)],
                "force_listen": True}})
        events = until(ws, "response.listen", 1)
        for _ in range(3):
            events += until(ws, "response.listen", 1)
        ws.send_json({"type": "session.close"})
        until(ws, "session.closed")
    units = server.duplex.backend.units[sid]
    # frames: one per unit; force_listen turns the scripted speak units (2, 3) into listens
    assert units == [(FIRST, 1, None), (UNIT, 1, "listen"), (UNIT, 1, "listen"),
                     (UNIT, 1, "listen")]
    free(server)


def test_official_duplex_force_speak_from_the_config_key():
    server, client = make()
    with client.websocket_connect("/v1/realtime?mode=audio") as ws:
        official_start(ws, config={"duplex_force": "speak"})
        ws.send_json({"type": "input.append", "input": {"audio": f32(FIRST)}})
        events = until(ws, "response.output_audio.delta")
        ws.send_json({"type": "session.close"})
        until(ws, "session.closed")
    assert events[0]["type"] == "response.output_text.delta" and events[0]["text"] == "u0 "
    free(server)


@pytest.mark.parametrize("event, code", [
    ({"type": "input.append", "input": {"audio": f32(10)}}, "invalid_event"),  # before init
    ({"type": "session.init", "payload": {"config": {"temperature": "hot"}}}, "invalid_value"),
    ({"type": "session.init", "payload": {"bogus": 1}}, "unknown_parameter"),
    ({"type": "session.init", "payload": {"max_slice_nums": 0}}, "invalid_value"),
    ({"type": "session.init", "payload": {"voice": {"ref_audio_base64": "!!"}}},
     "invalid_value"),
    ({"type": "session.init", "payload": {"voice": {"ref_audio_base64": f32(16000 * 11)}}},
     "audio_too_long"),
    ({"type": "response.create"}, "unknown_event"),
    ("not json", "invalid_json"),
])
def test_official_bad_events_are_an_error_then_close(event, code):
    server, client = make()
    with client.websocket_connect("/v1/realtime?mode=audio") as ws:
        assert ws.receive_json()["type"] == "session.queue_done"
        ws.send_text(event if isinstance(event, str) else json.dumps(event))
        err = ws.receive_json()
        assert err["type"] == "error" and err["error"]["code"] == code, err
        assert ws.receive_json()["type"] == "session.closed"
        with pytest.raises(WebSocketDisconnect) as e:
            ws.receive_json()
        assert e.value.code == 1008
    free(server)


def test_official_bad_audio_and_frames_after_init():
    for bad in ({"audio": base64.b64encode(b"abc").decode()},           # not float32
                {"audio": f32(10, np.nan)},                              # NaN
                {"audio": f32(10), "video_frames": [jpeg()]}):           # frame in audio mode
        server, client = make()
        with client.websocket_connect("/v1/realtime?mode=audio") as ws:
            official_start(ws)
            ws.send_json({"type": "input.append", "input": bad})
            err = ws.receive_json()
            assert err["type"] == "error", err
            assert err["error"]["code"] in ("invalid_audio", "invalid_event")
        free(server)
    server, client = make()
    with client.websocket_connect("/v1/realtime?mode=video") as ws:
        official_start(ws)
        ws.send_json({"type": "input.append", "input": {
            "audio": f32(10), "video_frames": [base64.b64encode(b"not an image").decode()]}})
        assert ws.receive_json()["error"]["code"] == "invalid_image"
    free(server)


def test_queue_position_eta_then_admission_and_refusal_past_the_queue():
    server, client = make({"max_sessions": 1, "max_queue": 1})
    with client.websocket_connect("/v1/realtime?mode=audio") as first:
        official_start(first)
        with client.websocket_connect("/v1/realtime?mode=audio") as second:
            queued = second.receive_json()
            assert queued["type"] == "session.queued" and queued["position"] == 1
            assert queued["queue_length"] == 1 and queued["estimated_wait_s"] > 0
            with client.websocket_connect("/v1/realtime?mode=audio") as third:
                err = third.receive_json()
                assert err["type"] == "error" and err["error"]["code"] == "server_busy"
                with pytest.raises(WebSocketDisconnect) as e:
                    third.receive_json()
                assert e.value.code == 1013
            assert server.duplex.stats()["queued"] == 1
            first.send_json({"type": "session.close"})
            until(first, "session.closed")
            official_start(second)  # the freed slot goes to the queue's head
            second.send_json({"type": "session.close"})
            until(second, "session.closed")
    assert server.duplex.stats()["refused"] == 1
    free(server)


def test_a_queued_socket_that_drops_leaves_the_queue():
    server, client = make({"max_sessions": 1, "max_queue": 2})
    with client.websocket_connect("/v1/realtime?mode=audio") as first:
        official_start(first)
        with client.websocket_connect("/v1/realtime?mode=audio") as second:
            assert second.receive_json()["type"] == "session.queued"
        with client.websocket_connect("/v1/realtime?mode=audio") as third:
            queued = third.receive_json()
            # the dropped one left: this one is first in line
            assert queued["type"] == "session.queued" and queued["position"] == 1
            first.send_json({"type": "session.close"})
            official_start(third)
    free(server)


def test_socket_drop_mid_session_frees_the_backend_session():
    server, client = make(unit_delay_s=0.05)
    with client.websocket_connect("/v1/realtime?mode=audio") as ws:
        sid = official_start(ws)["session_id"]
        ws.send_json({"type": "input.append", "input": {"audio": f32(FIRST + 2 * UNIT)}})
        ws.receive_json()
    free(server)
    assert server.duplex.backend.closed == 1 and sid in server.duplex.backend.units


def test_backend_failure_is_an_error_event_and_close_1011():
    server, client = make(fail_at=1)
    with client.websocket_connect("/v1/realtime?mode=audio") as ws:
        official_start(ws)
        ws.send_json({"type": "input.append", "input": {"audio": f32(FIRST + UNIT)}})
        events = until(ws, "error")
        assert events[-1]["error"]["code"] == "server_error"
        assert ws.receive_json()["type"] == "session.closed"
        with pytest.raises(WebSocketDisconnect) as e:
            ws.receive_json()
        assert e.value.code == 1011
    free(server)


def test_limits_idle_input_ahead_of_real_time_and_duration():
    server, client = make({"idle_timeout_s": 0.3})
    with client.websocket_connect("/v1/realtime?mode=audio") as ws:
        official_start(ws)
        closed = until(ws, "session.closed")[-1]
        assert closed["reason"] == "idle_timeout"
    free(server)
    server, client = make({"max_ahead_s": 2.0})
    with client.websocket_connect("/v1/realtime?mode=audio") as ws:
        official_start(ws)
        ws.send_json({"type": "input.append", "input": {"audio": f32(16000 * 3)}})
        err = until(ws, "error")[-1]
        assert err["error"]["code"] == "input_too_fast"
    free(server)
    server, client = make({"max_session_s": 0.3})
    with client.websocket_connect("/v1/realtime?mode=audio") as ws:
        official_start(ws)
        assert until(ws, "session.closed")[-1]["reason"] == "max_duration"
    free(server)


def test_outbound_bytes_bound_ends_a_session_whose_client_does_not_read():
    server, client = make({"max_outbound_bytes": 64 * 1024})
    with client.websocket_connect("/v1/realtime?mode=audio") as ws:
        official_start(ws, config={"duplex_force": "speak"})
        ws.send_json({"type": "input.append", "input": {"audio": f32(FIRST + 2 * UNIT)}})
        # each speak unit is ~128 KB of base64 float32: past the bound at once
        events = until(ws, "error")
        assert events[-1]["error"]["code"] == "client_too_slow"
    free(server)


def test_wrong_model_and_mode_are_refused():
    server, client = make()
    for url, code in (("/v1/realtime?mode=audio&model=other", "model_not_found"),
                      ("/v1/realtime?mode=radio", "invalid_mode")):
        with client.websocket_connect(url) as ws:
            err = ws.receive_json()
            assert err["error"]["code"] == code
            with pytest.raises(WebSocketDisconnect) as e:
                ws.receive_json()
            assert e.value.code == 1008
    free(server)


# -- vLLM-Omni's ?duplex=1 ---------------------------------------------------------------


def test_openai_shape_responses_follow_the_models_decisions():
    server, client = make()
    with client.websocket_connect("/v1/realtime?duplex=1&model=omniray",
                                  subprotocols=["realtime"]) as ws:
        created = ws.receive_json()
        assert created["type"] == "session.created"
        assert created["session"]["omniray"] == {"duplex": True, "duplex_force": None}
        ws.send_json({"type": "session.update", "session": {
            "instructions": "Be brief.",
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}})
        assert ws.receive_json()["type"] == "session.updated"
        # 8 units of 16 kHz pcm16: listen listen speak speak(end) listen listen speak speak(end)
        ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16(FIRST + 7 * UNIT)})
        ws.send_json({"type": "input_audio_buffer.commit"})  # accepted, no effect
        events = until(ws, "response.done") + until(ws, "response.done")
    kinds = [e["type"] for e in events]
    assert kinds.count("response.created") == 2 and kinds.count("response.done") == 2
    done = [e for e in events if e["type"] == "response.done"]
    assert all(d["response"]["status"] == "completed" for d in done)
    assert done[0]["response"]["output"][0]["content"][0]["transcript"] == "u2 u3 "
    audio = [e for e in events if e["type"] == "response.output_audio.delta"]
    assert len(audio) == 4 and len(base64.b64decode(audio[0]["delta"])) == 2 * 24000
    sid = created["session"]["id"]
    assert server.duplex.backend.inits[sid].system_prompt == "Be brief."
    free(server)


def test_openai_shape_force_listen_cancels_the_response_and_errors_go_on():
    server, client = make()
    with client.websocket_connect("/v1/realtime?duplex=1") as ws:
        ws.receive_json()
        ws.send_json({"type": "session.update", "session": {"omniray": {"duplex_force": "speak"}}})
        assert ws.receive_json()["session"]["omniray"]["duplex_force"] == "speak"
        ws.send_json({"type": "conversation.item.create", "item": {}})
        err = ws.receive_json()
        assert err["type"] == "error" and err["error"]["code"] == "unsupported_event"
        ws.send_json({"type": "session.update",
                      "session": {"turn_detection": {"type": "server_vad"}}})
        assert ws.receive_json()["error"]["code"] == "unsupported_value"
        # 24 kHz input (the default): 2 units (and room for the resampler's delay), both
        # forced to speak
        ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16(2 * 24000 + 1200)})
        events = until(ws, "response.output_audio.delta")
        events += until(ws, "response.output_audio.delta")
        ws.send_json({"type": "session.update", "session": {"instructions": "late"}})
        assert until(ws, "error")[-1]["error"]["code"] == "session_started"
        ws.send_json({"type": "response.cancel"})
        # a third unit (with room for the resampler's delay): listens, as cancelled
        ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16(24000 + 4800)})
        done = until(ws, "response.done")[-1]
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"]["reason"] == "client_cancelled"
    assert [e["type"] for e in events].count("response.created") == 1
    free(server)


def test_openai_shape_cancel_ends_the_response_at_once_and_drops_speech_in_flight():
    """response.cancel while units are with the model: response.done (cancelled,
    client_cancelled) comes at once, and nothing of the cancelled response follows, though
    the model speaks the units already in flight."""
    import time

    server, client = make(unit_delay_s=0.3)
    units = server.duplex.backend.units
    with client.websocket_connect("/v1/realtime?duplex=1") as ws:
        openai_speaking(ws, 3)
        until(ws, "response.output_audio.delta")  # the first unit spoke; two more in flight
        ws.send_json({"type": "response.cancel"})
        done = until(ws, "response.done")[-1]
        ws.send_json({"type": "session.update", "session": {"omniray": {"duplex_force": None}}})
        late = until(ws, "session.updated")
        # the unit being filled listens (the cancel forced it); then the in-flight ones land
        ws.send_json({"type": "input_audio_buffer.append", "audio": pcm16(24000 + 4800)})
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and sum(len(u) for u in units.values()) < 4:
            time.sleep(0.05)
        time.sleep(0.5)
        ws.send_json({"type": "session.update", "session": {"instructions": "x"}})
        late += until(ws, "error")
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"]["reason"] == "client_cancelled"
    assert not [e["type"] for e in late if e["type"].startswith("response.")], late
    forced = [force for u in units.values() for _, _, force in u]
    assert forced == ["speak", "speak", "speak", "listen"], forced
    free(server)


def test_openai_shape_cancel_between_a_units_text_and_its_audio_drops_the_audio():
    """The transcript of a unit goes out when the model has decided; a response.cancel that
    comes before its audio is made ends the response, and the audio never follows."""
    server, client = make(speech_delay_s=0.5)
    with client.websocket_connect("/v1/realtime?duplex=1") as ws:
        openai_speaking(ws, 1)
        said = until(ws, "response.output_audio_transcript.delta")
        ws.send_json({"type": "response.cancel"})
        done = until(ws, "response.done")
        time.sleep(0.8)  # the unit's audio is made meanwhile
        ws.send_json({"type": "session.update", "session": {"instructions": "x"}})
        late = until(ws, "error")
    assert [e["type"] for e in said][-2:] == ["response.created",
                                              "response.output_audio_transcript.delta"]
    assert [e["type"] for e in done] == ["response.output_audio.done",
                                         "response.output_audio_transcript.done",
                                         "response.done"]
    assert done[-1]["response"]["status_details"]["reason"] == "client_cancelled"
    assert not [e for e in late if e["type"].startswith("response.")], late
    free(server)


def test_a_session_the_model_falls_behind_on_ends():
    import time

    server, client = make({"max_ahead_s": 2.5}, unit_delay_s=5.0)
    with client.websocket_connect("/v1/realtime?mode=audio") as ws:
        official_start(ws)
        ws.send_json({"type": "input.append", "input": {"audio": f32(FIRST + UNIT)}})
        time.sleep(1.6)  # within real time + 2.5 s, but units 1..3 wait behind unit 0
        ws.send_json({"type": "input.append", "input": {"audio": f32(2 * UNIT)}})
        err = until(ws, "error")[-1]
        assert err["error"]["code"] == "server_behind"
    free(server)


class StageStandIn:
    """The Thinker stage's duplex methods (deployments/stages/duplex.py) over
    pipeline.duplex directly: a session of its own weights each (the tiny default)."""

    def __init__(self):
        self.sessions: dict = {}
        self.speeches: dict = {}

    async def duplex_holds(self):
        return {"sessions": 8}

    async def duplex_open(self, sid, init):
        from pipeline.duplex.config import DuplexConfig
        from pipeline.duplex.session import DuplexSession
        from pipeline.duplex.speech import DuplexSpeech
        from pipeline.duplex.thinker import DuplexThinker

        opts = dict(init.options)
        seed = opts.pop("seed", 0)
        cfg = DuplexConfig(**opts)
        session = DuplexSession(DuplexThinker.from_checkpoint(None, cfg, seed=seed),
                                DuplexSpeech.from_checkpoint(None, cfg, seed=seed))
        session.prepare(prefix=init.system_prompt, ref_audio=init.ref_audio,
                        prompt_wav=init.prompt_wav)
        self.sessions[sid] = (session, init.max_slice_nums)

    async def duplex_unit(self, sid, audio, frames, force):
        session, slices = self.sessions[sid]
        r = session.unit(audio, frames, force, slices)
        self.speeches[sid] = {"codes": r.codes, "pcm": r.pcm}
        yield {"decision": {"is_listen": r.is_listen, "end_of_turn": r.end_of_turn,
                            "text": r.text, "token_ids": r.token_ids,
                            "prefill_tokens": len(r.prefill)}}

    async def duplex_speech(self, sid):
        return self.speeches.pop(sid)

    async def duplex_close(self, sid):
        self.sessions.pop(sid)[0].close()
        return True


def _group(stage) -> SimpleNamespace:
    from fakes import LocalHandle

    return SimpleNamespace(stages=SimpleNamespace(via=lambda name, nbytes=0: LocalHandle(stage)),
                           asleep=False)


def test_the_stage_backend_spreads_sessions_over_groups_and_routes_their_calls():
    import asyncio

    from deployments.duplex.backend import DuplexInit, StageBackend

    class Stage:
        def __init__(self):
            self.calls = []

        async def duplex_open(self, sid, init):
            if init.options.get("top_k") == -1:
                raise ValueError("top_k must be positive")
            self.calls.append(("open", sid))

        async def duplex_unit(self, sid, audio, frames, force):
            self.calls.append(("unit", sid, len(audio), len(frames or ()), force))
            yield {"decision": {"is_listen": True, "end_of_turn": False, "text": "",
                                "token_ids": [1], "prefill_tokens": 12}}

        async def duplex_close(self, sid):
            self.calls.append(("close", sid))
            return True

    a, b = Stage(), Stage()

    async def main():
        backend = StageBackend([_group(a), _group(b)])
        for sid in ("s1", "s2", "s3"):
            await backend.open(sid, DuplexInit())
        r = await backend.unit("s2", np.zeros(UNIT, np.float32), None, "listen")
        held = backend.stats()["sessions"]
        with pytest.raises(ValueError):
            await backend.open("bad", DuplexInit(options={"top_k": -1}))
        for sid in ("s1", "s2", "s3"):
            await backend.close(sid)
        return r, held, backend.stats()["sessions"]

    r, held, after = asyncio.run(main())
    assert a.calls == [("open", "s1"), ("open", "s3"), ("close", "s1"), ("close", "s3")]
    assert b.calls == [("open", "s2"), ("unit", "s2", UNIT, 0, "listen"), ("close", "s2")]
    assert (r.is_listen, r.token_ids, r.prefill_tokens) == (True, [1], 12)
    assert (held, after) == (3, 0)


def test_sessions_run_at_most_what_the_thinkers_hold_and_the_rest_queue():
    """max_sessions is 4, but the two groups' Thinkers hold 3 and 2 sessions beside their
    chat turns, shared by 2 ingress replicas: this replica runs 1 + 1; a third waits; each
    group gets one; a group whose pool holds none refuses duplex."""
    import asyncio

    from deployments.duplex.backend import DuplexInit, StageBackend

    class Stage:
        def __init__(self, held):
            self.held, self.open = held, set()

        async def duplex_holds(self):
            return {"sessions": self.held}

        async def duplex_open(self, sid, init):
            self.open.add(sid)

        async def duplex_close(self, sid):
            self.open.discard(sid)
            return True

    a, b = Stage(3), Stage(2)
    cfg = AppConfig.model_validate({"duplex": {"max_sessions": 4, "max_queue": 2}})
    manager = DuplexManager(cfg.duplex, StageBackend([_group(a), _group(b)], share=2))
    moves = []

    async def notify(pos, eta, n):
        moves.append(pos)

    async def main():
        async with manager.slot("s1", notify), manager.slot("s2", notify):
            for sid in ("s1", "s2"):
                await manager.open(sid, DuplexInit())
            assert (a.open, b.open) == ({"s1"}, {"s2"})
            assert manager.stats()["limit"] == 2
            third = asyncio.create_task(manager._acquire("s3", notify))
            await asyncio.sleep(0.05)
            assert not third.done() and moves == [1]
            for sid in ("s1", "s2"):
                await manager.close(sid)
        await third  # a slot came free
        manager._release("s3")
        return manager.stats()

    st = asyncio.run(main())
    assert st["active"] == 0 and not st["leaks"] and st["backend"]["holds"] == 2

    none = DuplexManager(cfg.duplex, StageBackend([_group(Stage(0))]))
    with pytest.raises(Refused) as e:
        asyncio.run(none._acquire("x", notify))
    assert e.value.code == "duplex_unavailable"


def test_a_refused_option_is_an_error_event():
    from deployments.duplex.backend import StageBackend

    class Stage:
        async def duplex_holds(self):
            return {"sessions": 4}

        async def duplex_open(self, sid, init):
            raise ValueError("listen_top_k must be positive")

    server, client = make()
    server.duplex = DuplexManager(server.cfg.duplex, StageBackend([_group(Stage())]))
    with client.websocket_connect("/v1/realtime?mode=audio") as ws:
        assert ws.receive_json()["type"] == "session.queue_done"
        ws.send_json({"type": "session.init", "payload": {}})
        err = ws.receive_json()
        assert err["error"]["code"] == "invalid_value"
        assert "listen_top_k must be positive" in err["error"]["message"]
    free(server)


def test_the_official_wire_over_the_real_duplex_session_on_the_tiny_default():
    """The app's backend (StageBackend) over a stand-in of the Thinker stage's duplex
    methods running pipeline.duplex on the embedded default, behind the official wire:
    forced speak units come back as text and 1 s of 24 kHz audio each, seeded sessions
    say the same, and closing frees the session."""
    pytest.importorskip("pipeline.duplex.speech")
    from deployments.duplex.backend import StageBackend

    def session(seed: int) -> tuple[list, dict]:
        server, client = make()
        server.duplex = DuplexManager(server.cfg.duplex, StageBackend([_group(StageStandIn())]))
        rng = np.random.default_rng(0)
        with client.websocket_connect("/v1/realtime?mode=audio") as ws:
            official_start(ws, system_prompt="You are kind.",
                           config={"duplex_force": "speak", "seed": seed})
            for _ in range(2):
                audio = (0.1 * rng.standard_normal(UNIT)).astype("<f4")
                ws.send_json({"type": "input.append",
                              "input": {"audio": base64.b64encode(audio.tobytes()).decode()}})
            events = until(ws, "response.output_audio.delta")
            events += until(ws, "response.output_audio.delta")
            ws.send_json({"type": "session.close"})
            closed = until(ws, "session.closed")[-1]
        free(server)
        return events, closed["usage"]

    events, usage = session(seed=3)
    texts = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [t["unit"] for t in texts] == [0, 1] and all(t["text"] for t in texts)
    for e in events:
        if e["type"] == "response.output_audio.delta":
            assert len(base64.b64decode(e["audio"])) == 4 * 24000
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["output_tokens_details"]["audio_tokens"] > 0
    again, _ = session(seed=3)
    assert [e.get("text") for e in again] == [e.get("text") for e in events]

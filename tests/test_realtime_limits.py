"""The realtime session's bounds under abuse, in-process: the outbound buffer (audio deltas
merged for a reader that fell behind, then the session stopped), deleting or truncating the
item a response is writing, server VAD off the event loop, the replica's history budget,
sessions per client, the shorter idle timeout before any audio, and the brief echo of a
client's own large items."""

from __future__ import annotations

import asyncio
import base64
import json
import threading

import numpy as np
import pytest
from test_realtime_session import NO_VAD, Chat, Client, check_response_order, text_item

from deployments.realtime import outbound, session as rt_session
from deployments.realtime.session import HistoryBudget, RealtimeSession, SessionLimits


class Gate:
    """A socket write that takes `free` frames (the socket's buffer), then waits until the
    test opens the gate; records what went out."""

    def __init__(self, free: int = 0) -> None:
        self.open = asyncio.Event()
        self.free = free
        self.events: list[dict] = []

    async def __call__(self, text: str) -> None:
        if self.free > 0:
            self.free -= 1
        else:
            await self.open.wait()
        self.events.append(json.loads(text))

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]


async def wait_for(cond, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_a_reader_that_fell_behind_gets_its_audio_merged(monkeypatch):
    monkeypatch.setattr(outbound, "COALESCE_BYTES", 30_000)
    chat = Chat(words=2, chunks=40, piece_s=0.1)

    async def main():
        gate = Gate()
        s = RealtimeSession(chat, gate)
        await s.send(json.loads(json.dumps(NO_VAD)))  # something queued before the response
        s.items.append(rt_session.p.Item("item_u", "user",
                                         (rt_session.p.ContentPart("input_text", text="hi"),)))
        s._start(s.cfg, None)
        await wait_for(lambda: s.running is None)  # the whole response queued, none written
        assert s.outbox.coalesced > 0 and s.outbox.bytes > 0
        gate.open.set()
        await s.outbox.flush()
        await s.close()
        return gate, s

    gate, s = asyncio.run(main())
    rid = next(e for e in gate.events if e["type"] == "response.created")["response"]["id"]
    mine = [e for e in gate.events if e.get("response_id") == rid]
    audio = [e for e in mine if e["type"] == "response.output_audio.delta"]
    transcript = [e["delta"] for e in mine
                  if e["type"] == "response.output_audio_transcript.delta"]
    assert 1 < len(audio) < 40 and len(transcript) == len(audio)  # merged, in pairs
    pcm = np.concatenate([np.frombuffer(base64.b64decode(e["delta"]), "<i2") for e in audio])
    assert len(pcm) == 40 * 2400  # every sample, once, in order
    steps = np.minimum(np.repeat(np.arange(1, 41) * 0.1, 2400), 1.0)  # clipped to full scale
    assert np.abs(pcm - np.round(steps * 32767)).max() <= 1
    assert "".join(transcript) == "w0 w1 "
    assert gate.types()[-1] == "response.done"
    check_response_order(gate.events)
    assert s.outbox.bytes == 0


def test_a_reader_that_stops_reading_is_stopped_and_everything_freed(monkeypatch):
    monkeypatch.setattr(outbound, "MAX_BYTES", 200_000)
    chat = Chat(words=2, chunks=400, piece_s=0.1, delay=0.001)

    async def main():
        gate = Gate(free=4)  # then never opened: the client reads nothing more
        s = RealtimeSession(chat, gate)
        frames: asyncio.Queue = asyncio.Queue()
        for ev in (NO_VAD, text_item("talk"), {"type": "response.create"}):
            frames.put_nowait(json.dumps(ev))
        run = asyncio.ensure_future(s.run(frames.get))
        await asyncio.wait_for(run, 10)  # ends on its own: the outbox stopped
        return s

    s = asyncio.run(main())
    assert s.outbox.slow and s.outbox.stopped.startswith("slow reader")
    assert s.outbox.bytes == 0 and s.outbox.stats()["frames"] == 0
    assert s.running is None and s.items == [] and s.transcripts == {}
    assert chat.closed_early == 1 and chat.running == 0  # the turn was closed


def test_a_write_that_never_completes_stops_the_session(monkeypatch):
    monkeypatch.setattr(outbound, "WRITE_TIMEOUT_S", 0.05)

    async def main():
        gate = Gate()
        s = RealtimeSession(Chat(), gate)
        frames: asyncio.Queue = asyncio.Queue()
        frames.put_nowait(json.dumps(text_item("hi")))
        await asyncio.wait_for(s.run(frames.get), 10)
        return s

    s = asyncio.run(main())
    assert s.outbox.slow and "waited over" in s.outbox.stopped


@pytest.mark.parametrize("action", ["delete", "truncate"])
def test_deleting_or_truncating_the_item_being_written_cancels_its_response(action):
    async def main():
        c = Client(Chat(chunks=200, delay=0.01))
        await c(**NO_VAD)
        await c(**text_item("talk"))
        await c(type="response.create")
        await wait_for(lambda: "response.output_audio.delta" in c.types())
        item = next(e for e in c.events if e["type"] == "response.output_item.added")["item"]
        if action == "delete":
            await c(type="conversation.item.delete", item_id=item["id"])
        else:
            await c(type="conversation.item.truncate", item_id=item["id"], content_index=0,
                    audio_end_ms=0)
        n = len(c.events)
        await asyncio.sleep(0.1)
        return c, item, c.events[n:]

    c, item, after = asyncio.run(main())
    check_response_order(c.events)
    assert after == []
    t = c.types()
    assert t.count("response.done") == 1
    done = next(e for e in c.events if e["type"] == "response.done")["response"]
    assert done["status"] == "cancelled"
    assert done["status_details"]["reason"] == "client_cancelled"
    assert c.chat.closed_early == 1 and c.chat.running == 0
    last = "conversation.item.deleted" if action == "delete" else "conversation.item.truncated"
    assert t.index("response.done") < t.index(last) == len(t) - 1
    assert "error" not in t
    ids = [it.id for it in c.session.items]
    assert (item["id"] in ids) == (action == "truncate")


def test_server_vad_resampling_and_the_turns_audio_run_off_the_event_loop(monkeypatch):
    from deployments.realtime.listener import Listener

    threads: dict[str, list[int]] = {"append": [], "request": []}
    append, request = Listener.append, RealtimeSession.request

    def spy_append(self, pcm):
        threads["append"].append(threading.get_ident())
        return append(self, pcm)

    def spy_request(self, cfg, items=None):
        threads["request"].append(threading.get_ident())
        return request(self, cfg, items)

    monkeypatch.setattr(Listener, "append", spy_append)
    monkeypatch.setattr(RealtimeSession, "request", spy_request)

    async def main():
        c = Client(Chat())  # server VAD on: the default
        loop_thread = threading.get_ident()
        noise = (np.random.default_rng(0).standard_normal(24000) * 3000).astype("<i2")
        await c(type="input_audio_buffer.append", audio=base64.b64encode(noise).decode())
        await c(**NO_VAD)
        await c(type="input_audio_buffer.commit")
        await c(type="response.create")
        await c.response_done()
        await c.session.close()
        return c, loop_thread

    c, loop_thread = asyncio.run(main())
    assert threads["append"] and threads["request"]
    assert loop_thread not in threads["append"] + threads["request"]
    # the committed second of noise went to the turn as its audio
    part = c.chat.requests[0]["messages"][-1]["content"][0]
    assert part["type"] == "input_audio" and len(base64.b64decode(
        part["input_audio"]["data"])) == 44 + 48000


def test_the_replicas_history_budget_refuses_items_past_it():
    async def main():
        sessions: dict = {}
        budget = HistoryBudget(3000, sessions)
        a, b = Client(Chat(), history=budget), Client(Chat(), history=budget)
        sessions.update({"a": a.session, "b": b.session})
        await a(**text_item("x" * 2000))
        await b(**text_item("y" * 2000))  # past the budget: the replica holds a's
        used = budget.used()
        added = next(e for e in a.events if e["type"] == "conversation.item.added")
        await a(type="conversation.item.delete", item_id=added["item"]["id"])
        await b(**text_item("y" * 2000))  # room again
        return a, b, used, budget

    a, b, used, budget = asyncio.run(main())
    assert used == 2000
    codes = [e["error"]["code"] for e in b.events if e["type"] == "error"]
    assert codes == ["history_budget_exceeded"]
    assert b.types().count("conversation.item.added") == 1 and budget.used() == 2000


def test_a_clients_own_large_text_is_not_echoed_back():
    async def main():
        c = Client(Chat())
        await c(**text_item("short"))
        await c(**text_item("z" * (64 << 10)))
        return c

    c = asyncio.run(main())
    echoed = [e["item"]["content"][0]["text"] for e in c.events
              if e["type"] in ("conversation.item.added", "conversation.item.done")]
    assert echoed == ["short", "short", None, None]
    assert c.session.items[1].content[0].text == "z" * (64 << 10)  # kept, only not echoed
    assert len(c.session.messages(c.session.cfg)[1]["content"][0]["text"]) == 64 << 10


def test_a_session_without_audio_idles_out_sooner(monkeypatch):
    monkeypatch.setattr(rt_session, "NO_AUDIO_IDLE_TIMEOUT_S", 0.1)

    async def silent():
        await asyncio.sleep(30)

    async def main():
        c = Client(Chat(), limits=SessionLimits(idle_timeout_s=20))
        await asyncio.wait_for(c.session.run(silent), 5)  # closed after 0.1 s, not 20
        d = Client(Chat(), limits=SessionLimits(idle_timeout_s=20))
        await d(**NO_VAD)
        await d(type="input_audio_buffer.append", audio=base64.b64encode(b"\0\0" * 240).decode())
        return c, d

    c, d = asyncio.run(main())
    err = c.events[-1]["error"]
    assert err["code"] == "idle_timeout" and "0.1 s" in err["message"]
    assert d.session.idle_timeout_s == 20  # audio came: the configured timeout


def test_the_socket_route_bounds_sessions_per_client_and_by_history(monkeypatch):
    import time

    from starlette.testclient import TestClient
    from test_api import light_source

    from deployments.realtime import socket
    from fakes import build_local_app

    assert [socket.client_limit(n) for n in (1, 2, 3, 16)] == [1, 1, 2, 8]
    local = build_local_app({"realtime": {"max_sessions": 4}}, light_source())
    with TestClient(local.ingress.__serve_build_asgi_app__()) as client:
        with client.websocket_connect("/v1/realtime") as one, \
                client.websocket_connect("/v1/realtime") as two:
            assert one.receive_json()["type"] == two.receive_json()["type"] == "session.created"
            with client.websocket_connect("/v1/realtime") as third:  # this client's half
                err = third.receive_json()["error"]
                assert err["code"] == "session_limit_reached" and "this client" in err["message"]
        monkeypatch.setattr(socket, "HISTORY_BUDGET_BYTES", 1000)
        with client.websocket_connect("/v1/realtime") as ws:
            assert ws.receive_json()["type"] == "session.created"
            ws.send_text(json.dumps(NO_VAD))
            assert ws.receive_json()["type"] == "session.updated"
            ws.send_text(json.dumps(text_item("q" * 1000)))
            assert ws.receive_json()["type"] == "conversation.item.added"
            with client.websocket_connect("/v1/realtime") as late:  # the budget is spent
                err = late.receive_json()["error"]
                assert err["code"] == "session_limit_reached" and "history" in err["message"]
        for _ in range(100):
            if not local.ingress.realtime_sessions:
                break
            time.sleep(0.02)
        assert local.ingress.realtime_sessions == {}


def test_the_ingress_stats_add_up_the_sessions_history_and_waiting_output():
    from types import SimpleNamespace

    from test_api import light_source

    from fakes import build_local_app

    local = build_local_app({}, light_source())
    sessions = local.ingress.realtime_sessions
    sessions["a"] = SimpleNamespace(history_bytes=1200, outbox=SimpleNamespace(bytes=300))
    sessions["b"] = SimpleNamespace(history_bytes=34, outbox=SimpleNamespace(bytes=0))
    rt = asyncio.run(local.ingress.stats())["realtime"]
    assert (rt["sessions"], rt["history_bytes"], rt["outbound_bytes"]) == (2, 1234, 300)

"""The /realtime page's duplex modes (deployments/realtime/page.html) in headless Chromium with
fake media devices (a beeping mic, a test-pattern camera), speaking the official MiniCPM-o
Realtime V1 wire (`/v1/realtime?mode=audio|video`) to the ingress served by uvicorn in this
process, its duplex sessions on tests/fakes.py's scripted FakeDuplexBackend
(tests/duplex_app.py's FakeDuplexIngress; the stages are fake engines duplex never touches).

The page's `?duplex_force=speak` makes every unit speak (1 s of a 440 Hz tone, "u<i> "): the
page sends a unit of 16 kHz float32 mic a second (and a camera frame in video mode), plays the
replies without a gap, interrupts with force_listen, waits in the queue showing its place, shows
a refusal, and closes with session.close; after each, no slot, queue place or backend session
is left.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import numpy as np
import pytest
from _browser import Browser, Page, find_chromium
from test_api import light_source
from test_realtime_page import SILENT, render_worklet_script, serve_asgi
from websockets.sync.client import connect as ws_connect

from fakes import (
    FakeCode2WavEngine,
    FakeTalkerEngine,
    FakeThinkerEngine,
    LocalHandle,
)

# One slot and one queue place: a second session waits, a third is refused.
APP_CFG = {"capacity": 2, "duplex": {"max_sessions": 1, "max_queue": 1}}
UNIT = 16000  # samples of a unit: 1 s at 16 kHz


@pytest.fixture(scope="module")
def ingress():
    from deployments.stages.code2wav import Code2WavServer
    from deployments.stages.talker import TalkerServer
    from deployments.stages.thinker import ThinkerServer
    from duplex_app import FakeDuplexIngress

    source = light_source()
    c2w = Code2WavServer(APP_CFG, engine_cls=FakeCode2WavEngine, source=source)
    talker = TalkerServer(APP_CFG, LocalHandle(c2w), engine_cls=FakeTalkerEngine, source=source)
    thinker = ThinkerServer(APP_CFG, LocalHandle(talker), engine_cls=FakeThinkerEngine,
                            source=source)
    return FakeDuplexIngress(APP_CFG, LocalHandle(thinker), LocalHandle(talker),
                             LocalHandle(c2w), source=source)


class _OnItsLoop:
    """The ingress's ASGI app, noting the loop it runs on: the stages' stats are awaited
    there (their engines' tasks live on that loop)."""

    def __init__(self, app) -> None:
        self.app, self.loop = app, None

    async def __call__(self, scope, receive, send) -> None:
        self.loop = asyncio.get_running_loop()
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def served(ingress) -> Iterator[tuple[str, _OnItsLoop]]:
    app = _OnItsLoop(ingress.__serve_build_asgi_app__())
    with serve_asgi(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def server(served) -> str:
    return served[0]


@pytest.fixture(scope="module")
def stats(ingress, served):
    def get() -> dict:
        return asyncio.run_coroutine_threadsafe(ingress.stats(), served[1].loop).result(30)

    return get


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    binary = find_chromium()
    if binary is None:
        pytest.skip("no chromium binary (apt-get install -y chromium, or set OMNIRAY_CHROMIUM)")
    flags = [
        "--use-fake-ui-for-media-stream",  # grant mic and camera without a prompt
        "--use-fake-device-for-media-stream",
        "--autoplay-policy=no-user-gesture-required",
    ]
    with Browser(binary, flags) as b:
        yield b


def open_page(browser: Browser, url: str, mode: str) -> Page:
    p = browser.new_page(url)
    p.wait_for(f"window.omniray?.mode === '{mode}'", timeout_s=10)
    return p


def close_page(p: Page, errors: list[str] | None = None) -> None:
    """Whatever the page threw or logged is a bug; its error list is what the test expects."""
    state = p.evaluate("window.omniray")
    assert p.exceptions == [], p.exceptions
    assert p.console_errors == [], p.console_errors
    assert state["errors"] == (errors or []), state["errors"]
    p.close()


def _click(page: Page, element_id: str) -> None:
    page.evaluate(f"document.getElementById('{element_id}').click()", user_gesture=True)


def _duplex(page: Page) -> dict:
    return page.evaluate("window.omniray.duplex")


def wait_free(stats, timeout: float = 10.0) -> dict:
    """The app's invariants once the page's sessions are gone: idle (no slot held, nobody
    queued, no turn in flight), no backend session open, no leak."""
    deadline = time.time() + timeout
    while True:
        st = stats()
        d = st["duplex"]
        free = st["idle"] and d["idle"] and not st["leaks"] and d["backend"]["sessions"] == 0
        if free or time.time() > deadline:
            break
        time.sleep(0.1)
    assert free, st
    return st


def test_audio_session_speaks_is_interrupted_and_stops(browser, server, ingress, stats) -> None:
    page = open_page(browser, f"{server}/realtime?mode=audio&duplex_force=speak", "audio")
    assert page.evaluate("document.getElementById('say').hidden")  # turn-based controls off
    page.evaluate("document.getElementById('prompt').value = 'You are a test voice.'")
    _click(page, "live")
    page.wait_for("window.omniray.duplex?.phase === 'live'", timeout_s=10)
    sid = _duplex(page)["sessionId"]
    init = ingress.duplex.backend.inits[sid]
    assert (init.mode, init.system_prompt) == ("audio", "You are a test voice.")
    ingress.duplex.backend.text_pieces = True  # each unit's text in two deltas ("u", "0 ")

    # A unit of mic a second; each forced to speak comes back as text and 1 s of audio.
    page.wait_for("window.omniray.audioDeltas >= 2", timeout_s=15)
    page.wait_for("window.omniray.playedMs > 200 && window.omniray.activeSources > 0")
    page.wait_for(f"window.omniray.outputLevel > {100 * SILENT}")
    state = page.evaluate("window.omniray")
    assert state["sent"]["session.init"] == 1 and state["duplex"]["appends"] >= 2
    assert state["duplex"]["micRate"] == 16000  # Chromium captures at the unit's rate
    assert state["received"]["session.created"] == 1
    # Each delta queued whole: 1 s of 24 kHz float32 (the fake's unit of speech).
    assert state["scheduledMs"] == pytest.approx(1000 * state["audioDeltas"], abs=1)
    (turn,) = [e for e in state["transcript"] if e["role"] == "assistant"]
    assert turn["text"].startswith("u0 u1 ")  # units of one turn, in order
    assert "u0 u1" in page.evaluate("document.getElementById('log').innerText")

    # Interrupt: playback stops now, the next append carries force_listen, that unit listens.
    _click(page, "interrupt")
    state = page.evaluate("window.omniray")
    assert state["activeSources"] == 0 and state["duplex"]["interrupts"] == 1
    page.wait_for("window.omniray.duplex.forceListens === 1", timeout_s=5)
    page.wait_for("window.omniray.duplex.listens >= 1", timeout_s=10)
    forces = [u[2] for u in ingress.duplex.backend.units[sid]]
    assert forces.count("listen") == 1 and set(forces) == {"speak", "listen"}, forces
    # the page's count of units is the server's: the append it sent completed that unit
    assert forces.index("listen") == _duplex(page)["forcedUnit"]
    # The model speaks again after listening: a new turn, heard.
    heard = page.evaluate("window.omniray.audioDeltas")
    page.wait_for(f"window.omniray.audioDeltas > {heard}", timeout_s=10)
    page.wait_for("window.omniray.activeSources > 0")
    turns = [e for e in page.evaluate("window.omniray.transcript") if e["role"] == "assistant"]
    assert len(turns) == 2 and turns[1]["text"].strip()

    # Stop: session.close, the server's session.closed, its close; nothing more plays.
    _click(page, "live")
    page.wait_for("window.omniray.duplex.phase === 'closed'", timeout_s=10)
    d = _duplex(page)
    assert (d["closedReason"], d["closeCode"]) == ("user_stop", 1000)
    assert page.evaluate("window.omniray.sent['session.close']") == 1
    assert not page.evaluate("window.omniray.micOn")
    page.wait_for(f"window.omniray.outputLevel < {SILENT}", timeout_s=2)
    assert page.evaluate("window.omniray.activeSources") == 0
    ingress.duplex.backend.text_pieces = False
    units = ingress.duplex.backend.units[sid]
    assert units and all(n == UNIT for n, _, _ in units)  # whole 1 s units of 16 kHz audio
    assert len(units) <= d["appends"]
    # a unit's text deltas count as one spoken unit
    assert 2 <= d["speaks"] <= sum(f == "speak" for _, _, f in units)
    assert page.evaluate("document.getElementById('live').textContent") == "Start"
    close_page(page)
    wait_free(stats)


def test_video_session_sends_a_camera_frame_a_unit(browser, server, ingress, stats) -> None:
    page = open_page(browser, f"{server}/realtime?mode=video&duplex_force=speak", "video")
    _click(page, "live")
    page.wait_for("window.omniray.duplex?.phase === 'live'", timeout_s=10)
    assert page.evaluate("!document.getElementById('camera').hidden")
    page.wait_for("window.omniray.duplex.appends >= 2 && window.omniray.audioDeltas >= 1",
                  timeout_s=15)
    _click(page, "live")
    page.wait_for("window.omniray.duplex.phase === 'closed'", timeout_s=10)
    d = _duplex(page)
    assert d["frames"] == d["appends"] >= 2
    units = ingress.duplex.backend.units[d["sessionId"]]
    assert len(units) >= 1 and all(frames == 1 for _, frames, _ in units), units
    assert ingress.duplex.backend.inits[d["sessionId"]].mode == "video"
    assert page.evaluate("document.getElementById('camera').hidden")  # camera released
    close_page(page)
    wait_free(stats)


def _session(server: str):
    """A session of our own (raw socket, official wire): it holds a slot, or waits for one."""
    return ws_connect(server.replace("http", "ws") + "/v1/realtime?mode=audio",
                      open_timeout=10)


def test_queue_position_shown_then_live(browser, server, stats) -> None:
    page = open_page(browser, f"{server}/realtime?mode=audio", "audio")
    with _session(server) as holder:
        assert json.loads(holder.recv(timeout=10))["type"] == "session.queue_done"
        _click(page, "live")
        page.wait_for("window.omniray.duplex?.phase === 'queued'", timeout_s=10)
        d = _duplex(page)
        assert d["queue"]["position"] == 1 and d["queue"]["length"] == 1
        assert d["queue"]["etaS"] > 0
        assert "queued: 1 of 1" in page.evaluate("document.getElementById('status').textContent")
        assert "session.init" not in page.evaluate("window.omniray.sent")
    # The holder's socket is gone: its slot goes to the page.
    page.wait_for("window.omniray.duplex.phase === 'live'", timeout_s=10)
    assert _duplex(page)["queue"] is None
    _click(page, "live")
    page.wait_for("window.omniray.duplex.phase === 'closed'", timeout_s=10)
    assert _duplex(page)["closedReason"] == "user_stop"
    close_page(page)
    wait_free(stats)


def test_refusal_past_the_queue_is_shown(browser, server, stats) -> None:
    page = open_page(browser, f"{server}/realtime?mode=audio", "audio")
    with _session(server) as holder, _session(server) as waiter:
        assert json.loads(holder.recv(timeout=10))["type"] == "session.queue_done"
        assert json.loads(waiter.recv(timeout=10))["type"] == "session.queued"
        _click(page, "live")
        page.wait_for("window.omniray.duplex?.phase === 'closed'", timeout_s=10)
    state = page.evaluate("window.omniray")
    assert state["duplex"]["closeCode"] == 1013 and state["duplex"]["sessionId"] is None
    (error,) = state["errors"]
    assert error.startswith("server_busy: ")
    assert error in page.evaluate("document.getElementById('log').innerText")
    assert page.evaluate("document.getElementById('live').textContent") == "Start"
    close_page(page, errors=[error])
    wait_free(stats)


def test_mode_switch_ends_one_session_and_starts_the_other(browser, server, stats) -> None:
    page = open_page(browser, f"{server}/realtime", "turn")
    page.wait_for("window.omniray.sessionReady", timeout_s=10)
    page.evaluate("(() => { const m = document.getElementById('mode');"
                  " m.value = 'audio'; m.dispatchEvent(new Event('change')); })()")
    assert page.evaluate("window.omniray.mode") == "audio"
    assert not page.evaluate("window.omniray.connected")
    assert page.evaluate("document.getElementById('mic').hidden")
    assert not page.evaluate("document.getElementById('live').hidden")
    deadline = time.time() + 10
    while stats()["realtime"]["sessions"] and time.time() < deadline:
        time.sleep(0.1)
    assert stats()["realtime"]["sessions"] == 0  # its socket closed
    _click(page, "live")
    page.wait_for("window.omniray.duplex?.phase === 'live'", timeout_s=10)
    # Back to turn-based mid-session: the duplex session is closed, the turn socket reopens.
    page.evaluate("(() => { const m = document.getElementById('mode');"
                  " m.value = 'turn'; m.dispatchEvent(new Event('change')); })()")
    page.wait_for("window.omniray.sessionReady", timeout_s=10)
    assert page.evaluate("window.omniray.sent['session.close']") == 1
    assert not page.evaluate("window.omniray.micOn")
    close_page(page)
    wait_free(stats)


def test_a_turns_first_audio_waits_the_lead_then_plays_back_to_back(browser, server) -> None:
    page = open_page(browser, f"{server}/realtime?mode=audio", "audio")
    # Two 100 ms deltas of one turn queued at once: the first after the lead, the second
    # where the first ends (read with the page's own clock).
    t, lead, (a, da), (b, db) = page.evaluate(
        "(() => { audioContext(); const t = ctx.currentTime;"
        " for (let i = 0; i < 2; i++) playSamples('t', new Float32Array(2400), DUPLEX_LEAD_S);"
        " const g = items.get('t').segments.map((x) => [x.start, x.dur]);"
        " stopPlayback(); return [t, DUPLEX_LEAD_S, ...g]; })()",
        user_gesture=True,
    )
    assert lead > 0 and da == db == pytest.approx(0.1)
    # the page's clock runs in render quanta while the call runs (more of them on a loaded
    # machine): the start is the lead after the clock as playSamples read it, not before
    assert lead - 1e-9 <= a - t <= lead + 0.1
    assert b == pytest.approx(a + da, abs=1e-9)
    close_page(page)


def test_mic_worklet_makes_16k_float32_units(browser, server) -> None:
    page = open_page(browser, f"{server}/realtime?mode=audio", "audio")
    # 2 s at 48 kHz, as duplex mode runs the worklet: 16 kHz float32 in 1 s chunks
    script = render_worklet_script(
        48000, 2, "{ rate: DUPLEX_RATE, chunk: DUPLEX_CHUNK, float32: true }", True, 1)
    got = np.asarray(page.evaluate(script), dtype=np.float32)
    assert len(got) >= UNIT and len(got) % UNIT == 0  # whole 1 s units only
    # The same linear interpolation over the same float32 input, rounded to float32.
    x = (0.5 * np.sin(2 * np.pi * 440 * np.arange(96000) / 48000)).astype(np.float32)
    want = np.interp(np.arange(len(got)) * 3.0, np.arange(96000), x.astype(np.float64))
    assert np.abs(got - want.astype(np.float32)).max() <= 1e-7
    close_page(page)

"""The realtime voice page (deployments/realtime/page.html) in headless Chromium, its fake mic fed
from a WAV file, against the ingress's own routes and realtime session (server VAD included)
served by uvicorn in this process over the fake stage engines (tests/fakes.py), paced
so that a reply is still being made while its first second plays.

A spoken turn is answered with audio and a transcript, a response in progress can be
cancelled, an item's audio can be truncated at what was heard, and valid client events draw
no error events.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from _browser import Browser, Page, find_chromium
from test_api import light_source

from bench.speech import bursts, write_wav
from fakes import build_local_app

FAKE_MIC_RATE = 24000


def _write_mic_wav(path: Path, sr: int = FAKE_MIC_RATE) -> None:
    """What the fake mic says, looped: 1.2 s of speech then 2.8 s of near silence, so the
    server's VAD sees a turn start and end, and the reply's first audio comes before the
    next burst barges in, even on a busy machine."""
    write_wav(path, bursts([(1.2, True), (2.8, False)], sr, seed=0), sr)


# Fake stages: 10 spoken words x 12 codes x 40 ms = 4.8 s of speech a reply, made in about
# 2 s (a Code2Wav step of 1 s of audio every 0.3 s), so a reply plays while it is made.
APP_CFG = {"capacity": 4, "limits": {"max_tokens": 64},
           "thinker": {"engine": {"step_delay_s": 0.03}},
           "talker": {"engine": {"codes_per_id": 12}},
           "code2wav": {"engine": {"step_delay_s": 0.3}}}


@contextlib.contextmanager
def serve_asgi(app) -> Iterator[str]:
    """Runs an ASGI app on a free loopback port in a thread; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the app's server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()


@pytest.fixture(scope="module")
def local_app():
    return build_local_app(APP_CFG, light_source())


@pytest.fixture(scope="module")
def realtime_server(local_app) -> Iterator[str]:
    with serve_asgi(local_app.ingress.__serve_build_asgi_app__()) as url:
        yield url


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    binary = find_chromium()
    if binary is None:
        pytest.skip("no chromium binary (apt-get install -y chromium, or set OMNIRAY_CHROMIUM)")
    wav = tmp_path_factory.mktemp("mic") / "speech.wav"
    _write_mic_wav(wav)
    flags = [
        "--use-fake-ui-for-media-stream",  # grant the mic without a prompt
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={wav}",  # loops the file
        "--autoplay-policy=no-user-gesture-required",
    ]
    with Browser(binary, flags) as b:
        yield b


@pytest.fixture
def page(browser: Browser, realtime_server: str) -> Iterator[Page]:
    p = browser.new_page(f"{realtime_server}/realtime")
    p.wait_for("window.omniray?.sessionReady", timeout_s=10)
    yield p
    # Checked after the test's own assertions: whatever the page threw or logged is a bug.
    state = p.evaluate("window.omniray")
    assert p.exceptions == [], p.exceptions
    assert p.console_errors == [], p.console_errors
    assert state["errors"] == [], state["errors"]
    p.close()


def _click(page: Page, element_id: str) -> None:
    page.evaluate(f"document.getElementById('{element_id}').click()", user_gesture=True)


def _state(page: Page) -> dict:
    return page.evaluate("window.omniray")


SILENT = 1e-4  # output RMS of a stopped bus (speech is orders of magnitude above it)


def _assert_stays_silent(page: Page, seconds: float = 0.5) -> None:
    """Nothing reaches the speakers, no buffer is live and the heard ms do not grow."""
    # The meter's window (~85 ms) still holds the last audio for a moment after a stop.
    page.wait_for(f"window.omniray.outputLevel < {SILENT}", timeout_s=2)
    before = _state(page)
    time.sleep(seconds)
    after = _state(page)
    assert after["activeSources"] == 0
    assert after["outputLevel"] < SILENT
    assert after["playedMs"] == pytest.approx(before["playedMs"], abs=1.0)


def test_spoken_turn_then_interrupt(page: Page) -> None:
    _click(page, "mic")
    page.wait_for("window.omniray.micOn")
    # ~1 s of mic audio goes up in 100 ms appends; the server's VAD turns it into a response.
    page.wait_for("window.omniray.sent['input_audio_buffer.append'] >= 3")
    page.wait_for("window.omniray.received['input_audio_buffer.speech_started']", timeout_s=15)
    page.wait_for("window.omniray.audioDeltas > 0", timeout_s=20)
    _click(page, "mic")  # no further speech: the next barge-in would race the button
    page.wait_for("!window.omniray.micOn")

    # Heard, not just queued: the AudioContext's clock moves through the scheduled buffers.
    page.wait_for("window.omniray.playedMs > 150 && window.omniray.activeSources > 0")
    page.wait_for(f"window.omniray.outputLevel > {100 * SILENT}")
    # Generation runs ahead of playback; let some audio queue up so that stopping it is
    # distinguishable from letting it play out.
    page.wait_for(
        "window.omniray.scheduledMs - window.omniray.playedMs > 500 || !window.omniray.responseId",
        timeout_s=10,
    )
    state = _state(page)
    assert state["sourcesStarted"] >= 1 and state["scheduledMs"] >= state["playedMs"] > 0
    assert state["responseId"], "the response should still be running while its audio plays"
    spoken = [e for e in state["transcript"] if e["role"] == "assistant" and e["text"].strip()]
    assert spoken, state["transcript"]
    assert spoken[-1]["text"].strip()[:20] in page.evaluate(
        "document.getElementById('log').innerText"
    )
    assert any(e["role"] == "user" for e in state["transcript"])

    # The page's own audio clock and the end of what it had queued, read as the button is hit.
    t0, queued_end = page.evaluate(
        "(() => { const q = [ctx.currentTime, playEnd];"
        " document.getElementById('interrupt').click(); return q; })()",
        user_gesture=True,
    )
    state = _state(page)
    assert state["activeSources"] == 0
    assert state["sent"].get("response.cancel") == 1
    assert state["sent"].get("conversation.item.truncate") == 1
    (cut,) = state["truncated"]
    assert cut["itemId"] == spoken[-1]["itemId"]
    assert cut["audioEndMs"] == pytest.approx(state["itemPlayedMs"][cut["itemId"]], abs=1)
    assert 0 < cut["audioEndMs"] <= state["scheduledMs"]
    page.wait_for(f"window.omniray.outputLevel < {SILENT}", timeout_s=2)
    if queued_end - t0 > 0.4:
        # Silent while audio was still queued: the buffers were stopped, not played out.
        assert page.evaluate("ctx.currentTime") < queued_end
    page.wait_for("window.omniray.responseId === null", timeout_s=5)  # response.done came
    page.wait_for("window.omniray.received['conversation.item.truncated']", timeout_s=5)
    _assert_stays_silent(page)


def test_text_turn_and_server_vad_barge_in(page: Page) -> None:
    page.evaluate("document.getElementById('text').value = 'Hello there'")
    page.evaluate("document.getElementById('send').click()", user_gesture=True)
    state = _state(page)
    assert state["sent"].get("conversation.item.create") == 1
    assert state["sent"].get("response.create") == 1
    page.wait_for(
        "window.omniray.transcript.some(e => e.role === 'user' && e.text.includes('Hello there'))",
        timeout_s=5,
    )
    page.wait_for("window.omniray.activeSources > 0 && window.omniray.playedMs > 0", timeout_s=20)

    # Speaking over the answer: the server's speech_started must stop playback and truncate.
    _click(page, "mic")
    page.wait_for("window.omniray.bargeIns > 0", timeout_s=15)
    state = _state(page)
    assert state["sent"].get("conversation.item.truncate") == 1
    assert state["sent"].get("response.cancel") is None  # server VAD cancels by itself
    (cut,) = state["truncated"]
    assert cut["audioEndMs"] > 0
    _click(page, "mic")
    page.wait_for("!window.omniray.micOn")


def render_worklet_script(rate: int, seconds: int, options: str, float32: bool,
                          min_chunks: int) -> str:
    """JS that renders a known 440 Hz buffer of `seconds` at `rate` through the page's mic
    worklet (processorOptions `options`) in an offline context and returns the samples it
    posted, read little-endian as the wire carries them (pcm16, or float32 in duplex mode),
    once `min_chunks` chunks came (they arrive as messages after rendering)."""
    width, read = (4, "getFloat32") if float32 else (2, "getInt16")
    return f"""
(async () => {{
  const rate = {rate}, n = {seconds} * rate;
  const ac = new OfflineAudioContext(1, n, rate);
  const url = URL.createObjectURL(new Blob([WORKLET], {{ type: "text/javascript" }}));
  await ac.audioWorklet.addModule(url);
  const buf = ac.createBuffer(1, n, rate);
  const x = buf.getChannelData(0);
  for (let i = 0; i < n; i++) x[i] = 0.5 * Math.sin(2 * Math.PI * 440 * i / rate);
  const node = new AudioWorkletNode(ac, "pcm16-downsampler", {{
    numberOfInputs: 1, numberOfOutputs: 0, channelCount: 1, channelCountMode: "explicit",
    processorOptions: {options},
  }});
  const out = [];
  let chunks = 0;
  node.port.onmessage = (m) => {{
    const v = new DataView(m.data);
    for (let i = 0; i < v.byteLength / {width}; i++) out.push(v.{read}({width} * i, true));
    chunks += 1;
  }};
  const src = new AudioBufferSourceNode(ac, {{ buffer: buf }});
  src.connect(node);
  src.start(0);
  await ac.startRendering();
  for (let k = 0; k < 100 && chunks < {min_chunks}; k++) await new Promise((r) => setTimeout(r, 20));
  return out;
}})()
"""


@pytest.mark.parametrize("rate", [24000, 44100, 48000])
def test_mic_worklet_resamples_to_24k_pcm16(page: Page, rate: int) -> None:
    # 1 s at `rate` -> 24000 outputs: 10 chunks of 100 ms
    script = render_worklet_script(rate, 1, "{ rate: 24000, chunk: 2400 }", False, 9)
    got = np.asarray(page.evaluate(script), dtype=np.int64)
    assert len(got) >= 9 * 2400 and len(got) % 2400 == 0  # whole 100 ms chunks only
    # The same linear interpolation computed here, over the same float32 input samples.
    x = (0.5 * np.sin(2 * np.pi * 440 * np.arange(rate) / rate)).astype(np.float32)
    want_f = np.interp(np.arange(len(got)) * (rate / 24000), np.arange(rate), x.astype(np.float64))
    want = np.round(np.where(want_f < 0, want_f * 32768, want_f * 32767)).astype(np.int64)
    assert np.abs(got - want).max() <= 1  # rounding ties only
    # And it is the tone at 24 kHz, up to interpolation error (h^2 w^2 / 8 of the amplitude).
    t = np.arange(len(got)) / 24000
    assert np.abs(got / 32767 - 0.5 * np.sin(2 * np.pi * 440 * t)).max() < 1e-3


def test_the_pages_sessions_leave_nothing_behind(local_app, browser) -> None:
    """Run last: every page above has closed its socket; its session and turns are gone."""
    import asyncio

    ingress = local_app.ingress
    deadline = time.time() + 10
    while True:
        st = asyncio.run(ingress.stats())
        if (st["idle"] and not st["leaks"] and st["realtime"]["sessions"] == 0) or (
                time.time() > deadline):
            break
        time.sleep(0.1)
    assert st["realtime"]["sessions"] == 0 and st["idle"] and not st["leaks"], st

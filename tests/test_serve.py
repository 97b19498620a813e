"""The Ray Serve app end to end on CPU: one local Ray for the session (ray-notes.md), the
app built by `deployments.app` with the tiny default checkpoint and the real engines.

The cluster declares one logical GPU, so the builder applies its GPU fractions (the
scheduling path of a GPU machine) while torch runs on the CPU.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import tempfile
import threading
import time

import numpy as np
import pytest
import requests

pytest.importorskip("ray.serve")

import ray
from ray import serve
from test_api import data_uri, decode_wav, png_bytes, sse_events, wav_bytes

from deployments.app import build_omni_app
from deployments.schemas import AudioChunk, Done, TextDelta
from deployments.testing import (
    FakeCode2WavEngine,
    FakeTalkerEngine,
    FakeThinkerEngine,
    HandleCaller,
)

APP = "omniray"
WINDOW = 2
MEDIA_DIR = tempfile.mkdtemp(prefix="omniray-serve-media-")
# Small Talker units so the random tiny model's speech stays short on 2 CPU cores.
APP_CONFIG = {
    "active_stream_window": WINDOW,
    "request_timeout_s": 120,
    "allowed_local_media_path": MEDIA_DIR,
    "limits": {"max_tokens": 64, "default_max_tokens": 12, "max_images": 4},
    "thinker": {"engine": {"llm": {"max_num_seqs": 4}}},
    "talker": {"engine": {"max_streams": 8, "streaming_chunk_max_codes": 30,
                          "max_seq_len": 256}},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serve_app():
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 * 2**20)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_omni_app(APP_CONFIG), name=APP, route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    yield base
    serve.shutdown()
    ray.shutdown()


def _stage(name: str):
    return serve.get_deployment_handle(name, app_name=APP)


def _stats(name: str) -> dict:
    return _stage(name).stats.remote().result()


def _speech_body(**kw) -> dict:
    body = {"messages": [{"role": "user", "content": "Say something."}],
            "modalities": ["text", "audio"], "max_tokens": 12, "stream": True}
    body.update(kw)
    return body


def _stream(base: str, body: dict) -> list:
    with requests.post(f"{base}/v1/chat/completions", json=body, stream=True, timeout=180) as r:
        assert r.status_code == 200, r.text
        return sse_events(r.iter_lines())


# ---------------------------------------------------------------------------------------


def test_gpu_fractions_applied_on_a_gpu_cluster(serve_app):
    opts = {d: serve.status().applications[APP].deployments[d].status for d in
            ("Thinker", "Talker", "Code2Wav", "Ingress")}
    assert all(s == "HEALTHY" for s in opts.values()), opts
    # The whole logical GPU is 0.55 + 0.15 + 0.2 taken by the three stages.
    assert ray.available_resources().get("GPU", 0) == pytest.approx(0.1, abs=1e-6)


def test_streamed_chat_with_image_and_audio(serve_app):
    with open(os.path.join(MEDIA_DIR, "scene.png"), "wb") as f:
        f.write(png_bytes(80, 60, seed=3))
    content = [{"type": "text", "text": "What do you see and hear?"},
               {"type": "image_url", "image_url": {"url": data_uri(png_bytes(), "image/png")}},
               {"type": "image_url", "image_url": {"url": f"file://{MEDIA_DIR}/scene.png"}},
               {"type": "input_audio", "input_audio": {
                   "data": base64.b64encode(wav_bytes(0.5)).decode(), "format": "wav"}}]
    events = _stream(serve_app, _speech_body(messages=[{"role": "user", "content": content}]))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e.get("choices")]
    modalities = [c["modality"] for c in chunks]
    assert modalities[0] == "text" and "audio" in modalities
    first_audio = modalities.index("audio")
    assert "text" in modalities[:first_audio]
    pieces = []
    for c in chunks:
        if c["modality"] == "audio":
            pcm, rate = decode_wav(c["choices"][0]["delta"]["content"])
            assert rate == 24000 and c["choices"][0]["audio_metadata"]["frame_count"] == len(pcm)
            pieces.append(pcm)
    joined = np.concatenate(pieces)
    assert len(joined) >= 24000 // 2
    # One continuous stream: no seam at piece boundaries is larger than the largest
    # sample-to-sample step inside the pieces (the crossfade hides the joins).
    inner = max(np.abs(np.diff(p)).max() for p in pieces if len(p) > 1)
    bounds = np.cumsum([len(p) for p in pieces])[:-1]
    seams = [abs(joined[b] - joined[b - 1]) for b in bounds]
    assert not seams or max(seams) <= inner + 1e-3, f"seams {seams} vs inner step {inner}"
    usage = events[-2]["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0


def test_openai_client(serve_app):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{serve_app}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [APP]
    out = client.chat.completions.create(model=APP, max_tokens=6,
                                         messages=[{"role": "user", "content": "Hi"}])
    assert out.choices[0].message.content and out.usage.completion_tokens > 0
    text, audio = [], 0
    stream = client.chat.completions.create(
        model=APP, max_tokens=8, stream=True, messages=[{"role": "user", "content": "Hi"}],
        extra_body={"modalities": ["text", "audio"]})
    for chunk in stream:
        extra = chunk.model_extra or {}
        if chunk.choices and chunk.choices[0].delta.content:
            if extra.get("modality") == "audio":
                audio += 1
            else:
                text.append(chunk.choices[0].delta.content)
    assert "".join(text) and audio >= 1
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=APP, messages=[], max_tokens=4)


def test_handle_from_this_driver_and_from_a_second_app(serve_app):
    body = {"messages": [{"role": "user", "content": "Hi"}], "modalities": ["text", "audio"],
            "max_tokens": 8}
    handle = serve.get_app_handle(APP)
    events = list(handle.options(stream=True).chat.remote(body))
    assert isinstance(events[0], TextDelta) and isinstance(events[-1], Done)
    assert any(isinstance(e, AudioChunk) and e.pcm.dtype == np.float32 for e in events)

    caller = serve.deployment(HandleCaller, ray_actor_options={"num_cpus": 0}).bind(APP)
    serve.run(caller, name="caller", route_prefix="/caller")
    try:
        kinds = serve.get_app_handle("caller").remote(body).result()
    finally:
        serve.delete("caller")
    assert kinds[0] == "TextDelta" and "AudioChunk" in kinds and kinds[-1] == "Done"


def test_four_concurrent_streams_respect_the_window(serve_app):
    serve.get_app_handle(APP).reset_window_peaks.remote().result()
    results: list = [None] * 4

    def run(i: int) -> None:
        results[i] = _stream(serve_app, _speech_body(max_tokens=8 + i))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for events in results:
        assert events is not None and events[-1] == "[DONE]"
        assert "usage" in events[-2] and any(e.get("modality") == "audio" for e in events[:-1])
    window = serve.get_app_handle(APP).stats.remote().result()["window"]
    assert window["peak_active"] <= WINDOW and window["peak_waiting"] >= 1, window
    assert window["active"] == 0 and window["waiting"] == 0, window


def _all_free() -> tuple[bool, dict]:
    s = {n: _stats(n) for n in ("Thinker", "Talker", "Code2Wav")}
    window = serve.get_app_handle(APP).stats.remote().result()["window"]
    th, tk, cw = s["Thinker"], s["Talker"], s["Code2Wav"]
    eng = th["engine"]
    free = (th["open"] == 0 and th["forwarders"] == 0 and eng["num_running"] == 0
            and eng["num_waiting"] == 0 and eng["num_free_blocks"] == eng["num_total_blocks"]
            and tk["open"] == 0 and tk["pumps"] == 0 and tk["engine"]["open_streams"] == 0
            and cw["open"] == 0 and cw["streams"] == 0 and cw["engine"]["streams"] == 0
            and window["active"] == 0)
    return free, {**s, "window": window}


def test_client_disconnect_frees_every_stage(serve_app):
    body = _speech_body(max_tokens=60, ignore_eos=True)
    _all_free()  # warm the stage handles, so the checks below are quick
    r = requests.post(f"{serve_app}/v1/chat/completions", json=body, stream=True, timeout=60)
    lines = r.iter_lines()  # kept referenced: closing this generator would hang up early
    for line in lines:
        if line.startswith(b"data: ") and b'"modality":"text"' in line:
            break
    # Talker and Code2Wav streams are open from admission to the last audio piece.
    busy = {n: _stats(n) for n in ("Talker", "Code2Wav")}
    assert all(v["open"] >= 1 for v in busy.values()), f"turn not in flight: {busy}"
    r.close()  # the client goes away mid-turn
    deadline = time.time() + 60
    free, stats = _all_free()
    while not free and time.time() < deadline:
        time.sleep(0.25)
        free, stats = _all_free()
    assert free, f"state left behind after the disconnect: {json.dumps(stats, default=str)}"


def test_stage_exception_is_an_error_event_then_the_next_request_succeeds(serve_app):
    cfg = {"active_stream_window": 2, "code2wav": {"engine": {"fail_on_step": 1}}}
    app = build_omni_app(cfg, thinker_engine_cls=FakeThinkerEngine,
                         talker_engine_cls=FakeTalkerEngine,
                         code2wav_engine_cls=FakeCode2WavEngine, use_gpu=False)
    serve.run(app, name="faulty", route_prefix="/faulty")
    try:
        url = f"{serve_app}/faulty"
        first = _stream(url, _speech_body())
        errors = [e for e in first[:-1] if "error" in e]
        assert len(errors) == 1 and "injected Code2Wav fault" in errors[0]["error"]["message"]
        assert first[-1] == "[DONE]" and not any("usage" in e for e in first[:-1])
        second = _stream(url, _speech_body())
        assert any(e.get("modality") == "audio" for e in second[:-1]) and "usage" in second[-2]
    finally:
        serve.delete("faulty")


def test_bad_inputs_over_http_get_4xx(serve_app):
    from test_api import BAD_REQUESTS, EXPECT, prepare_body

    for name, body, status in BAD_REQUESTS:
        r = requests.post(f"{serve_app}/v1/chat/completions", timeout=60,
                          data=prepare_body(body, MEDIA_DIR),
                          headers={"content-type": "application/json"})
        assert r.status_code == status, f"{name}: {r.status_code} {r.text[:200]}"
        assert EXPECT[name] in r.json()["error"]["message"], name


def test_fixed_length_benchmark_mode(serve_app):
    """docs/bench.md: exactly N text tokens and M speech codes from the random tiny model;
    the audio is (3 silence codes + M) x 960 samples at 24 kHz."""
    body = _speech_body(max_tokens=40, omniray={"fixed_text_tokens": 5, "fixed_speech_codes": 30,
                                                 "return_timings": True, "unknown": 1})
    events = _stream(serve_app, body)
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 5
    samples = sum(len(decode_wav(c["choices"][0]["delta"]["content"])[0])
                  for c in events[:-1] if c.get("choices") and c["modality"] == "audio")
    assert samples == (3 + 30) * 960
    # Per-stage spans (docs/bench.md 2.3), in seconds since arrival, in pipeline order.
    timings = events[-2]["timings"]
    stages = [sp["stage"] for sp in timings["spans"]]
    assert stages[:4] == ["preprocess", "queue", "prefill", "decode"], stages
    assert stages.count("code2wav") >= 2 and stages.count("talker") >= 2
    assert all(0 <= sp["start"] <= sp["end"] for sp in timings["spans"])
    first = {sp["stage"]: sp for sp in reversed(timings["spans"])}
    assert first["queue"]["end"] <= first["prefill"]["start"] + 1e-6
    assert first["prefill"]["end"] <= first["decode"]["start"] + 1e-6
    assert timings["durations"]["code2wav"] > 0

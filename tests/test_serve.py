"""The Ray Serve app end to end on CPU: one local Ray for the session (ray-notes.md), the
app built by `deployments.app` with the tiny default checkpoint and the real engines.

The cluster declares one logical GPU, so the builder applies its GPU fractions (the
scheduling path of a GPU machine) while torch runs on the CPU.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time

import numpy as np
import pytest
import requests

pytest.importorskip("ray.serve")

import apps
import ray
from ray import serve
from test_api import data_uri, decode_wav, png_bytes, sse_events, wav_bytes

from deployments.app import build_omni_app
from deployments.wire import AudioChunk, Done, TextDelta
from fakes import FakeCode2WavEngine, FakeTalkerEngine, FakeThinkerEngine, HandleCaller

APP, WINDOW, MEDIA_DIR = apps.APP, apps.WINDOW, apps.MEDIA_DIR


def _stage(name: str):
    return serve.get_deployment_handle(name, app_name=APP)


def _stats(name: str) -> dict:
    return _stage(name).stats.remote().result()


def _speech_body(**kw) -> dict:
    body = {"messages": [{"role": "user", "content": "Say something."}],
            "modalities": ["text", "audio"], "max_tokens": 12, "stream": True,
            "omniray": {"stream_format": "vllm-omni"}}
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


def test_handle_from_this_driver_and_from_a_second_app(serve_app):
    # Seeded: unseeded, the tiny random Thinker may end its spoken span with its first token
    # (a CI run once got a turn with text and no audio), and there is nothing to speak.
    body = {"messages": [{"role": "user", "content": "Hi"}], "modalities": ["text", "audio"],
            "max_tokens": 8, "seed": 0}
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


def _all_free(app: str = APP) -> tuple[bool, dict]:
    """The app's invariants (Ingress.stats): idle, no leaks, every stage back to zero."""
    st = serve.get_app_handle(app).stats.remote().result()
    th, tk, cw = (st["stages"][n] for n in ("thinker", "talker", "code2wav"))
    eng = th.get("engine", {})
    free = (st["idle"] and not st["leaks"] and th["forwarders"] == 0
            and eng.get("num_free_blocks") == eng.get("num_total_blocks")
            and tk["engine"]["open_streams"] == 0 and tk["engine"]["unaccounted_slots"] == 0
            and cw["engine"]["open_streams"] == 0 and st["window"]["active"] == 0)
    return free, st


def wait_free(app: str = APP, timeout: float = 30.0) -> dict:
    deadline = time.time() + timeout
    free, st = _all_free(app)
    while not free and time.time() < deadline:
        time.sleep(0.25)
        free, st = _all_free(app)
    assert free, f"state left behind: {json.dumps(st, default=str)[:3000]}"
    return st


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
    wait_free(timeout=60)


def test_stage_exception_is_an_error_event_then_the_next_request_succeeds(serve_app):
    cfg = {"capacity": 2, "code2wav": {"engine": {"fail_on_step": 1}}}
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
    from test_bad_inputs import BAD_REQUESTS, EXPECT, prepare_body

    for name, body, status in BAD_REQUESTS:
        r = requests.post(f"{serve_app}/v1/chat/completions", timeout=60,
                          data=prepare_body(body, MEDIA_DIR),
                          headers={"content-type": "application/json"})
        assert r.status_code == status, f"{name}: {r.status_code} {r.text[:200]}"
        assert EXPECT[name] in r.json()["error"]["message"], name


def test_fixed_length_benchmark_mode(serve_app):
    """docs/bench.md: exactly N text tokens and M speech codes from the random tiny model;
    the audio is 3840 zeros then (3 silence codes + M) x 960 samples at 24 kHz."""
    body = _speech_body(max_tokens=40, omniray={"fixed_text_tokens": 5, "fixed_speech_codes": 30,
                                                 "return_timings": True, "unknown": 1,
                                                 "stream_format": "vllm-omni"})
    events = _stream(serve_app, body)
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 5
    samples = sum(len(decode_wav(c["choices"][0]["delta"]["content"])[0])
                  for c in events[:-1] if c.get("choices") and c["modality"] == "audio")
    assert samples == (3 + 30) * 960 + 3840  # after minicpmo-utils 1.0.7's 160 ms of zeros
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


def test_fixed_speech_shorter_than_its_text(serve_app):
    """A fixed-length stream that has spoken its M codes while the Thinker still says text:
    the rest goes unspoken and the turn ends normally (the Talker's stream is over, not gone)."""
    body = _speech_body(max_tokens=64, omniray={"fixed_text_tokens": 64,
                                                  "fixed_speech_codes": 10,
                                                  "stream_format": "vllm-omni"})
    events = _stream(serve_app, body)
    assert events[-1] == "[DONE]" and not any(
        isinstance(e, dict) and "error" in e for e in events), events[-3:]
    assert events[-2]["usage"]["completion_tokens"] == 64
    samples = sum(len(decode_wav(c["choices"][0]["delta"]["content"])[0])
                  for c in events[:-1] if c.get("choices") and c["modality"] == "audio")
    assert samples == (3 + 10) * 960  # one chunk, the last: no leading zeros


def _scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {series without Ray's per-process labels: summed value}."""
    import re

    out: dict[str, float] = {}
    for line in requests.get(url, timeout=10).text.splitlines():
        if not line.startswith("ray_omniray_"):
            continue
        name, _, value = line.rpartition(" ")
        labels = dict(re.findall(r'(\w+)="([^"]*)"', name))
        keep = {k: v for k, v in labels.items() if k in ("outcome", "reason", "stage", "name",
                                                         "le", "path", "cache")}
        key = name.split("{")[0] + "".join(f"|{k}={v}" for k, v in sorted(keep.items()))
        out[key] = out.get(key, 0.0) + float(value)
    return out


def test_metrics_reach_the_prometheus_export(serve_app, metrics_url):
    """The names of docs/api.md reach Ray's Prometheus export; HTTP refusals count as
    rejected (with a reason); stage gauges are there for every stage."""
    before = _scrape(metrics_url).get("ray_omniray_requests_total|outcome=rejected", 0.0)
    for _ in range(5):
        r = requests.post(f"{serve_app}/v1/chat/completions", data=b"{not json", timeout=30,
                          headers={"content-type": "application/json"})
        assert r.status_code == 400
    _stream(serve_app, _speech_body())
    want = ["ray_omniray_requests_total|outcome=ok", "ray_omniray_requests_total|outcome=rejected",
            "ray_omniray_errors_total|reason=invalid_request", "ray_omniray_audio_seconds_total",
            "ray_omniray_window_active", "ray_omniray_window_waiting"]
    want += [f"ray_omniray_stage_{m}|stage={s}" for s in ("thinker", "talker", "code2wav")
             for m in ("active_streams", "queue_depth")]
    want += ["ray_omniray_stage_free_slots|stage=talker", "ray_omniray_stage_kv_usage|stage=thinker"]
    deadline = time.time() + 60
    while True:
        got = _scrape(metrics_url)
        missing = [w for w in want if w not in got]
        rejected = got.get("ray_omniray_requests_total|outcome=rejected", 0.0) - before
        hist = any(k.startswith("ray_omniray_ttft_seconds_bucket") for k in got) and any(
            k.startswith("ray_omniray_stage_step_seconds_bucket|") for k in got)
        if (not missing and rejected >= 5 and hist) or time.time() > deadline:
            break
        time.sleep(1)
    assert not missing, (missing, sorted(got)[:80])
    assert rejected >= 5 and hist, (rejected, hist)


def test_a_stage_profiles_its_steps_through_its_handle(serve_app):
    """What `bench.gpu_e2e --profile-first-turn` asks: armed through the handle before a
    turn, the stage answers with the steps that turn made it run."""
    pending = _stage("Talker").profile.remote(2, 60.0)
    _stream(serve_app, _speech_body(max_tokens=6))
    got = pending.result(timeout_s=90)
    assert got["stage"] == "talker" and len(got["steps"]) == 2
    assert all(s["wall_ms"] > 0 for s in got["steps"])

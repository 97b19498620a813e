"""Stage replicas killed mid-stream, on a real local Ray Serve app (real engines, tiny
default). For each stage in turn: two speech turns are streaming, the stage's replica gets
SIGKILL; each in-flight turn must end with exactly one error event within 2 s; a text-only
and a speech turn must succeed within 30 s of the kill (Serve restarts the replica); then
every stage's state and the window are back to zero (Ingress.stats: idle, no leaks).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import requests

pytest.importorskip("ray.serve")

from ray import serve
from test_api import sse_events

from deployments.app import build_omni_app

APP = "faults"
CONFIG = {
    "capacity": 4,
    "request_timeout_s": 120,
    "limits": {"max_tokens": 400, "default_max_tokens": 12},
}
# Long enough that every stage is still busy when the kill lands: ~400 text tokens at a
# few ms each on the tiny model, and the speech that follows them.
LONG = {"messages": [{"role": "user", "content": "Tell me a long story."}],
        "modalities": ["text", "audio"], "max_tokens": 400, "ignore_eos": True,
        "stream": True, "omniray": {"stream_format": "vllm-omni"}}
TEXT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}
SPEECH = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
          "modalities": ["text", "audio"], "omniray": {"fixed_speech_codes": 10}}


@pytest.fixture(scope="module")
def faults_app(ray_http):
    serve.run(build_omni_app(CONFIG, use_gpu=False), name=APP, route_prefix=f"/{APP}")
    yield f"{ray_http}/{APP}"
    serve.delete(APP)


def _invariants(timeout: float = 30.0) -> dict:
    deadline = time.time() + timeout
    while True:
        try:
            st = serve.get_app_handle(APP).stats.remote().result(timeout_s=30)
        except Exception as e:  # noqa: BLE001 - a stage still restarting
            st = {"idle": False, "leaks": [repr(e)]}
        if (st.get("idle") and not st.get("leaks")) or time.time() > deadline:
            return st
        time.sleep(0.25)


class Streamer(threading.Thread):
    """One streamed turn; records when its first text arrived and when it ended. `hang_up`
    closes the connection at the next event, as a client that goes away."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.first_text = threading.Event()
        self.hang_up = threading.Event()
        self.events: list = []
        self.ended_at = 0.0
        self.status = 0

    def run(self) -> None:
        with requests.post(f"{self.url}/v1/chat/completions", json=self.body, stream=True,
                           timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if self.hang_up.is_set():
                    break
                ev = sse_events([line])
                if not ev:
                    continue
                self.events.extend(ev)
                if isinstance(ev[0], dict) and ev[0].get("modality") == "text":
                    self.first_text.set()
        self.ended_at = time.time()


@pytest.mark.parametrize("stage", ["Talker", "Code2Wav", "Thinker"])
def test_killed_stage_ends_in_flight_turns_and_the_app_recovers(faults_app, stage):
    ok = requests.post(f"{faults_app}/v1/chat/completions", json=SPEECH, timeout=120)
    assert ok.status_code == 200, ok.text
    turns = [Streamer(faults_app, LONG) for _ in range(2)]
    for t in turns:
        t.start()
    for t in turns:
        assert t.first_text.wait(60), "turn never started"
    pid = serve.get_deployment_handle(stage, app_name=APP).stats.remote().result()["pid"]
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    for t in turns:
        t.join(timeout=30)
        assert not t.is_alive(), "an in-flight turn still hangs"
        errors = [e for e in t.events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and t.events[-1] == "[DONE]", t.events[-3:]
        assert not any(isinstance(e, dict) and "usage" in e for e in t.events)
        assert errors[0]["error"]["code"] == "stage_unavailable", errors[0]
        assert t.ended_at - killed < 2.0, f"ended {t.ended_at - killed:.2f} s after the kill"
    # The next turns need no retry: they wait for Serve's new replica (within open_s).
    for body in (TEXT, SPEECH):
        r = requests.post(f"{faults_app}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, (stage, r.text[:300])
        assert r.json()["choices"][0]["message"]["content"]
        if body is SPEECH:
            assert r.json()["choices"][0]["message"]["audio"]["data"]
    recovered = time.time() - killed
    assert recovered < 30.0
    print(f"\n{stage} killed: in-flight turns ended "
          f"{', '.join(f'{t.ended_at - killed:.3f}' for t in turns)} s after the kill; a text "
          f"and a speech turn succeeded by {recovered:.1f} s")
    st = _invariants()
    assert st["idle"] and not st["leaks"], json.dumps(st, default=str)[:3000]
    new_pid = serve.get_deployment_handle(stage, app_name=APP).stats.remote().result()["pid"]
    assert new_pid != pid

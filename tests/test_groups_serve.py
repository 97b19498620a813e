"""Two stage groups on the session's local Ray Serve (real engines, tiny default): turns
spread over both and complete with their audio; one group's Talker killed mid-stream ends
that group's in-flight turns with one error each within 2 s while the other group's turns
complete; new turns go to the healthy group, and once Serve has restarted the replica the
first group serves again. The app's invariants hold at the end.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import requests

pytest.importorskip("ray.serve")

from ray import serve
from test_faults import CONFIG as FAULTS_CONFIG
from test_faults import LONG, SPEECH, Streamer

from deployments.app import build_omni_app

APP = "groups"
CONFIG = {**FAULTS_CONFIG, "groups": 2}  # two groups of the fault test's app


@pytest.fixture(scope="module")
def groups_app(ray_http):
    serve.run(build_omni_app(CONFIG, use_gpu=False), name=APP, route_prefix=f"/{APP}")
    yield f"{ray_http}/{APP}"
    serve.delete(APP)


# streamed, in vLLM-Omni's shape (each event names its modality)
STREAMED = {**SPEECH, "stream": True,
            "omniray": {**SPEECH["omniray"], "stream_format": "vllm-omni"}}


def _stats() -> dict:
    return serve.get_app_handle(APP).stats.remote().result(timeout_s=30)


def _settled(timeout: float = 30.0) -> dict:
    deadline = time.time() + timeout
    while True:
        try:
            st = _stats()
        except Exception as e:  # noqa: BLE001 - a stage still restarting
            st = {"idle": False, "leaks": [repr(e)]}
        if (st.get("idle") and not st.get("leaks")) or time.time() > deadline:
            return st
        time.sleep(0.25)


def _turns() -> list[int]:
    return [g["turns"] for g in _stats()["groups"]]


def test_two_groups_share_the_load_and_survive_a_dead_talker(groups_app):
    st = _stats()
    assert [g["name"] for g in st["groups"]] == ["g0", "g1"]
    assert {"talker-g0", "talker-g1", "code2wav-g1"} <= set(st["stages"])

    # 8 at once, each with its first text before any has ended, so every one was routed
    # while the others were in flight: the window (4 per group) puts 4 in each. Then the
    # clients go away, which frees every stage of both groups.
    turns = [Streamer(groups_app, LONG) for _ in range(8)]
    for t in turns:
        t.start()
    for t in turns:
        assert t.first_text.wait(60), "turn never started"
    assert not any(t.ended_at for t in turns), [t.events[-3:] for t in turns if t.ended_at]
    spread = _turns()
    assert sum(spread) == 8 and min(spread) >= 3, spread
    for t in turns:
        t.hang_up.set()
    for t in turns:
        t.join(timeout=30)
        assert t.status == 200 and not t.is_alive()
        assert not any(isinstance(e, dict) and "error" in e for e in t.events), t.events[-3:]
    st = _settled()
    assert st["idle"] and not st["leaks"], json.dumps(st, default=str)[:3000]

    # two long turns in each group (a tie goes to the first group: turns 0 and 2 land on
    # g0), then g0's Talker dies
    before = _turns()
    long_turns = []
    for _ in range(4):
        t = Streamer(groups_app, LONG)
        t.start()
        assert t.first_text.wait(60), "turn never started"
        long_turns.append(t)
    placed = [b - a for a, b in zip(before, _turns())]
    assert placed == [2, 2], placed
    pid = serve.get_deployment_handle("Talker-g0", app_name=APP).stats.remote().result()["pid"]
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    for t in long_turns[0::2]:  # g0's: one error each, within 2 s
        t.join(timeout=30)
        assert not t.is_alive(), "an in-flight turn still hangs"
        errors = [e for e in t.events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["error"]["code"] == "stage_unavailable", errors
        assert t.events[-1] == "[DONE]"
        assert t.ended_at - killed < 2.0, f"ended {t.ended_at - killed:.2f} s after the kill"
    # g0 was taken out of rotation until all its stages answer again; a new turn succeeds
    # without a retry (where it goes depends on how fast Serve restarts the Talker:
    # test_groups.py checks the routing while a group is down step by step)
    assert [g["downs"] for g in _stats()["groups"]] == [1, 0]
    r = requests.post(f"{groups_app}/v1/chat/completions", json=SPEECH, timeout=60)
    assert r.status_code == 200, r.text[:300]
    for t in long_turns[1::2]:  # g1's complete
        t.join(timeout=120)
        assert t.events[-1] == "[DONE]" and not any(
            isinstance(e, dict) and "error" in e for e in t.events), t.events[-3:]
    # and once Serve has restarted the replica, g0 serves again
    deadline = time.time() + 60
    while _stats()["groups"][0]["down"] and time.time() < deadline:
        time.sleep(0.25)
    assert not _stats()["groups"][0]["down"], "g0 never came back"
    before = _turns()
    turns = [Streamer(groups_app, STREAMED) for _ in range(6)]
    for t in turns:
        t.start()
    for t in turns:
        t.join(timeout=120)
        assert t.events[-1] == "[DONE]" and not any(
            isinstance(e, dict) and "error" in e for e in t.events), t.events[-3:]
        assert any(isinstance(e, dict) and e.get("modality") == "audio" for e in t.events)
    after = [b - a for a, b in zip(before, _turns())]
    assert after[0] >= 2, after  # g0 serves again
    new_pid = serve.get_deployment_handle("Talker-g0", app_name=APP).stats.remote().result()["pid"]
    assert new_pid != pid
    st = _settled()
    assert st["idle"] and not st["leaks"], json.dumps(st, default=str)[:3000]


def _replicas(app: str) -> dict[str, int]:
    deps = serve.status().applications[app].deployments
    return {
        name: sum(n for state, n in d.replica_states.items() if state == "RUNNING")
        for name, d in deps.items()
    }


def test_an_autoscaled_group_starts_from_zero_and_stops_when_idle(ray_http, monkeypatch):
    """Serve's own autoscaler scales group g1 from no replicas when the ingress wakes it
    (every awake window full), and back to none after group_idle_s without turns."""
    import deployments.app as app_module
    from fakes import FakeCode2WavEngine, FakeTalkerEngine, FakeThinkerEngine

    # Serve's downscale delay is group_idle_s + this margin (30 s as shipped, for turns routed
    # just before the ingress's cut-off); nothing is in flight here when g1 goes idle.
    monkeypatch.setattr(app_module, "DOWNSCALE_MARGIN_S", 3.0)

    app = "autogroups"
    cfg = {
        "capacity": 1,
        "max_groups": 2,
        "min_groups": 1,
        "group_idle_s": 3,
        "thinker": {"engine": {"step_delay_s": 0.05}},
    }
    serve.run(
        build_omni_app(
            cfg,
            thinker_engine_cls=FakeThinkerEngine,
            talker_engine_cls=FakeTalkerEngine,
            code2wav_engine_cls=FakeCode2WavEngine,
            use_gpu=False,
        ),
        name=app,
        route_prefix=f"/{app}",
    )
    url = f"{ray_http}/{app}"
    stats = serve.get_app_handle(app).stats
    try:
        start = _replicas(app)
        assert start["Talker-g0"] == 1 and start["Talker-g1"] == 0, start
        # Turns one after another until g1 is awake and serving: each one that finds g0's
        # window full (one slot) and the other waiting wakes g1.
        deadline = time.time() + 90
        while time.time() < deadline:
            turns = [Streamer(url, STREAMED) for _ in range(3)]
            for t in turns:
                t.start()
            for t in turns:
                t.join(timeout=120)
                assert t.events[-1] == "[DONE]" and not any(
                    isinstance(e, dict) and "error" in e for e in t.events
                ), t.events[-3:]
            groups = stats.remote().result(timeout_s=30)["groups"]
            if groups[1]["turns"] > 0:
                break
        assert groups[1]["wakes"] >= 1 and groups[1]["turns"] > 0, groups
        assert all(n == 1 for n in _replicas(app).values())
        # idle: the ingress stops sending g1 turns after 3 s, Serve stops it 3 s later
        deadline = time.time() + 120
        g1 = ("Thinker-g1", "Talker-g1", "Code2Wav-g1")
        while time.time() < deadline and any(_replicas(app)[d] for d in g1):
            stats.remote().result(timeout_s=30)  # keep the ingress's view fresh
            time.sleep(1.0)
        after = _replicas(app)
        assert not any(after[d] for d in g1), after
        assert after["Thinker-g0"] == 1
        st = stats.remote().result(timeout_s=30)
        assert st["groups"][1]["asleep"] and st["idle"] and not st["leaks"], st
        r = requests.post(f"{url}/v1/chat/completions", json=SPEECH, timeout=60)
        assert r.status_code == 200, r.text[:300]  # g0 alone still serves
    finally:
        serve.delete(app)

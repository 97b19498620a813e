"""bench/serve_path.py at a tiny size on the session's Ray Serve: the fake-engine app is
deployed with each stage transport in turn, every turn streams text and audio over HTTP, the
asked number of samples comes back, and the bench's app is gone afterwards."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("ray.serve")

from ray import serve

from bench import serve_path


def test_each_transport_is_measured_over_http(ray_http):
    result = serve_path.run(ray_http, requests=3, warmup=1, rounds=2)
    assert set(result) == set(serve_path.TRANSPORTS)
    for t, ms in result.items():
        for key in ("ttft", "ttfp"):
            assert len(ms[key]) == 3, (t, key)
            assert all(math.isfinite(x) and x > 0 for x in ms[key]), (t, key, ms[key])
    table = serve_path.table(result).splitlines()
    assert len(table) == 2 + len(result) and all(line.count("|") == 7 for line in table)
    assert serve_path.APP not in serve.status().applications


def test_the_app_is_the_shipped_config_with_the_transport():
    cfg = serve_path.app_config("ray")
    assert cfg["stage_transport"] == "ray"
    assert all(cfg[s]["engine"] == {} for s in ("thinker", "talker", "code2wav"))


def test_bad_arguments_are_refused_before_ray_is_touched():
    with pytest.raises(ValueError, match="unknown transports"):
        serve_path.run("http://127.0.0.1:1", transports=("tcp",))
    with pytest.raises(ValueError, match="requests >= 1"):
        serve_path.run("http://127.0.0.1:1", requests=0)

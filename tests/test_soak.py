"""A short soak in CI: 35 s at c=8 against the main app (real engines, tiny
default), every request kind, 15% of streamed turns hung up early (bench/soak.py). No turn
may lack its one terminal event, bad requests must get 4xx, and at the end nothing may be
left in any stage (Ingress.stats: idle, no leaks). The long version, with a stage killed
mid-run, is `python -m bench soak --turns 1000 --concurrency 16 --kill talker@0.5`
(docs/performance.md)."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("aiohttp")

from bench.soak import soak

SOAK_S = float(os.environ.get("OMNIRAY_SOAK_S", "35"))


def test_soak_nothing_lost_nothing_leaked(serve_app):
    res = asyncio.run(soak(serve_app, duration_s=SOAK_S, concurrency=8, hangup=0.15, seed=1,
                           max_tokens=8, app="omniray", settle_s=60))
    summary = res.summary()
    print(json.dumps(summary, indent=2))
    kinds = {t.kind for t in res.turns}
    assert kinds == {"text", "text_full", "speech", "speech_pcm", "speech_mp3", "speech_opus",
                     "speech_full", "image", "audio_in", "bad"}, kinds
    assert any(t.terminal == "hangup" for t in res.turns)
    assert summary["ok"], summary["problems"][:20]
    assert summary["outcomes"].get("done", 0) >= len(res.turns) // 2, summary

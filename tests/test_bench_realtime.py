"""bench/realtime.py's client against the ingress's own realtime route over the fake stage
engines (in this process, uvicorn): a spoken turn's onset is measured from speech_stopped to
the first audio delta, and the cancel ends the response."""

from __future__ import annotations

import asyncio

from test_api import light_source
from test_realtime_page import APP_CFG, serve_asgi

from bench.realtime import measure, summary
from fakes import build_local_app


def test_onset_and_barge_in_are_measured():
    local = build_local_app(APP_CFG, light_source())
    with serve_asgi(local.ingress.__serve_build_asgi_app__()) as url:
        rows = asyncio.run(measure(url, sessions=2, turns=1, listen_s=0.2))
    assert len(rows) == 2 and {r["session"] for r in rows} == {0, 1}
    for r in rows:
        assert r["status"] == "cancelled"  # a 4.8 s reply cancelled 0.2 s into its audio
        assert 0 < r["onset_s"] < 10 and 0 <= r["barge_in_done_s"] < 5
    s = summary(rows, skip_first=False)
    assert s["n"] == 2 and s["cancelled"] == 2 and s["onset_ms_median"] > 0

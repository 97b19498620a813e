"""The realtime abuse cases of bench/realtime.py (`--abuse`), run small against the ingress's
routes served by uvicorn in-process over real TCP (fake stages, no Ray): a client that never
reads is stopped by its session's outbound bound and closed as a slow reader, a VAD flood is
answered in full, and after each every session is gone and a good session gets its
response."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import pytest

pytest.importorskip("websockets")
pytest.importorskip("aiohttp")
uvicorn = pytest.importorskip("uvicorn")

from bench.realtime import abuse  # noqa: E402
from deployments.realtime import outbound  # noqa: E402


@pytest.fixture()
def served():
    from test_api import light_source

    from fakes import build_local_app

    local = build_local_app({}, light_source())
    sock = socket.socket()
    # a small send buffer (accepted sockets inherit it): what a few responses fill
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(local.ingress.__serve_build_asgi_app__(),
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)
    try:
        yield local, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_the_realtime_abuse_cases_run_small(served, monkeypatch, caplog):
    local, url = served
    # small bounds, so that a few short responses overflow a reader that does not read
    monkeypatch.setattr(outbound, "MAX_BYTES", 256 << 10)
    monkeypatch.setattr(outbound, "COALESCE_BYTES", 32 << 10)
    monkeypatch.setattr(outbound, "WRITE_TIMEOUT_S", 2.0)

    async def sessions_left() -> int:
        return len(local.ingress.realtime_sessions)

    with caplog.at_level(logging.INFO, logger="deployments.realtime.socket"):
        res = asyncio.run(abuse(url, small=True, sessions_left=sessions_left))
    print(json.dumps(res, indent=1))
    assert res["problems"] == [], res
    sr = res["slow_reader"]
    # the server ended it as a slow reader (the client, which reads nothing, may not know)
    assert any("slow reader" in r.getMessage() for r in caplog.records), sr
    vf = res["vad_flood"]
    assert vf["appends"] == 6 and vf["errors"] == 0 and vf["health_probes_during"] > 0
    assert {res[c]["good_session_after"] for c in ("slow_reader", "vad_flood")} <= {
        "completed", "incomplete"}
    # the last case's session ends on the server's thread once its socket closes
    deadline = time.monotonic() + 10
    while local.ingress.realtime_sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert local.ingress.realtime_sessions == {}

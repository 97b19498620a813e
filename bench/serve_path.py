"""The app's serving path alone: what Serve and the app's own request handling cost a turn
before any model work.

The whole app (serve_config.yaml's settings, one group) runs on Ray Serve over the fake
engines of deployments/testing.py, which answer at once (no model compute): a client sends
text-only speech turns one at a time over HTTP and reports the medians of its TTFT (first
text) and TTFP (first audio), i.e. the proxy, the ingress, every hop between the stages and
back. Each `--transports` value (AppConfig.stage_transport) is deployed in turn, reversed
every other round, so that load from other work hits all alike.

    python -m bench.serve_path [--requests 60] [--warmup 10] [--rounds 3]
                               [--transports ray,grpc] [--json F.json]

Reuses a Ray that is already initialised in the process (the test session's: pass its HTTP
base URL to `run`) under its own app name and route, and deletes the app after; otherwise
starts a small local one with HTTP on 127.0.0.1:8000. Environment variables that Serve reads
(e.g. RAY_SERVE_PROXY_USE_GRPC=1) reach the proxy and the replicas when this starts Ray.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import ray
from ray import serve

from bench.gpu_e2e import app_args
from bench.hops import ensure_ray

APP = "omniray-serve-path-bench"
HTTP_PORT = 8000  # when this starts Ray
ROUTE = "/serve-path-bench"
TRANSPORTS = ("ray", "grpc")
BODY = json.dumps(
    {
        "model": "omniray",
        "stream": True,
        "modalities": ["text", "audio"],
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "Say something short."}],
    }
).encode()


def app_config(transport: str) -> dict[str, Any]:
    """serve_config.yaml's app settings with `transport`; the fakes take no engine settings."""
    args = app_args(str(Path(__file__).resolve().parent.parent / "serve_config.yaml"), None)
    for stage in ("thinker", "talker", "code2wav"):
        args[stage]["engine"] = {}
    return {**args, "stage_transport": transport}


def turn_ms(base: str) -> tuple[float, float]:
    """One streamed speech turn: (ms to the first text, ms to the first audio)."""
    url = urlparse(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    t0 = time.perf_counter()
    conn.request("POST", ROUTE + "/v1/chat/completions", BODY, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"turn answered {resp.status}: {resp.read()[:200]!r}")
    text = audio = None
    while line := resp.readline():
        if not line.startswith(b"data: {"):
            continue
        now = (time.perf_counter() - t0) * 1e3
        choices = json.loads(line[6:]).get("choices") or [{}]  # the usage chunk has none
        delta = choices[0].get("delta") or {}
        said = delta.get("content") or (delta.get("audio") or {}).get("transcript")
        if text is None and said:
            text = now
        if audio is None and (delta.get("audio") or {}).get("data"):
            audio = now
    conn.close()
    if text is None or audio is None:
        raise RuntimeError("a turn ended without text or audio")
    return text, audio


def _deploy(transport: str) -> None:
    from deployments.app import build_omni_app
    from deployments.testing import FakeCode2WavEngine, FakeTalkerEngine, FakeThinkerEngine

    app = build_omni_app(
        app_config(transport),
        thinker_engine_cls=FakeThinkerEngine,
        talker_engine_cls=FakeTalkerEngine,
        code2wav_engine_cls=FakeCode2WavEngine,
        use_gpu=False,
    )
    serve.run(app, name=APP, route_prefix=ROUTE)


def run(
    base: str | None = None,
    requests: int = 60,
    warmup: int = 10,
    rounds: int = 3,
    transports: tuple[str, ...] = TRANSPORTS,
) -> dict[str, dict[str, list[float]]]:
    """{transport: {"ttft": [ms...], "ttfp": [ms...]}}, `requests` turns each."""
    if unknown := sorted(set(transports) - set(TRANSPORTS)):
        raise ValueError(f"unknown transports {unknown}; known: {list(TRANSPORTS)}")
    if requests < 1 or warmup < 0 or rounds < 1:
        raise ValueError("need requests >= 1, warmup >= 0, rounds >= 1")
    if ray.is_initialized() and base is None:
        raise ValueError("Ray is running here: pass the HTTP base URL of its Serve")
    started = ensure_ray(HTTP_PORT)
    if started:
        base = f"http://127.0.0.1:{HTTP_PORT}"
    out = {t: {"ttft": [], "ttfp": []} for t in transports}
    per_round = [requests // rounds + (r < requests % rounds) for r in range(rounds)]
    try:
        for r, k in enumerate(per_round):
            for t in transports if r % 2 == 0 else transports[::-1]:
                _deploy(t)
                for i in range(warmup + k):
                    text, audio = turn_ms(base)
                    if i >= warmup:
                        out[t]["ttft"].append(text)
                        out[t]["ttfp"].append(audio)
        return out
    finally:
        if APP in serve.status().applications:
            serve.delete(APP)
        if started:
            serve.shutdown()
            ray.shutdown()


def table(result: dict[str, dict[str, list[float]]]) -> str:
    def q(v: list[float], p: float) -> float:
        return sorted(v)[round(p * (len(v) - 1))]

    lines = [
        "| stage_transport | turns | TTFT median | TTFT p90 | TTFP median | TTFP p90 |",
        "|---|---|---|---|---|---|",
    ]
    for t, ms in result.items():
        lines.append(
            f"| {t} | {len(ms['ttft'])} | {statistics.median(ms['ttft']):.2f} | "
            f"{q(ms['ttft'], 0.9):.2f} | {statistics.median(ms['ttfp']):.2f} | "
            f"{q(ms['ttfp'], 0.9):.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=60, help="timed turns per transport")
    p.add_argument("--warmup", type=int, default=10, help="untimed turns after each deploy")
    p.add_argument("--rounds", type=int, default=3, help="rounds the transports take turns in")
    p.add_argument("--transports", default=",".join(TRANSPORTS))
    p.add_argument("--json", default="", help="write the raw samples here")
    a = p.parse_args(argv)
    result = run(None, a.requests, a.warmup, a.rounds, tuple(a.transports.split(",")))
    flags = {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_")}
    print(f"fake engines, text-only speech turns one at a time; ms; Serve env {flags or 'default'}")
    print(table(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    from bench.serve_path import main as _main  # the replicas import bench.serve_path

    raise SystemExit(_main())

"""Serve's HTTP path alone: what a request and a streamed event cost without any model.

A bare deployment behind Serve's HTTP proxy answers `GET /sse` with one SSE event the size
of one second of speech (24 kHz pcm16, base64) carrying the server's clock at the handler's
start and at the yield. The client (same machine, same clock) reports the way in (its send ->
the handler) and the way out (the yield -> its read of the event), medians over `--requests`
after 5 warm-ups. Compare with the app's report: the gap between the server's first-token /
first-audio marks and the client's TTFT / TTFP holds these two legs.

    python -m bench.proxy_hop [--requests 25] [--port 8000]
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import statistics
import sys
import time

PAYLOAD = base64.b64encode(os.urandom(48000)).decode()  # 1 s of 24 kHz pcm16


def build_app():
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from ray import serve

    api = FastAPI()

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    @serve.ingress(api)
    class Probe:
        @api.get("/sse")
        async def sse(self):
            t_in = time.time()

            async def events():
                yield f"data: {json.dumps({'in': t_in, 'out': time.time(), 'audio': PAYLOAD})}\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

    return Probe.bind()


def measure(port: int, requests: int) -> tuple[float, float]:
    """(way in ms, way out ms), medians after 5 warm-ups."""
    way_in, way_out = [], []
    for _ in range(requests + 5):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        sent = time.time()
        conn.request("GET", "/sse")
        resp = conn.getresponse()
        for line in resp.fp:
            if line.startswith(b"data: {"):
                now, event = time.time(), json.loads(line[6:])
                way_in.append((event["in"] - sent) * 1e3)
                way_out.append((now - event["out"]) * 1e3)
                break
        conn.close()
    return statistics.median(way_in[5:]), statistics.median(way_out[5:])


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.proxy_hop", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=25)
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(), name="proxy_hop", route_prefix="/")
        way_in, way_out = measure(args.port, args.requests)
        print(f"Serve's HTTP path, {args.requests} requests: way in {way_in:.2f} ms, "
              f"way out (one {len(PAYLOAD) // 1024} KiB event) {way_out:.2f} ms")
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU check of the Serve app: the shipped serve_config.yaml, three model stages sharing one
GPU by fractions, one streamed request then N concurrent ones over HTTP.

    python -m bench.gpu_serve [--model PATH] [--concurrency 4] [--max-tokens 48]

Prints per request TTFT / first-audio / end-to-end / audio seconds and, per stage, the
device memory its process holds. Exits non-zero if the app does not come up, a request
fails, a stage is not on the GPU, or the window is exceeded.
(Start from the repo root with Ray Serve importable; see docs of the GPU machine.)
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
import wave

import yaml


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(url: str, body: dict) -> dict:
    body = {**body, "omniray": {**body.get("omniray", {}), "stream_format": "vllm-omni"}}
    t0 = time.perf_counter()
    out = {"ttft": None, "first_audio": None, "audio_s": 0.0, "ok": False, "error": None}
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        resp = urllib.request.urlopen(req, timeout=600)
    except urllib.error.HTTPError as e:
        out["error"] = f"HTTP {e.code}: {e.read()[:200]!r}"
        return out
    with resp:
        for line in resp:  # SSE lines as they arrive
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if payload == b"[DONE]":
                break
            ev = json.loads(payload)
            now = time.perf_counter() - t0
            if "error" in ev:
                out["error"] = ev["error"]["message"]
                continue
            if not ev.get("choices"):
                out["usage"] = ev.get("usage")
                continue
            content = ev["choices"][0]["delta"].get("content")
            if not content:
                continue
            if ev.get("modality") == "audio":
                out["first_audio"] = out["first_audio"] or now
                with wave.open(io.BytesIO(base64.b64decode(content))) as w:
                    out["audio_s"] += w.getnframes() / w.getframerate()
            else:
                out["ttft"] = out["ttft"] or now
    out["e2e"] = time.perf_counter() - t0
    out["ok"] = out["error"] is None and out["audio_s"] > 0
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16, help="fixed text tokens per turn")
    ap.add_argument("--speech-codes", type=int, default=57, help="fixed speech codes per turn")
    ap.add_argument("--set", action="append", default=[],
                    help="override an app arg, e.g. thinker.engine.compile_llm_ops=false")
    ap.add_argument("--config", default="serve_config.yaml")
    ap.add_argument("--cpu-dry-run", action="store_true", help="check this script on a CPU box")
    args = ap.parse_args()

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from deployments.app import build_omni_app

    with open(args.config) as f:
        cfg = yaml.safe_load(f)["applications"][0]["args"]
    cfg["model"] = args.model
    cfg["active_stream_window"] = max(cfg.get("active_stream_window", 4), args.concurrency)
    for item in args.set:
        key, value = item.split("=", 1)
        *path, leaf = key.split(".")
        node = cfg
        for k in path:
            node = node.setdefault(k, {})
        node[leaf] = yaml.safe_load(value)

    ray.init(include_dashboard=False, log_to_driver=False)
    if ray.cluster_resources().get("GPU", 0) < 1 and not args.cpu_dry_run:
        print("no GPU in the Ray cluster", file=sys.stderr)
        return 2
    port = _port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    t = time.perf_counter()
    serve.run(build_omni_app(cfg), name="omniray", route_prefix="/")
    print(f"app RUNNING after {time.perf_counter() - t:.1f} s")
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    # Fixed lengths (docs/bench.md): a random model's EOS is arbitrary.
    body = {"messages": [{"role": "user", "content": "Tell me about the sea."}],
            "modalities": ["text", "audio"], "stream": True,
            "omniray": {"fixed_text_tokens": args.max_tokens,
                        "fixed_speech_codes": args.speech_codes}}

    _stream(url, body)  # warm-up: graphs, allocator, encoder paths
    rows = [("single", _stream(url, body))]
    results: list = [None] * args.concurrency

    def run(i: int) -> None:
        results[i] = _stream(url, body)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(args.concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    rows += [(f"c{args.concurrency}-{i}", r) for i, r in enumerate(results)]

    print(f"{'request':<10} {'ttft_ms':>8} {'first_audio_ms':>15} {'e2e_s':>7} {'audio_s':>8} ok")
    failed = 0
    for name, r in rows:
        ms = lambda v: f"{v * 1000:.0f}" if v is not None else "-"
        print(f"{name:<10} {ms(r['ttft']):>8} {ms(r['first_audio']):>15} "
              f"{r.get('e2e', 0):>7.2f} {r['audio_s']:>8.2f} {r['ok']} {r['error'] or ''}")
        failed += not r["ok"]

    print(f"\n{'stage':<10} {'allocated_GiB':>14} {'reserved_GiB':>13} {'peak_GiB':>9}")
    for name in ("Thinker", "Talker", "Code2Wav"):
        s = serve.get_deployment_handle(name, app_name="omniray").stats.remote().result()
        print(f"{name:<10} {s.get('gpu_allocated_gib', 0):>14.2f} "
              f"{s.get('gpu_reserved_gib', 0):>13.2f} {s.get('gpu_peak_gib', 0):>9.2f}")
        if "gpu_allocated_gib" not in s and not args.cpu_dry_run:
            print(f"FAIL: {name} is not on the GPU")
            failed += 1
    window = serve.get_app_handle("omniray").stats.remote().result()["window"]
    print(f"\nwindow: {window}")
    if window["peak_active"] > window["size"] > 0:
        failed += 1
    serve.shutdown()
    ray.shutdown()
    print("PASS" if not failed else f"FAIL ({failed})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

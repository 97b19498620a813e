"""Full-duplex sessions from a client's side of `WS /v1/realtime?mode=audio|video` (the
official Realtime V1 wire), N at once, each paced in real time: a unit of audio (1 s, and
a JPEG frame in video mode) is sent the moment its last sample would have been captured,
and each unit's decision is forced by a pattern (`--pattern SSL`: speak, speak, listen,
repeated; the session's `duplex_force: "speak"` and `force_listen` on L units), so
random weights give the same load as a talkative model. Per unit:

- decision: from the unit's last input sample leaving the client to its first event
  (`response.listen`, or the first text delta of a speaking unit, which the app sends as
  the text is drawn);
- first audio: from the same instant to the unit's first `response.output_audio.delta`;
- behind: units decided later than the next unit's last sample (the session lags);
- underruns: gaps in the client's playback: within a turn, a unit's audio that arrives
  after the audio before it has finished playing.

The sessions start together, so every second all their units arrive at once (the worst
case); `--spread` starts session i of N i/N of a unit later, as independent users would.

    python -m bench.duplex --url http://127.0.0.1:8000 --sessions 1,4,8,16 --seconds 30

GPU memory per session is the app's own figure (`Ingress.stats()`), not this client's.

`--chat C` measures ordinary chat turns beside the sessions: C closed-loop workers send
text prompts answered in speech (48 text tokens, 108 speech codes: the turn-based
benchmark's shape, docs/performance.md) for `--seconds`, first alone, then beside each run's
sessions; per run the turns' req/s and TTFP p50 both ways, and their ratio.

    python -m bench.duplex --url http://127.0.0.1:8000 --sessions 8 --chat 4 --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.speech import speech_like

IN_RATE, OUT_RATE = 16000, 24000
UNIT = 16000  # a unit's samples: 1 s at 16 kHz


@dataclass
class UnitTimes:
    sent: float                           # the unit's last sample left the client
    decided: float | None = None
    first_audio: float | None = None
    listen: bool | None = None
    end_of_turn: bool = False
    audio_s: float = 0.0


@dataclass
class SessionResult:
    units: list[UnitTimes] = field(default_factory=list)
    underruns: int = 0
    errors: list[str] = field(default_factory=list)


def _frame(seed: int) -> str:
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 255, (240, 320, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=80)
    return base64.b64encode(buf.getvalue()).decode()


async def one_session(url: str, seconds: float, pattern: str, mode: str, seed: int,
                      model: str | None, delay: float = 0.0) -> SessionResult:
    import websockets

    await asyncio.sleep(delay)
    res = SessionResult()
    query = f"?mode={mode}" + (f"&model={model}" if model else "")
    n_units = max(1, int(seconds))
    audio = speech_like(n_units, IN_RATE, seed=seed).astype("<f4")
    frame = _frame(seed) if mode == "video" else None
    async with websockets.connect(url.replace("http", "ws", 1) + "/v1/realtime" + query,
                                  subprotocols=["map.realtime"], max_size=None) as ws:
        while (ev := json.loads(await ws.recv()))["type"] != "session.queue_done":
            if ev["type"] == "error":
                res.errors.append(ev["error"]["code"])
                return res
        config = {"duplex_force": "speak"} if "S" in pattern else {"duplex_force": "listen"}
        await ws.send(json.dumps({"type": "session.init", "payload": {"config": config}}))
        if (ev := json.loads(await ws.recv()))["type"] != "session.created":
            res.errors.append(ev.get("error", {}).get("code", ev["type"]))
            return res
        done = asyncio.Event()
        play_end = 0.0  # when the client's playback of what it received runs out

        async def read() -> None:
            nonlocal play_end
            async for frame_text in ws:
                now = time.perf_counter()
                ev = json.loads(frame_text)
                kind, i = ev["type"], ev.get("unit")
                if kind == "error":
                    res.errors.append(ev["error"]["code"])
                    break
                if kind == "session.closed":
                    break
                if i is None or i >= len(res.units):
                    continue
                u = res.units[i]
                if kind == "response.output_text.delta":
                    u.end_of_turn = bool(ev.get("end_of_turn"))
                if kind in ("response.listen", "response.output_text.delta") and not u.decided:
                    u.decided, u.listen = now, kind == "response.listen"
                elif kind == "response.output_audio.delta":
                    secs = len(base64.b64decode(ev["audio"])) / 4 / OUT_RATE
                    if u.first_audio is None:
                        u.first_audio = now
                    prev = res.units[i - 1] if i > 0 else None
                    speaking_before = prev is not None and prev.listen is False \
                        and not prev.end_of_turn
                    if speaking_before and now > play_end:
                        res.underruns += 1
                    play_end = max(play_end, now) + secs
                    u.audio_s += secs
                if len(res.units) == n_units and all(x.decided for x in res.units):
                    done.set()
            done.set()

        reader = asyncio.get_running_loop().create_task(read())
        start = time.perf_counter()
        pos = 0
        for i in range(n_units):
            # the unit's last sample is captured at the end of its span: send it then
            await asyncio.sleep(max(0.0, start + (pos + UNIT) / IN_RATE - time.perf_counter()))
            chunk = audio[pos:pos + UNIT]
            pos += UNIT
            inp: dict[str, Any] = {"audio": base64.b64encode(chunk.tobytes()).decode()}
            if pattern[i % len(pattern)] == "L":
                inp["force_listen"] = True
            if frame is not None:
                inp["video_frames"] = [frame]
            res.units.append(UnitTimes(sent=0.0))
            await ws.send(json.dumps({"type": "input.append", "input": inp}))
            res.units[-1].sent = time.perf_counter()
        try:
            await asyncio.wait_for(done.wait(), 30)
        except asyncio.TimeoutError:
            res.errors.append("timeout")
        await ws.send(json.dumps({"type": "session.close"}))
        await asyncio.wait_for(reader, 10)
    return res


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summarize(results: list[SessionResult]) -> dict[str, Any]:
    decision = [(u.decided - u.sent) * 1e3 for r in results for u in r.units if u.decided]
    first = [(u.first_audio - u.sent) * 1e3 for r in results for u in r.units
             if u.first_audio]
    behind = sum(1 for r in results for a, b in zip(r.units, r.units[1:])
                 if a.decided is None or (b.sent and a.decided > b.sent))
    units = sum(len(r.units) for r in results)
    return {"sessions": len(results), "units": units,
            "decided": len(decision), "spoke": len(first), "behind": behind,
            "underruns": sum(r.underruns for r in results),
            "errors": sorted({e for r in results for e in r.errors}),
            "decision_ms": {f"p{q}": _pct(decision, q) for q in (50, 90, 99)},
            "first_audio_ms": {f"p{q}": _pct(first, q) for q in (50, 90, 99)},
            "decision_mean_ms": statistics.fmean(decision) if decision else None}


async def chat_load(url: str, concurrency: int, seconds: float, model: str | None
                    ) -> dict[str, Any]:
    """`concurrency` closed-loop chat workers for `seconds` (a turn under way then finishes):
    the turns completed, their req/s over the span and TTFP p50 in ms."""
    import aiohttp

    from bench.client import ClientOptions, RequestSpec, send_request
    from bench.metrics import RequestRecord

    opts = ClientOptions(url=url, model=model or "omniray", fixed_text_tokens=48,
                         fixed_speech_codes=108)
    spec = RequestSpec("chat", [{"role": "user", "content": "Tell me about the sea."}])
    records: list[RequestRecord] = []
    start = time.perf_counter()

    async def worker(w: int, session: aiohttp.ClientSession) -> None:
        k = 0
        while time.perf_counter() - start < seconds:
            rec = RequestRecord(f"chat-{w}-{k}")
            records.append(await send_request(session, spec, opts, rec))
            k += 1

    timeout = aiohttp.ClientTimeout(total=opts.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(w, session) for w in range(concurrency)))
    span = time.perf_counter() - start
    ok = [r for r in records if r.ok]
    ttfp = [(r.t_first_audio - r.t_send) * 1e3 for r in ok if r.t_first_audio is not None]
    return {"turns": len(ok), "failed": len(records) - len(ok),
            "req_s": len(ok) / span, "ttfp_p50_ms": _pct(ttfp, 50)}


async def run(url: str, sessions: int, seconds: float, pattern: str, mode: str,
              model: str | None, chat: int = 0, spread: bool = False) -> dict[str, Any]:
    jobs = [one_session(url, seconds, pattern, mode, seed=i, model=model,
                        delay=i / sessions * UNIT / IN_RATE if spread else 0.0)
            for i in range(sessions)]
    if not chat:
        return summarize(list(await asyncio.gather(*jobs)))
    *results, beside = await asyncio.gather(*jobs, chat_load(url, chat, seconds, model))
    return {**summarize(list(results)), "chat": beside}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.duplex", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="the app's HTTP base, e.g. http://127.0.0.1:8000")
    ap.add_argument("--sessions", default="1,4", help="concurrent sessions, one run each")
    ap.add_argument("--seconds", type=float, default=20.0, help="units per session")
    ap.add_argument("--pattern", default="SSL", help="forced decisions, S / L, cycled")
    ap.add_argument("--mode", choices=["audio", "video"], default="video")
    ap.add_argument("--model", default=None)
    ap.add_argument("--chat", type=int, default=0, metavar="C",
                    help="C chat workers beside the sessions, and alone first")
    ap.add_argument("--warmup", type=float, default=0.0, metavar="S",
                    help="first run 1 session and then the largest count for S seconds "
                         "each, unmeasured: the app's first units at a new batch size "
                         "load and compile what they need")
    ap.add_argument("--spread", action="store_true",
                    help="start the sessions spread over one unit (not all at once)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if set(args.pattern) - {"S", "L"} or not args.pattern:
        ap.error("--pattern is a string of S (speak) and L (listen)")
    report: dict[str, Any] = {"mode": args.mode, "pattern": args.pattern,
                              "spread": args.spread, "runs": []}
    counts = [int(x) for x in args.sessions.split(",") if x.strip()]
    if args.warmup > 0:
        report["warmup"] = []
        for n in sorted({1, max(counts, default=1)}):
            r = asyncio.run(run(args.url, n, args.warmup, args.pattern, args.mode, args.model))
            report["warmup"].append(r)
            print(json.dumps({"warmup": r}), flush=True)
    if args.chat:
        report["chat_alone"] = asyncio.run(chat_load(args.url, args.chat, args.seconds,
                                                     args.model))
        print(json.dumps({"chat_alone": report["chat_alone"]}), flush=True)
    for n in counts:
        r = asyncio.run(run(args.url, n, args.seconds, args.pattern, args.mode, args.model,
                            args.chat, args.spread))
        if args.chat and report["chat_alone"]["req_s"]:
            r["chat"]["req_s_ratio"] = r["chat"]["req_s"] / report["chat_alone"]["req_s"]
        report["runs"].append(r)
        print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

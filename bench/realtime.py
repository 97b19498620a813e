"""The realtime API's two latencies, from a client's side of `WS /v1/realtime`:

- speak onset: from the server's `input_audio_buffer.speech_stopped` (server VAD decided the
  user finished) to the first `response.output_audio.delta` of the response it started;
- barge-in: from the client's `response.cancel` to its `response.done` (and to the last audio
  delta that still arrived after the cancel, if any).

Each session speaks `--turns` times in real time (100 ms appends of speech-like audio, then
silence until VAD ends the turn), lets the answer play `--listen-s`, then cancels it.

    python -m bench.realtime --checkpoint random-full --sessions 1,4 --turns 4 --out DIR

It starts the app in-process (bench.gpu_e2e.InProcessServe) from serve_config.yaml, or
measures a running one with `--url`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.speech import speech_like

RATE = 24000
STEP_S = 0.1


class Session:
    """One socket: a reader task timestamps every server event."""

    def __init__(self, ws: Any):
        self.ws = ws
        self.events: list[tuple[float, dict]] = []
        self._new = asyncio.Condition()
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        async for frame in self.ws:
            ev = json.loads(frame)
            async with self._new:
                self.events.append((time.perf_counter(), ev))
                self._new.notify_all()

    async def send(self, **event: Any) -> float:
        await self.ws.send(json.dumps(event))
        return time.perf_counter()

    async def wait(self, kind: str, since: int, timeout: float = 120.0) -> tuple[int, float, dict]:
        """The first event of `kind` at index >= since: (index, time, event)."""
        async def find() -> tuple[int, float, dict]:
            async with self._new:
                while True:
                    for i in range(since, len(self.events)):
                        t, ev = self.events[i]
                        if ev["type"] == kind:
                            return i, t, ev
                        if ev["type"] == "error":
                            raise RuntimeError(f"server error: {ev['error']}")
                    await self._new.wait()

        return await asyncio.wait_for(find(), timeout)


async def one_session(url: str, turns: int, listen_s: float, seed: int,
                      omniray: dict | None = None) -> list[dict]:
    """`listen_s` None: let each response finish (its report then has the turn's spans)."""
    import websockets

    out = []
    ws_url = url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
    async with websockets.connect(f"{ws_url}/v1/realtime?model=omniray", max_size=None) as ws:
        s = Session(ws)
        await s.wait("session.created", 0)
        session = {"type": "realtime", "output_modalities": ["audio"],
                   "audio": {"input": {"turn_detection": {"type": "server_vad"}}}}
        if omniray:
            session["omniray"] = omniray
        await s.send(type="session.update", session=session)
        for turn in range(turns):
            speech = speech_like(1.5, RATE, seed=seed * 100 + turn)
            audio = np.concatenate([speech, np.zeros(int(1.5 * RATE), np.float32)])
            pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
            mark = len(s.events)
            step = int(RATE * STEP_S) * 2
            t_next = time.perf_counter()
            for i in range(0, len(pcm), step):  # real time, like a microphone
                await s.send(type="input_audio_buffer.append",
                             audio=base64.b64encode(pcm[i:i + step]).decode())
                t_next += STEP_S
                await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
                if any(ev["type"] == "input_audio_buffer.speech_stopped"
                       for _, ev in s.events[mark:]):
                    break  # the rest is silence
            i_stop, t_stop, _ = await s.wait("input_audio_buffer.speech_stopped", mark)
            _, _, created = await s.wait("response.created", i_stop)
            rid = created["response"]["id"]
            i_audio, t_audio, _ = await s.wait("response.output_audio.delta", i_stop)
            if listen_s is None:
                cancel_at, t_cancel = None, None
                i_done, t_done, done = await s.wait("response.done", i_audio, timeout=600)
            else:
                await asyncio.sleep(listen_s)
                cancel_at = len(s.events)
                t_cancel = await s.send(type="response.cancel")
                i_done, t_done, done = await s.wait("response.done", i_audio)
            late = [t for t, ev in s.events[cancel_at:i_done]
                    if ev["type"] == "response.output_audio.delta" and ev["response_id"] == rid
                    ] if cancel_at is not None else []
            report = done["response"].get("omniray") or {}
            out.append({"turn": turn, "onset_s": t_audio - t_stop,
                        # the server's clock from the commit: first text, first audio
                        "server_first_text_s": report.get("first_text_s", float("nan")),
                        "server_first_audio_s": report.get("first_audio_s", float("nan")),
                        "barge_in_done_s": (t_done - t_cancel) if t_cancel else float("nan"),
                        "barge_in_last_delta_s": (late[-1] - t_cancel) if late else 0.0,
                        "spans_ms": {k: round(v * 1000, 1) for k, v in
                                     (report.get("timings") or {}).get("durations", {}).items()},
                        # each stage's first span (ms since the turn's request arrived): the
                        # path to the first audio
                        "first_spans_ms": first_spans(report.get("timings")),
                        "late_deltas": len(late), "status": done["response"]["status"]})
            await asyncio.sleep(0.3)
        s.reader.cancel()
    return out


def first_spans(timings: dict | None) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for sp in (timings or {}).get("spans", []):
        out.setdefault(sp["stage"], [round(sp["start"] * 1000, 1), round(sp["end"] * 1000, 1)])
    return out


async def measure(url: str, sessions: int, turns: int, listen_s: float | None,
                  omniray: dict | None = None) -> list[dict]:
    rows = await asyncio.gather(*(one_session(url, turns, listen_s, seed=k, omniray=omniray)
                                  for k in range(sessions)))
    return [{"session": k, **r} for k, rs in enumerate(rows) for r in rs]


def summary(rows: list[dict], skip_first: bool) -> dict[str, float]:
    use = [r for r in rows if not (skip_first and r["turn"] == 0)] or rows

    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in use) * 1000, 1)

    spans = sorted({k for r in use for k in r.get("spans_ms", {})})

    def p90(key: str) -> float:
        v = sorted(r[key] for r in use)
        return round(v[min(len(v) - 1, int(0.9 * len(v)))] * 1000, 1)

    return {"n": len(use), "onset_ms_median": med("onset_s"), "onset_ms_p90": p90("onset_s"),
            "server_first_text_ms_median": med("server_first_text_s"),
            "server_first_audio_ms_median": med("server_first_audio_s"),
            "barge_in_done_ms_median": med("barge_in_done_s"),
            "barge_in_done_ms_p90": p90("barge_in_done_s"),
            "barge_in_last_delta_ms_median": med("barge_in_last_delta_s"),
            "cancelled": sum(r["status"] == "cancelled" for r in use),
            "spans_ms_median": {k: statistics.median(r["spans_ms"][k] for r in use
                                                     if k in r.get("spans_ms", {}))
                                for k in spans}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.realtime")
    ap.add_argument("--url", help="a running app (default: start one in-process)")
    ap.add_argument("--config", default="serve_config.yaml")
    ap.add_argument("--checkpoint", default=None, help="model: e.g. random-full")
    ap.add_argument("--set", action="append", default=[], help="config override key=value")
    ap.add_argument("--sessions", default="1,4")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--listen-s", type=float, default=0.5,
                    help="play this long, then cancel (barge-in); 0 = let it finish")
    ap.add_argument("--fixed-text-tokens", type=int, default=None)
    ap.add_argument("--fixed-speech-codes", type=int, default=None)
    ap.add_argument("--timings", action="store_true", help="ask for the turns' spans")
    ap.add_argument("--warmup-turns", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    results: dict[str, Any] = {"command": "python -m bench.realtime " + " ".join(argv or [])}

    listen = args.listen_s or None
    ext = {k: v for k, v in (("fixed_text_tokens", args.fixed_text_tokens),
                             ("fixed_speech_codes", args.fixed_speech_codes),
                             ("return_timings", args.timings or None)) if v is not None}

    def run(url: str) -> None:
        if args.warmup_turns:
            asyncio.run(measure(url, 1, args.warmup_turns, listen, ext))
        for n in (int(x) for x in args.sessions.split(",")):
            rows = asyncio.run(measure(url, n, args.turns, listen, ext))
            results[f"sessions_{n}"] = {"summary": summary(rows, skip_first=False),
                                        "rows": rows}
            print(f"sessions={n}: {json.dumps(results[f'sessions_{n}']['summary'])}",
                  flush=True)

    if args.url:
        run(args.url.rstrip("/"))
    else:
        from bench.gpu_e2e import InProcessServe, app_args, parse_sets

        srv = InProcessServe()
        overrides = parse_sets(args.set)
        with srv.app(app_args(args.config, args.checkpoint, overrides), "realtime") as url:
            run(url)
            results["stats"] = srv.ingress_stats()
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "realtime.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()

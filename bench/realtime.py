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

`--abuse` runs the realtime abuse cases instead (`abuse()`): a slow reader (a socket with a
4 KiB receive buffer that sends large text items and asks for responses, and never reads)
and a VAD flood (sessions appending minutes of noise under server VAD as fast as they can,
while `/health` is timed); after each, a good session must still get its response.

    python -m bench.realtime --url http://127.0.0.1:8000 --abuse
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import secrets
import socket
import statistics
import time
import urllib.parse
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


# ---------------------------------------------------------------------------------------
# Abuse cases


def _ws_url(url: str) -> str:
    ws = url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
    return f"{ws}/v1/realtime?model=omniray"


def _text_item(text: str) -> str:
    return json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})


async def good_session(url: str, timeout_s: float = 120.0) -> str:
    """One short text turn on a fresh session: its response's status."""
    import websockets

    async with websockets.connect(_ws_url(url), max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "output_modalities": ["text"],
            "audio": {"input": {"turn_detection": None}}}}))
        await ws.send(_text_item("Hello."))
        await ws.send(json.dumps({"type": "response.create",
                                  "response": {"max_output_tokens": 8}}))

        async def done() -> str:
            async for frame in ws:
                ev = json.loads(frame)
                if ev["type"] == "response.done":
                    return ev["response"]["status"]
            return "closed"

        return await asyncio.wait_for(done(), timeout_s)


class _RawSocket:
    """The client side of a WebSocket written by hand, so that nothing reads for it: after
    the handshake the socket is never read (its stream buffer stops the reading once it
    holds `limit` bytes), and frames go out masked, as a client's must."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, url: str, rcvbuf: int, limit: int = 1024) -> _RawSocket:
        u = urllib.parse.urlsplit(url)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (u.hostname, u.port or 80))
        reader, writer = await asyncio.open_connection(sock=sock, limit=limit)
        key = base64.b64encode(secrets.token_bytes(16)).decode()
        writer.write((f"GET /v1/realtime?model=omniray HTTP/1.1\r\nHost: {u.netloc}\r\n"
                      "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                      f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
                     .encode())
        status = await reader.readline()
        if b" 101 " not in status:
            raise RuntimeError(f"the handshake failed: {status!r}")
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        return cls(reader, writer)

    async def send(self, text: str) -> None:
        data = text.encode()
        n = len(data)
        head = bytes([0x81])  # FIN, text
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 1 << 16:
            head += bytes([0x80 | 126]) + n.to_bytes(2, "big")
        else:
            head += bytes([0x80 | 127]) + n.to_bytes(8, "big")
        mask = secrets.token_bytes(4)
        masked = (np.frombuffer(data, np.uint8)
                  ^ np.resize(np.frombuffer(mask, np.uint8), n)).tobytes()
        self.writer.write(head + mask + masked)
        await self.writer.drain()

    def closed(self) -> bool:
        return self.writer.is_closing() or self.reader.at_eof()

    def abort(self) -> None:
        self.writer.transport.abort()


async def slow_reader(url: str, *, items: int = 300, item_bytes: int = 2 << 20,
                      respond_every: int = 10, rcvbuf: int = 4096,
                      block_s: float = 10.0) -> dict[str, Any]:
    """A client that never reads: large text items (a response asked for every
    `respond_every`) through a socket with a `rcvbuf`-byte receive buffer. Ends when the
    server drops the connection (`closed`), when one of the client's writes has waited
    `block_s` (`blocked`: the server stopped reading it, backpressure), or `block_s` after
    every item went out (`accepted_all`); then aborts. The client reads nothing, so it sees
    no close code: the server's own log and stats say why it ended the session."""
    out: dict[str, Any] = {"items_sent": 0, "bytes_sent": 0, "outcome": "accepted_all"}
    t0 = time.perf_counter()
    ws = await _RawSocket.connect(url, rcvbuf)

    async def send(frame: str) -> bool:
        try:
            await asyncio.wait_for(ws.send(frame), block_s)
        except asyncio.TimeoutError:
            out["outcome"] = "blocked"
            return False
        except OSError:  # reset by the server
            out["outcome"] = "closed"
            return False
        out["bytes_sent"] += len(frame)
        return True

    try:
        if not await send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "audio": {"input": {"turn_detection": None}}}})):
            return out
        text = "x" * (item_bytes - 200)
        for i in range(items):
            frames = [_text_item(text)]
            if respond_every and i % respond_every == respond_every - 1:
                frames.append(json.dumps({"type": "response.create"}))
            for frame in frames:
                if not await send(frame):
                    return out
            out["items_sent"] = i + 1
        # Everything went out: stay (still not reading) and keep asking for a little, until
        # the server ends the session or stops reading this client.
        deadline = time.perf_counter() + block_s
        while time.perf_counter() < deadline:
            if not await send(json.dumps({"type": "response.create"})):
                return out
            await asyncio.sleep(0.2)
        return out
    finally:
        out["seconds"] = round(time.perf_counter() - t0, 2)
        ws.abort()


async def vad_flood(url: str, *, sessions: int = 4, appends: int = 10, append_s: float = 60.0,
                    probe_s: float = 0.05) -> dict[str, Any]:
    """`sessions` sockets each append `appends` x `append_s` seconds of noise under server
    VAD (no responses) as fast as the server takes them, while `/health` is timed every
    `probe_s`: its latency before and during the flood (reported, not judged)."""
    import aiohttp
    import websockets

    rng = np.random.default_rng(0)
    noise = (rng.standard_normal(int(append_s * RATE)) * 6000).clip(-32768, 32767)
    chunk = base64.b64encode(noise.astype("<i2").tobytes()).decode()
    flooding = asyncio.Event()
    stop = asyncio.Event()

    async def probe(http: aiohttp.ClientSession) -> tuple[list[float], list[float]]:
        before: list[float] = []
        during: list[float] = []
        while not stop.is_set():
            t = time.perf_counter()
            async with http.get(f"{url}/health") as r:
                await r.read()
            (during if flooding.is_set() else before).append(time.perf_counter() - t)
            await asyncio.sleep(probe_s)
        return before, during

    async def flood(k: int) -> dict[str, int]:
        counts = {"appends": 0, "errors": 0, "speech_started": 0}
        async with websockets.connect(_ws_url(url), max_size=None) as ws:
            await ws.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "audio": {"input": {"turn_detection": {
                    "type": "server_vad", "create_response": False,
                    "interrupt_response": False}}}}}))
            for _ in range(appends):
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
                counts["appends"] += 1
            # events are handled in order: this one's answer means every append was
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
            async for frame in ws:
                ev = json.loads(frame)
                if ev["type"] == "error":
                    counts["errors"] += 1
                elif ev["type"] == "input_audio_buffer.speech_started":
                    counts["speech_started"] += 1
                elif ev["type"] == "input_audio_buffer.cleared":
                    break
        return counts

    async with aiohttp.ClientSession() as http:
        prober = asyncio.ensure_future(probe(http))
        await asyncio.sleep(1.0)
        flooding.set()
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(flood(k) for k in range(sessions)))
        seconds = time.perf_counter() - t0
        stop.set()
        before, during = await prober

    def p50_ms(v: list[float]) -> float:
        return round(statistics.median(v) * 1000, 1) if v else float("nan")

    return {"sessions": sessions, "audio_s": sessions * appends * append_s,
            "seconds": round(seconds, 2),
            "appends": sum(c["appends"] for c in counts),
            "errors": sum(c["errors"] for c in counts),
            "speech_started": sum(c["speech_started"] for c in counts),
            "health_ms_p50_before": p50_ms(before), "health_ms_p50_during": p50_ms(during),
            "health_probes_during": len(during)}


async def abuse(url: str, *, small: bool = False,
                sessions_left: Any = None) -> dict[str, Any]:
    """Both cases, each followed by a good session; `sessions_left()` (optional) gives the
    replica's open realtime sessions, which must drop to 0 after each. `problems` lists
    what failed."""
    problems: list[str] = []
    out: dict[str, Any] = {}

    async def settled(case: str) -> None:
        if sessions_left is not None:
            for _ in range(200):
                if await sessions_left() == 0:
                    break
                await asyncio.sleep(0.1)
            else:
                problems.append(f"{case}: {await sessions_left()} sessions still open")
        status = await good_session(url)
        out[case]["good_session_after"] = status
        if status not in ("completed", "incomplete"):
            problems.append(f"{case}: a good session then got {status}")

    sr = dict(items=40, item_bytes=4 << 10, respond_every=1, block_s=4.0) if small else {}
    out["slow_reader"] = await slow_reader(url, **sr)
    await settled("slow_reader")
    vf = dict(sessions=2, appends=3, append_s=5.0) if small else {}
    out["vad_flood"] = await vad_flood(url, **vf)
    if out["vad_flood"]["errors"]:
        problems.append(f"vad_flood: {out['vad_flood']['errors']} error events")
    await settled("vad_flood")
    out["problems"] = problems
    return out


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
    ap.add_argument("--abuse", action="store_true",
                    help="run the abuse cases (slow reader, VAD flood) instead")
    args = ap.parse_args(argv)

    results: dict[str, Any] = {"command": "python -m bench.realtime " + " ".join(argv or [])}

    listen = args.listen_s or None
    ext = {k: v for k, v in (("fixed_text_tokens", args.fixed_text_tokens),
                             ("fixed_speech_codes", args.fixed_speech_codes),
                             ("return_timings", args.timings or None)) if v is not None}

    def run(url: str, stats: Any = None) -> None:
        if args.abuse:
            async def sessions_left() -> int:
                return (await asyncio.to_thread(stats))["realtime"]["sessions"]

            results["abuse"] = asyncio.run(abuse(url, sessions_left=stats and sessions_left))
            print(json.dumps(results["abuse"], indent=1), flush=True)
            return
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
            run(url, srv.ingress_stats)
            results["stats"] = srv.ingress_stats()
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "realtime.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()

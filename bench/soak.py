"""Soak: many turns of every kind against a running app, some hung up early, optionally one
stage replica killed mid-run; then check that nothing was lost and nothing leaked.

    python -m bench soak --url http://127.0.0.1:8000 --turns 1000 --concurrency 16 \\
        --hangup 0.1 --kill talker@0.5 --out soak.json

Each turn is one of KINDS (text or speech, streamed or not, every audio format, an image, an
audio input, a bad request), picked at random with a fixed seed. A streamed turn the client
hangs up on (`--hangup` of them, after 0-5 chunks) expects nothing more; every other turn
must end with exactly one terminal: a usage chunk (done) or one error chunk, then [DONE]
(streamed), or a status and body (not streamed). Bad requests must get a 4xx.

`--kill STAGE@F` SIGKILLs that stage's replica (found through the app's handle: the stage
reports its pid) once a fraction F of the turns has finished; this needs a Ray connection
(`--ray-address`, default auto) on the node that runs the replica. Turns that end with
`stage_unavailable` between the kill and the first speech turn that succeeds after it are
the kill's; any other 5xx fails the soak. At the end the app must be idle with no leaks
(`Ingress.stats()`: every stage back to zero), polled for up to `--settle-s`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import numpy as np

KINDS = {  # kind -> weight
    "text": 3, "text_full": 1, "speech": 3, "speech_pcm": 1, "speech_mp3": 1,
    "speech_opus": 1, "speech_full": 1, "image": 1, "audio_in": 1, "bad": 1,
}
STAGES = {"thinker": "Thinker", "talker": "Talker", "code2wav": "Code2Wav"}
BAD_BODIES = [
    b"{not json",
    json.dumps({"messages": []}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}).encode(),
    json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}).encode(),
    b"[" * 1000 + b"]" * 1000,
]


@dataclass
class Turn:
    index: int
    kind: str
    start: float = 0.0
    end: float = 0.0
    status: int = 0
    terminal: str = ""  # done | error | refused | hangup | none
    reason: str = ""
    chunks: int = 0
    audio_bytes: int = 0
    terminals: int = 0  # terminal events seen (must be exactly 1 unless hung up)


@dataclass
class SoakResult:
    turns: list[Turn] = field(default_factory=list)
    kill: dict[str, Any] | None = None
    final_stats: dict[str, Any] | None = None
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        by = Counter(f"{t.kind}:{t.terminal}" for t in self.turns)
        reasons = Counter(t.reason for t in self.turns if t.terminal == "error")
        lat = sorted(t.end - t.start for t in self.turns if t.terminal == "done")
        pct = (lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))], 3)) if lat else None
        return {"turns": len(self.turns), "seconds": round(self.seconds, 1),
                "outcomes": dict(Counter(t.terminal for t in self.turns)),
                "by_kind": dict(sorted(by.items())), "error_reasons": dict(reasons),
                "done_latency_s": {"p50": pct(0.5), "p99": pct(0.99)} if lat else {},
                "kill": self.kill, "idle_at_end": bool(self.final_stats
                                                       and self.final_stats.get("idle")),
                "leaks_at_end": (self.final_stats or {}).get("leaks"),
                "problems": self.problems, "ok": not self.problems}


# ---------------------------------------------------------------------------------------
# Requests


def _media() -> tuple[str, str]:
    import soundfile as sf
    from PIL import Image

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(buf, format="PNG")
    png = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    t = np.arange(8000) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000, format="WAV")
    return png, base64.b64encode(buf.getvalue()).decode()


def build_request(kind: str, rng: random.Random, media: tuple[str, str],
                  max_tokens: int, speech_codes: int | None = None) -> tuple[bytes, bool]:
    """(body, streamed) of one turn of `kind`."""
    if kind == "bad":
        return rng.choice(BAD_BODIES), False
    png, wav = media
    content: Any = f"Tell me something about the number {rng.randint(0, 10**6)}."
    body: dict[str, Any] = {"max_tokens": max_tokens, "stream": not kind.endswith("_full"),
                            "seed": rng.randint(0, 2**31)}
    if kind == "image":
        content = [{"type": "text", "text": "What is this?"},
                   {"type": "image_url", "image_url": {"url": png}}]
    if kind == "audio_in":
        content = [{"type": "text", "text": "What do you hear?"},
                   {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]
    body["messages"] = [{"role": "user", "content": content}]
    if kind.startswith("speech") or kind == "audio_in":
        fmt = {"speech_pcm": "pcm16", "speech_mp3": "mp3", "speech_opus": "opus"}.get(kind, "wav")
        body.update(modalities=["text", "audio"], audio={"format": fmt, "voice": "alloy"})
        if speech_codes:  # random weights stop speaking at random: bound the speech
            body["omniray"] = {"fixed_speech_codes": speech_codes}
    return json.dumps(body).encode(), body["stream"]


async def run_turn(session: aiohttp.ClientSession, url: str, turn: Turn, body: bytes,
                   streamed: bool, hangup_after: int | None) -> None:
    turn.start = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/chat/completions", data=body,
                                headers={"content-type": "application/json"}) as r:
            turn.status = r.status
            if r.status >= 400 or not streamed:
                payload = await r.read()
                turn.terminals = 1
                try:
                    obj = json.loads(payload)
                except ValueError:
                    obj = {}
                err = obj.get("error") if isinstance(obj, dict) else None
                if r.status >= 400:
                    turn.terminal = "refused" if r.status < 500 else "error"
                    turn.reason = str((err or {}).get("code", r.status))
                else:
                    turn.terminal = "done" if obj.get("choices") else "none"
                return
            done_seen = False
            async for raw in r.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done_seen = True
                    break
                obj = json.loads(data)
                turn.chunks += 1
                if "error" in obj:
                    turn.terminal, turn.terminals = "error", turn.terminals + 1
                    turn.reason = str(obj["error"].get("code"))
                elif obj.get("usage") is not None:
                    turn.terminal, turn.terminals = "done", turn.terminals + 1
                for c in obj.get("choices") or []:
                    audio = (c.get("delta") or {}).get("audio") or {}
                    turn.audio_bytes += len(audio.get("data") or "")
                if hangup_after is not None and turn.chunks >= hangup_after:
                    turn.terminal = "hangup"
                    return  # leaving the context manager closes the connection
            if not done_seen or not turn.terminal:
                turn.terminal = turn.terminal or "none"
                turn.reason = turn.reason or "stream ended without a terminal event"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        turn.terminal, turn.reason = "none", f"{type(e).__name__}: {e}"
    finally:
        turn.end = time.perf_counter()


# ---------------------------------------------------------------------------------------
# Ray side: kill a stage, read the app's invariants


def _handles(app: str, address: str) -> Any:
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, namespace="serve")
    return serve


def kill_stage(app: str, stage: str, address: str) -> dict[str, Any]:
    serve = _handles(app, address)
    stats = serve.get_deployment_handle(STAGES[stage], app_name=app).stats.remote().result(
        timeout_s=30)
    os.kill(stats["pid"], signal.SIGKILL)
    return {"stage": stage, "pid": stats["pid"]}


def app_stats(app: str, address: str) -> dict[str, Any]:
    serve = _handles(app, address)
    return serve.get_app_handle(app).stats.remote().result(timeout_s=60)


def settle(app: str, address: str, seconds: float) -> dict[str, Any]:
    """The app's stats once idle with no leaks, or the last reading after `seconds`."""
    deadline = time.time() + seconds
    while True:
        try:
            st = app_stats(app, address)
        except Exception as e:  # noqa: BLE001 - a restarting stage; try again
            st = {"idle": False, "leaks": [f"stats failed: {e}"]}
        if (st.get("idle") and not st.get("leaks")) or time.time() > deadline:
            return st
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------
# The run


async def soak(url: str, *, turns: int | None = None, duration_s: float | None = None,
               concurrency: int = 8, hangup: float = 0.1, seed: int = 0,
               max_tokens: int = 16, speech_codes: int | None = None,
               kill: str | None = None, app: str = "omniray", ray_address: str = "auto",
               settle_s: float = 60.0, request_timeout_s: float = 300.0,
               progress_every: int = 0) -> SoakResult:
    if turns is None and duration_s is None:
        raise ValueError("give turns or duration_s")
    rng = random.Random(seed)
    media = _media()
    kinds, weights = zip(*KINDS.items())
    kill_stage_name, kill_at = (kill.split("@") if kill else (None, None))
    if kill_stage_name is not None and kill_stage_name not in STAGES:
        raise ValueError(f"--kill stage must be one of {sorted(STAGES)}")
    result = SoakResult()
    _handles(app, ray_address)  # connect to Ray once, here, not from executor threads
    started = time.perf_counter()
    next_index = 0
    finished = 0
    loop = asyncio.get_running_loop()

    def more() -> bool:
        if turns is not None and next_index >= turns:
            return False
        return duration_s is None or time.perf_counter() - started < duration_s

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal next_index, finished
        while more():
            i, next_index = next_index, next_index + 1
            kind = rng.choices(kinds, weights)[0]
            body, streamed = build_request(kind, rng, media, max_tokens, speech_codes)
            hang = rng.randint(0, 5) if streamed and rng.random() < hangup else None
            turn = Turn(i, kind)
            result.turns.append(turn)
            await run_turn(session, url, turn, body, streamed, hang)
            finished += 1
            if progress_every and finished % progress_every == 0:
                seen = Counter(t.terminal for t in result.turns if t.end)
                print(f"[soak] {finished} turns in {time.perf_counter() - started:.0f} s: "
                      f"{dict(seen)}", file=sys.stderr, flush=True)
            total = turns or max(1, finished)
            if (kill_stage_name and result.kill is None
                    and finished >= float(kill_at) * total):
                result.kill = {"at_s": round(time.perf_counter() - started, 2),
                               "t": time.perf_counter()}  # claimed before the await
                result.kill.update(await loop.run_in_executor(
                    None, kill_stage, app, kill_stage_name, ray_address))

    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    result.seconds = time.perf_counter() - started
    result.final_stats = await loop.run_in_executor(None, settle, app, ray_address, settle_s)
    judge(result)
    return result


def judge(result: SoakResult) -> None:
    """Fill `result.problems` (empty = the soak passed)."""
    kill_t = result.kill["t"] if result.kill else None
    recovered = None
    if kill_t is not None:
        ok_after = [t.end for t in result.turns if t.start > kill_t and t.terminal == "done"
                    and (t.kind.startswith("speech") or t.kind == "audio_in")]
        recovered = min(ok_after, default=None)
        result.kill["recovered_after_s"] = (round(recovered - kill_t, 2)
                                            if recovered is not None else None)
        result.kill.pop("t", None)
    problems = result.problems
    for t in result.turns:
        if t.terminal == "hangup":
            continue
        if t.terminal == "none" or t.terminals != 1:
            problems.append(f"turn {t.index} ({t.kind}): {t.terminals} terminal events "
                            f"({t.reason or 'no terminal'})")
        elif t.kind == "bad" and t.terminal != "refused":
            problems.append(f"turn {t.index}: a bad request got {t.status} {t.terminal}")
        elif t.kind != "bad" and t.terminal in ("error", "refused"):
            in_kill = (kill_t is not None and t.end >= kill_t
                       and (recovered is None or t.start <= recovered)
                       and t.reason == "stage_unavailable")
            if not in_kill:
                problems.append(f"turn {t.index} ({t.kind}): {t.status} {t.reason}")
    st = result.final_stats or {}
    if not st.get("idle"):
        problems.append(f"the app is not idle at the end: {json.dumps(st, default=str)[:800]}")
    if st.get("leaks"):
        problems.append(f"leaks at the end: {st['leaks']}")
    if kill_t is not None and recovered is None:
        problems.append("no speech turn succeeded after the kill")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--duration", type=float, default=None, help="seconds (instead of --turns)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--hangup", type=float, default=0.1, help="fraction of streamed turns")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--speech-codes", type=int, default=None,
                    help="fixed speech codes per speech turn (random weights speak at random)")
    ap.add_argument("--kill", default=None, help="STAGE@FRACTION, e.g. talker@0.5")
    ap.add_argument("--app", default="omniray")
    ap.add_argument("--ray-address", default="auto")
    ap.add_argument("--settle", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the summary and every turn as JSON")
    args = ap.parse_args(argv)
    if args.turns is None and args.duration is None:
        args.turns = 1000
    res = asyncio.run(soak(args.url, turns=args.turns, duration_s=args.duration,
                           concurrency=args.concurrency, hangup=args.hangup, seed=args.seed,
                           max_tokens=args.max_tokens, speech_codes=args.speech_codes,
                           kill=args.kill, app=args.app, ray_address=args.ray_address,
                           settle_s=args.settle, progress_every=50))
    summary = res.summary()
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "turns": [asdict(t) for t in res.turns]}, f)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Code2Wav on one GPU: full-size random flow + vocoder, the engine as it ships
(`Code2WavEngineConfig()`; `--precision` picks an opt-in precision, `--n-timesteps` the
CFM's Euler steps: `--precision fp16 --n-timesteps 5` is the reference's
`Token2wav(float16=True, n_timesteps=5)`).

Check (exit 1 on failure): eight staggered streams of odd lengths (two voices) decoded
together give each stream the PCM it gets decoded alone, within 1e-4 and at least 80 dB
SNR for every chunk (batching must not change a stream's audio; the kernels over other
batch sizes may sum in another order). In a mode other than fp32 / 10 steps the same
streams are also compared with the fp32 / 10-step engine's PCM (SNR over all the audio and
the lowest a chunk; reported, not checked: the opt-ins trade precision for time), and that
engine's steps are timed beside the mode's.
Timings: wall ms of `engine.step()` (it ends with the PCM on the host) with B streams each
a full chunk ready, steady state, for each of --batches; a new stream's first chunk (its
voice template cached); the warm-up's seconds. `--profile`: each batch's step under
torch.profiler: kernel count, kernel ms, the top kernels and where the GPU idles.

    python -m bench.gpu_code2wav [--batches 1,2,4,8] [--iters 10] [--precision fp32]
        [--n-timesteps 10] [--profile] [--out F.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import numpy as np
import torch

from bench.cuda_timing import kernel_profile
from pipeline.code2wav.assets import random_code2wav, random_vocoder
from pipeline.code2wav.engine import Code2WavEngine, Code2WavEngineConfig
from pipeline.code2wav.voice import VoicePrompt
from pipeline.config import Code2WavConfig
from pipeline.handoff import CodeChunk

STAGGERED = [150, 57, 33, 120, 9, 90, 61, 200]  # codes a stream: odd final chunks


def voice(seed: int, codes: int) -> VoicePrompt:
    g = torch.Generator().manual_seed(seed)
    return VoicePrompt(torch.randint(0, 6561, (1, codes), generator=g),
                       torch.randn(1, 192, generator=g), torch.randn(1, 2 * codes, 80, generator=g))


def codes(seed: int, n: int) -> list[int]:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def schedule(lengths: list[int], seed: int, only: int | None = None):
    """Rounds of (stream id, codes, final, first) pieces of 9 codes: stream i starts in round
    i. `only`: that stream's pieces alone, in the same rounds."""
    streams = {f"s{i}": codes(seed + i, n) for i, n in enumerate(lengths)}
    pos, rounds, r = dict.fromkeys(streams, 0), [], 0
    while any(pos[k] < len(c) for k, c in streams.items()):
        rnd = []
        for i, (k, c) in enumerate(streams.items()):
            if r >= i and pos[k] < len(c):
                n = min(9, len(c) - pos[k])
                if only is None or only == i:
                    rnd.append((k, c[pos[k]: pos[k] + n], pos[k] + n == len(c), pos[k] == 0))
                pos[k] += n
        rounds.append(rnd)
        r += 1
    return rounds


def play(engine: Code2WavEngine, rounds, voices) -> dict[str, list[np.ndarray]]:
    """Each stream's PCM chunks, the schedule fed round by round with a step after each;
    the streams closed at the end."""
    out: dict[str, list[np.ndarray]] = {}
    for rnd in rounds:
        for sid, piece, final, first in rnd:
            if first:
                engine.open(sid, voices[int(sid[1:]) % len(voices)])
                out[sid] = []
            engine.feed(sid, CodeChunk(sid, tuple(piece), final))
        for chunk in engine.step():
            out[chunk.request_id].append(chunk.pcm)
    for sid, pcm in engine.drain().items():
        out[sid].extend(pcm)
    for sid in out:  # the stage server closes a finished turn; so does this
        engine.abort(sid)
    return out


def snr_db(a: np.ndarray, b: np.ndarray) -> float:
    a, err = a.astype(np.float64), (a - b).astype(np.float64)
    return float(10 * np.log10((a**2).sum() / max((err**2).sum(), 1e-300)))


def compare(ref, got, label: str) -> tuple[float, float]:
    """(largest abs difference, lowest SNR dB) over every stream's chunks."""
    worst, low = 0.0, float("inf")
    for sid in ref:
        for a, b in zip(ref[sid], got[sid], strict=True):
            worst = max(worst, float(np.abs(a - b).max()))
            low = min(low, snr_db(a, b))
    print(f"  {label}: max abs {worst:.2e}, lowest SNR {low:.1f} dB")
    return worst, low


def overall_snr_db(ref, got) -> float:
    """SNR dB of all the streams' audio together."""
    return snr_db(*(np.concatenate([c for sid in ref for c in x[sid]]) for x in (ref, got)))


def step_table(engine: Code2WavEngine, v: VoicePrompt, batches: list[int], iters: int,
               label: str) -> dict:
    rows: dict = {}
    for b in batches:
        wall = steady_step_ms(engine, v, b, iters)
        rows[b] = round(wall, 2)
        print(f"  {label} B={b}: step {wall:7.2f} ms ({wall / b:6.2f} ms a chunk)")
    return rows


def steady_step_ms(engine: Code2WavEngine, v: VoicePrompt, b: int, iters: int) -> float:
    """Median wall ms of a step with b streams each a full chunk ready, past the caches'
    growth and trimming."""
    ids = [f"t{b}_{i}" for i in range(b)]
    for sid in ids:
        engine.open(sid, v)
        engine.feed(sid, CodeChunk(sid, (4218,) * 3, False))
    walls = []
    for k in range(5 + iters):
        for i, sid in enumerate(ids):
            engine.feed(sid, CodeChunk(sid, tuple(codes(1000 * k + i, engine.cfg.chunk_size)),
                                       False))
        t0 = time.perf_counter()
        out = engine.step()
        torch.cuda.synchronize()
        if k >= 5:
            walls.append((time.perf_counter() - t0) * 1e3)
            assert len(out) == b, (len(out), b)
    for sid in ids:
        engine.abort(sid)
    return float(np.median(walls))


def first_chunk_ms(engine: Code2WavEngine, v: VoicePrompt, iters: int = 5) -> float:
    times = []
    for i in range(iters):
        sid = f"first{i}"
        t0 = time.perf_counter()
        engine.open(sid, v)
        engine.feed(sid, CodeChunk(sid, tuple(codes(i, 28)), False))
        engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        engine.abort(sid)
    return float(np.median(times))


def profile(engine: Code2WavEngine, v: VoicePrompt, b: int) -> dict:
    """One steady step of b chunks: kernels, kernel ms, the top ones and the idle gaps."""
    ids = [f"p{b}_{i}" for i in range(b)]
    for sid in ids:
        engine.open(sid, v)
        engine.feed(sid, CodeChunk(sid, (4218,) * 3, False))

    def feed(k: int) -> None:
        for sid in ids:
            engine.feed(sid, CodeChunk(sid, tuple(codes(k, engine.cfg.chunk_size)), False))

    for k in range(5):
        feed(k)
        engine.step()
    feed(5)
    n, ms, top, seq = kernel_profile(engine.step)
    for sid in ids:
        engine.abort(sid)
    print(f"  profile B={b}: {n} kernels, {ms:.2f} ms of kernel time")
    for name, us, count in top:
        print(f"    {us / 1e3:7.2f} ms {count:6d}x  {name}")
    return {"kernels": n, "kernel_ms": round(ms, 2), "top": top, "timeline": timeline(seq)}


def timeline(seq: list[tuple[float, str, float]], top: int = 8) -> dict:
    """Where the GPU waits inside a step: from the first kernel's start to the last one's end,
    the time no kernel runs, and its largest gaps with the kernels on either side (a gap
    before a graph's first kernel is host work before its replay, or its launch).
    seq: (start us, name, us) sorted by start."""
    if not seq:
        return {}
    gaps, end = [], seq[0][0] + seq[0][2]
    for i in range(1, len(seq)):
        start, _, us = seq[i]
        if start > end:
            gaps.append((start - end, i))
        end = max(end, start + us)
    span = end - seq[0][0]
    idle = sum(g for g, _ in gaps)
    largest = [{"us": round(g, 1), "at": i, "after": seq[i - 1][1][:70], "before": seq[i][1][:70]}
               for g, i in sorted(gaps, reverse=True)[:top]]
    print(f"  timeline: {span / 1e3:.2f} ms from the first kernel to the last, "
          f"{idle / 1e3:.2f} ms of it with no kernel running ({len(gaps)} gaps)")
    for g in largest:
        print(f"    {g['us']:8.1f} us idle before kernel {g['at']}: "
              f"after {g['after']} / before {g['before']}")
    return {"span_ms": round(span / 1e3, 3), "idle_ms": round(idle / 1e3, 3),
            "gaps": len(gaps), "largest": largest}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_code2wav",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-codes", type=int, default=25)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--batches", default="1,2,4,8", help="chunks a step to time (up to 32)")
    ap.add_argument("--precision", choices=["fp32", "tf32", "bf16", "fp16"], default="fp32",
                    help="token2wav_precision: the opt-ins are compared with fp32")
    ap.add_argument("--n-timesteps", type=int, default=10,
                    help="the CFM's Euler steps (engine n_timesteps); compared with 10")
    ap.add_argument("--layout", choices=["minicpmo-utils-1.0.7", "cosyvoice2"],
                    default="minicpmo-utils-1.0.7", help="which streaming vocoder")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch's CPU threads, as a replica runs its host work")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    cfg = Code2WavConfig()
    flow, _ = random_code2wav(cfg, seed=0)
    flow = flow.cuda().eval()
    hift = random_vocoder(cfg, 0, args.layout).cuda().eval()
    voices = [voice(1, args.prompt_codes), voice(2, args.prompt_codes + 12)]
    ecfg = Code2WavEngineConfig(token2wav_precision=args.precision,
                                n_timesteps=args.n_timesteps, max_streams=max(8, *batches))
    mode = f"{args.precision}, {args.n_timesteps} steps"
    # the flow is converted in place: the fp32 / 10-step engine gets a copy
    exact = Code2WavEngineConfig(max_streams=ecfg.max_streams)
    fp32_flow = copy.deepcopy(flow) if ecfg != exact else None
    engine = Code2WavEngine(flow, hift, cfg, ecfg)
    t0 = time.perf_counter()
    engine.warmup(voices[0])
    result: dict = {"precision": args.precision, "n_timesteps": args.n_timesteps,
                    "warmup_s": round(time.perf_counter() - t0, 1)}

    print(f"batched against alone ({len(STAGGERED)} staggered streams, {mode})")
    together = play(engine, schedule(STAGGERED, seed=8), voices)
    alone = {}
    for i in range(len(STAGGERED)):
        alone.update(play(engine, schedule(STAGGERED, seed=8, only=i), voices))
    worst, low = compare(alone, together, "together vs alone")
    ok = worst <= 1e-4 and low >= 80
    result["batched_vs_alone"] = {"max_abs": worst, "min_snr_db": low}
    if fp32_flow is not None:
        base = Code2WavEngine(fp32_flow, hift, cfg, exact)
        ref = play(base, schedule(STAGGERED, seed=8), voices)
        worst, low = compare(ref, together, f"{mode} vs fp32, 10 steps")
        every = overall_snr_db(ref, together)
        print(f"  {mode} vs fp32, 10 steps: SNR {every:.1f} dB over all the audio")
        result["vs_fp32"] = {"max_abs": worst, "min_snr_db": low, "snr_db": every}
        print("timings of fp32, 10 steps (median wall ms a step)")
        base.warmup(voices[0])
        result["fp32_step_ms"] = step_table(base, voices[0], batches, args.iters, "fp32")
        del base, fp32_flow
        engine = Code2WavEngine(flow, hift, cfg, ecfg)  # the precision's flags back on
        engine.warmup(voices[0])

    print(f"timings of {mode} (median wall ms a step)")
    rows = step_table(engine, voices[0], batches, args.iters, args.precision)
    rows["first_chunk_ms"] = round(first_chunk_ms(engine, voices[0]), 2)
    print(f"  first chunk of a new stream {rows['first_chunk_ms']} ms; "
          f"warm-up {result['warmup_s']} s")
    result["step_ms"] = rows
    if args.profile:
        result["profile"] = {b: profile(engine, voices[0], b) for b in batches}
    print("max memory allocated", round(torch.cuda.max_memory_allocated() / 2**30, 2), "GiB")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Code2Wav on one GPU: full-size random flow + HiFT, fp32 (as the reference).

Checks (exit 1 on failure), against the plain eager path (`Code2WavEngineConfig()`):
  * the slot pool with CUDA graphs (flow step and HiFT), one 30-chunk stream and 8 staggered
    streams (two voices, odd final lengths): PCM max abs diff <= 1e-4 and SNR >= 80 dB for every
    chunk; the per-chunk diffs are printed (no growth from chunk to chunk).
Timings (wall clock of `engine.step()`, which ends with the PCM on the host; flow = CUDA events
around the flow step), steady state (caches trimmed to prompt + 100 frames), B streams each
with a full chunk ready:
  * plain eager (the old engine path, B equal-shape streams), slot pool eager, slot pool + graphs;
  * a new stream's first chunk (template cache on);
  * the shipped configuration with and without its split DiT matmuls; --quick: the shipped one
    alone (its precision and timings, no bf16 run: about 80 s with --no-precision, where the
    whole run takes over 200 s of which each configuration's warm-up is ~60);
  * with --compare KNOB[,KNOB...] only the shipped configuration with each boolean knob
    flipped (e.g. `token2wav_dit_pool_attention`, `token2wav_vocoder_window_kernel`; several:
    one baseline, then each flipped alone, in one process; `A+B` flips A and B together), its
    precision pass on the shipped configuration with each flipped (skip it with
    --no-precision; it also says whether each gives the shipped step's PCM bit for bit, what
    an exact knob must), and no start-up warm-up (graphs are captured in the timed engines'
    first steps); --batches limits the timed batch sizes (default 1,2,4,8);
  * with --profile, a torch.profiler table of one B=1 and one B=8 graphed step: kernel count
    and the top kernels; with --sequence also one DiT block's kernels in launch order;
  * with --profile-ops (alone: nothing else runs), which ops launch a step's costliest
    kernels: the shipped configuration without its CUDA graphs (the same kernels, launched
    one by one, so each is tied to its aten op, input shapes and source line), one step at
    each of --batches.

    python bench/gpu_code2wav.py [--prompt-codes 25] [--iters 10] [--profile [--sequence]] [--quick]
        [--no-precision] [--compare KNOB[,KNOB...]] [--batches 1,2,4,8] [--out F.json]
    python bench/gpu_code2wav.py --profile-ops [--batches 1,8]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from collections import Counter

import numpy as np
import torch

from pipeline.code2wav.assets import random_code2wav, random_vocoder
from pipeline.code2wav.engine import Code2WavEngine, Code2WavEngineConfig
from pipeline.code2wav.voice import VoicePrompt
from pipeline.config import Code2WavConfig
from pipeline.handoff import CodeChunk

FAST = Code2WavEngineConfig(token2wav_slot_pool=True, token2wav_cfm_cuda_graph=True,
                            token2wav_hift_cuda_graph=True)
SLOTS_EAGER = Code2WavEngineConfig(token2wav_slot_pool=True)
FAST_TF32 = Code2WavEngineConfig(token2wav_slot_pool=True, token2wav_cfm_cuda_graph=True,
                                 token2wav_hift_cuda_graph=True, token2wav_precision="tf32")
FAST_C = Code2WavEngineConfig(token2wav_slot_pool=True, token2wav_cfm_cuda_graph=True,
                              token2wav_hift_cuda_graph=True, token2wav_compile_estimator=True)
SHIPPED = Code2WavEngineConfig(  # serve_config.yaml's
    token2wav_slot_pool=True, token2wav_cfm_cuda_graph=True, token2wav_hift_cuda_graph=True,
    token2wav_compile_estimator=True, token2wav_vocoder_gemm_convs=True,
    token2wav_dit_split_matmuls=True, token2wav_dit_pool_attention=True,
    token2wav_vocoder_fused_snakes=True, token2wav_vocoder_window_kernel=True,
    token2wav_dit_tails_in_post=True, token2wav_dit_kv_write_kernel=True,
    token2wav_vocoder_fused_biases=True, token2wav_vocoder_frame_major=True)
UNSPLIT = dataclasses.replace(SHIPPED, token2wav_dit_split_matmuls=False)
SHIPPED_BF16 = dataclasses.replace(SHIPPED, token2wav_precision="bf16")  # opt-in
FAST_C_TF32 = Code2WavEngineConfig(
    token2wav_slot_pool=True, token2wav_cfm_cuda_graph=True, token2wav_hift_cuda_graph=True,
    token2wav_compile_estimator=True, token2wav_precision="tf32")


def flipped(knobs: str) -> Code2WavEngineConfig:
    """The shipped configuration with a boolean knob, or several joined by '+', the other
    way."""
    return dataclasses.replace(SHIPPED, **{k: not getattr(SHIPPED, k) for k in knobs.split("+")})


def flipped_name(knobs: str) -> str:
    return "shipped, " + ", ".join(f"{k}={not getattr(SHIPPED, k)}" for k in knobs.split("+"))


def voice(seed: int, codes: int, dev) -> VoicePrompt:
    g = torch.Generator().manual_seed(seed)
    return VoicePrompt(torch.randint(0, 6561, (1, codes), generator=g),
                       torch.randn(1, 192, generator=g), torch.randn(1, 2 * codes, 80, generator=g))


def codes(seed: int, n: int) -> list[int]:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def play(engine, schedule, voices) -> dict[str, list[np.ndarray]]:
    out: dict[str, list[np.ndarray]] = {}
    for rnd in schedule:
        for sid, piece, final, first in rnd:
            if first:
                engine.open(sid, voices[int(sid[1:]) % len(voices)])
                out[sid] = []
            engine.feed(sid, CodeChunk(sid, tuple(piece), final))
        for chunk in engine.step():
            out[chunk.request_id].append(chunk.pcm)
    for sid, pcm in engine.drain().items():
        out[sid].extend(pcm)
    return out


def schedule(lengths: list[int], stagger: int, seed: int):
    streams = {f"s{i}": codes(seed + i, n) for i, n in enumerate(lengths)}
    pos, rounds, r = dict.fromkeys(streams, 0), [], 0
    while any(pos[k] < len(c) for k, c in streams.items()):
        rnd = []
        for i, (k, c) in enumerate(streams.items()):
            if r >= stagger * i and pos[k] < len(c):
                n = min(9, len(c) - pos[k])
                rnd.append((k, c[pos[k]: pos[k] + n], pos[k] + n == len(c), pos[k] == 0))
                pos[k] += n
        rounds.append(rnd)
        r += 1
    return rounds


def same_as(shipped, got, label) -> dict:
    """A flipped configuration's PCM against the shipped configuration's: bit for bit, or
    the largest difference (reported, not a check: the adaLN table is not exact)."""
    pairs = [(a, b) for sid in shipped for a, b in zip(shipped[sid], got[sid], strict=True)]
    bitwise = all(np.array_equal(a, b) for a, b in pairs)
    worst = max((float(np.abs(a - b).max()) for a, b in pairs), default=0.0)
    print(f"  {label} against the shipped step: "
          + ("bit for bit" if bitwise else f"max abs {worst:.2e}"))
    return {"bitwise": bitwise, "max_abs": worst}


def compare(ref, got, label) -> tuple[float, float]:
    worst, low = 0.0, 1e9
    for sid in ref:
        diffs = []
        for a, b in zip(ref[sid], got[sid], strict=True):
            err = float(np.abs(a - b).max())
            snr = float(10 * np.log10((a.astype(np.float64) ** 2).sum()
                                      / max(((a - b).astype(np.float64) ** 2).sum(), 1e-300)))
            diffs.append(err)
            worst, low = max(worst, err), min(low, snr)
        print(f"  {label} {sid} ({len(diffs)} chunks) max abs per chunk: "
              + " ".join(f"{d:.1e}" for d in diffs))
    print(f"  {label}: worst max abs {worst:.2e}, lowest SNR {low:.1f} dB")
    return worst, low


def steady_step_ms(engine, v, b: int, iters: int, seed: int) -> tuple[float, float]:
    """(step wall ms, flow device ms) with b streams each a full chunk ready, past trimming."""
    ids = [f"t{seed}_{i}" for i in range(b)]
    for sid in ids:
        engine.open(sid, v)
        engine.feed(sid, CodeChunk(sid, (4218,) * 3, False))
    k = 0

    def feed():
        nonlocal k
        for sid in ids:
            chunk = codes(seed * 1000 + k, engine.cfg.chunk_size)
            engine.feed(sid, CodeChunk(sid, tuple(chunk), False))
            k += 1

    for _ in range(5):  # growth, trimming, captures
        feed()
        engine.step()
    torch.cuda.synchronize()
    walls, flows = [], []
    original = engine._flow_slots if engine.pool is not None else None
    events = []

    def timed_flow(plan, spk):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        mel = original(plan, spk)
        e.record()
        events.append((s, e))
        return mel

    if original is not None:
        engine._flow_slots = timed_flow
    for _ in range(iters):
        feed()
        t0 = time.perf_counter()
        out = engine.step()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1000)
        assert len(out) == b, (len(out), b)
    if original is not None:
        engine._flow_slots = original
        flows = [s.elapsed_time(e) for s, e in events]
    for sid in ids:
        engine.abort(sid)
    return float(np.median(walls)), float(np.median(flows)) if flows else float("nan")


def first_chunk_ms(engine, v, iters: int) -> float:
    times = []
    for i in range(iters):
        sid = f"first{i}"
        t0 = time.perf_counter()
        engine.open(sid, v)
        engine.feed(sid, CodeChunk(sid, tuple(codes(i, 28)), False))
        engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
        engine.abort(sid)
    return float(np.median(times))


def profile(engine, v, b: int, sequence: bool = False) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    ids = [f"p{b}_{i}" for i in range(b)]
    for sid in ids:
        engine.open(sid, v)
        engine.feed(sid, CodeChunk(sid, (4218,) * 3, False))
    # the host's time in each CUDA graph launch of a step (a large graph's launch is host
    # work the GPU may wait for), outside the profiler: its own hooks slow the launches
    launches: list[list[float]] = []
    replay = torch.cuda.CUDAGraph.replay

    def timed(graph):
        t0 = time.perf_counter()
        replay(graph)
        launches[-1].append((time.perf_counter() - t0) * 1e3)

    torch.cuda.CUDAGraph.replay = timed
    try:
        for k in range(6):
            for sid in ids:
                engine.feed(sid, CodeChunk(sid, tuple(codes(k, 25)), False))
            if k < 5:
                launches.append([])
                engine.step()
    finally:
        torch.cuda.CUDAGraph.replay = replay
    torch.cuda.synchronize()
    steady = [row for row in launches[2:] if len(row) == len(launches[-1])]
    launch_ms = [round(float(np.median(col)), 3) for col in zip(*steady)]
    print(f"  graph launches a step B={b} (host ms each, median of {len(steady)} steps): {launch_ms}")
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        engine.step()
        torch.cuda.synchronize()
    host = host_profile(engine, ids, b)
    for sid in ids:
        engine.abort(sid)
    kernels: Counter = Counter()
    calls: Counter = Counter()
    seq = []  # (start us, name, us) of every kernel, in launch order
    for e in p.events():
        if e.device_type.name == "CUDA":
            us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            kernels[e.name] += us
            calls[e.name] += 1
            seq.append((e.time_range.start, e.name, us))
    total = sum(kernels.values()) / 1000
    top = [(name[:90], round(us / 1000, 2), calls[name]) for name, us in kernels.most_common(25)]
    print(f"  profile B={b}: {sum(calls.values())} kernels, {total:.1f} ms of kernel time")
    for name, ms, n in top:
        print(f"    {ms:7.2f} ms {n:6d}x  {name}")
    out = {"kernels": sum(calls.values()), "kernel_ms": round(total, 2), "top": top}
    out["timeline"] = timeline(sorted(seq))
    out["graph_launch_ms"] = launch_ms
    out["host"] = host
    if sequence:
        out["sequence"] = block_sequence(sorted(seq))
    return out


_STEP_FILES = {"engine.py", "slots.py", "batching.py", "stream.py"}
_STEP_PARTS = {"step", "_slot_step", "_plain_step", "_flow_slots", "_next", "plan", "commit",
               "vocode"}


def host_profile(engine, ids: list[str], b: int, steps: int = 3, top: int = 14) -> list:
    """The host's side of a step (cProfile over `steps` steps, ms a step): where a step's
    wall beyond its GPU timeline goes. A function's own time holds what the host waits for
    in it too (the PCM's copy waits for the GPU)."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    for k in range(steps):
        for sid in ids:
            engine.feed(sid, CodeChunk(sid, tuple(codes(100 + k, 25)), False))
        pr.enable()
        engine.step()
        torch.cuda.synchronize()
        pr.disable()
    rows = []
    for (path, line, fn), (_, calls, own, cum, _) in pstats.Stats(pr).stats.items():
        where = f"{path.rsplit('/', 2)[-1]}:{line} {fn}" if line else fn
        rows.append((round(own * 1e3 / steps, 2), round(cum * 1e3 / steps, 2),
                     round(calls / steps, 1), where[:90]))
    rows.sort(reverse=True)
    # the step's parts: the batcher, the plan's host tensors, the flow, the vocoder
    parts = [r for r in rows if r[3].split(":")[0] in _STEP_FILES
             and r[3].split(" ")[-1] in _STEP_PARTS]
    print(f"  host B={b} (cProfile, ms a step: own / cumulative, calls a step):")
    for own, cum, calls, where in rows[:top] + sorted(parts, key=lambda r: -r[1]):
        print(f"    {own:8.2f} {cum:8.2f} {calls:8.1f}  {where}")
    return rows[:top] + parts


def timeline(seq: list[tuple[float, str, float]], top: int = 8) -> dict:
    """Where the GPU waits inside a step: from the first kernel's start to the last one's end,
    the time no kernel runs, and its largest gaps with the kernels on either side (a gap
    before a graph's first kernel is host work before its replay, its launch, or the
    profiler's hooks on that launch). seq: (start us, name, us) sorted by start."""
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


def block_sequence(seq: list[tuple[float, str, float]], dit_calls: int = 160) -> dict:
    """One DiT block's kernels in launch order (from the DiT's second attention kernel to its
    third: a block of the first Euler step), and how many kernels run before the DiT's first
    attention (the flow encoder, in_proj) and after its last (final layer, vocoder). The DiT's
    attentions are the last `dit_calls` (16 blocks x 10 Euler steps): the encoder's come first
    and the vocoder has none."""
    att = [i for i, (_, name, _) in enumerate(seq) if "attention" in name.lower()
           or "fmha" in name.lower()][-dit_calls:]
    if len(att) < 3:
        print("  sequence: fewer than 3 attention kernels found")
        return {}
    a, z = att[1], att[2]
    block = [(name[:100], round(us, 2)) for _, name, us in seq[a:z]]
    print(f"  one DiT block: {len(block)} kernels, {sum(u for _, u in block) / 1e3:.3f} ms; "
          f"{att[0]} kernels before the first attention, {len(seq) - att[-1] - 1} after the "
          f"last; {len(att)} attention kernels")
    for name, us in block:
        print(f"    {us:8.2f} us  {name}")
    return {"block": block, "before_first_attention": att[0],
            "after_last_attention": len(seq) - att[-1] - 1, "attention_kernels": len(att)}


def op_profile(engine, v, b: int, top: int = 6, per_kernel: int = 4) -> dict:
    """One eager step of B chunks under the profiler with CPU ops, shapes and stacks: for the
    `top` kernels by GPU time, the ops (name, input shapes, source line) that launched them."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    ids = [f"o{b}_{i}" for i in range(b)]
    for sid in ids:
        engine.open(sid, v)
        engine.feed(sid, CodeChunk(sid, (4218,) * 3, False))
    for k in range(4):  # the compiled regions compile in the first steps
        for sid in ids:
            engine.feed(sid, CodeChunk(sid, tuple(codes(k, 25)), False))
        if k < 3:
            engine.step()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True,
              with_stack=True) as p:
        engine.step()
        torch.cuda.synchronize()
    for sid in ids:
        engine.abort(sid)
    rows = kernel_sources(p.events(), top, per_kernel)
    print(f"  ops behind the top kernels, B={b} (eager step; GPU ms, launches):")
    for r in rows:
        print(f"    {r['ms']:8.2f} ms {r['n']:5d}x  {r['kernel'][:110]}")
        for o in r["ops"]:
            print(f"        {o['ms']:7.2f} ms {o['n']:5d}x  {o['op']} {o['shapes'][:80]}  @ {o['site']}")
    return {"kernels": rows}


def kernel_sources(events, top: int = 6, per_kernel: int = 4) -> list[dict]:
    """Profiler events (CPU ops with `.kernels` and shapes, their callers as `cpu_parent`: aten
    ops, then Python frames) -> the `top` kernel names by GPU time, each with the `per_kernel`
    costliest launchers: the aten ops from the launching one out ("copy_<clone<reshape"), its
    input shapes, and the innermost source line under pipeline/ ("?" if none)."""
    by_kernel: dict[str, Counter] = {}
    count: dict[str, Counter] = {}
    for e in events:
        kernels = getattr(e, "kernels", None) or []
        if not kernels:
            continue
        ops, site, up = [], "?", e
        while up is not None:  # the op's callers: aten ops, then Python frames (with_stack)
            if up.name.startswith("aten::") and site == "?":
                ops.append(up.name[6:])
            elif "pipeline/" in up.name:
                site = up.name.split("pipeline/", 1)[1]
                break
            up = up.cpu_parent
        key = ("<".join(ops) or e.name, str(getattr(e, "input_shapes", "") or ""), site)
        for k in kernels:
            by_kernel.setdefault(k.name, Counter())[key] += k.duration
            count.setdefault(k.name, Counter())[key] += 1
    totals = Counter({name: sum(c.values()) for name, c in by_kernel.items()})
    rows = []
    for name, us in totals.most_common(top):
        ops = [{"op": op, "shapes": shapes, "site": site, "ms": round(t / 1e3, 3),
                "n": count[name][(op, shapes, site)]}
               for (op, shapes, site), t in by_kernel[name].most_common(per_kernel)]
        rows.append({"kernel": name, "ms": round(us / 1e3, 3),
                     "n": sum(count[name].values()), "ops": ops})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-codes", type=int, default=25)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--sequence", action="store_true",
                    help="with --profile: one DiT block's kernels in launch order")
    ap.add_argument("--layout", choices=["minicpmo-utils-1.0.7", "cosyvoice2"],
                    default="minicpmo-utils-1.0.7", help="which streaming vocoder")
    ap.add_argument("--quick", action="store_true",
                    help="only the shipped configuration's precision and timings")
    ap.add_argument("--no-precision", action="store_true",
                    help="timings only (no comparison against the plain eager path)")
    ap.add_argument("--compare", default=None, metavar="KNOB[,KNOB...]",
                    help="time the shipped configuration, then with each boolean knob flipped "
                         "(A+B: flipped together)")
    ap.add_argument("--batches", default="1,2,4,8",
                    help="the batch sizes (chunks a step) to time, comma-separated")
    ap.add_argument("--profile-ops", action="store_true",
                    help="only: which ops launch the costliest kernels (an eager step each B)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch's CPU threads: a replica's (Ray sets OMP_NUM_THREADS=1 for "
                         "num_cpus 0), which the step's host work runs with")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    knobs = args.compare.split(",") if args.compare else []
    for knob in (k for group in knobs for k in group.split("+")):  # a typo fails here, not
        if not isinstance(getattr(SHIPPED, knob, None), bool):   # after minutes of warm-up
            ap.error(f"--compare: {knob} is not a boolean Code2WavEngineConfig field")
    batches = [int(b) for b in args.batches.split(",")]
    assert torch.cuda.is_available(), "needs CUDA"
    dev = torch.device("cuda")
    cfg = Code2WavConfig()
    flow, _ = random_code2wav(cfg, seed=0)
    hift = random_vocoder(cfg, 0, args.layout)
    flow, hift = flow.to(dev).eval(), hift.to(dev).eval()
    flow_bf16 = copy.deepcopy(flow)  # token2wav_precision bf16 converts its estimator in place
    voices = [voice(1, args.prompt_codes, dev), voice(2, args.prompt_codes + 12, dev)]
    result: dict = {"prompt_codes": args.prompt_codes}
    ok = True
    if args.profile_ops:  # the shipped step's kernels, launched one by one (no graphs)
        eager = dataclasses.replace(SHIPPED, token2wav_cfm_cuda_graph=False,
                                    token2wav_hift_cuda_graph=False)
        eng = Code2WavEngine(flow, hift, cfg, eager)
        result["ops"] = {b: op_profile(eng, voices[0], b) for b in batches}
        return finish(result, args.out, ok)

    # with --compare: the shipped configuration with each knob flipped, else the slot pool +
    # graphs
    checks = ({flipped_name(k): flipped(k) for k in knobs} if knobs
              else {"slot pool + graphs": FAST})
    print(f"precision: {', '.join(checks)} vs plain eager")
    refs = {}
    plays = (("30-chunk", [747], 1), ("8 streams", [150, 57, 33, 120, 9, 90, 61, 200], 1))
    for label, lengths, stagger in plays if not args.no_precision else ():
        sched = schedule(lengths, stagger, seed=len(lengths))
        refs[label] = (sched, play(Code2WavEngine(flow, hift, cfg), sched, voices))
    # every reference first: a compiled configuration compiles the shared flow in place
    for label, (sched, ref) in refs.items():
        # with --compare also the shipped step's own PCM, which an exact knob gives bit for bit
        shipped = play(Code2WavEngine(flow, hift, cfg, SHIPPED), sched, voices) if knobs else None
        for name, checked in checks.items():
            fast = Code2WavEngine(flow, hift, cfg, checked)
            got = play(fast, sched, voices)
            tag = label if not knobs else f"{label} {name}"
            worst, low = compare(ref, got, tag)
            sizes = {k: v for k, v in fast.counters.items() if k.startswith("batch_size")}
            result[f"precision_{tag}"] = {"max_abs": worst, "min_snr_db": low, "batches": sizes}
            ok &= worst <= 1e-4 and low >= 80
            if shipped is not None:
                result[f"vs_shipped_{tag}"] = same_as(shipped, got, tag)
        if args.quick or knobs:
            continue
        # opt-in TF32 against the same fp32 reference: reported, not a check
        got = play(Code2WavEngine(flow, hift, cfg, FAST_TF32), sched, voices)
        worst, low = compare(ref, got, label + " tf32")
        result[f"precision_{label}_tf32"] = {"max_abs": worst, "min_snr_db": low}
        Code2WavEngine(flow, hift, cfg)  # back to fp32 flags

    print("timings (median ms)")
    rows = {}

    def timings(name, ecfg):
        eng = Code2WavEngine(flow, hift, cfg, ecfg)
        t0 = time.perf_counter()
        if ecfg.token2wav_cfm_cuda_graph and args.compare is None:
            eng.warmup(voices[0])
        warm = time.perf_counter() - t0
        rows[name] = {}
        for b in batches:
            wall, fl = steady_step_ms(eng, voices[0], b, args.iters, seed=b)
            rows[name][b] = {"step_ms": round(wall, 2), "flow_ms": round(fl, 2)}
            print(f"  {name:15s} B={b}: step {wall:7.2f} ms  flow {fl:7.2f} ms  "
                  f"({wall / b:6.2f} ms a chunk)")
        rows[name]["first_chunk_ms"] = round(first_chunk_ms(eng, voices[0], 5), 2)
        rows[name]["warmup_s"] = round(warm, 1)
        print(f"  {name:15s} first chunk of a new stream {rows[name]['first_chunk_ms']} ms; "
              f"warm-up {warm:.1f} s; pool {eng.pool.nbytes() / 2**30 if eng.pool else 0:.2f} GiB")
        if ecfg.token2wav_cfm_cuda_graph:
            print(f"  graphs: {eng.graphs.captures} captures, {len(eng.graphs.graphs)} kept; "
                  f"pool attention kernel {eng.pool_attention}")
            if args.profile:
                result[f"profile {name}"] = {b: profile(eng, voices[0], b, args.sequence)
                                            for b in sorted({batches[0], batches[-1]})}
        del eng
        torch.cuda.empty_cache()

    if knobs:
        timings("shipped", SHIPPED)
        for k in knobs:
            timings(flipped_name(k), flipped(k))
        result["timings"] = rows
        return finish(result, args.out, ok)
    for name, ecfg in (("plain eager", Code2WavEngineConfig()), ("slots eager", SLOTS_EAGER),
                       ("slots + graphs", FAST), ("slots + graphs tf32", FAST_TF32)):
        if not args.quick:
            timings(name, ecfg)
    # Compiling changes the shared flow in place: everything uncompiled is done by now.
    print("precision: compiled slot pool + graphs vs plain eager")
    for label, (sched, ref) in refs.items():
        for tag, ecfg in (("compiled", FAST_C), ("shipped", SHIPPED)):
            if args.quick and tag == "compiled":
                continue
            got = play(Code2WavEngine(flow, hift, cfg, ecfg), sched, voices)
            worst, low = compare(ref, got, f"{label} {tag}")
            result[f"precision_{label}_{tag}"] = {"max_abs": worst, "min_snr_db": low}
            ok &= worst <= 1e-4 and low >= 80
    # opt-in bf16 DiT against the same fp32 reference: reported, not a check
    for label, (sched, ref) in refs.items() if not args.quick else ():
        got = play(Code2WavEngine(flow_bf16, hift, cfg, SHIPPED_BF16), sched, voices)
        worst, low = compare(ref, got, f"{label} shipped bf16")
        result[f"precision_{label}_shipped_bf16"] = {"max_abs": worst, "min_snr_db": low}
    Code2WavEngine(flow, hift, cfg)  # back to fp32 flags
    for name, ecfg in (("slots + graphs + compile", FAST_C),
                       ("slots + graphs + compile tf32", FAST_C_TF32),
                       ("shipped, DiT matmuls not split", UNSPLIT),
                       ("shipped (+ vocoder convs as GEMMs, DiT matmuls split)", SHIPPED)):
        if not (args.quick and ecfg is not SHIPPED):
            timings(name, ecfg)
    if not args.quick:
        flow = flow_bf16
        timings("shipped bf16 (opt-in)", SHIPPED_BF16)
    result["timings"] = rows
    return finish(result, args.out, ok)


def finish(result: dict, out: str | None, ok: bool) -> int:
    """Peak memory, the JSON (with --out), OK / FAILED: the exit status."""
    print("max memory allocated", round(torch.cuda.max_memory_allocated() / 2**30, 2), "GiB")
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

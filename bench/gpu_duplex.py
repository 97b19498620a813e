"""Full-duplex units on one GPU, in process (no Serve): the served Thinker (its engine's
model and KV pool, as `deployments/stages/duplex.py` builds sessions) and the duplex speech
models, full size, random weights. N sessions' units run as one batch
(`pipeline.duplex.batch.run_units`), forced speak / speak / listen, 1 s of audio each (and a
320x240 frame in the video mode). Per batch: its wall time, and inside it the encoders
(`plan_prefill_batch`; the vision encoder eager, not compiled as served), the speech side
(`speak_steps`: Talker draws + Token2Wav) and its Token2Wav; the Thinker's share is the rest.
The speech models load with their Token2Wav slots for the plan's most sessions and warm up
as the server's do. A session is in real time while a batch of its speak units takes under
1 s.

`--check` first runs 4 greedy sessions x 6 units with the decode step eager and then in the
engine's decode graphs (the sessions' rows as its guests), and counts the units whose tokens
agree (the graph path's GPU check).

    python -m bench.gpu_duplex --plan audio:1:10,audio:16:10,video:16:10,audio:16:5 --check

A plan entry is MODE:SESSIONS:STEPS[:PRECISION] (STEPS: Token2Wav's Euler steps, the
reference's `n_timesteps`; PRECISION fp32 (default) or fp16, its `enable_float16`).
`--history 30` first runs 30 untimed listen units a session: the steady state of a long
session (its 30 s audio buffer, its encoder cache). The file runs on its own too (`python
bench/gpu_duplex.py ...` from a tree whose `pipeline` is on PYTHONPATH): it imports nothing
from `bench`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_duplex", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", default="audio:1:10,audio:8:10,audio:16:10,video:16:10")
    ap.add_argument("--units", type=int, default=6, help="units a session, one batch each")
    ap.add_argument("--history", type=int, default=0, metavar="SECONDS",
                    help="untimed listen units a session first (its audio buffer and encoder "
                         "cache at length: the steady state from 30 s)")
    ap.add_argument("--check", action="store_true", help="graph vs eager decode, greedy")
    ap.add_argument("--checkpoint", default="random-full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kv-gib", type=float, default=8.0, help="the Thinker engine's KV pool")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="profile the last plan entry's last speak unit (torch.profiler), "
                         "its kernel table to FILE")
    args = ap.parse_args(argv)

    import pipeline.duplex.batch as batch_mod
    import pipeline.duplex.speech as speech_mod
    from pipeline.checkpoint import ModelSource
    from pipeline.duplex.batch import UnitRequest, run_units
    from pipeline.duplex.config import DuplexConfig
    from pipeline.duplex.session import DuplexSession
    from pipeline.duplex.speech import DuplexSpeech, SpeechModels
    from pipeline.duplex.thinker import DuplexThinker, reference_special_tokens
    from pipeline.thinker.llm_engine.engine import EngineConfig, LLMEngine
    from pipeline.thinker.model import ThinkerModel
    from pipeline.tokenizer import TextTokenizer
    from pipeline.utils import resolve_dtype

    try:
        from pipeline.duplex.kv import KVPages
    except ImportError:  # a tree before the paged pool (sessions own their KV)
        KVPages = None

    cuda = args.device == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def mem() -> int:
        return torch.cuda.memory_allocated() if cuda else 0

    t0 = time.perf_counter()
    src = ModelSource.open(args.checkpoint)
    # the Thinker as its engine builds it (ThinkerEngine.from_source: fused projections,
    # compiled ops, the fused QK-norm/RoPE/KV kernel) and its KV pool, without the vision
    # encoder's compile and warm-up (the video mode's frames run it eagerly here)
    dtype = resolve_dtype("auto", torch.device(args.device))
    model = ThinkerModel.load(src, args.device, dtype)
    model.llm.fuse_projections()
    if cuda:
        model.llm.compile_ops()
    model.llm.fuse_qk_rope_kv()
    plan = []
    for entry in args.plan.split(","):
        mode, n, steps, *precision = entry.split(":")
        plan.append((mode, int(n), (int(steps), precision[0] if precision else "fp32")))
    kv_bytes = int(args.kv_gib * 2**30)
    try:  # the sessions' decode rows as the engine's guests, in its decode graphs
        llm_engine = LLMEngine(model.llm, EngineConfig(
            kv_cache_bytes=kv_bytes, max_guest_rows=max(n for _, n, _ in plan)),
            args.device, dtype)
        pages = KVPages.of_engine(llm_engine, llm_engine.step)
    except TypeError:  # a tree before guest rows: the pool's own decode graphs
        llm_engine = LLMEngine(model.llm, EngineConfig(cuda_graphs=False,
                                                       kv_cache_bytes=kv_bytes),
                               args.device, dtype)
        pages = KVPages.of_engine(llm_engine) if KVPages else None
    tokenizer = TextTokenizer.from_dir(src.tokenizer_dir)
    kw = {"pages": pages} if pages else {}
    special = reference_special_tokens(src.tokenizer_dir)
    models_at: dict[tuple[int, str], SpeechModels] = {}  # per Euler steps and precision

    def speech_models_at(t2w: tuple[int, str]) -> SpeechModels:
        """The speech models at `t2w` (Euler steps, precision), their Token2Wav slots for
        the plan's most sessions in that mode, warmed up as the server does (its graphs
        captured)."""
        if t2w not in models_at:
            most = max(n for _, n, s in plan if s == t2w)
            steps, precision = t2w
            # a tree before the precision option: fp32 only
            kw = {} if precision == "fp32" else {"precision": precision}
            t = time.perf_counter()
            models_at[t2w] = m = SpeechModels.from_source(src, args.device, n_timesteps=steps,
                                                          streams=most, **kw)
            m.token2wav.warmup(last_chunks=False)
            print(f"speech models at {steps} steps {precision}, {most} slots: loaded and "
                  f"warmed up in {time.perf_counter() - t:.1f} s", flush=True)
        return models_at[t2w]

    speech_models = speech_models_at(plan[0][2])
    print(f"loaded in {time.perf_counter() - t0:.1f} s; GPU {mem() / 2**30:.1f} GiB", flush=True)

    spent: dict[str, list[float]] = {"speech": [], "token2wav": [], "encoders": []}

    def timed(fn, key):
        def wrapped(*a, **k):
            sync()
            t = time.perf_counter()
            r = fn(*a, **k)
            sync()
            spent[key].append(1e3 * (time.perf_counter() - t))
            return r
        return wrapped

    def timed_steps(fn, key):
        """A step-wise generator function timed over its steps (run_units runs nothing
        between them)."""
        def wrapped(*a, **k):
            sync()
            t = time.perf_counter()
            r = yield from fn(*a, **k)
            sync()
            spent[key].append(1e3 * (time.perf_counter() - t))
            return r
        return wrapped

    if hasattr(speech_mod, "speak_steps"):
        speech_mod.speak_steps = timed_steps(speech_mod.speak_steps, "speech")
    elif hasattr(speech_mod, "speak_batch"):  # a tree before the batch ran in steps
        speech_mod.speak_batch = timed(speech_mod.speak_batch, "speech")
    else:  # a tree before the speech side batched
        DuplexSpeech.speak = timed(DuplexSpeech.speak, "speech")
    if hasattr(speech_mod, "_token2wav_steps"):
        speech_mod._token2wav_steps = timed_steps(speech_mod._token2wav_steps, "token2wav")
    elif hasattr(speech_mod, "_token2wav_batch"):
        speech_mod._token2wav_batch = timed(speech_mod._token2wav_batch, "token2wav")
    else:  # a tree before Token2Wav batched
        DuplexSpeech._token2wav = timed(DuplexSpeech._token2wav, "token2wav")
    if hasattr(batch_mod, "plan_prefill_batch"):
        batch_mod.plan_prefill_batch = timed(batch_mod.plan_prefill_batch, "encoders")
    rng = np.random.default_rng(0)

    def frame():
        from PIL import Image
        return Image.fromarray(rng.integers(0, 255, (240, 320, 3), dtype=np.uint8))

    def session(i: int, cfg, speech: bool):
        th = DuplexThinker(model, tokenizer, cfg, seed=i, special_tokens=special,
                           **kw)
        s = DuplexSession(th, DuplexSpeech(speech_models, seed=i) if speech else None)
        s.prepare(prefix=None)
        return s

    report: dict = {"runs": []}
    if args.check and pages is not None:
        step = getattr(pages, "step", None)

        def greedy(use_graphs: bool) -> list:
            if step is None:  # a tree before guest rows
                pages.use_graphs = use_graphs
            else:
                pages.step = step if use_graphs else None
            r = np.random.default_rng(7)
            ss = [session(i, DuplexConfig(decode_mode="greedy"), False) for i in range(4)]
            out = []
            for u in range(6):
                reqs = [UnitRequest(s, (0.1 * r.standard_normal(16000)).astype(np.float32),
                                    None, "speak" if u % 3 < 2 else "listen") for s in ss]
                out.append([x.token_ids for x in run_units(reqs)])
            for s in ss:
                s.close()
            if step is None:
                pages.use_graphs = True
            else:
                pages.step = step
            return out

        t = time.perf_counter()
        a, b = greedy(False), greedy(True)
        pairs = [(x, y) for ua, ub in zip(a, b) for x, y in zip(ua, ub)]
        same = sum(x == y for x, y in pairs)
        decided = sum(x[:1] == y[:1] for x, y in pairs)
        print(f"graph vs eager decode, greedy, 4 sessions x 6 units: units with equal tokens "
              f"{same}/{len(pairs)}, equal decisions {decided}/{len(pairs)} "
              f"({time.perf_counter() - t:.1f} s)", flush=True)
        report["graph_check"] = {"equal_units": same, "equal_decisions": decided,
                                 "units": len(pairs)}

    pattern = "SSL"
    # the profiled unit: the last entry's last speak unit (a warm one when there are 2 or more)
    profiled = ([u for u in range(1, args.units) if pattern[u % 3] == "S"] or [0])[-1]
    for k, (mode, n, t2w) in enumerate(plan):
        speech_models = speech_models_at(t2w)
        print(f"== {mode}: {n} sessions, Token2Wav {t2w[0]} steps {t2w[1]}", flush=True)
        sync()
        mem0 = mem()  # the sessions' memory outside the KV pool (its blocks are allocated)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        sessions = [session(i, DuplexConfig(), True) for i in range(n)]
        if args.history:  # untimed listen units first: the sessions' audio buffers at length
            t = time.perf_counter()
            for u in range(args.history):
                run_units([UnitRequest(s, (0.1 * rng.standard_normal(16000 if u else 16560))
                                       .astype(np.float32),
                                       [frame()] if mode == "video" else None, "listen")
                           for s in sessions])
            print(f"N={n}: {args.history} s of history in {time.perf_counter() - t:.1f} s",
                  flush=True)
        rows = []
        for u in range(args.units):
            force = "speak" if pattern[u % 3] == "S" else "listen"
            first = u == 0 and not args.history  # a session's first unit: 1.035 s
            reqs = [UnitRequest(s, (0.1 * rng.standard_normal(16560 if first else 16000))
                                .astype(np.float32), [frame()] if mode == "video" else None,
                                force) for s in sessions]
            for v in spent.values():
                v.clear()
            last = k == len(plan) - 1 and u == profiled
            prof = None
            if args.profile and last:
                prof = torch.profiler.profile(activities=[
                    torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
                prof.__enter__()
            sync()
            t = time.perf_counter()
            res = run_units(reqs)
            sync()
            total = 1e3 * (time.perf_counter() - t)
            if prof is not None:
                prof.__exit__(None, None, None)
                Path(args.profile).parent.mkdir(parents=True, exist_ok=True)
                Path(args.profile).write_text(
                    prof.key_averages().table(sort_by="cuda_time_total", row_limit=60) + "\n"
                    + prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
            bad = [r for r in res if isinstance(r, BaseException)]
            if bad:
                print("unit failed:", repr(bad[0]), flush=True)
            good = [r for r in res if not isinstance(r, BaseException)]
            row = {"unit": u, "force": force, "total_ms": round(total, 1),
                   **{f"{k}_ms": round(sum(v), 1) for k, v in spent.items()},
                   "tokens": sum(len(r.token_ids) for r in good),
                   "codes": sum(len(r.codes) for r in good), "failed": len(bad)}
            row["thinker_ms"] = round(total - row["speech_ms"] - row["encoders_ms"], 1)
            rows.append(row)
            print(f"N={n} unit {u} {force}: {total:.0f} ms = encoders {row['encoders_ms']:.0f}"
                  f" + thinker {row['thinker_ms']:.0f} + speech {row['speech_ms']:.0f} "
                  f"(Token2Wav {row['token2wav_ms']:.0f}); tokens {row['tokens']}, codes "
                  f"{row['codes']}", flush=True)
        sync()
        held = (mem() - mem0) / max(1, n)
        peak = ((torch.cuda.max_memory_allocated() if cuda else 0) - mem0) / max(1, n)
        print(f"N={n}: outside the KV pool, GiB a session held {held / 2**30:.3f}, at the "
              f"peak {peak / 2**30:.3f}", flush=True)
        for s in sessions:
            s.close()
        report["runs"].append({"mode": mode, "sessions": n, "token2wav_steps": t2w[0],
                               "token2wav_precision": t2w[1], "history_s": args.history,
                               "units": rows, "gib_a_session": round(held / 2**30, 3),
                               "peak_gib_a_session": round(peak / 2**30, 3)})
        if cuda:
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The Talker's decode on one GPU: full size, random bf16 weights, the engine as it ships
(`TalkerEngineConfig()`, full-span streams of fixed length: EOS masked).

Checks (exit 1 on failure): every code a speech code (below EOS), every stream as long as
asked, and the same seeds give the same codes when the batch runs again.
Timings, each --batches size (1, 2, 4, 8 by default): wall ms a `engine.step()` (host work included: noise draws,
reading the codes), per code, and the first step (every stream's prefill and first draw).
`--profile`: one step at batch 1 and 8 under torch.profiler: kernel count, kernel ms (the
GPU's time a step) and the top kernels.

    python -m bench.gpu_talker [--steps 200] [--warmup 20] [--prompt 40] [--profile]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import torch

from bench.cuda_timing import kernel_profile
from pipeline.config import TalkerConfig
from pipeline.handoff import SpokenChunk, TalkerSpec
from pipeline.talker.engine import TalkerEngine, TalkerEngineConfig
from pipeline.talker.model import TalkerModel



def build_model(cfg: TalkerConfig) -> TalkerModel:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = TalkerModel(cfg)
    return model.to(torch.bfloat16).eval()


def open_streams(engine: TalkerEngine, ids: list[str], prompt: int, max_codes: int) -> None:
    """One full-span stream per id: `prompt` spoken-span tokens with random hidden rows."""
    g = torch.Generator().manual_seed(1)
    for i, sid in enumerate(ids):
        engine.open(sid, TalkerSpec(seed=1000 + i, max_codes=max_codes))
        prompt_ids = torch.randint(0, 151000, (prompt,), generator=g)
        hidden = torch.randn(prompt, engine.cfg.llm_dim, generator=g)
        engine.feed(sid, SpokenChunk(prompt_ids, hidden, True))


def run_batch(engine: TalkerEngine, batch: int, args, tag: str) -> dict:
    """`batch` streams: the first step (prefills), warm-up steps, then timed steps."""
    ids = [f"{tag}{batch}s{i}" for i in range(batch)]
    open_streams(engine, ids, args.prompt, 1 + args.warmup + args.steps + 64)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.step()
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3
    for _ in range(args.warmup):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    codes = [engine.stream_codes(sid) for sid in ids]
    for sid in ids:
        engine.abort(sid)
    return {"codes": codes, "step_ms": step_ms, "code_ms": step_ms / batch, "first_ms": first_ms}


def check_codes(rows: dict[int, dict], again: dict, eos: int, want: int) -> list[str]:
    """What a batch's codes must be: speech codes, `want` a stream, and the same again."""
    bad = []
    for batch, row in rows.items():
        for i, c in enumerate(row["codes"]):
            if len(c) < want or not all(0 <= x < eos for x in c):
                bad.append(f"batch {batch} stream {i}: {len(c)} codes, max {max(c, default=-1)}")
    if again["codes"] != rows[4]["codes"]:
        bad.append("batch 4 run again: other codes for the same seeds")
    return bad


def profile(engine: TalkerEngine, args) -> None:
    print("profile: one step (kernel time in ms)")
    for batch in (1, 8):
        ids = [f"p{batch}s{i}" for i in range(batch)]
        open_streams(engine, ids, args.prompt, 10_000)
        for _ in range(5):
            engine.step()
        n, ms, top, _ = kernel_profile(engine.step)
        print(f"  B{batch}: {n} kernels, {ms:.3f} ms")
        for name, us, count in top:
            print(f"    {us / 1e3:7.3f} ms {count:5d}x  {name}")
        for sid in ids:
            engine.abort(sid)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_talker",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=40, help="spoken-span tokens per stream")
    ap.add_argument("--max-seq-len", type=int, default=1024, help="KV positions per slot")
    ap.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")],
                    default=[1, 2, 4, 8], help="streams a step to time (up to 32)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    # fixed length: EOS masked for every draw (min_new > max_new) so timings compare
    cfg = replace(TalkerConfig(), min_new_tokens=10**6, max_new_tokens=2048,
                  max_position_embeddings=args.max_seq_len)
    model = build_model(cfg)
    t0 = time.perf_counter()
    engine = TalkerEngine(model, TalkerEngineConfig(max_streams=max(args.batches), mode="full_span"))
    torch.cuda.synchronize()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, Talker "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f} M params bf16; engine built "
          f"in {time.perf_counter() - t0:.1f} s")
    rows = {b: run_batch(engine, b, args, "b") for b in args.batches}
    bad = check_codes(rows, run_batch(engine, 4, args, "again"), cfg.eos_code,
                      args.steps)
    print(f"   {'batch':>5} {'step ms':>8} {'per code':>9} {'1st step':>9}")
    for b, t in rows.items():
        print(f"   {b:>5} {t['step_ms']:8.3f} {t['code_ms']:9.3f} {t['first_ms']:9.1f}")
    print(f"   ({args.steps} timed steps after {args.warmup} warm-up steps; prompt "
          f"{args.prompt} + 2 rows; 1st step = the prefills and first draws)")
    if args.profile:
        profile(engine, args)
    print("all checks OK" if not bad else "CHECKS FAILED:\n  " + "\n  ".join(bad))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())

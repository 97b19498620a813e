"""Talker decode on the GPU: CUDA graphs vs eager, full size, random bf16 weights.

For batch 1 and 4 (full_span streams, fixed length: EOS is masked throughout), it runs the
same streams with the same seeds through an engine with CUDA graphs and one without, checks
that both produce the same codes (seeded sampling and greedy), and prints step times.
Exits 1 if a parity check fails.

    python bench/gpu_talker.py [--steps 200] [--warmup 20] [--prompt 40] [--decode-steps 4]

--decode-steps K runs the graph engine with K decode steps per replay (TalkerEngineConfig.
decode_steps); the eager engine stays at one step, and the codes are compared over the
common prefix. Times are per engine.step() call and per code drawn.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import torch

from pipeline.config import TalkerConfig
from pipeline.talker.engine import TalkerEngine, TalkerEngineConfig
from pipeline.talker.model import TalkerModel
from pipeline.talker.sampling import TalkerSamplingParams


def build_model(cfg: TalkerConfig) -> TalkerModel:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = TalkerModel(cfg)
    return model.to(torch.bfloat16).eval()


def run(model, batch, graphs, sampling, args, decode_steps=1):
    """Returns (codes per stream, ms per step() call, ms per code of one stream, ms of the
    first step = prefill + first draw)."""
    cfg = model.cfg
    engine = TalkerEngine(
        model,
        TalkerEngineConfig(max_streams=4, mode="full_span", cuda_graphs=graphs, sampling=sampling,
                           decode_steps=decode_steps),
    )
    assert (engine.graphs is not None) == graphs
    g = torch.Generator().manual_seed(1)
    for i in range(batch):
        engine.open(f"s{i}", seed=1000 + i)
        ids = torch.randint(0, 151000, (args.prompt,), generator=g)
        hidden = torch.randn(args.prompt, cfg.llm_dim, generator=g)
        engine.feed_text(f"s{i}", ids, hidden, text_finished=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.step()  # prefill + first code of every stream
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3
    for _ in range(args.warmup):
        engine.step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    before = len(engine.stream_codes("s0"))
    start.record()
    for _ in range(args.steps):
        engine.step()
    end.record()
    torch.cuda.synchronize()
    total_ms = start.elapsed_time(end)
    codes = [engine.stream_codes(f"s{i}") for i in range(batch)]
    per_code = total_ms / max(1, len(codes[0]) - before)
    del engine
    torch.cuda.empty_cache()
    return codes, total_ms / args.steps, per_code, first_ms


def first_mismatch(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--prompt", type=int, default=40, help="spoken-span tokens per stream")
    parser.add_argument("--decode-steps", type=int, default=1, help="graph engine's decode_steps")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    # Fixed length: EOS masked for every draw (min_new > max_new) so timings compare.
    cfg = replace(TalkerConfig(), min_new_tokens=10**6, max_new_tokens=2048)
    model = build_model(cfg)
    print(
        f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"Talker {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M params bf16"
    )

    failures = []
    rows = []
    expected_codes = 1 + args.warmup + args.steps
    for label, sampling in [("sampled", None), ("greedy", TalkerSamplingParams(temperature=0.0))]:
        for batch in (1, 4):
            eager_codes, eager_ms, eager_code, eager_first = run(model, batch, False, sampling,
                                                                 args)
            graph_codes, graph_ms, graph_code, graph_first = run(model, batch, True, sampling,
                                                                 args, args.decode_steps)
            for i, (a, b) in enumerate(zip(eager_codes, graph_codes)):
                n = min(len(a), len(b))
                bad = first_mismatch(a[:n], b[:n])
                if (
                    bad >= 0
                    or len(a) != expected_codes
                    or len(b) < expected_codes
                    or not all(0 <= c < cfg.eos_code for c in a)
                ):
                    failures.append(
                        f"{label} batch {batch} stream {i}: {len(a)} eager / {len(b)} graph codes "
                        f"(expected {expected_codes}), first mismatch at {bad}"
                    )
            distinct = len({tuple(c) for c in eager_codes})
            rows.append((label, batch, "off", eager_ms, eager_code, eager_first, distinct))
            graphs = "on" if args.decode_steps == 1 else f"on x{args.decode_steps}"
            rows.append((label, batch, graphs, graph_ms, graph_code, graph_first, distinct))

    print(
        f"\n{'sampling':9} {'batch':>5} {'graphs':>7} {'ms/call':>8} {'ms/code':>8} "
        f"{'codes/s':>8} {'1st step ms':>11} {'distinct':>8}"
    )
    for label, batch, graphs, ms, per_code, first, distinct in rows:
        print(
            f"{label:9} {batch:>5} {graphs:>7} {ms:8.3f} {per_code / batch:8.3f} "
            f"{1e3 * batch / per_code:8.0f} {first:11.1f} {distinct:>8}"
        )
    print(
        f"(ms/call = per engine.step(); ms/code = per code of one stream / batch; {args.steps} "
        f"timed calls after {args.warmup} warm-up calls; prompt {args.prompt} + 2 rows; "
        f"'distinct' = distinct code sequences in the batch; 'on xK' = K steps per replay)"
    )
    if failures:
        print("\nPARITY FAILED (CUDA graphs vs eager):")
        for f in failures:
            print("  " + f)
        return 1
    print("\nparity OK: CUDA-graph decode == eager decode (same seeds; and greedy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

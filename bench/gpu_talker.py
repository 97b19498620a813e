"""Talker decode on the GPU, full size, random bf16 weights: the plain forward, the fused one
(`talker_fused`) and the fused one compiled (`talker_compile`).

Sections (exit 1 if a check marked "fails" fails):
  1. precision, model level: 4 streams prefilled, then --precision-steps greedy decode steps
     teacher-forced with the plain path's codes (so every step compares the same inputs):
     the plain path on the fused model's weight views must equal the plain path before
     fusing bit for bit (fails otherwise); fused and compiled logits against plain are
     reported (max abs diff, steps bitwise equal, argmax agreement);
  2. CUDA graphs == eager for each forward (seeded sampling and greedy, batch 1 and 4,
     full_span streams of fixed length: EOS masked); fails on any code mismatch;
  3. codes of each forward against plain's with the same seeds, over every stream (reported:
     GEMMs of other widths may sum in another order on the GPU);
  4. timings with graphs, batch 1, 2, 4, 8: ms per engine.step() (host work included: noise
     draws, reading the codes), and the GPU time of the step alone (its graph replayed back to
     back), per code; against the targets (1.0 ms a code at batch 1, 0.35 at batch 8);
  5. --profile: torch.profiler of one graphed engine.step() and one eager decode step at
     batch 1 and 8: kernel count and the top kernels;
  6. --attention: one layer's decode attention at batch 1 / 8 and read_len 256 .. 2048, 20
     calls in a CUDA graph: the plain path's SDPA (token-major cache, bool mask), the fused
     path's SDPA (head-major cache, additive mask built once), and matmul-softmax-matmul
     (eager and compiled), in us a layer, with the matmul's difference to SDPA.

    python bench/gpu_talker.py [--fused/--no-fused] [--compile] [--prefill-graphs] [--rope-kernel]
        [--profile] [--attention]
        [--steps 200] [--warmup 20] [--prompt 40] [--decode-steps K] [--precision-steps 300]

--prefill-graphs adds the compiled forward with each unit's prefill padded and replayed as a
CUDA graph (`prefill_graphs`): its codes against plain's and eager's, its "1st step" (the
prefills) beside the others'.

--rope-kernel adds the padded variant with each layer's RoPE and K / V cache write as one
Triton kernel (`talker_rope_kernel`): its logits and codes against plain's, its timings and
(with --profile) its kernels a step beside the others'.

--decode-steps K runs the graph engines with K decode steps per replay (the eager ones stay
at one step; codes are compared over the common prefix).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections import Counter
from dataclasses import replace

import torch
import torch.nn.functional as F

from bench.cuda_timing import cuda_ms
from pipeline.config import TalkerConfig
from pipeline.graphs import GraphRunner
from pipeline.handoff import SpokenChunk, TalkerSpec
from pipeline.talker.engine import TalkerEngine, TalkerEngineConfig
from pipeline.talker.fused import FusedTalker
from pipeline.talker.graphs import bucket_up
from pipeline.talker.model import TalkerKVCache, TalkerModel
from pipeline.talker.sampling import TalkerSamplingParams

VARIANTS = {
    "plain": {},
    "fused": {"talker_fused": True},
    "compiled": {"talker_fused": True, "talker_compile": True},
    # compiled, each unit's prefill padded and replayed as a CUDA graph (--prefill-graphs)
    "padded": {"talker_fused": True, "talker_compile": True, "prefill_graphs": True},
    # padded, each layer's RoPE and K / V write as one Triton kernel (--rope-kernel)
    "rope": {
        "talker_fused": True, "talker_compile": True, "prefill_graphs": True,
        "talker_rope_kernel": True,
    },
}
BATCHES = (1, 2, 4, 8)
TARGETS = {1: 1.0, 8: 0.35}  # ms a code, GPU alone
GREEDY = TalkerSamplingParams(temperature=0.0)


def build_model(cfg: TalkerConfig) -> TalkerModel:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = TalkerModel(cfg)
    return model.to(torch.bfloat16).eval()


def first_mismatch(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


# ---------------------------------------------------------------------------------------
# 1. precision


@torch.no_grad()
def teacher_forced(forward, cache: TalkerKVCache, prompts, steps: int, codes=None):
    """Prefill slot i with prompts[i], then `steps` decode steps over rows [0, len(prompts)).
    codes None: feed the argmax; else feed codes[t]. Returns (logits (1 + steps, n, V), the
    fed codes)."""
    n = len(prompts)
    out = [torch.stack([forward.prefill(cache, i, p) for i, p in enumerate(prompts)])]
    positions = torch.tensor([p.shape[0] for p in prompts], device="cuda")
    active = torch.ones(n, dtype=torch.bool, device="cuda")
    fed = [out[0].argmax(-1)] if codes is None else codes
    for t in range(steps):
        read_len = bucket_up(int(positions.max()) + 1, (256, 512, cache.max_len))
        out.append(forward.decode(cache, fed[t], positions, active, read_len))
        if codes is None:
            fed.append(out[-1].argmax(-1))
        positions = positions + 1
    return torch.stack(out), fed


def precision(model: TalkerModel, args, variants: list[str]) -> bool:
    cfg = model.cfg
    g = torch.Generator().manual_seed(7)
    prompts = [
        (torch.randn(args.prompt + 2 + 9 * i, cfg.hidden_size, generator=g) * 0.5).to(
            "cuda", torch.bfloat16
        )
        for i in range(4)
    ]

    def cache(layout: str) -> TalkerKVCache:
        return TalkerKVCache(cfg, 4, 1024, torch.bfloat16, torch.device("cuda"), layout=layout)

    steps = args.precision_steps
    ref, fed = teacher_forced(model, cache("tokens"), prompts, steps)
    ok = True
    results = {}
    fused_model = copy.deepcopy(model)  # fused in place; `model` stays plain for the rest
    results["plain, weights fused"] = teacher_forced(
        _fused_views(fused_model), cache("tokens"), prompts, steps, fed
    )[0]
    for name in variants:
        if name in ("fused", "compiled", "rope"):  # padded's forward is the compiled one
            forward = FusedTalker(fused_model, compile=name != "fused", rope_kernel=name == "rope")
            results[name] = teacher_forced(forward, cache("heads"), prompts, steps, fed)[0]
    print(
        f"\n1. precision: bf16 logits against the plain path, {len(prompts)} streams, prefill + "
        f"{steps} teacher-forced steps"
    )
    scale = ref.abs().max().item()
    for name, got in results.items():
        diff = (got - ref).abs()
        per_step = diff.flatten(1).amax(1)
        equal_steps = int((per_step == 0).sum())
        argmax = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        line = (
            f"   {name:22} max abs diff {diff.max().item():.3e} (|logits| <= {scale:.2f}), "
            f"mean {diff.mean().item():.2e}, bitwise-equal steps {equal_steps}/{len(per_step)}, "
            f"argmax agrees {100 * argmax:.2f}%"
        )
        if name == "plain, weights fused" and diff.max().item() != 0:
            line += "  <- fails: the plain path on the weight views must be bitwise unchanged"
            ok = False
        print(line)
    del fused_model
    torch.cuda.empty_cache()
    return ok


def _fused_views(model: TalkerModel) -> TalkerModel:
    model.fuse_projections()
    return model


# ---------------------------------------------------------------------------------------
# 2-4. engines


def make_engine(model, variant: str, graphs: bool, sampling, args, decode_steps: int = 1):
    config = TalkerEngineConfig(
        max_streams=max(BATCHES),
        mode="full_span",
        cuda_graphs=graphs,
        sampling=sampling,
        decode_steps=decode_steps,
        max_seq_len=args.max_seq_len,
        **VARIANTS[variant],
    )
    t0 = time.perf_counter()
    engine = TalkerEngine(model, config)
    torch.cuda.synchronize()
    return engine, time.perf_counter() - t0


def run_batch(engine: TalkerEngine, batch: int, args, replay: bool = False) -> dict:
    """`batch` fixed-length streams: the first step (prefills), warm-up steps, timed steps.
    With `replay`, the step's graph is then replayed back to back (GPU time alone); that
    decodes on, so the streams are closed afterwards either way."""
    cfg = engine.cfg
    g = torch.Generator().manual_seed(1)
    ids = [f"b{batch}s{i}" for i in range(batch)]
    length = 1 + args.warmup + args.steps
    for i, sid in enumerate(ids):
        engine.open(sid, TalkerSpec(seed=1000 + i, max_codes=length + 64))
        prompt_ids = torch.randint(0, 151000, (args.prompt,), generator=g)
        hidden = torch.randn(args.prompt, cfg.llm_dim, generator=g)
        engine.feed(sid, SpokenChunk(prompt_ids, hidden, True))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.step()  # prefill + first code of every stream
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3
    for _ in range(args.warmup):
        engine.step()
    before = len(engine.stream_codes(ids[0]))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(args.steps):
        engine.step()
    end.record()
    torch.cuda.synchronize()
    total_ms = start.elapsed_time(end)
    codes = [engine.stream_codes(sid) for sid in ids]
    out = {
        "codes": codes,
        "step_ms": total_ms / args.steps,
        "code_ms": total_ms / max(1, len(codes[0]) - before) / batch,
        "first_ms": first_ms,
    }
    if replay and engine.graphs is not None:
        rows = bucket_up(
            max(engine._streams[s].slot for s in ids) + 1, engine.config.graph_batch_sizes
        )
        top = max(engine._streams[s].position for s in ids) + args.replays + 1
        read_len = bucket_up(top, engine.config.graph_kv_lengths)
        graph = engine.graphs.graphs[(rows, read_len, 1)].graph
        out["gpu_step_ms"] = cuda_ms(graph.replay, args.replays, warmup=0)
        out["gpu_code_ms"] = out["gpu_step_ms"] / batch
    for sid in ids:
        engine.abort(sid)
    return out


def engines_section(model, args, variants: list[str]) -> tuple[bool, dict]:
    """Sections 2 and 3, and section 4's numbers (graph engine, seeded sampling)."""
    failures, timing, codes = [], {}, {}
    build = {}
    for variant in variants:
        for label, sampling in (("sampled", None), ("greedy", GREEDY)):
            eager, _ = make_engine(model, variant, False, sampling, args)
            graph, build_s = make_engine(model, variant, True, sampling, args, args.decode_steps)
            build.setdefault(variant, build_s)
            for batch in BATCHES if label == "sampled" else (1, 4):
                g = run_batch(graph, batch, args, replay=label == "sampled")
                if label == "sampled":
                    timing[(variant, batch)] = g
                    codes[(variant, batch)] = g["codes"]
                if batch not in (1, 4):
                    continue
                e = run_batch(eager, batch, args)
                for i, (a, b) in enumerate(zip(e["codes"], g["codes"])):
                    n = min(len(a), len(b))
                    bad = first_mismatch(a[:n], b[:n])
                    if bad >= 0 or not all(0 <= c < model.cfg.eos_code for c in a):
                        failures.append(
                            f"{variant} {label} batch {batch} stream {i}: first mismatch at {bad}"
                        )
                timing.setdefault((variant, "eager", label, batch), e)
            del eager, graph
            torch.cuda.empty_cache()

    print("\n2. CUDA graphs == eager (codes, batch 1 and 4, sampled and greedy):")
    print(
        "   " + ("FAILED:\n     " + "\n     ".join(failures) if failures else "OK, every forward")
    )
    print("\n3. codes against plain, same seeds (first differing code per stream, -1 = none):")
    for variant in variants:
        if variant == "plain":
            continue
        parts = []
        for batch in BATCHES:
            mism = [
                first_mismatch(a, b)
                for a, b in zip(codes[("plain", batch)], codes[(variant, batch)])
            ]
            parts.append(f"B{batch} {mism}")
        print(f"   {variant:9} " + "; ".join(parts))

    print(
        "\n4. timings with CUDA graphs (ms; graphs built in: "
        + ", ".join(f"{v} {s:.1f} s" for v, s in build.items())
        + ")"
    )
    print(
        f"   {'forward':9} {'batch':>5} {'step':>8} {'per code':>9} {'GPU step':>9} "
        f"{'GPU/code':>9} {'1st step':>9}  target"
    )
    for variant in variants:
        for batch in BATCHES:
            t = timing[(variant, batch)]
            target = TARGETS.get(batch)
            mark = ""
            if target is not None and "gpu_code_ms" in t:
                mark = f"<= {target}: " + ("met" if t["gpu_code_ms"] <= target else "missed")
            print(
                f"   {variant:9} {batch:>5} {t['step_ms']:8.3f} {t['code_ms']:9.3f} "
                f"{t.get('gpu_step_ms', float('nan')):9.3f} {t.get('gpu_code_ms', float('nan')):9.3f} "
                f"{t['first_ms']:9.1f}  {mark}"
            )
    for variant in variants:
        e1, e4 = timing[(variant, "eager", "sampled", 1)], timing[(variant, "eager", "sampled", 4)]
        print(
            f"   {variant:9} eager (no graphs): {e1['step_ms']:.3f} ms a step at B1, "
            f"{e4['step_ms']:.3f} at B4"
        )
    print(
        f"   (step = one engine.step(): noise draws + replay + reading the codes; per code = "
        f"step / batch; GPU = the step's graph replayed {args.replays}x back to back; "
        f"{args.steps} timed steps after {args.warmup} warm-up steps; prompt {args.prompt} + 2 "
        f"rows; 1st step = the prefills and first draws)"
    )
    return not failures, timing


# ---------------------------------------------------------------------------------------
# 5. profile


def kernel_table(fn) -> tuple[int, float, list]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    times: Counter = Counter()
    calls: Counter = Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            times[e.name] += e.device_time_total
            calls[e.name] += 1
    top = [(name[:80], us, calls[name]) for name, us in times.most_common(10)]
    return sum(calls.values()), sum(times.values()) / 1e3, top


def profile_section(model, args, variants: list[str]) -> None:
    print("\n5. profile (one step; kernel time in ms)")
    for variant in variants:
        engine, _ = make_engine(model, variant, True, None, args)
        for batch in (1, 8):
            profile_batch(engine, batch, args, variant)
        del engine
        torch.cuda.empty_cache()


def profile_batch(engine: TalkerEngine, batch: int, args, variant: str) -> None:
    ids = [f"p{i}" for i in range(batch)]
    g = torch.Generator().manual_seed(2)
    for i, sid in enumerate(ids):
        engine.open(sid, TalkerSpec(seed=i, max_codes=10_000))
        ids_in = torch.randint(0, 151000, (args.prompt,), generator=g)
        hidden = torch.randn(args.prompt, engine.cfg.llm_dim, generator=g)
        engine.feed(sid, SpokenChunk(ids_in, hidden, True))
    for _ in range(5):
        engine.step()
    rows = bucket_up(batch, engine.config.graph_batch_sizes)
    read_len = bucket_up(args.prompt + 2 + 10, engine.config.graph_kv_lengths)

    def eager_step() -> None:  # the ops the graph holds, launched one by one
        engine._decode_steps(rows, read_len, 1)

    for what, fn in (("graphed engine.step()", engine.step), ("eager decode step", eager_step)):
        n, ms, top = kernel_table(fn)
        print(f"   {variant} B{batch} {what}: {n} kernels, {ms:.3f} ms")
        for name, us, count in top:
            print(f"      {us / 1e3:7.3f} ms {count:5d}x  {name}")
    for sid in ids:  # the eager step decoded behind the engine's back: done with these
        engine.abort(sid)


# ---------------------------------------------------------------------------------------
# 6. attention


def matmul_attention(q, keys, values, mask):
    """q (B, H, 1, D); keys/values (B, H, S, D); mask (B, 1, 1, S) additive."""
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * q.shape[-1] ** -0.5 + mask
    return torch.matmul(scores.softmax(-1).to(q.dtype), values)


def attention_section(cfg: TalkerConfig) -> None:
    compiled = torch.compile(matmul_attention, dynamic=False)
    print(
        f"\n6. decode attention, one layer (us; {cfg.num_hidden_layers} calls in a CUDA graph), "
        f"H={cfg.num_attention_heads}, D={cfg.head_dim}"
    )
    print(
        f"   {'B':>2} {'read_len':>8} {'plain SDPA':>10} {'fused SDPA':>10} {'matmul':>8} "
        f"{'matmul+compile':>14} {'matmul vs SDPA':>14}"
    )
    for b in (1, 8):
        for s in (256, 512, 1024, 2048):
            us, diff = attention_case(cfg, b, s, compiled)
            print(
                f"   {b:>2} {s:>8} {us['plain']:10.1f} {us['fused']:10.1f} {us['matmul']:8.1f} "
                f"{us['compiled']:14.1f} {diff:14.2e}"
            )


def attention_case(cfg: TalkerConfig, b: int, s: int, compiled) -> tuple[dict, float]:
    h, d, t = cfg.num_attention_heads, cfg.head_dim, 4097
    g = torch.Generator(device="cuda").manual_seed(0)
    k_tok = torch.randn(b, t, h, d, device="cuda", generator=g).to(torch.bfloat16)
    v_tok = torch.randn(b, t, h, d, device="cuda", generator=g).to(torch.bfloat16)
    k_head, v_head = k_tok.transpose(1, 2).contiguous(), v_tok.transpose(1, 2).contiguous()
    q = torch.randn(b, h, 1, d, device="cuda", generator=g).to(torch.bfloat16)
    pos = torch.randint(s // 2, s, (b,), device="cuda", generator=g)
    allowed = (torch.arange(s, device="cuda")[None, :] <= pos[:, None])[:, None, None, :]
    additive = torch.zeros(allowed.shape, dtype=torch.bfloat16, device="cuda")
    additive.masked_fill_(~allowed, float("-inf"))
    keys, values = k_head[:, :, :s], v_head[:, :, :s]
    fns = {
        "plain": lambda: F.scaled_dot_product_attention(
            q, k_tok[:, :s].transpose(1, 2), v_tok[:, :s].transpose(1, 2), attn_mask=allowed
        ),
        "fused": lambda: F.scaled_dot_product_attention(q, keys, values, attn_mask=additive),
        "matmul": lambda: matmul_attention(q, keys, values, additive),
        "compiled": lambda: compiled(q, keys, values, additive),
    }
    us, outs = {}, {}
    runner = GraphRunner(max_graphs=len(fns))
    for name, fn in fns.items():
        outs[name] = fn()  # compiles, picks kernels

        def layers(fn=fn) -> None:
            for _ in range(cfg.num_hidden_layers):
                fn()

        runner.add(name, layers)  # warm-up runs on a side stream, then the capture
        us[name] = cuda_ms(runner.graphs[name].graph.replay, 50) * 1e3 / cfg.num_hidden_layers
    diff = (outs["matmul"].float() - outs["fused"].float()).abs().max().item()
    return us, diff


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--prompt", type=int, default=40, help="spoken-span tokens per stream")
    parser.add_argument("--decode-steps", type=int, default=1, help="graph engines' decode_steps")
    parser.add_argument(
        "--fused",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="include the fused forward (default on)",
    )
    parser.add_argument("--compile", action="store_true", help="include fused + compiled")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--attention", action="store_true", help="attention micro-benchmark")
    parser.add_argument("--precision-steps", type=int, default=300)
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--max-seq-len", type=int, default=1024, help="KV positions per slot")
    parser.add_argument("--prefill-graphs", action="store_true",
                        help="add the compiled forward with its prefills as CUDA graphs")
    parser.add_argument("--rope-kernel", action="store_true",
                        help="add that forward with its RoPE + K / V write as one kernel")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    variants = (
        ["plain"] + (["fused"] if args.fused else []) + (["compiled"] if args.compile else [])
    )
    if args.compile and not args.fused:
        variants = ["plain", "compiled"]
    if args.prefill_graphs:
        variants.append("padded")
    if args.rope_kernel:
        variants.append("rope")
    # Fixed length: EOS masked for every draw (min_new > max_new) so timings compare.
    cfg = replace(TalkerConfig(), min_new_tokens=10**6, max_new_tokens=2048)
    model = build_model(cfg)
    print(
        f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, Talker "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f} M params bf16; forwards: "
        f"{', '.join(variants)}"
    )
    ok = precision(model, args, variants)
    # The engines fuse `model` in place (the plain path then runs on the weight views, shown
    # bitwise equal above); plain engines are built first all the same.
    engines_ok, _ = engines_section(model, args, variants)
    if args.profile:
        profile_section(model, args, variants)
    if args.attention:
        attention_section(cfg)
    ok = ok and engines_ok
    print("\n" + ("all checks OK" if ok else "CHECKS FAILED (see above)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

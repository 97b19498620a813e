"""The Thinker's LLM engine on one GPU at full Qwen3-8B size (random bf16 weights), as it
ships (`EngineConfig()`: its graphs, sampler and prefix cache as the defaults set them).

Checks (exit 1 on a failure):
  1. FlashInfer against torch paged attention, full-size heads (32 q / 8 kv / 128): a
     prefill batch (chunks over a cached prefix) and a decode batch, outputs and cache writes;
  2. the same greedy tokens when the same requests run again (batch 1 and 4).
Timings: a --prefill-token prompt's prefill step; wall ms a decode step (host work
included) at each --batches size, greedy and sampled; the step that prefills a short prompt
over a cached 2000-token history and samples its first token (a follow-up or realtime turn).
`--profile`: the kernels of one decode step at batch 1 and 16 (GEMM against the rest) and of one cached short prefill.

    python -m bench.gpu_llm [--kv-gib 4] [--steps 64] [--prefill 2500] [--batches 1,2,4,8,16] [--profile]

Weights: built on the GPU, seeded. Residual-branch outputs are scaled down and lm_head is
tied to a permutation of the embedding plus noise, so greedy choices have clear margins and
a repeat must agree token for token.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time

import torch

from bench.cuda_timing import kernel_profile
from pipeline.config import LLMConfig
from pipeline.thinker.llm_engine.attention import AttnMetadata, FlashInferAttention, TorchAttention
from pipeline.thinker.llm_engine.engine import EngineConfig, LLMEngine
from pipeline.handoff import SamplingParams
from pipeline.thinker.llm import Qwen3LM

FAILURES: list[str] = []
GEMM = re.compile(r"gemm|gemv|nvjet|cutlass|sm90_xmma|wgmma", re.I)
SAMPLED = {"temperature": 0.7, "top_p": 0.8, "top_k": 100, "repetition_penalty": 1.05}


def check(ok: bool, what: str, detail: str) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}: {detail}")
    if not ok:
        FAILURES.append(what)


@torch.no_grad()
def build_model(cfg: LLMConfig, device: torch.device, seed: int = 0) -> Qwen3LM:
    t0 = time.time()
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = Qwen3LM(cfg)
        finally:
            torch.set_default_dtype(prev)
    assert model.rotary.cos.dtype == torch.float32  # the RoPE table is built in fp32 explicitly
    g = torch.Generator(device=device).manual_seed(seed)
    branch_std = 0.002  # o_proj / down_proj: keep the residual stream near the embedding
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            p.normal_(0.0, branch_std, generator=g)
        elif "embed_tokens" in name:
            p.normal_(0.0, 1.0, generator=g)
        elif name == "lm_head.weight":
            pass
        else:
            p.normal_(0.0, 0.02, generator=g)
    perm = torch.randperm(cfg.vocab_size, generator=g, device=device)
    model.lm_head.weight.copy_(
        0.01 * model.model.embed_tokens.weight[perm]
        + torch.randn(model.lm_head.weight.shape, generator=g, device=device, dtype=torch.bfloat16)
        * 0.02
    )
    model.eval()
    torch.cuda.synchronize()
    print(
        f"model built in {time.time() - t0:.1f} s, "
        f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params"
    )
    return model


@torch.no_grad()
def attention_parity(device: torch.device) -> None:
    print("1) FlashInfer vs torch paged attention (bf16)")
    Hq, Hkv, D, bs, nblocks = 32, 8, 128, 16, 512
    dtype = torch.bfloat16
    fi = FlashInferAttention(Hq, Hkv, D, bs, nblocks + 1, dtype, device)
    ref = TorchAttention()
    rng = random.Random(0)
    for decode in (False, True):
        shapes = (
            [(0, 700), (300, 1), (1000, 257), (37, 64)]
            if not decode
            else [(1, 1), (99, 1), (2047, 1), (500, 1)]
        )
        free = list(range(nblocks))
        rng.shuffle(free)
        kv = torch.randn(nblocks + 1, 2, bs, Hkv, D, dtype=dtype, device=device)
        tables, qs, ks, vs, slots, indptr, lens = [], [], [], [], [], [0], []
        for n_past, n_new in shapes:
            n = n_past + n_new
            t = [free.pop() for _ in range((n + bs - 1) // bs)]
            tables.append(t)
            qs.append(torch.randn(n_new, Hq, D, dtype=dtype, device=device))
            ks.append(torch.randn(n_new, Hkv, D, dtype=dtype, device=device))
            vs.append(torch.randn(n_new, Hkv, D, dtype=dtype, device=device))
            slots += [t[p // bs] * bs + p % bs for p in range(n_past, n)]
            indptr.append(indptr[-1] + n_new)
            lens.append(n)
        width = max(map(len, tables))
        bt = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        meta = AttnMetadata(
            torch.tensor(indptr, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32),
            bt.to(device),
            bt,
            torch.tensor(slots, device=device),
            decode,
            bs,
        )
        q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
        kv_a, kv_b = kv.clone(), kv.clone()
        o_ref = ref.forward(kv_a, q, k, v, meta, D**-0.5).float()
        fi.prepare(meta)
        o_fi = fi.forward(kv_b, q, k, v, meta, D**-0.5).float()
        d = (o_ref - o_fi).abs()
        check(
            bool(d.max() < 2e-2) and torch.equal(kv_a, kv_b),
            f"{'decode' if decode else 'prefill'} attention",
            f"max {d.max():.2e} mean {d.mean():.2e} (tol 2e-2), cache writes equal {torch.equal(kv_a, kv_b)}",
        )


def make_engine(model: Qwen3LM, device: torch.device, kv_gib: float, max_seqs: int = 8) -> LLMEngine:
    cfg = EngineConfig(kv_cache_bytes=int(kv_gib * 1024**3), max_num_seqs=max(8, max_seqs))
    return LLMEngine(model, cfg, device, torch.bfloat16)


def rand_ids(model: Qwen3LM, n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist()


@torch.no_grad()
def decode(eng: LLMEngine, prompts: list[list[int]], steps: int, sampled: bool, tag: str
           ) -> tuple[dict[str, list[int]], list[float]]:
    """Tokens per request and the wall ms of every decode-only step (step() returns once the
    step's ids are on the host: the full per-step cost, host work included)."""
    for i, p in enumerate(prompts):
        extra = {**SAMPLED, "seed": 100 + i} if sampled else {}
        eng.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=steps, ignore_eos=True,
                                                       stop_ids=(), **extra))
    toks: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(prompts))}
    times = []
    while eng.has_unfinished():
        only_decode = not eng.scheduler.waiting and all(
            s.num_computed >= s.num_prompt for s in eng.scheduler.running)
        t0 = time.perf_counter()
        outs = eng.step()
        if only_decode:
            times.append((time.perf_counter() - t0) * 1e3)
        for o in outs:
            toks[o.request_id] += o.token_ids
    return toks, times


def one_step_ms(eng: LLMEngine, prompt: list[int], rid: str) -> float:
    """Wall ms of the step that prefills `prompt` and samples its first token."""
    eng.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True, **SAMPLED, seed=1))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    while eng.has_unfinished():
        eng.step()
    return ms


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


@torch.no_grad()
def timings(model: Qwen3LM, eng: LLMEngine, args) -> dict[str, float]:
    gen = torch.Generator().manual_seed(2)
    rows = {}
    for bs in args.batches:
        prompts = [rand_ids(model, int(n), gen) for n in torch.randint(50, 400, (bs,), generator=gen)]
        for sampled in (False, True):
            kind = "sampled" if sampled else "greedy"
            decode(eng, prompts, 4, sampled, f"w{bs}{kind}")  # JIT, graphs, allocator
            toks, times = decode(eng, prompts, args.steps, sampled, f"t{bs}{kind}")
            rows[f"decode ms a step, batch {bs}, {kind}"] = median(times)
            if not sampled and bs in (1, 4):
                again, _ = decode(eng, prompts, args.steps, sampled, f"t{bs}{kind}")
                check(again == toks, f"greedy repeat, batch {bs}", f"tokens equal {again == toks}")
    prompt = rand_ids(model, args.prefill, gen)
    for k in range(2):
        one_step_ms(eng, prompt, f"pw{k}")
    rows[f"prefill {args.prefill} tokens, ms"] = median(
        [one_step_ms(eng, prompt, f"p{k}") for k in range(3)])
    history = rand_ids(model, 2000, gen)
    one_step_ms(eng, history, "h")  # its blocks enter the prefix cache
    for n in (16, 64, 256):
        for k in range(2):
            one_step_ms(eng, history + rand_ids(model, n, gen), f"cw{n}_{k}")
        rows[f"{n} new tokens over 2000 cached, ms"] = median(
            [one_step_ms(eng, history + rand_ids(model, n, gen), f"c{n}_{k}") for k in range(5)])
    return rows


@torch.no_grad()
def profile(model: Qwen3LM, eng: LLMEngine) -> None:
    gen = torch.Generator().manual_seed(4)

    def show(what: str, fn) -> None:
        n, ms, top, seq = kernel_profile(fn)
        print(f"  {what}: {n} kernels, {ms:.3f} ms of kernels")
        gemm = sum(us for _, name, us in seq if GEMM.search(name)) / 1e3
        print(f"    GEMM kernels {gemm:.3f} ms, the rest {ms - gemm:.3f} ms")
        for name, us, count in top[:8]:
            print(f"    {us / 1e3:7.3f} ms {count:5d}x  {name}")

    for bs in (1, 16):
        for i in range(bs):
            eng.add_request(f"prof{bs}_{i}", rand_ids(model, 300, gen),
                            SamplingParams(max_tokens=64, ignore_eos=True, **SAMPLED, seed=i))
        for _ in range(8):  # the prefill, then decode steps
            eng.step()
        show(f"decode step, batch {bs}", eng.step)
        while eng.has_unfinished():
            eng.step()
    history = rand_ids(model, 2000, gen)
    one_step_ms(eng, history, "prof_h")
    eng.add_request("prof_c", history + rand_ids(model, 64, gen),
                    SamplingParams(max_tokens=1, ignore_eos=True))
    show("64 new tokens over 2000 cached", eng.step)
    while eng.has_unfinished():
        eng.step()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_llm", description=__doc__.split("\n")[0])
    ap.add_argument("--kv-gib", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=64, help="decode steps a timing")
    ap.add_argument("--prefill", type=int, default=2500)
    ap.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2, 4, 8, 16],
                    help="decode batch sizes to time")
    ap.add_argument("--profile", action="store_true", help="also the kernels of a few steps")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    attention_parity(device)
    model = build_model(LLMConfig(), device)
    model.fuse_projections()  # as the Thinker serves it: joined matmuls, compiled layer halves
    model.compile_ops()
    eng = make_engine(model, device, args.kv_gib, max(args.batches))
    print("engine: " + ", ".join(f"{k} {v}" for k, v in vars(eng.config).items()))
    rows = timings(model, eng, args)
    print("\n| metric | value |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.2f} |")
    print(f"| peak GPU memory GiB | {torch.cuda.max_memory_allocated() / 1024**3:.1f} |")
    if args.profile:
        profile(model, eng)
    if FAILURES:
        print(f"\nFAILED: {', '.join(FAILURES)}")
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

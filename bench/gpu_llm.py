"""GPU self-check + timing of the Thinker LLM engine at full Qwen3-8B size (random weights).

    python bench/gpu_llm.py [--kv-gib 4] [--steps 32]

Checks (exit 1 on a failure):
  1. FlashInfer vs torch paged attention, bf16, full-size heads (32 q / 8 kv / 128):
     a prefill batch (chunks over a cached prefix) and a decode batch.
  2. Engine prefill logits, flashinfer vs torch backend (same weights, same prompt).
  3. CUDA-graph decode vs eager decode (both flashinfer): token-exact greedy over
     --steps steps at batch 1 and 4, and the returned hidden rows agree (bf16 tol).
  4. Host sampler vs in-graph sampler (both with graphs): the same tokens for greedy and
     for seeded sampled requests (the device sampler draws what the host one draws).
Timing (CUDA events, after warmup): prefill of 2500 tokens, decode ms/step at batch 1 and 4
with graphs on; then wall-clock ms per decode step (host work included) at batch 1, 2, 4, 8
with the host sampler, sampling inside the graph, and sampling inside the graph with the
next step launched before the last one's ids reach the host (`launch_ahead`), greedy and
sampled, all three drawing the same tokens.

--profile: only a torch.profiler table of one graphed decode step (in-graph sampler) at
batch 1 and 8, launching ahead and not: kernel count, kernel time and the top kernels, and
the wall ms a step.
--profile-prefill N [N ...]: only the step that prefills N new tokens and samples the first
one, cold and over a cached 2000-token history (wall ms), then the kernels and the host's
top ops of one such cached step (a short turn's prefill measured 50-90 ms in the app).
--pieces T (with --profile-prefill): the same on an engine with piecewise_graph_tokens=T,
in the same run, plus greedy tokens and hidden rows of each engine against the eager one.
--whole T (with --profile-prefill): also an engine with prefill_graph_tokens=T (a prefill step
as one CUDA graph, attention inside; piecewise graphs as --pieces for larger steps).
--qk-rope-kv: only the fused QK-norm + RoPE + K/V cache write (`Qwen3LM.fuse_qk_rope_kv`,
ThinkerEngineConfig.fused_qk_rope_kv) off and on, on the served engine settings (decode,
piecewise and whole prefill graphs): one graphed decode step's kernel count, kernel ms and
wall ms at batch 1 and 8, then a 300-token prompt + --steps greedy tokens and a second turn
over its cached prefix: the same tokens, and the largest logit difference (exit 1 if not).

Weights: built directly on the GPU (no disk), seeded. Residual-branch outputs are scaled
down and lm_head is tied to a permutation of the embedding plus noise, so greedy choices
have clear margins: eager and graph runs then must agree token for token, and any
numerical drift shows up in the hidden-row comparison instead of as a coin flip.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from pipeline.config import LLMConfig
from pipeline.thinker.llm_engine.attention import AttnMetadata, FlashInferAttention, TorchAttention
from pipeline.thinker.llm_engine.engine import EngineConfig, LLMEngine
from pipeline.handoff import SamplingParams
from pipeline.thinker.llm import Qwen3LM

FAILURES: list[str] = []


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


# ---------------------------------------------------------------------------------------
# 1) attention op parity


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


# ---------------------------------------------------------------------------------------
# 2) engine prefill, flashinfer vs torch backend


def make_engine(model, device, kv_gib, **kw) -> LLMEngine:
    base = {
        "max_num_seqs": 4,
        "max_num_batched_tokens": 4096,
        "block_size": 16,
        "kv_cache_bytes": int(kv_gib * 1024**3),
        "attention_backend": "flashinfer",
        "cuda_graphs": True,
        # the timings repeat one prompt: cold prefills, not prefix-cache hits
        # (bench/gpu_followup.py measures the cache)
        "enable_prefix_caching": False,
    }
    return LLMEngine(model, EngineConfig(**{**base, **kw}), device, torch.bfloat16)


@torch.no_grad()
def backend_parity(model, device, kv_gib) -> None:
    print("2) engine prefill logits: flashinfer vs torch backend")
    prompt = torch.randint(
        0, model.cfg.vocab_size, (600,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    hiddens = {}
    for backend in ("torch", "flashinfer"):
        eng = make_engine(model, device, kv_gib / 2, attention_backend=backend, cuda_graphs=False)
        eng.add_request(
            "p",
            prompt,
            SamplingParams(max_tokens=3, stop_ids=(), ignore_eos=True),
            return_hidden=True,
        )
        rows, toks = [], []
        while eng.has_unfinished():
            for o in eng.step():
                toks += o.token_ids
                if o.hidden is not None:
                    rows.append(o.hidden)
        hiddens[backend] = (torch.cat(rows).float(), toks)
        del eng
        torch.cuda.empty_cache()
    (h_t, tok_t), (h_f, tok_f) = hiddens["torch"], hiddens["flashinfer"]
    d = (h_t - h_f).abs()
    rel = (d.norm() / h_t.norm()).item()
    # 36 bf16 layers: the two kernels' rounding differs, so this is looser than the op check.
    check(
        rel < 5e-2 and tok_t == tok_f,
        "prefill+decode hidden, flashinfer vs torch",
        f"rel L2 {rel:.2e} max {d.max():.2e}, tokens equal {tok_t == tok_f}",
    )


# ---------------------------------------------------------------------------------------
# 3) graphs vs eager, and timing


@torch.no_grad()
def decode_run(eng: LLMEngine, prompts: list[list[int]], steps: int):
    sp = SamplingParams(max_tokens=steps, stop_ids=(), ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, sp, return_hidden=True)
    toks = {f"r{i}": [] for i in range(len(prompts))}
    hid = {f"r{i}": [] for i in range(len(prompts))}
    times = []
    while eng.has_unfinished():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        outs = eng.step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        for o in outs:
            toks[o.request_id] += o.token_ids
            if o.hidden is not None:
                hid[o.request_id].append(o.hidden.float())
    return toks, {k: torch.cat(v) for k, v in hid.items() if v}, times


# ---------------------------------------------------------------------------------------
# 4) host sampler vs sampling inside the graph

SAMPLED = {"temperature": 0.7, "top_p": 0.8, "top_k": 100, "repetition_penalty": 1.05}


@torch.no_grad()
def wall_decode(eng: LLMEngine, prompts: list[list[int]], steps: int, sampled: bool):
    """Tokens per request and wall ms of every decode-only step (step() returns once the
    step's ids are on the host, so this is the full per-step cost, host work included)."""
    for i, p in enumerate(prompts):
        extra = {**SAMPLED, "seed": 100 + i} if sampled else {}
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=steps, ignore_eos=True, **extra))
    toks = {f"r{i}": [] for i in range(len(prompts))}
    times = []
    while eng.has_unfinished():
        decode = all(s.num_computed >= s.num_prompt for s in eng.scheduler.running) and not (
            eng.scheduler.waiting
        )
        t0 = time.perf_counter()
        outs = eng.step()
        if decode:
            times.append((time.perf_counter() - t0) * 1e3)
        for o in outs:
            toks[o.request_id] += o.token_ids
    return toks, times


MODES = {  # sampler, and whether step N+1 is launched before step N's ids reach the host
    "host": {"device_sampling": False},
    "graph": {"device_sampling": True, "launch_ahead": False},
    "ahead": {"device_sampling": True, "launch_ahead": True},
}


def sampler_comparison(model, device, kv_gib: float, steps: int) -> dict[str, float]:
    print("4) host sampler vs in-graph sampler vs in-graph + launch ahead (graphs, max_num_seqs 8)")
    engines = {mode: make_engine(model, device, kv_gib, max_num_seqs=8, **kw)
               for mode, kw in MODES.items()}
    gen = torch.Generator().manual_seed(3)
    rows = {}
    for bs in (1, 2, 4, 8):
        prompts = [
            torch.randint(0, model.cfg.vocab_size, (int(n),), generator=gen).tolist()
            for n in torch.randint(50, 400, (bs,), generator=gen)
        ]
        for sampled in (False, True):
            res = {}
            for mode, eng in engines.items():
                wall_decode(eng, prompts, 4, sampled)  # warmup
                res[mode] = wall_decode(eng, prompts, steps, sampled)
            kind = "sampled" if sampled else "greedy"
            for mode in ("graph", "ahead"):
                same = res["host"][0] == res[mode][0]
                check(same, f"host sampler vs {mode}, {kind}, batch {bs}", f"tokens equal {same}")
            for mode, (_, times) in res.items():
                rows[(bs, kind, mode)] = sorted(times)[len(times) // 2]
    heads = [f"{k}, {m}" for k in ("greedy", "sampled") for m in MODES]
    print("\n| batch | " + " | ".join(heads) + " |")
    print("|---" * (len(heads) + 1) + "|")
    for bs in (1, 2, 4, 8):
        cells = [rows[(bs, k, m)] for k in ("greedy", "sampled") for m in MODES]
        print(f"| {bs} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    print(f"(wall ms per decode step, median of {steps} steps; host = host sampler; graph = in "
          f"the graph; ahead = in the graph + launch ahead; sampled = {SAMPLED}, seeded)")
    engines.clear()
    torch.cuda.empty_cache()
    return {
        f"decode wall ms/step, batch {bs}, {k}, {m}": rows[(bs, k, m)]
        for bs in (1, 8)
        for k in ("greedy", "sampled")
        for m in MODES
    }


def tokens_and_hidden(
    eng: LLMEngine, rid: str, prompt: list[int], sp: SamplingParams
) -> tuple[list[int], torch.Tensor]:
    """One request run to its end on `eng`: its tokens and its hidden rows (fp32)."""
    eng.add_request(rid, prompt, sp, return_hidden=True)
    ids, rows = [], []
    while eng.has_unfinished():
        for o in eng.step():
            ids += o.token_ids
            rows += [o.hidden] if o.hidden is not None else []
    return ids, torch.cat(rows).float()


@torch.no_grad()
def compiled_vs_plain(model, device, kv_gib: float, tokens: int = 200) -> None:
    """The full-size check of compile_ops against the plain layers, on the same weights: a
    300-token prompt (prefilled by piecewise graphs over two chunks) and `tokens` greedy
    decode steps (graphs) on each, their tokens and their hidden rows compared, with the
    first and last 50 rows' mean difference (drift). Leaves the model compiled."""
    print(f"1b) compiled layers vs plain: 300-token prompt, {tokens} greedy tokens")
    prompt = torch.randint(
        0, model.cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(7)
    ).tolist()
    got = {}
    for name in ("plain", "compiled"):
        if name == "compiled":
            model.compile_ops()
        eng = make_engine(model, device, kv_gib / 2, piecewise_graph_tokens=256,
                          max_num_batched_tokens=256)
        sp = SamplingParams(max_tokens=tokens, stop_ids=(), ignore_eos=True)
        got[name] = tokens_and_hidden(eng, "c", prompt, sp)
        del eng
        torch.cuda.empty_cache()
    (ids_p, h_p), (ids_c, h_c) = got["plain"], got["compiled"]
    diff = (h_c - h_p).abs().amax(dim=-1) / h_p.abs().amax()
    first = next((i for i, (a, b) in enumerate(zip(ids_p, ids_c)) if a != b), None)
    check(
        first is None and diff.max() <= 3e-2,
        "compiled layers vs plain",
        f"tokens equal {first is None} (first difference at {first}), hidden max |diff| / "
        f"max |h| {diff.max():.2e}, mean over the first / last 50 rows "
        f"{diff[:50].mean():.2e} / {diff[-50:].mean():.2e}",
    )


def decode_step_profile(eng: LLMEngine, bs: int, gen: torch.Generator):
    """`bs` sampled requests of 300-token prompts on `eng`, warmed up for 8 steps: the wall
    ms a decode step over the next 8, then one step's (kernel count, kernel ms, top
    kernels); the requests are then run to their end."""
    from bench.gpu_talker import kernel_table

    for i in range(bs):
        prompt = torch.randint(0, eng.model.cfg.vocab_size, (300,), generator=gen).tolist()
        eng.add_request(f"p{bs}-{i}", prompt,
                        SamplingParams(max_tokens=64, ignore_eos=True, **SAMPLED, seed=i))
    for _ in range(8):  # prefill, then decode steps (FlashInfer JIT, graph warm-up)
        eng.step()
    t0 = time.perf_counter()
    for _ in range(8):
        eng.step()
    wall = (time.perf_counter() - t0) / 8 * 1e3
    n, ms, top = kernel_table(eng.step)
    while eng.has_unfinished():
        eng.step()
    return wall, n, ms, top


@torch.no_grad()
def profile_decode(model, device, kv_gib: float) -> None:
    print("profile: one graphed decode step (in-graph sampler; kernel time in ms)")
    gen = torch.Generator().manual_seed(4)
    for bs, ahead in ((1, False), (1, True), (8, False), (8, True)):
        eng = make_engine(model, device, kv_gib, max_num_seqs=8, launch_ahead=ahead)
        wall, n, ms, top = decode_step_profile(eng, bs, gen)
        print(f"  B{bs}, launch ahead {ahead}: {n} kernels, {ms:.3f} ms of kernels, "
              f"{wall:.2f} ms wall a step")
        for name, us, count in top:
            print(f"    {us / 1e3:7.3f} ms {count:5d}x  {name}")
        del eng
        torch.cuda.empty_cache()


@torch.no_grad()
def qk_rope_kv_compare(model, device, kv_gib: float, steps: int) -> None:
    """The fused QK-norm + RoPE + K/V kernel off and on, on the same weights and on the
    engine settings served (decode graphs, piecewise and whole prefill graphs up to 512
    tokens, prefix caching): a decode step's kernels and wall ms at batch 1 and 8; the
    greedy tokens and logits of a 300-token prompt + `steps` tokens and of a second turn
    over its cached prefix (its prefill a graph step over 300 + `steps` cached tokens).
    Leaves the kernel off."""
    print(f"qk-rope-kv: fused QK-norm + RoPE + K/V write off vs on ({steps} greedy tokens a turn)")
    gen = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, model.cfg.vocab_size, (300,), generator=gen).tolist()
    extra = torch.randint(0, model.cfg.vocab_size, (20,), generator=gen).tolist()
    sp = SamplingParams(max_tokens=steps, stop_ids=(), ignore_eos=True)
    got, rows = {}, {}
    for on in (False, True):
        if model.fuse_qk_rope_kv(on) != on:
            check(False, "fuse_qk_rope_kv", "the kernel does not run on this device")
            return
        eng = make_engine(model, device, kv_gib, max_num_seqs=8, enable_prefix_caching=True,
                          piecewise_graph_tokens=512, prefill_graph_tokens=512)
        ids_a, h_a = tokens_and_hidden(eng, f"a{on}", prompt, sp)
        ids_b, h_b = tokens_and_hidden(eng, f"b{on}", prompt + ids_a + extra, sp)
        hidden = torch.cat([h_a, h_b]).to(device, torch.bfloat16)
        got[on] = ids_a + ids_b, model.compute_logits(hidden).float()
        for bs in (1, 8):
            wall, n, ms, top = decode_step_profile(eng, bs, gen)
            rows[on, bs] = (n, ms, wall)
            print(f"  kernel {'on' if on else 'off'}, B{bs}: {n} kernels, {ms:.3f} ms of "
                  f"kernels, {wall:.2f} ms wall a step")
            for name, us, count in top[:6]:
                print(f"    {us / 1e3:7.3f} ms {count:5d}x  {name}")
        del eng
        torch.cuda.empty_cache()
    model.fuse_qk_rope_kv(False)
    (ids_off, logits_off), (ids_on, logits_on) = got[False], got[True]
    first = next((i for i, (a, b) in enumerate(zip(ids_off, ids_on)) if a != b), None)
    diff = (logits_on - logits_off).abs().amax(dim=-1)  # per row, both turns' in order
    scale = logits_off.abs().amax()
    check(
        first is None and diff.max() <= 3e-2 * scale,
        "fused qk-rope-kv vs plain",
        f"tokens equal {first is None} (first difference at {first}), logits max |diff| "
        f"{diff.max():.3e} (max |logit| {scale:.2f}), mean over the first / last 16 rows "
        f"{diff[:16].mean():.2e} / {diff[-16:].mean():.2e}",
    )
    print("\n| decode step | off | on |\n|---|---|---|")
    for bs in (1, 8):
        for i, what in enumerate(("kernels", "kernel ms", "wall ms")):
            fmt = "{:d}" if i == 0 else "{:.3f}"
            cells = [fmt.format(rows[on, bs][i]) for on in (False, True)]
            print(f"| B{bs} {what} | {cells[0]} | {cells[1]} |")


@torch.no_grad()
def profile_prefill(
    model,
    device,
    kv_gib: float,
    lengths: list[int],
    pieces: int = 0,
    prefix: int = 2000,
    whole: int = 0,
) -> None:
    """Wall ms of the step that prefills a short prompt and samples its first token: cold
    (nothing cached) and as a new turn over a cached `prefix`-token history (the realtime
    and follow-up shape); then the kernels and the host's top ops of one cached step.
    With `pieces` > 0, the same on an engine whose such steps run as piecewise graphs
    (`piecewise_graph_tokens`), and with `whole` > 0 on one whose such steps run as whole
    graphs (`prefill_graph_tokens`), measured in the same run, and each engine's greedy
    tokens and returned hidden rows compared with the eager one's after each length's
    prefill."""
    from torch.profiler import ProfilerActivity, profile

    from bench.gpu_talker import kernel_table

    kinds = {"eager": (0, 0)}
    if pieces:
        kinds[f"pieces<={pieces}"] = (pieces, 0)
    if whole:
        kinds[f"whole<={whole}"] = (pieces, whole)
    engines = {
        name: make_engine(model, device, kv_gib, enable_prefix_caching=True,
                          device_sampling=True, piecewise_graph_tokens=p,
                          prefill_graph_tokens=w)
        for name, (p, w) in kinds.items()
    }
    gen = torch.Generator().manual_seed(5)

    def rand(n: int) -> list[int]:
        return torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist()

    k = 0

    def one(eng, prompt: list[int], fn=None) -> float:
        nonlocal k
        k += 1
        eng.add_request(f"f{k}", prompt, SamplingParams(max_tokens=1, ignore_eos=True,
                                                        **SAMPLED, seed=k))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = (fn or eng.step)()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        while eng.has_unfinished():
            eng.step()
        return ms if fn is None else out

    history = rand(prefix)
    for eng in engines.values():
        one(eng, history)  # the history's blocks enter the prefix cache
    print(f"profile: one prefill step + its first token (wall ms, median of 5; "
          f"cached = after {prefix} cached tokens)")
    for n in lengths:
        cells = []
        for name, eng in engines.items():
            for _ in range(2):  # FlashInfer JIT, compiled helpers' shapes, allocator
                one(eng, rand(n))
                one(eng, history + rand(n))
            cold = sorted(one(eng, rand(n)) for _ in range(5))[2]
            cached = sorted(one(eng, history + rand(n)) for _ in range(5))[2]
            cells.append(f"{name}: cold {cold:7.2f} ms, cached {cached:7.2f} ms")
        print(f"  {n:5d} new tokens: " + " | ".join(cells))
    if len(engines) > 1:
        print("graphs vs eager: 16 greedy tokens after each prefill over the cached history")
        for n in lengths:
            prompt = history + rand(n)
            got = {}
            for name, eng in engines.items():
                k += 1
                sp = SamplingParams(max_tokens=16, ignore_eos=True)
                got[name] = tokens_and_hidden(eng, f"p{k}", prompt, sp)
            ids_a, h_a = got["eager"]
            for name, (ids_b, h_b) in got.items():
                if name == "eager":
                    continue
                rel = ((h_a - h_b).abs().max() / h_a.abs().max()).item()
                ok = ids_a == ids_b and rel <= 3e-2
                print(f"  [{'ok' if ok else 'FAIL'}] {name}, {n:5d} new tokens: tokens equal "
                      f"{ids_a == ids_b}, hidden max |diff| / max |eager| {rel:.2e}")
    n = lengths[0]
    for name, eng in engines.items():
        count, ms, top = one(eng, history + rand(n), lambda e=eng: kernel_table(e.step))
        print(f"  {name}: one cached {n}-token step: {count} kernels, {ms:.3f} ms of kernels")
        for kname, us, calls in top[:6]:
            print(f"    {us / 1e3:7.3f} ms {calls:5d}x  {kname}")

        def host_ops(e=eng):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                e.step()
            return prof

        prof = one(eng, history + rand(n), host_ops)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-gib", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=2500)
    ap.add_argument("--sampler-steps", type=int, default=64, help="decode steps per timing")
    ap.add_argument(
        "--no-fuse", action="store_true", help="keep separate q/k/v and gate/up matmuls"
    )
    ap.add_argument("--no-compile", action="store_true", help="eager elementwise helpers")
    ap.add_argument("--profile", action="store_true", help="only the decode-step profile")
    ap.add_argument("--profile-prefill", type=int, nargs="*", metavar="N",
                    help="only short prefill steps of N new tokens, cold and cached (e.g. 16 64 256)")
    ap.add_argument("--pieces", type=int, default=0, metavar="T",
                    help="with --profile-prefill: also an engine with piecewise_graph_tokens=T")
    ap.add_argument("--whole", type=int, default=0, metavar="T",
                    help="with --profile-prefill: also an engine with prefill_graph_tokens=T")
    ap.add_argument("--qk-rope-kv", action="store_true",
                    help="only the fused QK-norm + RoPE + K/V kernel off vs on (profile + check)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    attention_parity(device)
    cfg = LLMConfig()
    model = build_model(cfg, device)
    if not args.no_fuse:
        model.fuse_projections()
    if not args.no_compile:
        if args.profile or args.profile_prefill or args.qk_rope_kv:
            model.compile_ops()
        else:
            compiled_vs_plain(model, device, args.kv_gib)
    print(
        f"serving transforms: fuse_projections={not args.no_fuse} compile_ops={not args.no_compile}"
    )
    if args.profile:
        profile_decode(model, device, args.kv_gib)
        return 0
    if args.qk_rope_kv:
        qk_rope_kv_compare(model, device, args.kv_gib, args.steps)
        return 1 if FAILURES else 0
    if args.profile_prefill:
        profile_prefill(model, device, args.kv_gib, args.profile_prefill, args.pieces,
                        whole=args.whole)
        return 0
    backend_parity(model, device, args.kv_gib)

    print("3) CUDA-graph decode vs eager (flashinfer)")
    t0 = time.time()
    eng_g = make_engine(model, device, args.kv_gib, cuda_graphs=True)
    print(f"  graphs captured for {eng_g.runner.graphs.sizes} in {time.time() - t0:.1f} s")
    eng_e = make_engine(model, device, args.kv_gib, cuda_graphs=False)
    gen = torch.Generator().manual_seed(2)
    timing = {}
    for bs in (1, 4):
        prompts = [
            torch.randint(0, cfg.vocab_size, (int(n),), generator=gen).tolist()
            for n in torch.randint(50, 400, (bs,), generator=gen)
        ]
        decode_run(eng_g, prompts, 4)  # warmup (flashinfer JIT, allocator)
        decode_run(eng_e, prompts, 4)
        replays0 = eng_g.runner.graphs.num_replays
        tg, hg, times_g = decode_run(eng_g, prompts, args.steps)
        replays = eng_g.runner.graphs.num_replays - replays0
        te, he, times_e = decode_run(eng_e, prompts, args.steps)
        check(
            replays == args.steps - 1,
            f"graph replays, batch {bs}",
            f"{replays} of {args.steps - 1} decode steps",
        )
        same = tg == te
        dmax = max((hg[k] - he[k]).abs().max().item() for k in hg)
        rel = max(((hg[k] - he[k]).norm() / he[k].norm()).item() for k in hg)
        check(
            same and rel < 2e-2,
            f"graph vs eager, batch {bs}",
            f"tokens equal {same} ({sum(map(len, tg.values()))} tokens), hidden rel L2 {rel:.2e} max {dmax:.2e}",
        )
        steady = sorted(times_g[1:])  # skip the prefill step
        timing[f"decode ms/step, batch {bs} (graphs)"] = steady[len(steady) // 2]
        steady = sorted(times_e[1:])
        timing[f"decode ms/step, batch {bs} (eager)"] = steady[len(steady) // 2]

    # prefill timing: one 2500-token prompt in one step
    p = torch.randint(0, cfg.vocab_size, (args.prefill,), generator=gen).tolist()
    for _ in range(2):
        decode_run(eng_g, [p], 1)  # warmup
    ms = []
    for _ in range(3):
        _, _, t = decode_run(eng_g, [p], 1)
        ms.append(t[0])
    timing[f"prefill {args.prefill} tokens, ms"] = sorted(ms)[1]

    del eng_e
    torch.cuda.empty_cache()
    timing.update(sampler_comparison(model, device, args.kv_gib, args.sampler_steps))

    print("\n| metric | value |\n|---|---|")
    for k, v in timing.items():
        print(f"| {k} | {v:.2f} |")
    print(f"| KV blocks (block 16) | {eng_g.block_manager.num_blocks} |")
    print(f"| peak GPU memory GiB | {torch.cuda.max_memory_allocated() / 1024**3:.1f} |")
    if FAILURES:
        print(f"\nFAILED: {', '.join(FAILURES)}")
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

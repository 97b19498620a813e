"""Code2Wav on one GPU: full-size random flow + HiFT, fp32 (as the reference) or a bf16 flow.

Checks (exit 1 on failure):
  * CUDA-graph CFM (whole 10-step loop) vs eager, batch 1 and 2: mel and caches bitwise equal
    (reported), max abs diff <= 1e-4 required;
  * batched stream_step (batch 2) vs one stream at a time: max abs pcm diff <= 1e-3.
Timings (CUDA events, after warm-up), steady state (caches trimmed to prompt + 100 frames):
  * ms per 25-code chunk (flow + CFM + HiFT) at batch 1, 2, 4, eager vs graph (batch 4 has no
    graph: it falls back to eager);
  * a new stream's first chunk with the initial-state template cache on (clone) vs off
    (setup_cache + chunk).
With --compile, after all of the above (uncompiled), the DiT blocks are compiled in place
(`compile_dit_blocks`, the engine's token2wav_compile_estimator) and a fresh graph runner
captures them:
  * compiled CFM graph vs the uncompiled eager mel/caches of check 1 (same inputs), max abs
    diff <= 1e-4 required; the first call's compile + capture time;
  * the chunk timings again, the speedup of the graph column, the batch-1 flow time, and the
    number of Dynamo graphs (TORCH_LOGS=recompiles shows why each recompiled).

    python bench/gpu_code2wav.py [--prompt-codes 150] [--iters 20] [--dtype bfloat16] [--compile]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch._dynamo.utils import counters

from bench.cuda_timing import cuda_ms as timed
from pipeline.code2wav.assets import random_code2wav
from pipeline.code2wav.dit import compile_dit_blocks
from pipeline.code2wav.graphs import CFMGraphRunner, HiFTGraphRunner
from pipeline.code2wav.stream import Crossfade, StreamState, initial_state, stream_step
from pipeline.config import Code2WavConfig


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-codes", type=int, default=150)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="flow dtype"
    )
    ap.add_argument(
        "--compile", action="store_true", help="then compile the DiT blocks and time again"
    )
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    dev = torch.device("cuda")
    cfg = Code2WavConfig()
    flow, hift = random_code2wav(cfg, seed=0)
    dtype = getattr(torch, args.dtype)
    flow, hift = flow.to(dev, dtype).eval(), hift.to(dev).eval()  # HiFT stays fp32
    print(
        f"flow {sum(p.numel() for p in flow.parameters()) / 1e6:.1f} M params, "
        f"hift {sum(p.numel() for p in hift.parameters()) / 1e6:.1f} M params"
    )
    g = torch.Generator().manual_seed(0)
    p = args.prompt_codes
    pt = torch.randint(0, cfg.vocab_size, (1, p), generator=g).to(dev)
    pm = torch.randn(1, 2 * p, 80, generator=g).to(dev, dtype)
    spk = torch.randn(1, 192, generator=g).to(dev, dtype)
    xf = Crossfade(cfg.mel_overlap_frames * cfg.hift.hop_length, dev)

    def codes(seed: int, n: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, cfg.vocab_size, (1, n), generator=gen).to(dev)

    template = initial_state(flow, cfg, pt, pm, spk)

    def steady(seed: int) -> StreamState:
        st = template.clone()
        st.generator = torch.Generator(device=dev)
        st.generator.manual_seed(seed)
        for k in range(3):  # past trimming: caches at prompt + 100 frames
            _, (st,) = stream_step(flow, hift, cfg, [st], codes(seed * 10 + k, 28), False, xf)
        return st

    states = [steady(s) for s in range(4)]
    failures = []

    # 1. CFM graph vs eager on the exact chunk inputs
    runner = CFMGraphRunner(flow.decoder, (1, 2))
    parity = {}  # batch -> inputs and the eager (uncompiled) outputs, for --compile
    with torch.inference_mode():
        for b in (1, 2):
            from pipeline.code2wav.flow import FlowCache

            cache = FlowCache.cat([s.flow for s in states[:b]]) if b > 1 else states[0].flow
            tokens = torch.cat([codes(100 + i, 28) for i in range(b)])
            spk_b = spk.expand(b, -1)
            mel_e, cache_e = flow.inference_chunk(tokens, spk_b, cache, False)
            parity[b] = (tokens, spk_b, cache, mel_e, cache_e)
            mel_g, cache_g = flow.inference_chunk(tokens, spk_b, cache, False, cfm=runner)
            mel_g2, _ = flow.inference_chunk(tokens, spk_b, cache, False, cfm=runner)  # replay path
            diffs = [
                (mel_e - mel_g2).abs().max().item(),
                (cache_e.est_att - cache_g.est_att).abs().max().item(),
                (cache_e.est_cnn - cache_g.est_cnn).abs().max().item(),
            ]
            bitwise = torch.equal(mel_e, mel_g2) and torch.equal(cache_e.est_att, cache_g.est_att)
            print(
                f"CFM graph vs eager, batch {b}: bitwise={bitwise} max diff mel/att/cnn = "
                + " / ".join(f"{d:.2e}" for d in diffs)
            )
            if max(diffs) > 1e-4:
                failures.append(f"graph parity batch {b}: {max(diffs):.3g}")

        # 2. batched vs one at a time (same per-stream generators)
        def fresh(i):
            st = states[i].clone()
            st.generator = torch.Generator(device=dev)
            st.generator.manual_seed(1000 + i)
            return st

        toks = torch.cat([codes(200 + i, 28) for i in range(2)])
        batched, _ = stream_step(flow, hift, cfg, [fresh(0), fresh(1)], toks, False, xf)
        singles = [
            stream_step(flow, hift, cfg, [fresh(i)], toks[i : i + 1], False, xf)[0]
            for i in range(2)
        ]
        d = max((batched[i] - singles[i][0]).abs().max().item() for i in range(2))
        print(f"batched (2) vs single streams: max pcm diff {d:.2e}")
        bound = 1e-3 if dtype == torch.float32 else 5e-2  # bf16 GEMMs differ by batch shape
        if d > bound:
            failures.append(f"batched vs single: {d:.3g}")

    # 3. timings per 25-code chunk
    def chunk_table(run_cfm: CFMGraphRunner) -> dict[int, tuple[float, float]]:
        """Prints and returns {batch: (eager ms, graph ms)} per 25-code chunk."""
        times = {}
        print("\n| batch | eager ms/chunk | graph ms/chunk | graph ms per stream |")
        print("|---|---|---|---|")
        for b in (1, 2, 4):
            sts = [fresh(i % 4) if i < 2 else states[i].clone() for i in range(b)]
            toks = torch.cat([codes(300 + i, 28) for i in range(b)])
            with torch.inference_mode():
                e = timed(lambda: stream_step(flow, hift, cfg, sts, toks, False, xf), args.iters)
                gr = timed(
                    lambda: stream_step(flow, hift, cfg, sts, toks, False, xf, cfm=run_cfm),
                    args.iters,
                )
            times[b] = (e, gr)
            print(
                f"| {b} | {e:.1f} | {gr:.1f}"
                f"{' (eager fallback)' if b not in run_cfm.batch_sizes else ''} | {gr / b:.1f} |"
            )
        return times

    times = chunk_table(runner)

    # 3b. where a batch-1 chunk's time goes: flow (encoder + graphed CFM) vs HiFT
    st = fresh(0)
    tok1 = codes(350, 28)

    def flow_chunk_ms(run_cfm: CFMGraphRunner) -> float:
        with torch.inference_mode():
            return timed(
                lambda: flow.inference_chunk(tok1, spk, st.flow, False, cfm=run_cfm), args.iters
            )

    flow_ms = flow_chunk_ms(runner)
    with torch.inference_mode():
        mel, _ = flow.inference_chunk(tok1, spk, st.flow, False, cfm=runner)
        mel_in = torch.cat([st.vocoder.mel, mel.float()], dim=2)
        hift_ms = timed(lambda: hift(mel_in, st.vocoder.source, [st.generator]), args.iters)
    print(f"\nbatch-1 chunk breakdown: flow encoder + CFM graph {flow_ms:.1f} ms, "
          f"HiFT ({mel_in.shape[2]} mel frames) {hift_ms:.1f} ms")
    # 3c. HiFT as a CUDA graph (token2wav_hift_cuda_graph): same output for the same draws
    hift_graph = HiFTGraphRunner(hift, (1, 2))
    with torch.inference_mode():
        gen_state = st.generator.get_state()
        ref = hift(mel_in, st.vocoder.source, [st.generator])
        st.generator.set_state(gen_state)
        got = hift_graph(mel_in, st.vocoder.source, [st.generator])  # capture
        st.generator.set_state(gen_state)
        got = hift_graph(mel_in, st.vocoder.source, [st.generator])  # replay
        hg_ms = timed(lambda: hift_graph(mel_in, st.vocoder.source, [st.generator]), args.iters)
    d = max((a - b).abs().max().item() for a, b in zip(ref, got))
    print(f"HiFT graph {hg_ms:.1f} ms (eager {hift_ms:.1f}); max diff vs eager {d:.2e}")
    if d > 1e-4:
        failures.append(f"HiFT graph parity: {d:.3g}")

    # 4. new stream's first chunk: template cache on vs off
    first = codes(400, 28)
    with torch.inference_mode():
        on = timed(
            lambda: stream_step(flow, hift, cfg, [template.clone()], first, False, xf), args.iters
        )
        off = timed(
            lambda: stream_step(
                flow, hift, cfg, [initial_state(flow, cfg, pt, pm, spk)], first, False, xf
            ),
            args.iters,
        )
    print(
        f"\nfirst chunk of a new stream (prompt {p} codes): "
        f"template cache on {on:.1f} ms, off {off:.1f} ms"
    )
    print(
        f"graph captures {runner.captures}, replays {runner.replays}, fallbacks {runner.fallbacks}"
    )

    # 5. the same with the DiT blocks compiled (in place: everything above ran uncompiled)
    if args.compile:
        tf32 = torch.backends.cuda.matmul.allow_tf32
        print(f"\n== compiled DiT blocks (compile_dit_blocks, default mode; TF32 matmul {tf32})")
        counters.clear()
        compile_dit_blocks(flow.decoder.estimator)
        runner_c = CFMGraphRunner(flow.decoder, (1, 2))
        with torch.inference_mode():
            for b, (tokens, spk_b, cache, mel_e, cache_e) in parity.items():
                t0 = time.perf_counter()
                flow.inference_chunk(tokens, spk_b, cache, False, cfm=runner_c)  # compile, capture
                torch.cuda.synchronize()
                first_s = time.perf_counter() - t0
                mel_c, cache_c = flow.inference_chunk(tokens, spk_b, cache, False, cfm=runner_c)
                diffs = [
                    (mel_e - mel_c).abs().max().item(),
                    (cache_e.est_att - cache_c.est_att).abs().max().item(),
                    (cache_e.est_cnn - cache_c.est_cnn).abs().max().item(),
                ]
                print(
                    f"compiled CFM graph vs eager, batch {b}: first call (compile + capture) "
                    f"{first_s:.1f} s, max diff mel/att/cnn = "
                    + " / ".join(f"{d:.2e}" for d in diffs)
                )
                if max(diffs) > 1e-4:
                    failures.append(f"compiled graph parity batch {b}: {max(diffs):.3g}")
        times_c = chunk_table(runner_c)
        for b in times:
            (e, gr), (e_c, gr_c) = times[b], times_c[b]
            print(
                f"batch {b}: graph {gr:.1f} -> {gr_c:.1f} ms/chunk (x{gr / gr_c:.2f}), "
                f"eager {e:.1f} -> {e_c:.1f} ms/chunk"
            )
        flow_ms_c = flow_chunk_ms(runner_c)
        print(f"batch-1 flow encoder + CFM graph: {flow_ms:.1f} -> {flow_ms_c:.1f} ms")
        print(
            f"dynamo graphs for the DiT blocks: {counters['stats']['unique_graphs']}; "
            f"graph captures {runner_c.captures}, fallbacks {runner_c.fallbacks}"
        )

    if failures:
        print("FAIL: " + "; ".join(failures))
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())

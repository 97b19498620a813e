"""GPU: what the audio encoder's first call at a new clip length costs, against a repeat.

    python -m bench.gpu_audio [--lengths 457 689 1003 1501 2222 2999] [--profile] [--graphs]

Random weights at the released geometry (AudioConfig() defaults, LLM hidden 4096), bf16,
one clip a call. Each mode encodes clip lengths (mel frames) it has not seen before, twice
each, and prints the wall ms of the first and the second call: a first call much slower
than the second is a per-shape cost (a kernel built or chosen for that shape), which a
served turn pays whenever its audio has a new length. Modes: SDPA free to pick cuDNN
attention (torch's own choice), cuDNN off for the convs as well as attention, and as
shipped (SDPA off cuDNN attention: pipeline/sdpa.py). Then one batch of two clips
in every mode, against the cuDNN one (the kernels may sum in another order; nothing else
differs). `--profile` prints the top ops of one first call with cuDNN attention.

`--graphs`: only the audio graphs (`audio_cuda_graphs`, model.py AudioGraphs: one clip per
bucket of mel frames as a CUDA graph) against the eager encoder as shipped: wall ms a call
(median of 7 repeats, a realtime utterance's lengths and a clip's) and the tokens' largest
difference relative to the eager ones' largest value.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from bench.gpu_vision import init_small
from pipeline import sdpa
from pipeline.config import ThinkerConfig
from pipeline.thinker.audio import AudioEncoder


def build(device: torch.device) -> AudioEncoder:
    torch.manual_seed(0)
    with device:
        enc = AudioEncoder.from_config(ThinkerConfig()).eval()
        init_small(enc)
    return enc.to(torch.bfloat16)


MODES = {
    "cuDNN attn": sdpa.sdpa_choice,  # what torch 2.11 picks on an H200
    "no cuDNN convs": lambda: torch.backends.cudnn.flags(enabled=False),
    "as shipped": contextlib.nullcontext,  # SDPA off cuDNN attention (pipeline/sdpa.py)
}


@torch.inference_mode()
def call_ms(enc: AudioEncoder, n_mel: int, mode: str = "as shipped") -> float:
    mel = torch.randn(1, enc.apm.cfg.num_mel_bins, n_mel, device="cuda", dtype=torch.bfloat16)
    flags = MODES[mode]()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with flags:
        enc(mel, [n_mel])
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0)


def median_ms(fn, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[repeats // 2]


@torch.inference_mode()
def graphs_vs_eager(enc: AudioEncoder, lengths: list[int]) -> None:
    from pipeline.thinker.model import AudioGraphs

    graphs = AudioGraphs(enc, torch.bfloat16)
    t0 = time.perf_counter()
    graphs.capture()
    print(f"audio graphs: buckets {graphs.buckets} captured in {time.perf_counter() - t0:.1f} s")
    print("mel frames  bucket  eager ms  graph ms  max |diff| / max |eager|")
    gen = torch.Generator().manual_seed(0)
    for n in lengths:
        feats = torch.randn(enc.apm.cfg.num_mel_bins, n, generator=gen).to(torch.bfloat16)
        mel = feats[None].cuda()
        eager = enc(mel, [n])[0].float()
        graph = graphs.encode(feats).float()
        rel = ((graph - eager).abs().max() / eager.abs().max()).item()
        e_ms = median_ms(lambda mel=mel, n=n: enc(mel, [n]))
        g_ms = median_ms(lambda feats=feats: graphs.encode(feats))
        print(f"{n:10}  {graphs.bucket(n):6}  {e_ms:8.2f}  {g_ms:8.2f}  {rel:24.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[457, 689, 1003, 1501, 2222, 2999])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--graphs", action="store_true", help="only the audio graphs against eager")
    args = ap.parse_args()
    enc = build(torch.device("cuda"))
    if args.graphs:
        call_ms(enc, 300)  # CUDA context, cuBLAS handles: not measured
        graphs_vs_eager(enc, [97, 150, 213, 400, 777, 1501, 2999])
        return
    for mode in MODES:  # CUDA context, cuBLAS handles, each backend's first use: not measured
        call_ms(enc, 300, mode)
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print("mode            mel frames  first ms  second ms")
    for k, mode in enumerate(MODES):
        for n in args.lengths:
            n += k  # lengths this mode has not seen
            first, second = call_ms(enc, n, mode), call_ms(enc, n, mode)
            print(f"{mode:14}  {n:10}  {first:8.1f}  {second:9.1f}")
    # The same clip in every mode: the kernels may sum in another order, nothing more.
    mel = torch.randn(2, enc.apm.cfg.num_mel_bins, 1234, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        outs = {}
        for mode, kernels in MODES.items():
            with kernels():
                outs[mode] = torch.cat(enc(mel, [1234, 777])).float()
    ref = outs["cuDNN attn"]
    print("mode            max |diff| / max |cuDNN|   mean |diff| / mean |cuDNN|")
    for mode, out in outs.items():
        d = (out - ref).abs()
        print(f"{mode:14}  {d.max().item() / ref.abs().max().item():24.2e}"
              f"   {d.mean().item() / ref.abs().mean().item():26.2e}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call_ms(enc, args.lengths[0] + 7, "cuDNN attn")
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()

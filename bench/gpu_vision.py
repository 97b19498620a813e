"""GPU check + timing of the Thinker's vision path (SigLIP 26 layers + resampler), bf16.

    python -m bench.gpu_vision [--batches 16 32] [--iters 10]

Random weights at the released geometry (VisionConfig() defaults, LLM hidden 4096).
1. Parity on a padded batch of mixed slice sizes: every backend (bf16) is compared with
   an fp32 eager copy; a backend passes when its error is within 1.5x (+ a small floor)
   of bf16 eager's own error against fp32, and its mean error is < 2% of the mean |ref|.
   Backends: eager, sdpa, flash (if a varlen kernel exists), sdpa+compile.
2. Timing: ms per 448x448 slice (32x32 = 1024 patches) for each batch size, vpm +
   resampler, CUDA events after warm-up.
Exits 1 when a parity check fails.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

from bench.cuda_timing import cuda_ms as time_ms
from pipeline.config import ThinkerConfig, VisionConfig
from pipeline.thinker.resampler import Resampler
from pipeline.thinker.vision import (
    VARLEN_KERNEL_NAME,
    VisionEncoder,
    compile_vision_layers,
    flash_available,
    pack_strips,
)

MIXED_SIZES = [(32, 32), (28, 36), (36, 28), (30, 34), (16, 20), (35, 35), (8, 50), (32, 32)]


def build(device: torch.device) -> tuple[VisionEncoder, Resampler]:
    cfg = ThinkerConfig(vision=VisionConfig())
    torch.manual_seed(0)
    with device:
        vpm = VisionEncoder.from_config(cfg, "eager").eval()
        res = Resampler.from_config(cfg).eval()
        for m in (vpm, res):
            init_small(m)
        res.query.data.normal_(std=1.0)
    return vpm, res


def build_shipped(device: torch.device) -> tuple[VisionEncoder, Resampler]:
    """`build` as the Thinker runs it: bf16, sdpa, the encoder's layers compiled."""
    vpm, res = build(device)
    vpm, res = vpm.to(torch.bfloat16), res.to(torch.bfloat16)
    vpm.set_attn_backend("sdpa")
    compile_vision_layers(vpm)
    return vpm, res


def init_small(module: torch.nn.Module) -> None:
    """Small random weights and unit LayerNorms: activations stay O(1) over many layers."""
    for name, p in module.named_parameters():
        if "norm" in name or name.startswith("ln_"):
            torch.nn.init.ones_(p) if name.endswith("weight") else torch.nn.init.zeros_(p)
        elif p.ndim >= 2:
            torch.nn.init.normal_(p, std=0.02)
        else:
            torch.nn.init.normal_(p, std=0.01)


def run(vpm, res, pv, tgt, mask):
    return res(vpm(pv, tgt, mask), tgt)


def rel_err(
    out: torch.Tensor, ref: torch.Tensor, lens: list[int] | None = None
) -> tuple[float, float]:
    """(max |diff| / max |ref|, mean |diff| / mean |ref|) over real rows."""
    if lens is not None:
        out = torch.cat([out[i, :n] for i, n in enumerate(lens)])
        ref = torch.cat([ref[i, :n] for i, n in enumerate(lens)])
    d = (out.float() - ref.float()).abs()
    r = ref.float().abs()
    return (d.max() / r.max()).item(), (d.mean() / r.mean()).item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False

    vpm, res = build(dev)
    vpm32, res32 = copy.deepcopy(vpm).float(), copy.deepcopy(res).float()
    vpm, res = vpm.to(torch.bfloat16), res.to(torch.bfloat16)
    has_flash = flash_available(dev)
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}, "
        f"varlen kernel: {VARLEN_KERNEL_NAME} "
        f"(flash backend {'on' if has_flash else 'off'})"
    )

    # ---- parity on a padded, mixed batch
    g = torch.Generator(device=dev).manual_seed(1)
    strips = [torch.randn(3, 14, 14 * h * w, device=dev, generator=g) for h, w in MIXED_SIZES]
    pv, tgt, mask = pack_strips(strips, MIXED_SIZES)
    lens = [h * w for h, w in MIXED_SIZES]
    failures = []
    with torch.no_grad():
        vpm32.set_attn_backend("eager")
        feats32 = vpm32(pv, tgt, mask)
        out32 = res32(feats32, tgt)
        results = {}
        backends = ["eager", "sdpa"] + (["flash"] if has_flash else [])
        for b in backends:
            vpm.set_attn_backend(b)
            feats = vpm(pv.bfloat16(), tgt, mask)
            results[b] = (feats, res(feats, tgt))
        vpm.set_attn_backend("sdpa")
        compile_vision_layers(vpm)
        feats = vpm(pv.bfloat16(), tgt, mask)
        results["sdpa+compile"] = (feats, res(feats, tgt))

    base_f = rel_err(results["eager"][0], feats32, lens)
    base_o = rel_err(results["eager"][1], out32)
    print(
        f"\n{'backend':<14} {'vpm max/mean rel err vs fp32':>30} {'resampler max/mean':>22}  "
        f"{'vs bf16 eager (vpm mean)':>24}  ok"
    )
    for name, (feats, out) in results.items():
        ef = rel_err(feats, feats32, lens)
        eo = rel_err(out, out32)
        ee = rel_err(feats, results["eager"][0], lens)
        ok = (
            ef[1] <= 1.5 * base_f[1] + 2e-3
            and eo[1] <= 1.5 * base_o[1] + 2e-3
            and ee[1] < 2e-2
            and torch.isfinite(out).all().item()
        )
        if not ok:
            failures.append(name)
        print(
            f"{name:<14} {ef[0]:>14.2e} / {ef[1]:<13.2e} {eo[0]:>10.2e} / {eo[1]:<9.2e}  "
            f"{ee[1]:>24.2e}  "
            f"{'yes' if ok else 'NO'}"
        )
    del vpm32, res32

    # ---- timing: 448x448 slices, 1024 patches each
    print(
        f"\n{'backend':<14}" + "".join(f"{'B=' + str(b) + ' ms/slice':>18}" for b in args.batches)
    )
    rows = [("eager", False), ("sdpa", False)] + ([("flash", False)] if has_flash else [])
    rows += [("sdpa", True)] + ([("flash", True)] if has_flash else [])
    for backend, compiled in rows:
        label = backend + ("+compile" if compiled else "")
        cells = []
        try:
            for bsz in args.batches:
                x = torch.randn(bsz, 3, 14, 14 * 1024, device=dev, dtype=torch.bfloat16)
                t = torch.tensor([(32, 32)] * bsz, dtype=torch.int32)
                m = torch.ones(bsz, 1, 1024, dtype=torch.bool, device=dev)
                if compiled:
                    compile_vision_layers(vpm)
                else:
                    for layer in vpm.encoder.layers:
                        layer._compiled_call_impl = None  # back to the eager forward
                vpm.set_attn_backend(backend)
                with torch.no_grad():
                    ms = time_ms(lambda: run(vpm, res, x, t, m), args.iters)
                cells.append(f"{ms / bsz:>18.3f}")
        except Exception as e:  # a backend that cannot run here is reported, not fatal
            cells.append(f"  failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
        print(f"{label:<14}" + "".join(cells))

    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print(f"\ndynamo graphs compiled in all (shared by the 26 layers): {graphs}")
    if failures:
        print(f"\nPARITY FAILED: {', '.join(failures)}")
        return 1
    print("\nall parity checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

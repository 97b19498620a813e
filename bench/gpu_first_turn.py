"""What a shape's first call costs after start-up, where the app's first turn pays it.

    python -m bench.gpu_first_turn [--parts vision talker code2wav] [--json out.json]

vision: the compiled SigLIP + resampler (full size, random bf16 weights), warmed up as the
  Thinker warms it (`ThinkerModel.warm_up_vision`: one slice, two, two of mixed sizes), then
  batches of shapes a turn brings (the 16 + 14 slices of a 30-frame clip, other remainders,
  16:9 frames, mixed sizes): each new shape's first call and a repeat, wall ms. Once with
  SDPA free to pick its kernel (cuDNN attention on an H200) and once as the Thinker runs it.
talker: the engine as serve_config.yaml builds it (fused + compiled, decode graphs), full-size
  random weights: streams whose spoken spans have other lengths (a streamed chunk's recompute
  prompt has any length), some repeated: the step that prefills each and draws its first
  code, wall ms. Once with SDPA free to pick its kernel and once as shipped (pipeline/sdpa.py).
code2wav: the engine as serve_config.yaml builds it (slot pool, graphs, fp32), after its own
  warm-up: streams one at a time whose last chunks have different lengths (speech ends
  anywhere); ms of each step and the vocoder graph captures it made; then more streams with
  every last chunk's vocoder run eagerly instead of captured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.gpu_vision import build as build_vision
from pipeline.thinker.vision import compile_vision_layers, pack_strips

FULL = (32, 32)  # a 448x448 slice
VISION_BATCHES = [
    ("30-frame clip: 16", [FULL] * 16),
    ("30-frame clip: 14", [FULL] * 14),
    ("23-frame clip: 7", [FULL] * 7),
    ("16:9 frames (24x42): 16", [(24, 42)] * 16),
    ("mixed sizes: 5", [FULL, (28, 36), (36, 28), (16, 20), (24, 42)]),
    ("30-frame clip: 16 again", [FULL] * 16),
]


def _ms(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t)


@torch.inference_mode()
def vision(cudnn_attention: bool) -> dict:
    from pipeline import sdpa

    torch._dynamo.reset()
    dev = torch.device("cuda")
    vpm, res = build_vision(dev)
    vpm, res = vpm.to(torch.bfloat16), res.to(torch.bfloat16)
    vpm.set_attn_backend("sdpa")
    with sdpa.sdpa_choice(cudnn_attention):
        compile_vision_layers(vpm)
        g = torch.Generator(device=dev).manual_seed(0)

        def call(sizes):
            strips = [torch.randn(3, 14, 14 * h * w, device=dev, generator=g) for h, w in sizes]
            pv, tgt, mask = pack_strips(strips, sizes)
            return lambda: res(vpm(pv.bfloat16(), tgt, mask), tgt)

        t0 = time.perf_counter()
        for sizes in ([FULL], [FULL, FULL], [FULL, (32, 16)]):  # warm_up_vision's passes
            call(sizes)()
        torch.cuda.synchronize()
        out = {"warm_up_s": round(time.perf_counter() - t0, 1), "batches": {}}
        for name, sizes in VISION_BATCHES:
            fn = call(sizes)
            first = _ms(fn)
            again = statistics.median(_ms(fn) for _ in range(5))
            out["batches"][name] = {"first_ms": round(first, 1), "repeat_ms": round(again, 2)}
            print(f"  {name:<28} first {first:8.1f} ms   repeat {again:7.2f} ms", flush=True)
        return out


def _serve_engine_config(section: str) -> dict:
    import yaml

    cfg = yaml.safe_load(Path("serve_config.yaml").read_text())
    return cfg["applications"][0]["args"][section]["engine"]


def talker(lengths: list[int]) -> dict:
    from pipeline import sdpa
    from pipeline.checkpoint import ModelSource
    from pipeline.handoff import SpokenChunk, TalkerSpec
    from pipeline.talker.engine import TalkerEngine, TalkerEngineConfig

    t0 = time.perf_counter()
    config = TalkerEngineConfig(**_serve_engine_config("talker"))
    eng = TalkerEngine.from_source(ModelSource.open("random-full"), config, "cuda")
    out: dict = {"build_s": round(time.perf_counter() - t0, 1)}
    print(f"  engine built and warmed up in {out['build_s']} s", flush=True)
    g = torch.Generator().manual_seed(0)
    for mode, choice in (("sdpa_any_kernel", True), ("shipped", False)):
        with sdpa.sdpa_choice(choice):
            rows = []
            for i, n in enumerate(lengths):
                sid = f"{mode}{i}"
                eng.open(sid, TalkerSpec(mode="full_span", seed=i, max_codes=1))
                ids = torch.randint(0, 151000, (n,), generator=g)
                eng.feed(sid, SpokenChunk(ids, torch.randn(n, eng.cfg.llm_dim, generator=g), True))
                rows.append({"span": n, "prefill_step_ms": round(_ms(eng.step), 1)})
                eng.abort(sid)
            out[mode] = rows
            print(f"  {mode:<16} " + " ".join(f"{r['span']}:{r['prefill_step_ms']}" for r in rows)
                  + "  (span rows: ms)", flush=True)
    return out


def code2wav(lengths: list[int], eager_lengths: list[int]) -> dict:
    from pipeline.checkpoint import ModelSource
    from pipeline.code2wav.causal_hift import vocode_chunk
    from pipeline.code2wav.engine import Code2WavEngine, Code2WavEngineConfig

    t0 = time.perf_counter()
    config = Code2WavEngineConfig(**_serve_engine_config("code2wav"))
    eng = Code2WavEngine.from_source(ModelSource.open("random-full"), config, "cuda")
    out: dict = {"build_s": round(time.perf_counter() - t0, 1)}
    print(f"  engine built and warmed up in {out['build_s']} s; "
          f"captures cfm {eng.graphs.captures} vocoder {eng.hift_graphs.captures}", flush=True)
    voice = eng.voices.default()
    out["streams"] = _streams(eng, voice, lengths, "")
    # the same for new final lengths with every last chunk's vocoder run eagerly (no capture)
    graphs = eng.hift_graphs
    shipped_call = type(graphs).__call__

    class EagerLast(type(graphs)):
        def __call__(self, states, mel, last, generators=None):
            if last:
                self.fallback()
                return vocode_chunk(self.vocoder, states, mel, last, generators=generators)
            return shipped_call(self, states, mel, last, generators)

    graphs.__class__ = EagerLast
    print("  last chunks eager:", flush=True)
    out["streams_last_eager"] = _streams(eng, voice, eager_lengths, "e")
    return out


def _streams(eng, voice, lengths: list[int], tag: str) -> list[dict]:
    from pipeline.handoff import CodeChunk

    rows = []
    for i, n in enumerate(lengths):
        sid = f"s{tag}{i}"
        eng.open(sid, voice)
        eng.feed(sid, CodeChunk(sid, tuple([eng.cfg.silence_code] * n), True))
        steps, caps = [], []
        while eng.has_work():
            before = (eng.graphs.captures, eng.hift_graphs.captures)
            steps.append(round(_ms(eng.step), 1))
            caps.append((eng.graphs.captures - before[0], eng.hift_graphs.captures - before[1]))
        eng.abort(sid)
        rows.append({"codes": n, "step_ms": steps, "captures_cfm_vocoder": caps})
        print(f"  {n:3d} codes: steps {steps} ms, captures (cfm, vocoder) {caps}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", nargs="+", default=["vision", "talker", "code2wav"])
    ap.add_argument("--spans", type=int, nargs="+", default=[40, 40, 57, 23, 23, 81, 12, 40, 66])
    ap.add_argument("--lengths", type=int, nargs="+",
                    default=[57, 57, 66, 44, 44, 20, 20, 79, 57])
    ap.add_argument("--eager-lengths", type=int, nargs="+", default=[30, 37, 52, 30, 37])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    if "vision" in args.parts:
        for mode, cudnn in (("sdpa_any_kernel", True), ("shipped", False)):
            print(f"vision, {mode}:", flush=True)
            res[f"vision_{mode}"] = vision(cudnn)
    if "talker" in args.parts:
        print("talker:", flush=True)
        res["talker"] = talker(args.spans)
    if "code2wav" in args.parts:
        print("code2wav:", flush=True)
        res["code2wav"] = code2wav(args.lengths, args.eager_lengths)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

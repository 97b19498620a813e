"""The whole Thinker at full size on one GPU (random bf16 weights, no disk): one
Daily-Omni-shaped 30 s request (30 frames at 1 fps interleaved with 30 x 1 s audio, about
2.5k prompt tokens) through processing, SigLIP + resampler, Whisper, splice, prefill,
then decode at batch 1 and 4.

    python -m bench.gpu_thinker [--seconds 30] [--decode 64] [--json out.json]

Reports (CUDA-synchronised wall times, medians of --iters after warmup):
  processing ms (CPU), vision ms (30 frames, batched) and ms per frame, audio ms,
  prefill ms (LLM only), server-side TTFT (add_request -> first token),
  decode ms/step at batch 1 and 4 (CUDA graphs), tokens-equal check graphs vs eager.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time

import numpy as np
import torch


def _media(seconds: int, seed: int = 0) -> list[dict]:
    import soundfile as sf
    from PIL import Image

    rng = np.random.default_rng(seed)
    parts: list[dict] = []
    for i in range(seconds):
        img = rng.integers(0, 255, (448, 448, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, "PNG")
        parts.append({"type": "image", "data": buf.getvalue()})
        t = np.arange(16000) / 16000
        wav = io.BytesIO()
        sf.write(wav, (0.2 * np.sin(2 * np.pi * (200 + 20 * i) * t)).astype(np.float32), 16000, format="WAV")
        parts.append({"type": "audio", "data": wav.getvalue()})
    parts.append({"type": "text", "text": "What happens in this video? A. a dog runs B. a car stops "
                                          "C. a man sings D. it rains. Answer with the letter."})
    return [{"role": "user", "content": parts}]


def _sync() -> None:
    torch.cuda.synchronize()


def _sync_ms(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=30)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--model", default="random-full", help="checkpoint dir, 'tiny' or 'random-full'")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    from pipeline.checkpoint import ModelSource
    from pipeline.thinker.llm_engine.engine import EngineConfig
    from pipeline.handoff import SamplingParams
    from pipeline.processing.processor import Processor
    from pipeline.thinker.engine import ThinkerEngine, ThinkerEngineConfig

    global _sync
    if args.device == "cpu":  # dry run of the script itself
        _sync = lambda: None  # noqa: E731
    t0 = time.perf_counter()
    source = ModelSource.open(args.model)
    # repeated prompts must measure cold prefills (bench/gpu_followup.py measures the cache)
    cfg = ThinkerEngineConfig(llm=EngineConfig(max_num_seqs=8, kv_cache_bytes=8 * 2**30,
                                               enable_prefix_caching=False),
                              vision_attn_backend="sdpa", compile_mm_encoder=True,
                              encoder_cache_size=0)
    eng = ThinkerEngine.from_source(source, cfg, args.device)
    print(f"load {time.perf_counter() - t0:.1f} s, graphs={eng.llm.uses_cuda_graphs}", flush=True)
    proc = Processor(source.config.thinker, eng.tokenizer)
    messages = _media(args.seconds)

    def build(rid: str, max_tokens: int):
        return proc.build(messages, speech_output=True, request_id=rid, max_slice_nums=1, use_image_id=False,
                          sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    res: dict[str, float] = {}
    t = time.perf_counter()
    req = build("p0", 1)
    res["processing_ms"] = 1000 * (time.perf_counter() - t)
    res["prompt_tokens"] = req.num_prompt_tokens
    print(f"prompt {req.num_prompt_tokens} tokens, {len(req.images)} frames, {len(req.audios)} clips", flush=True)

    def run(reqs) -> dict[str, list[int]]:
        out = {r.request_id: [] for r in reqs}
        for r in reqs:
            eng.open(r.request_id, r)
        while eng.has_work():
            for d in eng.step():
                out[d.request_id] += d.token_ids
        return out

    # warmup: compile, flashinfer JIT, graph capture paths
    for i in range(2):
        run([build(f"w{i}", 8)])
        run([build(f"wb{i}{j}", 8) for j in range(4)])

    model = eng.model
    res["vision_ms"] = _sync_ms(lambda: model.encode_images(req.images, cfg.vision_batch_size), args.iters)
    res["vision_ms_per_frame"] = res["vision_ms"] / len(req.images)
    res["audio_ms"] = _sync_ms(lambda: model.encode_audios(req.audios), args.iters)

    # server-side TTFT: open -> first sampled token (encoders + prefill)
    ttfts = []
    for i in range(args.iters):
        r = build(f"t{i}", 1)
        _sync()
        t = time.perf_counter()
        run([r])
        ttfts.append(1000 * (time.perf_counter() - t))
    res["ttft_ms"] = statistics.median(ttfts)
    res["prefill_ms"] = res["ttft_ms"] - res["vision_ms"] - res["audio_ms"]

    # decode at batch 1 and 4: time steps once every request is decoding
    for bs in (1, 4):
        reqs = [build(f"d{bs}_{j}", args.decode + 1) for j in range(bs)]
        for r in reqs:
            eng.open(r.request_id, r)
        while eng.stats()["num_waiting_encode"] or eng.stats()["num_waiting"] or \
                any(s.output_ids == [] for s in eng._streams.values()):
            eng.step()
        steps = []
        while eng.has_work():
            _sync()
            t = time.perf_counter()
            eng.step()
            _sync()
            steps.append(1000 * (time.perf_counter() - t))
        res[f"decode_ms_b{bs}"] = statistics.median(steps[2:-2]) if len(steps) > 6 else statistics.median(steps)

    print("\n| metric | value |\n|---|---|")
    for k, v in res.items():
        print(f"| {k} | {v:.2f} |" if isinstance(v, float) else f"| {k} | {v} |")
    if torch.cuda.is_available():
        print(f"| peak GPU memory GiB | {torch.cuda.max_memory_allocated() / 2**30:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

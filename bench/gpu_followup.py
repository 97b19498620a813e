"""A follow-up turn on the same 30 s clip: TTFT with the prefix cache off and on (Thinker alone).

Per iteration: a first turn about a new clip (cold: new media, the encoders run), then a
follow-up question about it (the whole first prompt is a cached prefix: no encoder runs,
only the new tokens are prefilled). One token each (`max_tokens=1`: TTFT). Iteration 0 warms
up (compile, FlashInfer JIT) and is not a measurement.

    python bench/gpu_followup.py [--model random-full] [--device cuda] [--iters 4]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.gpu_thinker import _media
from pipeline.checkpoint import ModelSource
from pipeline.thinker.llm_engine.engine import EngineConfig
from pipeline.handoff import SamplingParams
from pipeline.processing.processor import Processor
from pipeline.thinker.engine import ThinkerEngine, ThinkerEngineConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random-full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=4)
    args = ap.parse_args()
    src = ModelSource.open(args.model)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for caching in (False, True):
        llm = EngineConfig(max_num_seqs=8, kv_cache_bytes=8 * 2**30 if cuda else 2**26,
                           enable_prefix_caching=caching)
        eng = ThinkerEngine.from_source(
            src, ThinkerEngineConfig(llm=llm, encoder_cache_size=0), args.device)
        proc = Processor(src.config.thinker, eng.tokenizer)

        def ttft(msgs, rid, eng=eng, proc=proc):
            r = proc.build(msgs, speech_output=True, request_id=rid, max_slice_nums=1,
                           use_image_id=False,
                           sampling=SamplingParams(max_tokens=1, ignore_eos=True))
            sync()
            t = time.perf_counter()
            eng.open(r.request_id, r)
            while eng.has_work():
                eng.step()
            sync()
            return 1000 * (time.perf_counter() - t), r.num_prompt_tokens

        for i in range(args.iters):
            video = _media(30, seed=i)
            cold, n0 = ttft(video, f"c{i}")
            follow = video + [{"role": "assistant", "content": "B."},
                              {"role": "user", "content": f"Why? {i}"}]
            warm, n1 = ttft(follow, f"f{i}")
            s = eng.stats()
            print(f"prefix caching {'on' if caching else 'off'}, iter {i}: first turn {cold:.1f} ms "
                  f"({n0} tokens), follow-up {warm:.1f} ms ({n1} tokens); cache hits "
                  f"{s['prefix_cache_hits']}/{s['prefix_cache_queries']} tokens, media skipped "
                  f"{s['media_skipped']}", flush=True)
        del eng
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""One multimodal Thinker request end to end, streamed to the terminal.

    python -m pipeline.demo                       # embedded tiny default, generated media
    python -m pipeline.demo --model /path/to/MiniCPM-o-4_5 --image cat.jpg --audio q.wav

With the random-weight default the text is gibberish by design; the point is that the
whole path runs: media decoding, slicing, mel features, encoders, splice, paged
continuous-batching decode, streaming detokenization and spoken-span hidden states.
"""

from __future__ import annotations

import argparse
import io
import sys
import time

import numpy as np


def _demo_media() -> tuple[bytes, bytes]:
    """A 640x480 gradient PNG and a 2 s 16 kHz tone, made here (no files needed)."""
    import soundfile as sf
    from PIL import Image

    x = np.linspace(0, 255, 640, dtype=np.float32)
    rgb = np.stack([np.tile(x, (480, 1)), np.tile(x[::-1], (480, 1)), np.full((480, 640), 96.0)], -1)
    png = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8)).save(png, "PNG")
    t = np.arange(32000) / 16000
    wav = io.BytesIO()
    sf.write(wav, (0.3 * np.sin(2 * np.pi * 330 * t)).astype(np.float32), 16000, format="WAV")
    return png.getvalue(), wav.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: embedded tiny model)")
    ap.add_argument("--image", help="image file (default: a generated picture)")
    ap.add_argument("--audio", help="audio file (default: a generated tone)")
    ap.add_argument("--prompt", default="Describe what you see and hear.")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--speech", action="store_true", help="use the speech-output template (<|tts_bos|>)")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)

    from pipeline.checkpoint import ModelSource
    from pipeline.thinker.llm_engine.engine import EngineConfig
    from pipeline.handoff import SamplingParams
    from pipeline.processing.errors import MediaError
    from pipeline.processing.processor import Processor
    from pipeline.thinker.engine import ThinkerEngine, ThinkerEngineConfig

    t0 = time.perf_counter()
    source = ModelSource.open(args.model)
    engine = ThinkerEngine.from_source(
        source, ThinkerEngineConfig(llm=EngineConfig(kv_cache_bytes=256 * 2**20)), args.device)
    print(f"[loaded {source.path} on {engine.device} in {time.perf_counter() - t0:.1f} s]", file=sys.stderr)

    image, audio = _demo_media()
    if args.image:
        image = open(args.image, "rb").read()
    if args.audio:
        audio = open(args.audio, "rb").read()
    messages = [{"role": "user", "content": [
        {"type": "image", "data": image}, {"type": "audio", "data": audio},
        {"type": "text", "text": args.prompt}]}]
    try:
        req = Processor(source.config.thinker, engine.tokenizer).build(
            messages, speech_output=args.speech, request_id="demo",
            sampling=SamplingParams(max_tokens=args.max_tokens))
    except MediaError as e:
        print(f"bad input: {e}", file=sys.stderr)
        return 2
    print(f"[prompt: {req.num_prompt_tokens} tokens, {len(req.image_bounds)} image slices, "
          f"{sum(e - s for s, e in req.audio_bounds)} audio tokens]", file=sys.stderr)

    t1 = time.perf_counter()
    engine.open(req.request_id, req)
    first = None
    spoken = 0
    while engine.has_work():
        for d in engine.step():
            if d.text:
                first = first or time.perf_counter()
                print(d.text, end="", flush=True)
            spoken += len(d.spoken_ids)
            if d.finished:
                print()
                print(f"[{d.num_output_tokens} tokens, finish: {d.finish_reason}, "
                      f"first text {1000 * ((first or time.perf_counter()) - t1):.0f} ms, "
                      f"total {1000 * (time.perf_counter() - t1):.0f} ms, "
                      f"spoken-span hidden rows: {spoken}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

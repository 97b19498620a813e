"""CPU timing of the ingress's build of a benchmark clip with the media handoff.

    python -m bench.frames_handoff [--iters 9] [--data-dir /tmp/handoff-clips]

`Processor.build` of the app benchmark's request (a synthetic 30 s clip, 448x448 at 5 fps,
and its wav as a part of its own, the bench's `--media file` shape), alone and 8 at once on
8 threads of one process (as an ingress replica builds concurrent requests), four ways: no
handoff; frames handed over 8 at a time while the video decodes, converted on 1 or on
`HANDOFF_WORKERS` threads; and frames handed over only once all are decoded
(`frames_while_decoding=False`). Prints the median build ms, when the first and the last
frames went (ms into the build), how many frames went ahead and when the wav part's clip
went (it decodes before the video). The builds' requests are checked equal to the
no-handoff build's first (exits 1 when not).

`--processes`: also the no-handoff build 8 at once in 8 processes of their own (spawned),
against 8 threads of one process: if the threads are much slower, the builds hold the GIL,
and builds spread over processes (ingress replicas: `ingress.num_replicas`) would run side
by side.

Last, what the ingress's media cache adds to a new clip's build: storing the clip's parts
(its own copy of their tensors) 20 times under new keys, the cache growing as an ingress's
does while new clips come in (median ms a store).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import torch

from bench.datasets import make_synthetic_daily_omni, media_paths
from pipeline.checkpoint import ModelSource, default_checkpoint
from pipeline.handoff import ImageInput
from pipeline.processing import video as V
from pipeline.processing.media_cache import MediaCache
from pipeline.processing.processor import Processor
from pipeline.tokenizer import TextTokenizer

MODES = tuple(dict.fromkeys(
    (("no handoff", 0), ("chunks", 1), ("chunks", V.HANDOFF_WORKERS), ("all at once", 0))))


def _setup(data_dir: str) -> tuple[ModelSource, Processor, list[tuple[bytes, bytes]]]:
    """The default checkpoint's processor and the 8 synthetic clips (video, wav)."""
    root = make_synthetic_daily_omni(data_dir, num_videos=8, durations=(30.0,))
    clips = [tuple(p.read_bytes() for p in media_paths(root / "Videos", f"syn000_{i:04d}"))
             for i in range(8)]
    src = ModelSource.open(None)
    proc = Processor(src.config.thinker, TextTokenizer.from_dir(src.path or default_checkpoint()))
    return src, proc, clips


def _messages(clips: list[tuple[bytes, bytes]], i: int) -> list[dict]:
    video, audio = clips[i]
    return [{"role": "user", "content": [
        {"type": "video", "data": video}, {"type": "audio", "data": audio},
        {"type": "text", "text": "What happens? A. a B. b C. c D. d"}]}]


_PROCESS: dict = {}  # a worker process's processor and clips, set up on its first build


def _build_in_process(data_dir: str, i: int) -> float:
    """Build ms of clip i without a handoff, in a worker process of its own."""
    if not _PROCESS:
        _, _PROCESS["proc"], _PROCESS["clips"] = _setup(data_dir)
    t0 = time.perf_counter()
    _PROCESS["proc"].build(_messages(_PROCESS["clips"], i), speech_output=True)
    return (time.perf_counter() - t0) * 1e3


def _processes(data_dir: str, iters: int) -> None:
    with ProcessPoolExecutor(8, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_build_in_process, [data_dir] * 16, [i % 8 for i in range(16)]))  # warm up
        rows = []
        for _ in range(iters):
            rows += [(ms,) for ms in pool.map(_build_in_process, [data_dir] * 8, range(8))]
    print(f"8 at once, 8 processes, no handoff  build {_median(rows, 0)} ms", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--data-dir", default="/tmp/handoff-clips")
    ap.add_argument("--processes", action="store_true",
                    help="also 8 builds at once in 8 processes (the GIL's share)")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="sys.setswitchinterval for the builds (Python's default: 5 ms)")
    args = ap.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    print(f"GIL switch interval {sys.getswitchinterval() * 1e3:g} ms", flush=True)
    src, proc, clips = _setup(args.data_dir)

    def messages(i: int) -> list[dict]:
        return _messages(clips, i)

    def build(i: int, mode: str) -> tuple[float, float | None, float | None, int, float | None,
                                          object]:
        t0, sent, clip = time.perf_counter(), [], []

        def on_media(items: list) -> None:  # frames, or the audio part's clip
            at = (time.perf_counter() - t0) * 1e3
            frames = sum(isinstance(m, ImageInput) for m in items)
            if frames:
                sent.append((at, frames))
            else:
                clip.append(at)

        req = proc.build(messages(i), speech_output=True,
                         on_media=None if mode == "no handoff" else on_media,
                         frames_while_decoding=mode == "chunks")
        ms = (time.perf_counter() - t0) * 1e3
        first, last = (sent[0][0], sent[-1][0]) if sent else (None, None)
        return ms, first, last, sum(n for _, n in sent), (clip or [None])[0], req

    default = V.HANDOFF_WORKERS
    ref = build(0, "no handoff")[-1]
    for mode, workers in MODES[1:]:
        V.HANDOFF_WORKERS = workers or default
        req = build(0, mode)[-1]
        same = req.input_ids == ref.input_ids and all(
            a.content_hash == b.content_hash and all(
                torch.equal(x, y) for x, y in zip(a.pixel_values, b.pixel_values, strict=True))
            for a, b in zip(req.images, ref.images, strict=True))
        if not same:
            print(f"{mode}: the request differs from the no-handoff build", file=sys.stderr)
            return 1
    for at_once in (1, 8):
        for mode, workers in MODES:
            V.HANDOFF_WORKERS = workers or default
            rows: list[tuple] = []
            with ThreadPoolExecutor(at_once) as pool:
                for it in range(args.iters + 1):  # the first round warms up
                    got = list(pool.map(lambda i, m=mode: build(i, m)[:5], range(at_once)))
                    rows += got if it else []

            name = f"{mode}" + (f", {workers} thread(s)" if mode == "chunks" else "")
            print(f"{at_once} at once, {name:22s} build {_median(rows, 0)} ms, first "
                  f"{_median(rows, 1)} ms, last {_median(rows, 2)} ms, frames ahead "
                  f"{_median(rows, 3)}, audio clip {_median(rows, 4)} ms", flush=True)
    if args.processes:
        _processes(args.data_dir, args.iters)
    video, _ = clips[0]
    parts = V.pack_omni(V.decode_video(video), src.config.thinker.slicing, "bench")
    cache, stores = MediaCache(2**40), []
    for i in range(20):
        t0 = time.perf_counter()
        cache._put(("bench", i), parts)
        stores.append((time.perf_counter() - t0) * 1e3)
    print(f"media cache: a 30 s clip's parts ({cache.stats().bytes // 20 / 2**20:.1f} MiB) "
          f"stored in {statistics.median(stores):.1f} ms (median of 20, the cache growing)")
    return 0


def _median(rows: list[tuple], k: int) -> str:
    xs = [r[k] for r in rows if r[k] is not None]
    return f"{statistics.median(xs):.1f}" if xs else "-"


if __name__ == "__main__":
    sys.exit(main())

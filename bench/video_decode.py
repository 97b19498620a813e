"""CPU timing of video decoding: only the packets the picked frames need vs every frame.

    python -m bench.video_decode [--iters 5] [--quick] [--max-frames 64] [--preprocess]
    python -m bench.video_decode --audio-features [--iters 31]

Builds synthetic MP4 clips in a temp dir (libx264 with x264's default B frames, AAC stereo
44.1 kHz; a panned smooth texture, a moving disk and a little grain, so P/B frames cost
something) and times `decode_video` on each, the median of --iters interleaved runs, wall
and process CPU time (all threads): `full_decode=True` (every frame up to the last pick, the
old path) against the default (`_decode_picked`), video alone and with the audio track.
Each clip's frames and audio are checked equal bit for bit first; exits 1 when they are
not. "packets" is how many video packets each path sends to a decoder (the new path's H.264
decoder then skips the non-reference ones that are not picks).

--preprocess times what the ingress does with a video part instead (`decode_video` then
`pack_omni`): the frames alone, the audio track alone, the two one after the other, then
the frame slicing and log-mels ("serial"), and as shipped (the audio track decoded on its
own thread beside the frames); the last two are checked equal first.

--audio-features times only a 30 s clip's thirty 1 s audio segments to log-mels, one at a
time against together (one batched STFT), alone and from four threads at once.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import av
import numpy as np
import torch

from pipeline.config import SliceConfig
from pipeline.processing import video as V
from pipeline.processing.audio import process_audio, process_audios
from pipeline.processing.template import OmniPart

SR = 44100


@dataclass(frozen=True)
class Clip:
    seconds: float
    fps: int
    gop: int
    width: int
    height: int
    preset: str = "medium"  # x264's

    @property
    def name(self) -> str:
        p = "" if self.preset == "medium" else f" {self.preset}"
        return f"{self.width}x{self.height} {self.fps}fps gop{self.gop}{p} {self.seconds:g}s"


CLIPS = [
    Clip(30, 5, 250, 448, 448, "veryfast"),  # the app bench's (bench/datasets.py) encoding
    Clip(30, 5, 250, 448, 448),
    Clip(30, 30, 30, 448, 448),
    Clip(30, 30, 250, 448, 448),
    Clip(60, 30, 250, 448, 448),
    Clip(30, 30, 30, 1280, 720),
    Clip(30, 30, 250, 1280, 720),
    Clip(60, 30, 250, 1280, 720),
]
QUICK = [CLIPS[0], CLIPS[2], CLIPS[3]]


def make_clip(clip: Clip, path: str, seed: int = 0) -> None:
    """Write `clip` as an MP4 (h264 yuv420p + AAC) to path."""
    rng = np.random.default_rng(seed)
    w, h = clip.width, clip.height
    # A smooth texture twice the frame size, panned across over the clip.
    coarse = rng.integers(0, 256, (h // 16 + 2, w // 16 + 2, 3), dtype=np.uint8)
    tex = np.asarray(
        av.VideoFrame.from_ndarray(np.ascontiguousarray(coarse), format="rgb24")
        .reformat(width=2 * w, height=2 * h, interpolation="BICUBIC")
        .to_ndarray(format="rgb24")
    )
    yy, xx = np.mgrid[0:h, 0:w]
    n = round(clip.seconds * clip.fps)
    with av.open(path, "w", format="mp4") as c:
        v = c.add_stream(
            "libx264", rate=clip.fps, options={"g": str(clip.gop), "preset": clip.preset}
        )
        v.width, v.height, v.pix_fmt = w, h, "yuv420p"
        a = c.add_stream("aac", rate=SR, layout="stereo")
        for i in range(n):
            u = i / max(n - 1, 1)
            x0, y0 = int(u * w), int(0.5 * u * h)
            img = tex[y0 : y0 + h, x0 : x0 + w].astype(np.int16)
            cx, cy = w * (0.5 + 0.35 * np.cos(6 * u)), h * (0.5 + 0.35 * np.sin(9 * u))
            img[(xx - cx) ** 2 + (yy - cy) ** 2 < (h / 8) ** 2] = (230, 60, 40)
            img += rng.integers(-3, 4, img.shape, dtype=np.int16)
            frame = av.VideoFrame.from_ndarray(img.clip(0, 255).astype(np.uint8), format="rgb24")
            for p in v.encode(frame):
                c.mux(p)
        for p in v.encode(None):
            c.mux(p)
        t = np.arange(int(clip.seconds * SR)) / SR
        tone = 0.2 * np.sin(2 * np.pi * 440 * t) + 0.02 * rng.standard_normal(t.size)
        x = np.stack([tone, tone[::-1]]).astype(np.float32)
        for s in range(0, x.shape[1], 1024):
            f = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(x[:, s : s + 1024]), format="fltp", layout="stereo"
            )
            f.sample_rate = SR
            for p in a.encode(f):
                c.mux(p)
        for p in a.encode(None):
            c.mux(p)


def packets_sent(data: bytes, max_frames: int) -> tuple[int, int]:
    """(packets the new path sends to a decoder, packets up to the last pick's pts: about what
    the plain path decodes before it stops)."""
    with av.open(io.BytesIO(data)) as c:
        s = c.streams.video[0]
        n, fps = V._probe(s, c)
        _, indices, _ = V.sample_timestamps(n, fps, max_frames)
        packets = [p for p in c.demux(s) if p.size]
    plan = V._plan_runs(packets, indices)
    if plan is None:
        return len(packets), len(packets)
    runs, pick_pts = plan
    last = max(pick_pts)  # the plain path stops once the last pick is out
    return sum(b - a + 1 for a, b in runs), sum(p.pts <= last for p in packets)


def timings(
    data: bytes, max_frames: int, iters: int
) -> dict[tuple[bool, bool], tuple[float, float]]:
    """{(full_decode, with_audio): (median wall ms, median CPU ms of all threads)}; the four
    variants run interleaved, so a busy machine slows them alike."""
    keys = [(fd, au) for fd in (True, False) for au in (False, True)]
    wall: dict[tuple[bool, bool], list[float]] = {k: [] for k in keys}
    cpu: dict[tuple[bool, bool], list[float]] = {k: [] for k in keys}
    for it in range(iters + 1):  # the first round warms up
        for fd, au in keys:
            t, c = time.perf_counter(), time.process_time()
            V.decode_video(data, max_frames=max_frames, with_audio=au, full_decode=fd)
            if it:
                wall[fd, au].append((time.perf_counter() - t) * 1e3)
                cpu[fd, au].append((time.process_time() - c) * 1e3)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in keys}


def preprocess_timings(data: bytes, max_frames: int, iters: int) -> dict[str, float] | None:
    """Median wall ms of the preprocessing variants (module docstring), run interleaved;
    None when the serial and shipped results differ."""
    cfg = SliceConfig()

    def serial() -> OmniPart:
        video = V.decode_video(data, max_frames=max_frames, with_audio=False)
        samples = V._decode_audio_track(data, 600.0)
        segments = V.segment_audio(samples, video.timestamps, video.duration)
        return V.pack_omni(replace(video, audio_segments=segments), cfg, "h")

    def shipped() -> OmniPart:
        return V.pack_omni(V.decode_video(data, max_frames=max_frames), cfg, "h")

    if pickle.dumps(serial()) != pickle.dumps(shipped()):  # every array, bit for bit
        return None
    variants = {
        "frames alone": lambda: V.decode_video(data, max_frames=max_frames, with_audio=False),
        "audio track alone": lambda: V._decode_audio_track(data, 600.0),
        "serial": serial,
        "as shipped": shipped,
    }
    wall: dict[str, list[float]] = {k: [] for k in variants}
    for it in range(iters + 1):  # the first round warms up
        for name, fn in variants.items():
            t = time.perf_counter()
            fn()
            if it:
                wall[name].append((time.perf_counter() - t) * 1e3)
    return {k: statistics.median(v) for k, v in wall.items()}


def clip_files(clips: list[Clip]) -> Iterator[tuple[Clip, bytes]]:
    """Each clip made in a temporary folder, with its MP4 bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        for clip in clips:
            path = os.path.join(tmp, "clip.mp4")
            make_clip(clip, path)
            with open(path, "rb") as f:
                yield clip, f.read()


def print_header(header: str) -> None:
    print(header)
    print("|---" * (header.count("|") - 1) + "|")


def main_preprocess(clips: list[Clip], max_frames: int, iters: int) -> int:
    print_header("| clip | frames alone | audio track alone | serial | as shipped | saved |")
    ok = True
    for clip, data in clip_files(clips):
        t = preprocess_timings(data, max_frames, iters)
        if t is None:
            print(f"| {clip.name} | SERIAL AND SHIPPED DIFFER |")
            ok = False
            continue
        cells = " | ".join(f"{v:.1f}" for v in t.values())
        saved = 1 - t["as shipped"] / t["serial"]
        print(f"| {clip.name} | {cells} | {saved:.0%} |", flush=True)
    return 0 if ok else 1


def main_audio_features(iters: int) -> int:
    """A 30 s clip's thirty 1 s audio segments to log-mels: one at a time (`process_audio`
    each) against together (`process_audios`, one batched STFT), alone and from four threads
    at once (an ingress preprocessing four requests). Checked equal bit for bit first."""
    rng = np.random.default_rng(0)
    segs = [(0.1 * rng.standard_normal(16000)).astype(np.float32) for _ in range(30)]
    if not all(torch.equal(a.features, b.features)
               for a, b in zip(process_audios(segs), map(process_audio, segs))):
        print("ONE AT A TIME AND TOGETHER DIFFER")
        return 1
    ways = {"one at a time": lambda: [process_audio(x) for x in segs],
            "together": lambda: process_audios(segs)}

    def threaded(fn, n: int = 4) -> float:
        workers = [threading.Thread(target=fn) for _ in range(n)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return (time.perf_counter() - t0) * 1e3

    print_header("| 30 x 1 s segments | alone, ms | four threads at once, ms a round |")
    for name, fn in ways.items():
        fn()
        alone = [threaded(fn, 1) for _ in range(iters)]
        four = [threaded(fn) for _ in range(iters)]
        print(f"| {name} | {statistics.median(alone):.1f} | {statistics.median(four):.1f} |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--max-frames", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="three 448x448 30 s clips only")
    ap.add_argument("--preprocess", action="store_true",
                    help="decode + pack as the ingress does: serial vs as shipped (ms wall)")
    ap.add_argument("--audio-features", action="store_true",
                    help="only the log-mels of 30 x 1 s segments: one at a time vs together")
    args = ap.parse_args()
    if args.audio_features:
        return main_audio_features(args.iters)
    clips = QUICK if args.quick else CLIPS
    print(
        f"PyAV {av.__version__}, {os.cpu_count()} CPUs, max_frames {args.max_frames}, "
        f"median of {args.iters}"
    )
    if args.preprocess:
        return main_preprocess(clips, args.max_frames, args.iters)
    print_header(
        "| clip | packets new/full | video full ms wall / CPU | video new ms wall / CPU "
        "| speedup wall / CPU | +audio full ms wall | +audio new ms wall |"
    )
    ok = True
    mf = args.max_frames
    for clip, data in clip_files(clips):
        new = V.decode_video(data, max_frames=mf)
        old = V.decode_video(data, max_frames=mf, full_decode=True)
        same = new.timestamps == old.timestamps and all(
            np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(new.frames, old.frames, strict=True)
        )
        same = same and all(
            np.array_equal(a, b)
            for a, b in zip(new.audio_segments or [], old.audio_segments or [], strict=True)
        )
        if not same:
            print(f"| {clip.name} | FRAMES DIFFER |")
            ok = False
            continue
        sent, full = packets_sent(data, mf)
        t = timings(data, mf, args.iters)
        (fw, fc), (nw, nc) = t[True, False], t[False, False]
        print(
            f"| {clip.name} | {sent}/{full} | {fw:.1f} / {fc:.1f} | {nw:.1f} / {nc:.1f} "
            f"| {fw / nw:.1f}x / {fc / nc:.1f}x | {t[True, True][0]:.1f} "
            f"| {t[False, True][0]:.1f} |",
            flush=True,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""CPU timing of a video decode beside a thread running Python, per GIL switch interval.

    python -m bench.gil_decode [--iters 5] [--intervals 5,1,0.5,0.2] [--data-dir /tmp/gil-clip]

FFmpeg decodes without the GIL, but the thread driving it takes the GIL back after every
packet it sends and every frame it receives. While another thread runs Python (in the
ingress: other requests' builds, the event loop), each of those takes waits until the other
thread gives the GIL up, which it does every switch interval (`sys.setswitchinterval`,
5 ms by default). Times `decode_video` of the app benchmark's synthetic 30 s clip (448x448,
5 fps, its frames and audio track), the median of --iters: alone, then beside a thread
that only counts in Python, at each interval (ms); and the counting thread's rate, to show
what the shorter interval costs it. The frames are checked equal to the lone decode's.
`ingress.switch_interval_ms` sets an ingress replica's interval.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench.datasets import make_synthetic_daily_omni
from pipeline.processing import video as V


def decode_ms(data: bytes, iters: int, busy: bool) -> tuple[float, float, list]:
    """Median ms of a decode (and the counting thread's million counts a second)."""
    times, rates, frames = [], [], []
    for _ in range(iters):
        stop, count = threading.Event(), [0]

        def spin(stop=stop, count=count):
            while not stop.is_set():
                count[0] += 1

        other = threading.Thread(target=spin) if busy else None
        if other is not None:
            other.start()
        t0 = time.perf_counter()
        frames = V.decode_video(data).frames
        dt = time.perf_counter() - t0
        stop.set()
        if other is not None:
            other.join()
        times.append(dt * 1e3)
        rates.append(count[0] / dt / 1e6)
    return statistics.median(times), statistics.median(rates), frames


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gil_decode")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--intervals", default="5,1,0.5,0.2", help="switch intervals, ms")
    ap.add_argument("--data-dir", default="/tmp/gil-clip")
    args = ap.parse_args()
    root = make_synthetic_daily_omni(args.data_dir, num_videos=1, durations=(30.0,))
    data = next(Path(root).rglob("*.mp4")).read_bytes()
    default = sys.getswitchinterval()
    V.decode_video(data)  # warm the decoder and the converter up
    alone, _, ref = decode_ms(data, args.iters, busy=False)
    print(f"decode alone: {alone:.1f} ms ({len(ref)} frames)")
    for ms in (float(x) for x in args.intervals.split(",")):
        sys.setswitchinterval(ms / 1e3)
        took, rate, frames = decode_ms(data, args.iters, busy=True)
        if len(frames) != len(ref) or not all(
                np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(frames, ref)):
            print(f"interval {ms:g} ms: the frames differ from the lone decode's", file=sys.stderr)
            return 1
        print(f"switch interval {ms:g} ms: decode beside a busy Python thread {took:.1f} ms; "
              f"the thread counted {rate:.2f} M/s")
    sys.setswitchinterval(default)
    return 0


if __name__ == "__main__":
    sys.exit(main())

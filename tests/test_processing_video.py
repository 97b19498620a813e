"""Video: 1 fps sampling on a generated MP4, audio segments, omni packing, errors."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from pipeline.config import SliceConfig
from pipeline.processing.errors import (
    CorruptMediaError,
    MediaTooLargeError,
    NoVideoStreamError,
    UnsupportedMediaError,
)
from pipeline.processing.template import AudioPart, ImagePart
from pipeline.processing.video import decode_video, frame_rgb, pack_omni, sample_timestamps

FPS = 10


def make_mp4(seconds: float, audio: bool = True, size=(64, 48)) -> bytes:
    """Frame i is a flat gray of level 8 * i (so decoded frames reveal their index),
    plus a 440 Hz tone on an AAC track."""
    buf = io.BytesIO()
    n = round(seconds * FPS)
    with av.open(buf, "w", format="mp4") as c:
        v = c.add_stream("mpeg4", rate=FPS)
        v.width, v.height, v.pix_fmt = size[0], size[1], "yuv420p"
        a = c.add_stream("aac", rate=16000, layout="mono") if audio else None
        for i in range(n):
            img = np.full((size[1], size[0], 3), (8 * i) % 256, np.uint8)
            for p in v.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in v.encode(None):
            c.mux(p)
        if a is not None:
            x = 0.3 * np.sin(2 * np.pi * 440 * np.arange(int(seconds * 16000)) / 16000)
            x = x.astype(np.float32)
            for i in range(0, len(x), 1024):
                f = av.AudioFrame.from_ndarray(x[None, i : i + 1024], format="flt", layout="mono")
                f.sample_rate = 16000
                for p in a.encode(f):
                    c.mux(p)
            for p in a.encode(None):
                c.mux(p)
    return buf.getvalue()


def test_sample_timestamps_rules():
    ts, idx, dur = sample_timestamps(35, 10.0, 64)  # 3.5 s -> seconds 0..3
    assert ts == [0.0, 1.0, 2.0, 3.0] and idx == [0, 10, 20, 30] and dur == 3.5
    ts, idx, _ = sample_timestamps(3000, 25.0, 64)  # 120 s > 64 -> 64 frames on the 0.1 s grid
    assert len(ts) == 64 and ts[0] == 0.0 and ts[-1] == 119.9 and idx[-1] == min(2997, 2999)
    ts, _, _ = sample_timestamps(5, 10.0, 64)  # 0.5 s -> still one frame
    assert ts == [0.0]


def test_decode_1fps_frames_and_audio():
    v = decode_video(make_mp4(3.5), max_frames=64)
    assert v.num_frames == 4 and v.timestamps == [0.0, 1.0, 2.0, 3.0]
    levels = [int(np.asarray(f).mean()) for f in v.frames]
    assert [round(lv / 8) for lv in levels] == [0, 10, 20, 30], levels
    assert v.audio_segments is not None
    lens = [s.size for s in v.audio_segments]
    assert lens[:3] == [16000] * 3 and 7000 <= lens[3] <= 8000, lens
    seg = v.audio_segments[1]
    assert 0.2 < np.abs(seg).max() < 0.45  # the tone survived AAC + resampling


def test_max_frames_subsamples_long_video():
    v = decode_video(make_mp4(8.0, audio=False), max_frames=4)
    assert v.num_frames == 4 and v.audio_segments is None
    assert v.timestamps == [0.0, 2.6, 5.2, 7.9]  # linspace(0, 79, 4) truncated


def test_pack_omni_interleaves_frame_then_audio():
    v = decode_video(make_mp4(2.5))
    omni = pack_omni(v, SliceConfig(), "hash")
    kinds = [type(p).__name__ for p in omni.parts]
    assert kinds == ["ImagePart", "AudioPart"] * 3
    frames = [p for p in omni.parts if isinstance(p, ImagePart)]
    assert all(f.image.grid is None and not f.use_image_id for f in frames)
    assert all(f.image.image.num_slices == 1 for f in frames)
    audio = [p for p in omni.parts if isinstance(p, AudioPart)]
    assert [a.num_tokens for a in audio] == [10, 10, 5]
    assert len({id(a.clip) for a in audio}) == 3  # one clip per second by default

    merged = pack_omni(v, SliceConfig(), "hash", merge_audio=True)
    maudio = [p for p in merged.parts if isinstance(p, AudioPart)]
    assert len({id(a.clip) for a in maudio}) == 1
    assert [(a.first_token, a.num_tokens) for a in maudio] == [(0, 10), (10, 10), (20, 5)]


def test_video_errors():
    with pytest.raises(MediaTooLargeError, match=r"3.0 s long, over the limit of 2 s"):
        decode_video(make_mp4(3.0, audio=False), max_seconds=2)
    with pytest.raises(MediaTooLargeError, match="64x48"):
        decode_video(make_mp4(1.0, audio=False), max_pixels=1000)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        a = c.add_stream("aac", rate=16000, layout="mono")
        f = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="flt", layout="mono")
        f.sample_rate = 16000
        for p in list(a.encode(f)) + list(a.encode(None)):
            c.mux(p)
    with pytest.raises(NoVideoStreamError, match="no video stream"):
        decode_video(buf.getvalue())
    with pytest.raises(UnsupportedMediaError):
        decode_video(b"this is not a video at all" * 20)
    mp4 = make_mp4(1.0)
    with pytest.raises(CorruptMediaError):
        decode_video(mp4[:8] + b"\x00" * 64)


@pytest.mark.parametrize("size", [(64, 48), (90, 62)])
def test_frame_rgb_equals_to_image(size):
    buf, rng = io.BytesIO(), np.random.default_rng(0)
    with av.open(buf, "w", format="mp4") as c:  # colourful noise: every conversion path shows
        v = c.add_stream("mpeg4", rate=FPS)
        v.width, v.height, v.pix_fmt = size[0], size[1], "yuv420p"
        for _ in range(4):
            img = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            for p in v.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in v.encode(None):
            c.mux(p)
    with av.open(io.BytesIO(buf.getvalue())) as c:
        for frame in c.decode(video=0):
            ref = np.asarray(frame.to_image().convert("RGB"))
            got = frame_rgb(frame)
            assert got.mode == "RGB" and np.array_equal(np.asarray(got), ref)

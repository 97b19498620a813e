"""Video: 1 fps sampling on a generated MP4, audio segments, omni packing, errors."""

from __future__ import annotations

import io
import struct
from fractions import Fraction

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
from pipeline.processing.video import (
    _decode_picked,
    _plan_runs,
    _probe,
    decode_video,
    frame_rgb,
    pack_omni,
    sample_timestamps,
)

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


# --- decoding only the picked frames (_decode_picked) equals decoding every frame ---


def encode_clip(
    seconds: float,
    fps: int,
    *,
    codec: str = "libx264",
    fmt: str = "mp4",
    options: dict[str, str] | None = None,
    size=(96, 64),
    audio: bool = False,
    frame_pts: list[int] | None = None,
) -> bytes:
    """A clip whose every frame differs (a noise strip panned 1 px a frame, the frame index
    burnt into a corner), so a wrong, missing or shifted frame shows in the pixels.
    frame_pts: explicit pts in 1/1000 s (variable frame rate)."""
    rng = np.random.default_rng(1)
    w, h = size
    n = len(frame_pts) if frame_pts is not None else round(seconds * fps)
    strip = rng.integers(0, 256, (h, w + n, 3), dtype=np.uint8)
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        v = c.add_stream(codec, rate=fps, options=options or {})
        v.width, v.height, v.pix_fmt = w, h, "yuv420p"
        if frame_pts is not None:
            v.time_base = v.codec_context.time_base = Fraction(1, 1000)
        a = c.add_stream("aac", rate=44100, layout="stereo") if audio else None
        for i in range(n):
            img = np.ascontiguousarray(strip[:, i : i + w])
            img[:8, :8] = (5 * i) % 256
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            if frame_pts is not None:
                frame.pts, frame.time_base = frame_pts[i], Fraction(1, 1000)
            for p in v.encode(frame):
                c.mux(p)
        for p in v.encode(None):
            c.mux(p)
        if a is not None:
            x = 0.1 * rng.standard_normal((2, int(seconds * 44100))).astype(np.float32)
            for s in range(0, x.shape[1], 1024):
                f = av.AudioFrame.from_ndarray(
                    np.ascontiguousarray(x[:, s : s + 1024]), format="fltp", layout="stereo"
                )
                f.sample_rate = 44100
                for p in a.encode(f):
                    c.mux(p)
            for p in a.encode(None):
                c.mux(p)
    return buf.getvalue()


def naive_frames(data: bytes, max_frames: int) -> list[np.ndarray]:
    """The rule on its own: decode every frame; pick i is decoded frame min(i, count - 1)."""
    with av.open(io.BytesIO(data)) as c:
        s = c.streams.video[0]
        n, fps = _probe(s, c)
        _, indices, _ = sample_timestamps(n, fps, max_frames)
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(s)]
    return [frames[min(i, len(frames) - 1)] for i in indices]


def picked(data: bytes, max_frames: int, workers: int = 1):
    """(_decode_picked's frames or None, its runs or None, the stream's packet count)."""
    with av.open(io.BytesIO(data)) as c:
        s = c.streams.video[0]
        n, fps = _probe(s, c)
        _, indices, _ = sample_timestamps(n, fps, max_frames)
        packets = [p for p in c.demux(s) if p.size]
    plan = _plan_runs(packets, indices)
    with av.open(io.BytesIO(data)) as c:
        frames = _decode_picked(data, c, c.streams.video[0], indices, lambda w, h: None, workers)
    return frames, None if plan is None else plan[0], len(packets)


def assert_same_as_full(data: bytes, max_frames: int = 64, *, sparse: bool = True):
    """decode_video == full_decode=True == the naive rule, bit for bit (frames and audio);
    sparse: _decode_picked itself handled the clip (no fallback), on 1 and on 3 threads."""
    ref = naive_frames(data, max_frames)
    new = decode_video(data, max_frames=max_frames)
    old = decode_video(data, max_frames=max_frames, full_decode=True)
    assert new.timestamps == old.timestamps and new.duration == old.duration
    assert len(new.frames) == len(old.frames) == len(ref)
    for a, b, r in zip(new.frames, old.frames, ref):
        assert np.array_equal(np.asarray(a), r) and np.array_equal(np.asarray(b), r)
    assert (new.audio_segments is None) == (old.audio_segments is None)
    for a, b in zip(new.audio_segments or [], old.audio_segments or [], strict=True):
        assert np.array_equal(a, b)
    for workers in (1, 3):  # one decoder for every run, and runs side by side
        frames, runs, n_packets = picked(data, max_frames, workers)
        if sparse:
            assert frames is not None and all(
                np.array_equal(np.asarray(a), r) for a, r in zip(frames, ref, strict=True)
            )
    return runs, n_packets


X264_CASES = {
    # name: (seconds, fps, x264 options); every case has a partial last second
    "gop30-bf3-30fps": (6.4, 30, {"g": "30"}),
    "gop250-bf3-30fps": (6.4, 30, {"g": "250"}),
    "gop30-bf0-30fps": (6.4, 30, {"g": "30", "bf": "0"}),
    "gop12-bf3-25fps": (5.3, 25, {"g": "12"}),
    "gop50-bf2-25fps": (5.3, 25, {"g": "50", "bf": "2"}),
    "gop10-bf3-5fps": (9.5, 5, {"g": "10"}),
    "gop250-bf0-5fps": (9.5, 5, {"g": "250", "bf": "0"}),
    "intra-only": (3.2, 30, {"g": "1"}),
    "bf8-pyramid-strict": (4.3, 30, {"g": "45", "x264-params": "bframes=8:b-adapt=0:ref=4"}),
    "bf3-no-pyramid": (4.3, 30, {"g": "45", "x264-params": "b-pyramid=none"}),
    "open-gop": (4.3, 30, {"x264-params": "keyint=40:open-gop=1"}),
}


@pytest.mark.parametrize("name", list(X264_CASES))
def test_picked_frames_equal_full_decode_h264(name):
    seconds, fps, options = X264_CASES[name]
    runs, n_packets = assert_same_as_full(encode_clip(seconds, fps, options=options))
    decoded = sum(b - a + 1 for a, b in runs)
    if options.get("g") in ("1", "12", "30"):  # keyframes at least once a second: jumps
        assert len(runs) > 1 and decoded < n_packets // 2, runs


def test_picked_frames_with_audio_and_max_frames():
    # 70 s > max_frames 64: picks on the 0.1 s grid; the audio track is cut the same way.
    data = encode_clip(70.3, 10, options={"g": "25"}, size=(32, 32), audio=True)
    runs, n_packets = assert_same_as_full(data, max_frames=64)
    assert len(runs) > 1 and sum(b - a + 1 for a, b in runs) < n_packets
    assert_same_as_full(data, max_frames=8)
    assert_same_as_full(encode_clip(9.7, 30, options={"g": "30"}, audio=True), max_frames=4)


@pytest.mark.parametrize(
    "codec,fmt,options",
    [
        ("libx264", "matroska", {"g": "12"}),
        ("libx264", "mpegts", {"g": "12"}),
        ("libx265", "matroska", {"x265-params": "keyint=12:open-gop=0:log-level=none"}),
        ("libx265", "mp4", {"x265-params": "keyint=12:log-level=none"}),  # open GOP (CRA)
        ("mpeg4", "mp4", {"g": "12"}),
        ("mpeg4", "avi", {"g": "12", "bf": "2"}),
        ("mpeg2video", "mpegts", {"g": "12", "bf": "2"}),
        ("libvpx-vp9", "webm", {"g": "12"}),
        ("libvpx", "webm", {"g": "12"}),
    ],
)
def test_picked_frames_equal_full_decode_other_codecs(codec, fmt, options):
    assert_same_as_full(encode_clip(5.5, 10, codec=codec, fmt=fmt, options=options))


def test_variable_frame_rate():
    # 20-90 ms between frames; frame i is still the i-th frame shown.
    gaps = np.random.default_rng(2).integers(20, 90, 140)
    frame_pts = [0, *np.cumsum(gaps)[:-1].tolist()]
    for fmt in ("matroska", "mp4"):
        data = encode_clip(0, 20, fmt=fmt, options={"g": "15"}, frame_pts=frame_pts)
        runs, _ = assert_same_as_full(data)
        assert len(runs) > 1


def test_edit_list_discarded_packets():
    # An MP4 edit list that starts 3 frames in: the demuxer flags those packets discard, they
    # decode but are not shown, so frame 0 is the 4th packet's picture; the frame count in
    # the metadata still says 41, so the last pick (index 40) is past the 38 shown frames.
    data = encode_clip(4.1, 10, options={"g": "12"})
    at = data.find(b"elst")
    assert data[at + 4] == 0  # version 0: u32 entry count, u32 duration, s32 media time
    media_time = struct.unpack(">i", data[at + 16 : at + 20])[0]
    edited = data[: at + 16] + struct.pack(">i", media_time + 3 * 1024) + data[at + 20 :]
    with av.open(io.BytesIO(edited)) as c:
        packets = list(c.demux(c.streams.video[0]))
        assert c.streams.video[0].frames == 41 and sum(p.is_discard for p in packets) == 3
    runs, _ = assert_same_as_full(edited)
    assert len(runs) > 1


def test_streams_without_usable_pts_fall_back_to_full_decode():
    # A raw Annex B H.264 stream has no timestamps to rank its packets by.
    frames, runs, _ = picked(encode_clip(3.3, 25, fmt="h264", options={"g": "12"}), 64)
    assert frames is None and runs is None
    # Matroska with every two frames stamped alike: which comes first is the decoder's call,
    # so the whole stream is decoded as before.
    buf = io.BytesIO()
    clip = encode_clip(4.5, 10, options={"g": "10", "bf": "0"})
    with av.open(io.BytesIO(clip)) as src, av.open(buf, "w", format="matroska") as dst:
        out = dst.add_stream_from_template(src.streams.video[0])
        for i, p in enumerate(q for q in src.demux(video=0) if q.size):
            p.pts = p.dts = (i // 2) * 2 * 1024
            p.stream = out
            dst.mux(p)
    data = buf.getvalue()
    with av.open(io.BytesIO(data)) as c:
        assert len({p.pts for p in c.demux(video=0) if p.size}) == 23
    frames, runs, _ = picked(data, 64)
    assert frames is None and runs is None
    assert_same_as_full(data, sparse=False)
    assert decode_video(data).num_frames == 5


def test_interlaced_h264_falls_back_to_full_decode():
    # MBAFF frames: a stream coded as fields may carry a frame's two fields in two packets,
    # which the packet count would take for two frames.
    data = encode_clip(3.3, 25, options={"g": "12", "x264-params": "interlaced=1"})
    frames, runs, _ = picked(data, 64)
    assert frames is None and runs is not None
    assert_same_as_full(data, sparse=False)

"""Video decoding (PyAV) into 1 fps frames + 1 s audio segments, MiniCPM-o omni style.

Follows OpenBMB `minicpmo.utils.get_video_frame_audio_segments` (stack_frames=1), the recipe
the Daily-Omni "minicpm-interleave" bench mode ports:
1. n frames at avg_fps -> duration = n / avg_fps, num_seconds = max(1, ceil(duration))
2. timestamps t_i = 0, 1, ..., num_seconds - 1; frame index min(int(t_i * avg_fps), n - 1)
   (the frame shown at t_i). If duration > max_frames, timestamps are the 0.1 s grid
   uniformly subsampled (linspace, int) down to max_frames frames.
3. audio track -> 16 kHz mono; segment i = samples [int(t_i * sr), int(t_{i+1} * sr)),
   the last one up to the video duration, zero-padded to >= 1600 samples (0.1 s).
   No audio stream -> vision only (segments None), as the reference degrades; an audio
   stream that decodes to 0 samples is refused (EmptyMediaError), like an empty audio part.

Decoding reads every video packet first (no pixels), ranks the shown ones by pts (frame i of
step 2 is the i-th frame a full decode returns) and decodes only what the picked frames need:
from the latest keyframe at or before each pick (runs side by side on threads, each with its
own decoder), skipping H.264's non-reference frames that are not picks. The frames are the
full decode's, bit for bit; streams where that cannot be shown from the packets and the
frames (no or repeated pts, other codecs, decode errors, ...) are decoded in full as before.

Frame size limits (pixels, aspect ratio) are checked on the stream's width x height before
anything is decoded, and again on each kept frame (a stream may change resolution).

Each frame is later processed as ONE unsliced image (max_slice_nums 1, 64 tokens, no
<image_id>), see `template.py` and `Processor`.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import av
import numpy as np
from PIL import Image

from pipeline.config import SliceConfig
from pipeline.processing.audio import (
    SAMPLE_RATE,
    audio_num_tokens,
    clip_num_tokens,
    decode_av_audio,
    process_audio,
    process_audios,
)
from pipeline.processing.errors import (
    CorruptMediaError,
    EmptyMediaError,
    MediaTooLargeError,
    NoVideoStreamError,
    UnsupportedMediaError,
)
from pipeline.processing.image import MAX_ASPECT_RATIO, check_aspect_ratio, process_image
from pipeline.processing.template import AudioPart, ImagePart, OmniPart

MIN_SEGMENT_SAMPLES = 1600

# Codecs whose container keyframes reset the decoder's references, so decoding may start at
# one: every frame from it on decodes to the same pixels as from the stream's start (its
# open-GOP leading pictures excepted, see `_plan_runs`). Other codecs decode from the start.
SEEK_CODECS = frozenset({"h264", "hevc", "mpeg4", "mpeg2video", "vp8", "vp9"})
# Codecs where skip_frame NONREF drops only frames no other frame predicts from (H.264:
# nal_ref_idc 0). HEVC is not here: its NONREF skips sub-layer non-reference pictures, which
# a higher temporal layer may still reference.
SKIP_NONREF_CODECS = frozenset({"h264"})
# Threads that decode one video's runs (stretches that each start at a keyframe) side by side.
DECODE_WORKERS = min(8, os.cpu_count() or 1)
# Frames per `on_frames` call while later ones still decode (8 slices still make a full-rate
# vision batch), converted and handed on by up to HANDOFF_WORKERS threads beside the decode
# threads, so a chunk is not held up behind the one before it.
HANDOFF_FRAMES = 8
HANDOFF_WORKERS = max(1, min(4, (os.cpu_count() or 1) // 4))

# on_frames(picks, frames, timestamps, pending): frames[i] is the picks[i]-th of the frames
# decode_video returns; pending: more of the video (frames, its audio track) is to come.
OnFrames = Callable[[list[int], list[Image.Image], list[float], bool], None]


@dataclass
class DecodedVideo:
    """frames[i] is the frame at timestamps[i] seconds; audio_segments[i] (16 kHz mono
    float32) is the audio from timestamps[i] to the next timestamp (None: no audio track)."""

    frames: list[Image.Image]
    timestamps: list[float]
    duration: float
    audio_segments: list[np.ndarray] | None
    # Frames handed to on_frames came from a decode that was then given up for the plain one:
    # they may differ from `frames`, so they must not stand in for them.
    redecoded: bool = False

    @property
    def num_frames(self) -> int:
        return len(self.frames)


def uniform_indices(n: int, k: int) -> list[int]:
    """k of range(n) evenly spread (np.linspace(0, n - 1, k) truncated), all when n <= k."""
    if n <= k:
        return list(range(n))
    return [int(i) for i in np.linspace(0, n - 1, k)]


def sample_timestamps(
    num_video_frames: int, avg_fps: float, max_frames: int
) -> tuple[list[float], list[int], float]:
    """(timestamps, frame indices, duration) for a clip of num_video_frames at avg_fps."""
    duration = num_video_frames / avg_fps
    num_seconds = max(1, math.ceil(duration))
    if duration > max_frames:
        grid = [round(i * 0.1, 1) for i in range(int(duration / 0.1))]
        pick = uniform_indices(len(grid), max_frames)
        timestamps = [grid[i] for i in pick]
    else:
        timestamps = [float(i) for i in range(num_seconds)]
    indices = [min(int(t * avg_fps), num_video_frames - 1) for t in timestamps]
    return timestamps, indices, duration


def segment_audio(
    samples: np.ndarray, timestamps: list[float], duration: float
) -> list[np.ndarray]:
    """Cut 16 kHz samples at the frame timestamps (see the module docstring)."""
    segments = []
    for i, start in enumerate(timestamps):
        end = timestamps[i + 1] if i + 1 < len(timestamps) else duration
        seg = samples[int(start * SAMPLE_RATE) : int(end * SAMPLE_RATE)]
        if i == len(timestamps) - 1 and seg.size < MIN_SEGMENT_SAMPLES:
            seg = np.concatenate([seg, np.zeros(MIN_SEGMENT_SAMPLES - seg.size, np.float32)])
        if seg.size == 0:  # audio track shorter than the video
            seg = np.zeros(MIN_SEGMENT_SAMPLES, np.float32)
        segments.append(seg.astype(np.float32, copy=False))
    return segments


def _open(data: bytes) -> av.container.InputContainer:
    try:
        return av.open(io.BytesIO(data), mode="r")
    except av.FFmpegError as e:
        if data[4:8] == b"ftyp" or data.startswith((b"\x1aE\xdf\xa3", b"RIFF")):
            raise CorruptMediaError(f"video container could not be opened: {e}") from e
        raise UnsupportedMediaError(
            "video bytes are not a container FFmpeg can read (e.g. MP4, MOV, MKV, WebM, AVI)"
        ) from e


def _probe(
    stream: av.video.stream.VideoStream, container: av.container.InputContainer
) -> tuple[int, float]:
    """(frame count, average fps) from metadata; duration * fps when the count is missing."""
    fps = float(stream.average_rate) if stream.average_rate else 0.0
    if fps <= 0:
        fps = float(stream.guessed_rate) if stream.guessed_rate else 0.0
    n = int(stream.frames or 0)
    if n <= 0:
        seconds = None
        if stream.duration is not None and stream.time_base is not None:
            seconds = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            seconds = container.duration / av.time_base
        if seconds and fps:
            n = math.floor(seconds * fps)
    return n, fps


def decode_video(
    data: bytes,
    *,
    max_frames: int = 64,
    max_seconds: float = 600.0,
    max_pixels: int = 4096 * 4096,
    max_aspect_ratio: float = MAX_ASPECT_RATIO,
    with_audio: bool = True,
    full_decode: bool = False,
    on_frames: OnFrames | None = None,
    handoff_frames: int = HANDOFF_FRAMES,
) -> DecodedVideo:
    """Video bytes -> DecodedVideo: at most max_frames frames, 1 fps for short clips.

    Raises NoVideoStreamError, MediaTooLargeError (longer than max_seconds, or frames over
    max_pixels), AspectRatioError (frames over max_aspect_ratio), CorruptMediaError /
    UnsupportedMediaError, EmptyMediaError (no frames, or an audio track of 0 samples).

    Only the packets the picked frames need are decoded (`_decode_picked`); full_decode=True
    decodes every frame up to the last pick instead (the same frames, bit for bit: the
    reference the tests and bench/video_decode.py compare against).

    on_frames(picks, frames, timestamps, pending) gets the frames as they are decoded, so their
    encoding can start before this returns: `handoff_frames` at a time while later ones still
    decode (from the packets-only path, on threads of their own; 0: not while decoding), then
    the rest before the audio track is waited for (pending: it is still decoding). An error
    after a call still raises here.
    """
    if not data:
        raise EmptyMediaError("video part is empty (0 bytes)")
    with _open(data) as container:
        if not container.streams.video:
            raise NoVideoStreamError(f"container {container.format.name} has no video stream")
        stream = container.streams.video[0]
        n, fps = _probe(stream, container)
        if n <= 0 or fps <= 0:
            raise CorruptMediaError("video stream has no frame count / frame rate metadata")
        if n / fps > max_seconds:
            raise MediaTooLargeError(
                f"video is {n / fps:.1f} s long, over the limit of {max_seconds:g} s"
            )
        # Once per video, from the stream header; 0 means the demuxer does not know the
        # size yet, and then only the per-frame check below applies.
        if stream.width > 0 and stream.height > 0:
            _check_frame_size(stream.width, stream.height, max_pixels, max_aspect_ratio)
        timestamps, indices, duration = sample_timestamps(n, fps, max_frames)

        def check_size(w: int, h: int) -> None:
            _check_frame_size(w, h, max_pixels, max_aspect_ratio)

        # The audio track decodes on its own thread and container while the frames decode
        # here (both spend most of their time in FFmpeg and soxr, outside the GIL).
        handed: set[int] = set()  # picks in the on_frames calls made while decoding

        def on_chunk(picks: list[int], images: list[Image.Image]) -> None:
            assert on_frames is not None
            on_frames(picks, images, [timestamps[i] for i in picks], True)
            handed.update(picks)

        with ThreadPoolExecutor(1, thread_name_prefix="video-audio") as pool:
            audio = pool.submit(_decode_audio_track, data, max_seconds) if with_audio else None
            frames = (
                None
                if full_decode
                else _decode_picked(
                    data, container, stream, indices, check_size,
                    on_chunk=None if on_frames is None or handoff_frames <= 0 else on_chunk,
                    chunk=handoff_frames,
                )
            )
            redecoded = frames is None and bool(handed)
            if frames is None:  # the plain path: every frame up to the last pick, in order
                with _open(data) as plain:
                    frames = _decode_frames(plain, plain.streams.video[0], indices, check_size)
            if not frames:
                raise EmptyMediaError("video stream decodes to 0 frames")
            if on_frames is not None and not redecoded:
                pending = audio is not None and bool(container.streams.audio) and not audio.done()
                rest = [i for i in range(len(frames)) if i not in handed]
                on_frames(rest, [frames[i] for i in rest], [timestamps[i] for i in rest], pending)
            samples = None if audio is None else audio.result()
    segments = None if samples is None else segment_audio(samples, timestamps, duration)
    return DecodedVideo(frames, timestamps, duration, segments, redecoded)


def _decode_audio_track(data: bytes, max_seconds: float) -> np.ndarray | None:
    """The video's first audio track as 16 kHz mono (None: it has none)."""
    with _open(data) as container:
        if not container.streams.audio:
            return None
        _demux_only(container, container.streams.audio[0])
        try:
            samples = decode_av_audio(container, max_seconds)
        except av.FFmpegError as e:
            raise CorruptMediaError(f"video's audio track could not be decoded: {e}") from e
    if samples.size == 0:
        raise EmptyMediaError("video's audio track decodes to 0 samples")
    return samples


def _check_frame_size(width: int, height: int, max_pixels: int, max_aspect_ratio: float) -> None:
    if width * height > max_pixels:
        raise MediaTooLargeError(
            f"video frames are {width}x{height}, over the limit of {max_pixels} pixels"
        )
    if width == 0 or height == 0:
        raise CorruptMediaError(f"video frame has zero size ({width}x{height})")
    check_aspect_ratio(width, height, max_aspect_ratio, what="video frame")


def frame_rgb(frame: av.VideoFrame) -> Image.Image:
    """An RGB PIL image of a decoded frame: the pixels of `frame.to_image().convert("RGB")`,
    through `to_ndarray` (about 8x faster per 448x448 frame)."""
    return Image.fromarray(frame.to_ndarray(format="rgb24"))


def _demux_only(container: av.container.InputContainer, stream: av.stream.Stream) -> None:
    """Make the demuxer skip every other stream's packets instead of reading them."""
    for other in container.streams:
        if other.index != stream.index:
            other.discard = av.stream.Discard.all


def _plan_runs(
    packets: list[av.Packet], indices: list[int]
) -> tuple[list[tuple[int, int]], list[int]] | None:
    """(runs, pts of each pick): the packet ranges [first, last] (decode order) to decode, each
    from a fresh decoder, so that every pick's packet and all it references are decoded.

    Frame index i is the i-th frame a full decode returns; the decoder returns frames in
    presentation order, so that is the i-th smallest pts among the packets it shows (a packet
    flagged discard, e.g. before an MP4 edit list's start, decodes but is not shown). None when
    that cannot be read off the packets: a packet without pts, or two with the same.
    """
    pts = [p.pts for p in packets]
    if not pts or None in pts or len(set(pts)) < len(pts):
        return None
    shown = sorted((p.pts, j) for j, p in enumerate(packets) if not p.is_discard)
    if not shown:
        return None
    picks = [shown[min(i, len(shown) - 1)] for i in indices]  # past the end: the last frame
    # A run starts at packet 0 (as a full decode does) or at a keyframe that no later packet
    # precedes in presentation order: such a later packet is an open-GOP leading picture,
    # which may reference frames before the keyframe.
    starts, low = [0], math.inf
    for j in range(len(packets) - 1, 0, -1):
        low = min(low, pts[j])
        if packets[j].is_keyframe and pts[j] == low:
            starts.append(j)
    starts.sort()
    runs: list[tuple[int, int]] = []
    for j in sorted({d for _, d in picks}):
        first = starts[bisect.bisect_right(starts, j) - 1]
        if runs and first <= runs[-1][1] + 1:  # the run already passes this start: go on
            runs[-1] = (runs[-1][0], j)
        else:
            runs.append((first, j))
    return runs, [t for t, _ in picks]


def _decode_picked(
    data: bytes,
    container: av.container.InputContainer,
    stream: av.video.stream.VideoStream,
    indices: list[int],
    check_size: Callable[[int, int], None],
    workers: int = DECODE_WORKERS,
    on_chunk: Callable[[list[int], list[Image.Image]], None] | None = None,
    chunk: int = HANDOFF_FRAMES,
) -> list[Image.Image] | None:
    """The frames at `indices` (as `_decode_frames` gives them), decoding only the packets they
    need: from the latest usable keyframe at or before each pick, and for H.264 without the
    non-reference frames that are not picks. Runs that start at their own keyframe decode side
    by side on up to `workers` threads, each with its own decoder (a decode from the start
    spreads over frame threads; one from many keyframes would otherwise not), and the picks
    convert to RGB on the same threads (those handed on early, on on_chunk's).

    on_chunk(picks, images): the images of those picks (indices into `indices`, ascending),
    `chunk` or more at a time as they are decoded, but never the last ones (the caller hands
    those on with what it knows then); called on threads of their own, maybe side by side.

    None when this stream does not allow it (codec outside SEEK_CODECS, packets without
    distinct pts, a decode error, a frame the decoder returns out of the expected order): the
    caller then decodes every frame."""
    if stream.codec_context.name not in SEEK_CODECS:
        return None
    _demux_only(container, stream)
    try:
        packets = [p for p in container.demux(stream) if p.size]
    except av.FFmpegError:
        return None
    plan = _plan_runs(packets, indices)
    if plan is None:
        return None
    runs, pick_pts = plan
    wanted = set(pick_pts)
    groups = _split_runs(runs, workers)
    threads = 0 if len(groups) == 1 else max(1, (os.cpu_count() or 1) // len(groups))

    with ThreadPoolExecutor(workers, thread_name_prefix="video-decode") as pool:
        picked = None if on_chunk is None else _Chunks(pick_pts, chunk, on_chunk, check_size)
        on_pick = None if picked is None else picked.add

        def decode_group(group: list[tuple[int, int]]) -> dict[int, av.VideoFrame] | None:
            if len(groups) == 1:
                return _decode_runs(stream, packets, group, wanted, threads, on_pick)
            try:
                with av.open(io.BytesIO(data), mode="r") as own:  # a decoder of its own
                    return _decode_runs(own.streams.video[0], packets, group, wanted, threads,
                                        on_pick)
            except av.FFmpegError:
                return None

        try:
            parts = list(pool.map(decode_group, groups))
            images = {} if picked is None else picked.wait()  # the picks already converted
        finally:
            if picked is not None:
                picked.close()
        if any(part is None for part in parts):
            return None
        got = {t: f for part in parts for t, f in part.items()}
        if not wanted <= got.keys():
            return None
        for t in pick_pts:  # in pick order, as the plain path checks them
            check_size(got[t].width, got[t].height)
        unique = [t for t in dict.fromkeys(pick_pts) if t not in images]
        images.update(zip(unique, pool.map(frame_rgb, [got[t] for t in unique]), strict=True))
    return [images[t] for t in pick_pts]


class _Chunks:
    """`_decode_picked`'s picks to on_chunk while later ones still decode: the decode threads
    add frames as they come out (runs decode side by side, so not in pick order); every
    `chunk` more picks are checked, converted to RGB and handed on, on threads of their own
    (the decode threads keep decoding)."""

    def __init__(
        self,
        pick_pts: list[int],
        chunk: int,
        on_chunk: Callable[[list[int], list[Image.Image]], None],
        check_size: Callable[[int, int], None],
    ):
        self.chunk, self.on_chunk, self.check_size = max(1, chunk), on_chunk, check_size
        self._picks: dict[int, list[int]] = {}  # pts -> its picks (a repeat: the last frame)
        for i, t in enumerate(pick_pts):
            self._picks.setdefault(t, []).append(i)
        self._left = len(pick_pts)  # picks not decoded yet
        self._held: list[tuple[int, av.VideoFrame]] = []  # decoded, not handed on yet
        self._futures: list[Future[dict[int, Image.Image]]] = []
        self._pool = ThreadPoolExecutor(HANDOFF_WORKERS, thread_name_prefix="video-handoff")
        self._lock = threading.Lock()

    def add(self, pts: int, frame: av.VideoFrame) -> None:
        with self._lock:
            if pts not in self._picks:
                return
            self._held.append((pts, frame))
            self._left -= len(self._picks[pts])
            if self._left == 0 or sum(len(self._picks[t]) for t, _ in self._held) < self.chunk:
                return  # the last picks are the caller's to hand on
            held, self._held = self._held, []
            self._futures.append(self._pool.submit(self._send, held))

    def _send(self, held: list[tuple[int, av.VideoFrame]]) -> dict[int, Image.Image]:
        images: dict[int, Image.Image] = {}
        for t, f in held:
            self.check_size(f.width, f.height)
            images[t] = frame_rgb(f)
        picks = sorted((i, t) for t in images for i in self._picks[t])
        self.on_chunk([i for i, _ in picks], [images[t] for _, t in picks])
        return images

    def wait(self) -> dict[int, Image.Image]:
        """The RGB images handed on, by pts, once every call is done (raises the first one's
        error)."""
        images: dict[int, Image.Image] = {}
        for f in self._futures:
            images.update(f.result())
        return images

    def close(self) -> None:
        self._pool.shutdown()


def _split_runs(runs: list[tuple[int, int]], k: int) -> list[list[tuple[int, int]]]:
    """runs in at most k consecutive groups of about as many packets each."""
    total = sum(b - a + 1 for a, b in runs)
    groups: list[list[tuple[int, int]]] = [[]]
    done = 0
    for a, b in runs:
        if groups[-1] and len(groups) < k and done >= total * len(groups) / k:
            groups.append([])
        groups[-1].append((a, b))
        done += b - a + 1
    return groups


def _decode_runs(
    stream: av.video.stream.VideoStream,
    packets: list[av.Packet],
    runs: list[tuple[int, int]],
    wanted: set[int],
    threads: int,
    on_pick: Callable[[int, av.VideoFrame], None] | None = None,
) -> dict[int, av.VideoFrame] | None:
    """{pts: frame} of the wanted frames in `runs`, each run decoded from a flushed decoder
    (each also to on_pick(pts, frame) as it comes out).

    None on a decode error, or when the run's frames show that packets and frames do not
    pair one to one as `_plan_runs` counts them: a frame out of pts order or with a pts no
    sent packet has, a packet without a frame (an invisible VP8/VP9 frame; checked where no
    frame is skipped), an interlaced frame (its fields may come in two packets)."""
    ctx = stream.codec_context
    stream.thread_type = "AUTO"
    ctx.thread_count = threads  # 0: FFmpeg's choice (cores + 1, at most 16)
    skip_nonref = ctx.name in SKIP_NONREF_CODECS
    got: dict[int, av.VideoFrame] = {}
    try:
        for first, last in runs:
            sent = {p.pts for p in packets[first : last + 1] if not p.is_discard}
            prev, shown = -math.inf, 0
            for p in [*packets[first : last + 1], None]:  # None drains the reorder buffer
                if skip_nonref and p is not None:  # a pick may itself be a non-reference frame
                    ctx.skip_frame = "DEFAULT" if p.pts in wanted else "NONREF"
                for f in ctx.decode(p):
                    if f.pts not in sent or f.pts <= prev or f.interlaced_frame:
                        return None
                    prev, shown = f.pts, shown + 1
                    if f.pts in wanted:  # only picks are held: the decoder reuses the others
                        got[f.pts] = f
                        if on_pick is not None:
                            on_pick(f.pts, f)
            ctx.flush_buffers()
            if not skip_nonref and shown != len(sent):
                return None
    except av.FFmpegError:
        return None
    return got


def _decode_frames(
    container: av.container.InputContainer,
    stream: av.video.stream.VideoStream,
    indices: list[int],
    check_size: Callable[[int, int], None],
) -> list[Image.Image]:
    """The plain path: decode every frame in order up to the last pick, keeping the wanted
    frame indices (repeats allowed); when the stream has fewer frames than its metadata
    claims, later picks reuse the last decoded frame. `check_size(w, h)` runs on every kept
    frame before it is converted."""
    wanted = set(indices)
    last_needed = max(indices)
    stream.thread_type = "AUTO"
    got: dict[int, Image.Image] = {}
    last_frame = None  # (index, av frame) of the newest decoded frame
    try:
        for i, frame in enumerate(container.decode(stream)):
            last_frame = (i, frame)
            if i in wanted:
                check_size(frame.width, frame.height)
                got[i] = frame_rgb(frame)
            if i >= last_needed:
                break
    except av.FFmpegError as e:
        if not got:
            raise CorruptMediaError(f"video stream could not be decoded: {e}") from e
    if last_frame is None:
        return []
    tail = None  # picks past the real end reuse the last decoded frame
    out = []
    for idx in indices:
        if idx not in got and tail is None:
            check_size(last_frame[1].width, last_frame[1].height)
            tail = frame_rgb(last_frame[1])
        out.append(got.get(idx, tail))
    return out


def _frame_hash(video_hash: str, t: float, cfg: SliceConfig) -> str:
    """Encoder-cache key of one frame: the video bytes' hash + timestamp + pixel options."""
    key = f"{video_hash}|frame@{t}|slices=1|res={cfg.scale_resolution}|patch={cfg.patch_size}"
    return hashlib.sha256(key.encode()).hexdigest()


def frame_parts(
    frames: list[Image.Image], timestamps: list[float], cfg: SliceConfig, video_hash: str
) -> list[ImagePart]:
    """Each frame as one unsliced image (max_slice_nums 1, 64 tokens, no <image_id>), keyed
    for the encoder cache by the video's hash and its timestamp."""
    return [
        ImagePart(process_image(f, cfg, _frame_hash(video_hash, t, cfg), 1), use_image_id=False)
        for f, t in zip(frames, timestamps, strict=True)
    ]


def pack_omni(
    video: DecodedVideo,
    cfg: SliceConfig,
    video_hash: str,
    *,
    merge_audio: bool = False,
    frames: list[ImagePart] | None = None,
) -> OmniPart:
    """Interleave frame i and audio segment i (Daily-Omni "minicpm-interleave" / reference omni
    chat): [frame_0, audio_0, frame_1, audio_1, ...], joined without separators.

    Frames: one unsliced image each (max_slice_nums 1, 64 tokens, no <image_id>), as the
    reference omni path and the bench's mm_processor_kwargs do.
    Audio: by default each segment is its own clip (what vLLM-Omni does with one audio_url per
    second: own log-mel floor, own encoder pass). merge_audio=True makes the whole track one
    clip (reference `chat(merge_audio_from_same_content=True)`: one feature pass, block-causal
    encoder context across seconds) and maps segment i to its token range of that clip.
    frames: `frame_parts` of this video, when they were made already.
    """
    if frames is None:
        frames = frame_parts(video.frames, video.timestamps, cfg, video_hash)
    if video.audio_segments is None:
        return OmniPart(list(frames))
    audio: list[AudioPart] = []
    if merge_audio:
        clip = process_audio(np.concatenate(video.audio_segments))
        total = clip_num_tokens(clip)
        done, samples = 0, 0
        for seg in video.audio_segments:
            samples += seg.size
            upto = min(audio_num_tokens(samples), total)
            audio.append(AudioPart(clip, upto - done, first_token=done))
            done = upto
    else:
        for clip in process_audios(video.audio_segments):
            audio.append(AudioPart(clip, clip_num_tokens(clip)))
    parts: list[ImagePart | AudioPart] = []
    for f, a in zip(frames, audio):
        parts.append(f)
        if a.num_tokens > 0:
            parts.append(a)
    return OmniPart(parts)

"""Benchmark data: Daily-Omni in its published layout, and a synthetic set of the same shape.

Daily-Omni layout (HF `liarliar/Daily-Omni`):
    <root>/qa.json                               list of {Question, Choice, Answer, video_id,
                                                 Type, video_duration ("30s"|"60s"),
                                                 video_category}
    <root>/Videos/<id>/<id>_video.mp4
    <root>/Videos/<id>/<id>_audio.wav

Request packing (`item_messages`):
  - "video" (default): one `video_url` part (data:video/mp4) + one audio part (the clip's wav)
    + the question text. The server samples 1 fps frames and 1 s audio pieces and interleaves
    them, MiniCPM-o omni style (up to 64 pairs).
  - "interleave": the client does that packing itself: 1 fps JPEG `image_url` parts, each
    followed by its 1 s wav piece, up to `max_pairs`, then the question text.
  - "track": one `video_url` part whose MP4 carries the wav as its own AAC track (what a
    user's recording looks like; muxed once by the client, `<id>_track.mp4` beside the
    clip: the video packets copied, the wav encoded), then the question text. The server
    decodes the frames and the track side by side and interleaves 1 s pairs.

Accuracy: `extract_choice_letter` parses the answer the way Daily-Omni's evaluation does, and an
answer counts only on an exact letter match.

The synthetic set (`make_synthetic_daily_omni`) writes generated clips (moving shapes, tones;
fixed seed) plus a qa.json in the same layout, so the same loader and packing are exercised on
machines without the data.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bench.client import RequestSpec

DAILY_OMNI_PROMPT = (
    "Your task is to accurately answer multiple-choice questions based on the given video "
    "and audio together.\n"
    "Select the single most accurate answer from the given choices.\n"
    "Question: {question}\n"
    "Choices:\n{choices}\n"
    "Your answer should be a capital letter representing your choice: A, B, C, or D. "
    "Don't generate any other text."
)

LETTERS = "ABCD"


@dataclass(frozen=True)
class DailyOmniItem:
    """One multiple-choice question about one clip."""

    qid: str
    video_id: str
    question: str
    choices: tuple[str, ...]
    answer: str
    qa_type: str
    video_category: str
    video_duration: str  # "30s" / "60s" as in qa.json
    video_path: Path
    audio_path: Path

    @property
    def meta(self) -> dict[str, Any]:
        return {
            "video_id": self.video_id,
            "type": self.qa_type,
            "category": self.video_category,
            "duration": self.video_duration,
        }


def media_paths(videos_dir: Path, video_id: str) -> tuple[Path, Path]:
    d = videos_dir / video_id
    return d / f"{video_id}_video.mp4", d / f"{video_id}_audio.wav"


def load_daily_omni(
    root: str | os.PathLike,
    qa_json: str | os.PathLike | None = None,
    videos_dir: str | os.PathLike | None = None,
    limit: int | None = None,
    durations: Sequence[str] | None = None,
    require_media: bool = True,
) -> list[DailyOmniItem]:
    """Read qa.json and resolve each item's media.

    Items with missing fields, or (with require_media) missing media files, are skipped.
    `durations` keeps only those buckets, e.g. ("30s",).
    """
    root = Path(root)
    qa_path = Path(qa_json) if qa_json else root / "qa.json"
    vdir = Path(videos_dir) if videos_dir else root / "Videos"
    with open(qa_path, encoding="utf-8") as f:
        raw = json.load(f)
    items: list[DailyOmniItem] = []
    for i, d in enumerate(raw):
        try:
            vid = str(d["video_id"])
            q, choices, ans = d["Question"], d["Choice"], d["Answer"]
        except KeyError:
            continue
        if isinstance(choices, str):
            choices = [c for c in choices.split("\n") if c.strip()]
        dur = str(d.get("video_duration", ""))
        if durations and dur not in durations:
            continue
        vpath, apath = media_paths(vdir, vid)
        if require_media and not (vpath.exists() and apath.exists()):
            continue
        items.append(
            DailyOmniItem(
                qid=f"{vid}#{i}",
                video_id=vid,
                question=str(q),
                choices=tuple(str(c) for c in choices),
                answer=str(ans).strip().upper(),
                qa_type=str(d.get("Type", "")),
                video_category=str(d.get("video_category", "")),
                video_duration=dur,
                video_path=vpath,
                audio_path=apath,
            )
        )
        if limit is not None and len(items) >= limit:
            break
    return items


def format_choices(choices: Sequence[str]) -> str:
    """One choice per line, lettered A.. unless the data already letters them."""
    lines = []
    for i, c in enumerate(choices):
        c = c.strip()
        if re.match(r"^[A-D]\s*[.:)]", c):
            lines.append(c)
        else:
            lines.append(f"{LETTERS[i]}. {c}")
    return "\n".join(lines)


def build_prompt(question: str, choices: Sequence[str]) -> str:
    return DAILY_OMNI_PROMPT.format(question=question.strip(), choices=format_choices(choices))


# ----------------------------------------------------------------------------- answer parsing

_LEADING = re.compile(r"^([A-D])(?=$|[\s\W_])")
_STANDALONE = re.compile(r"\b([A-D])\b")
# CJK-safe: a letter not touching other ASCII letters (\b fails next to CJK word characters)
_LOOSE = re.compile(r"(?<![A-Za-z])([A-D])(?![A-Za-z])")


def extract_choice_letter(text: str | None) -> str | None:
    """The chosen letter in a model answer, Daily-Omni style; None if there is none.

    1. if the text contains "assistant" (a decoded chat turn), only what follows it counts;
    2. a leading A-D followed by whitespace, punctuation or the end;
    3. else the first standalone A-D (word boundaries);
    4. else the last A-D not adjacent to other Latin letters (e.g. "答案是B").
    """
    if not text:
        return None
    m = re.search(r"assistant\s*([\s\S]*)$", text)
    s = (m.group(1) if m else text).strip()
    if not s:
        return None
    if (m := _LEADING.match(s)) is not None:
        return m.group(1)
    if (m := _STANDALONE.search(s)) is not None:
        return m.group(1)
    loose = _LOOSE.findall(s)
    return loose[-1] if loose else None


def is_correct(text: str | None, answer: str) -> bool:
    letter = extract_choice_letter(text)
    return letter is not None and letter == answer.strip().upper()


# ----------------------------------------------------------------------------- packing


@lru_cache(maxsize=256)
def _b64_file(path: str) -> str:
    with open(path, "rb") as f:
        return base64.b64encode(f.read()).decode()


def audio_part(b64_wav: str, style: str) -> dict[str, Any]:
    """A wav content part: OpenAI `input_audio` or a vLLM-style `audio_url` data URI."""
    if style == "input_audio":
        return {"type": "input_audio", "input_audio": {"data": b64_wav, "format": "wav"}}
    if style == "audio_url":
        return {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{b64_wav}"}}
    raise ValueError(f"unknown audio part style {style!r}")


def item_messages(
    item: DailyOmniItem,
    pack: str = "video",
    input_mode: str = "all",
    audio_style: str = "input_audio",
    max_pairs: int = 64,
    system_prompt: str | None = None,
    transport: str = "data",
) -> list[dict[str, Any]]:
    """Chat messages for one item (see the module docstring for `pack`).

    input_mode: "all" (video + audio), "visual" (video only), "audio" (audio only) or "text"
    (the question alone: a text prompt that still asks for speech).
    transport (pack "video" only): "data" inlines the files as base64 data: URIs; "file" sends
    file:// URLs of the absolute paths (video_url + audio_url), as vLLM's bench does by
    default; the server must share the file system and allow the folder.
    """
    if transport not in ("data", "file"):
        raise ValueError(f"unknown transport {transport!r}")
    use_v, use_a = input_mode in ("all", "visual"), input_mode in ("all", "audio")
    if not (use_v or use_a or input_mode == "text"):
        raise ValueError(f"unknown input_mode {input_mode!r}")
    parts: list[dict[str, Any]] = []
    if pack == "track":
        if not use_v:
            raise ValueError("pack 'track' sends the audio inside the video: input_mode all")
        path = muxed_track_clip(item) if use_a else item.video_path
        url = (path.resolve().as_uri() if transport == "file"
               else f"data:video/mp4;base64,{_b64_file(str(path))}")
        parts.append({"type": "video_url", "video_url": {"url": url}})
    elif pack == "video" and transport == "file":
        if use_v:
            parts.append({"type": "video_url",
                          "video_url": {"url": item.video_path.resolve().as_uri()}})
        if use_a:
            parts.append({"type": "audio_url",
                          "audio_url": {"url": item.audio_path.resolve().as_uri()}})
    elif pack == "video":
        if use_v:
            b64 = _b64_file(str(item.video_path))
            parts.append({"type": "video_url",
                          "video_url": {"url": f"data:video/mp4;base64,{b64}"}})
        if use_a:
            parts.append(audio_part(_b64_file(str(item.audio_path)), audio_style))
    elif pack == "interleave":
        frames = video_frames_1fps(item.video_path, max_pairs) if use_v else []
        pieces = audio_pieces_1s(item.audio_path, max_pairs) if use_a else []
        for i in range(max(len(frames), len(pieces))):
            if i < len(frames):
                parts.append({"type": "image_url",
                              "image_url": {"url": f"data:image/jpeg;base64,{frames[i]}"}})
            if i < len(pieces):
                parts.append(audio_part(pieces[i], audio_style))
    else:
        raise ValueError(f"unknown pack mode {pack!r}")
    parts.append({"type": "text", "text": build_prompt(item.question, item.choices)})
    messages: list[dict[str, Any]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": parts})
    return messages


def muxed_track_clip(item: DailyOmniItem) -> Path:
    """`<id>_track.mp4` beside the clip: its video packets as they are, and its wav as an AAC
    track (44.1 kHz stereo, as most recordings are: the server resamples and downmixes).
    Written once (under a temporary name first)."""
    import av
    import soundfile as sf

    out = item.video_path.with_name(f"{item.video_id}_track.mp4")
    if out.exists():
        return out
    audio, sr = sf.read(str(item.audio_path), dtype="float32", always_2d=True)
    mono = audio.mean(axis=1)
    rate = 44100
    n = round(len(mono) * rate / sr)
    x = np.interp(np.arange(n) * sr / rate, np.arange(len(mono)), mono).astype(np.float32)
    stereo = np.ascontiguousarray(np.stack([x, x]))
    tmp = out.with_suffix(".part.mp4")
    with av.open(str(item.video_path)) as src, av.open(str(tmp), mode="w", format="mp4") as dst:
        vin = src.streams.video[0]
        vout = dst.add_stream_from_template(vin)
        aout = dst.add_stream("aac", rate=rate, layout="stereo")
        for packet in src.demux(vin):
            if packet.dts is None:
                continue
            packet.stream = vout
            dst.mux(packet)
        for i in range(0, stereo.shape[1], 1024):
            frame = av.AudioFrame.from_ndarray(stereo[:, i : i + 1024], format="fltp",
                                               layout="stereo")
            frame.sample_rate = rate
            for packet in aout.encode(frame):
                dst.mux(packet)
        for packet in aout.encode(None):
            dst.mux(packet)
    os.replace(tmp, out)
    return out


def video_frames_1fps(path: Path, max_frames: int = 64) -> list[str]:
    """Base64 JPEGs of the frame nearest to each whole second (0 s, 1 s, ...)."""
    import av

    out: list[str] = []
    next_t = 0.0
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        for frame in container.decode(stream):
            t = float(frame.pts * stream.time_base) if frame.pts is not None else next_t
            if t + 1e-6 < next_t:
                continue
            buf = io.BytesIO()
            frame.to_image().save(buf, format="JPEG", quality=90)
            out.append(base64.b64encode(buf.getvalue()).decode())
            next_t += 1.0
            if len(out) >= max_frames:
                break
    return out


def audio_pieces_1s(path: Path, max_pieces: int = 64) -> list[str]:
    """Base64 wavs of consecutive 1 s pieces (the last one may be shorter)."""
    import soundfile as sf

    from bench.metrics import wav_bytes

    audio, sr = sf.read(str(path), dtype="float32", always_2d=True)
    mono = audio.mean(axis=1)
    pieces = []
    for i in range(0, len(mono), sr):
        seg = mono[i : i + sr]
        if len(seg) < sr // 10:  # drop a sliver shorter than 0.1 s
            break
        pieces.append(base64.b64encode(wav_bytes(seg, sr)).decode())
        if len(pieces) >= max_pieces:
            break
    return pieces


def make_specs(
    items: Sequence[DailyOmniItem],
    pack: str = "video",
    input_mode: str = "all",
    audio_style: str = "input_audio",
    max_pairs: int = 64,
    transport: str = "data",
) -> list[RequestSpec]:
    return [
        RequestSpec(
            item_id=it.qid,
            messages=item_messages(it, pack, input_mode, audio_style, max_pairs,
                                   transport=transport),
            answer=it.answer,
            meta=it.meta,
        )
        for it in items
    ]


# ----------------------------------------------------------------------------- synthetic set

_SYN_TYPES = ("AV Event Alignment", "Event Sequence", "Context understanding",
              "Inference", "Reasoning", "Comparative")


def make_synthetic_daily_omni(
    root: str | os.PathLike,
    num_videos: int = 20,
    durations: Sequence[float] = (30.0, 60.0),
    seed: int = 0,
    size: tuple[int, int] = (448, 448),
    fps: int = 5,
    sample_rate: int = 16000,
    overwrite: bool = False,
    workers: int = 1,
) -> Path:
    """Write `num_videos` generated clips and a qa.json in the Daily-Omni layout under `root`.

    Clip i lasts durations[i % len(durations)] seconds. Video: a bright square moving over a
    drifting colour gradient (h264, `size` = (width, height), `fps`). Audio: a tone whose pitch
    changes every second plus a little noise (mono wav at `sample_rate`). Everything follows from
    `seed` (the clips do not depend on `workers`). Existing clips are kept unless `overwrite`.
    """
    root = Path(root)
    vdir = root / "Videos"
    vdir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    qa: list[dict[str, Any]] = []
    jobs: list[tuple[Path, Path, float, int]] = []
    for i in range(num_videos):
        dur = float(durations[i % len(durations)])
        vid = f"syn{seed:03d}_{i:04d}"
        vpath, apath = media_paths(vdir, vid)
        vpath.parent.mkdir(parents=True, exist_ok=True)
        clip_seed = int(rng.integers(0, 2**31 - 1))
        if overwrite or not (vpath.exists() and apath.exists()):
            jobs.append((vpath, apath, dur, clip_seed))
        answer = LETTERS[int(rng.integers(0, 4))]
        qa.append(
            {
                "Question": f"What does the moving square do in synthetic clip {i}?",
                "Choice": [f"{L}. option {L.lower()} for clip {i}" for L in LETTERS],
                "Answer": answer,
                "video_id": vid,
                "Type": _SYN_TYPES[i % len(_SYN_TYPES)],
                "video_duration": f"{dur:g}s",
                "video_category": "synthetic",
            }
        )
    args = [(v, a, d, s, size, fps, sample_rate) for v, a, d, s in jobs]
    if workers > 1 and len(args) > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=min(workers, len(args))) as pool:
            list(pool.map(_write_clip, args))
    else:
        for a in args:
            _write_clip(a)
    with open(root / "qa.json", "w", encoding="utf-8") as f:
        json.dump(qa, f, indent=1)
    return root


def _write_clip(job: tuple[Path, Path, float, int, tuple[int, int], int, int]) -> None:
    vpath, apath, dur, clip_seed, size, fps, sample_rate = job
    # write under temporary names so an interrupted run never leaves a truncated clip behind
    vtmp, atmp = vpath.with_suffix(".part.mp4"), apath.with_suffix(".part.wav")
    write_synthetic_video(vtmp, dur, size, fps, clip_seed)
    write_synthetic_audio(atmp, dur, sample_rate, clip_seed)
    os.replace(vtmp, vpath)
    os.replace(atmp, apath)


def write_synthetic_video(path: Path, seconds: float, size: tuple[int, int], fps: int,
                          seed: int) -> None:
    import av

    w, h = size
    w, h = w - w % 2, h - h % 2  # yuv420p needs even sides
    rng = np.random.default_rng(seed)
    base = rng.uniform(0, 255, size=3)
    vel = rng.uniform(-1, 1, size=2)
    side = max(4, min(w, h) // 6)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    ramp = 0.02 * (xx + yy)
    sin_r, cos_r = np.sin(ramp), np.cos(ramp)  # sin(r + p) = sin r cos p + cos r sin p
    n = int(round(seconds * fps))
    with av.open(str(path), mode="w") as out:
        codec = "libx264"
        try:
            stream = out.add_stream(codec, rate=fps)
        except Exception:  # noqa: BLE001 - some FFmpeg builds lack x264
            stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        if stream.codec_context.name == "libx264":
            stream.options = {"preset": "veryfast"}
        for k in range(n):
            t = k / fps
            img = np.empty((h, w, 3), dtype=np.float32)
            for c in range(3):
                p = t * (c + 1)
                img[..., c] = base[c] + 40 * (sin_r * np.cos(p) + cos_r * np.sin(p))
            np.clip(img, 0, 255, out=img)
            cx = int((0.5 + 0.4 * np.sin(vel[0] * t + seed)) * (w - side))
            cy = int((0.5 + 0.4 * np.cos(vel[1] * t + seed)) * (h - side))
            img[cy : cy + side, cx : cx + side] = 255.0
            frame = av.VideoFrame.from_ndarray(img.astype(np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def write_synthetic_audio(path: Path, seconds: float, sample_rate: int, seed: int) -> None:
    import soundfile as sf

    rng = np.random.default_rng(seed + 1)
    n = int(round(seconds * sample_rate))
    per_s = rng.uniform(150.0, 900.0, size=int(np.ceil(seconds)) + 1)
    t = np.arange(n) / sample_rate
    freq = per_s[(t // 1.0).astype(int)]
    phase = 2 * np.pi * np.cumsum(freq) / sample_rate
    x = 0.3 * np.sin(phase) + 0.02 * rng.standard_normal(n)
    sf.write(str(path), x.astype(np.float32), sample_rate, subtype="PCM_16")

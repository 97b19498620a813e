"""Processor: OpenAI-style messages with raw media bytes -> ThinkerRequest.

Stages per request:
1. normalize messages: content is a string or a list of parts, each a string, a
   `MediaBytes(kind, data)` or a dict {"type": "text", "text"} / {"type": kind, "data": bytes}
2. check byte sizes, decode and process each media part (image.py / audio.py / video.py)
3. count vision items (images + video frames) against `max_images`
4. build the ChatML prompt (template.py), check `max_prompt_tokens`
5. wrap everything into a ThinkerRequest (handoff.py)
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from pipeline.config import ThinkerConfig
from pipeline.handoff import SamplingParams, ThinkerRequest
from pipeline.processing.audio import clip_num_tokens, decode_audio, process_audio
from pipeline.processing.errors import (
    InvalidMessageError,
    MediaTooLargeError,
    PromptTooLongError,
    TooManyFramesError,
)
from pipeline.processing.image import decode_image, image_content_hash, process_image
from pipeline.processing.template import (
    ROLES,
    AudioPart,
    ImagePart,
    Message,
    OmniPart,
    Part,
    TextPart,
    build_prompt,
)
from pipeline.processing.video import decode_video, pack_omni

MEDIA_KINDS = ("image", "audio", "video")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class MediaLimits:
    """Input limits; each violation raises a typed MediaError naming the limit."""

    max_media_bytes: int = 64 * 1024 * 1024  # per media part, before decoding
    max_image_pixels: int = 4096 * 4096  # per image / video frame, from the header
    max_images: int = 128  # images + video frames in one request
    max_video_frames: int = 64  # frames sampled per video (longer videos are subsampled)
    max_video_seconds: float = 600.0
    max_audio_seconds: float = 600.0  # per audio part
    max_prompt_tokens: int = 32768  # after expanding every placeholder

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"MediaLimits.{name} must be > 0, got {value}")


@dataclass(frozen=True)
class MediaBytes:
    """A raw media part. max_slice_nums overrides the image slicing cap (images only)."""

    kind: str
    data: bytes
    max_slice_nums: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in MEDIA_KINDS:
            raise InvalidMessageError(f"media kind {self.kind!r} is not one of {MEDIA_KINDS}")


@dataclass(frozen=True)
class _ImageOptions:
    max_slice_nums: int | None = None
    use_image_id: bool | None = None


class Processor:
    """Turns chat messages into ThinkerRequests for one model (see module docstring).

    chunked_audio: audio parts use one placeholder group per 1 s (streaming / omni layout)
                   instead of one group per clip (plain chat default).
    merge_video_audio: a video's audio track is one clip instead of one clip per second
                   (see `pack_omni`).
    decode_workers: threads that decode one message's media parts side by side (video and
                   audio decoding, resizing and log-mel release the GIL); 1 = in order, inline.
    """

    def __init__(
        self,
        thinker_cfg: ThinkerConfig,
        tokenizer: Tokenizer,
        limits: MediaLimits = MediaLimits(),
        *,
        chunked_audio: bool = False,
        merge_video_audio: bool = False,
        decode_workers: int = 4,
    ):
        self.cfg = thinker_cfg
        self.tokenizer = tokenizer
        self.limits = limits
        self.chunked_audio = chunked_audio
        self.merge_video_audio = merge_video_audio
        self.decode_workers = decode_workers
        self._pool: ThreadPoolExecutor | None = None  # made on first use

    def build(
        self,
        messages: list[dict[str, Any]] | list[Message],
        *,
        speech_output: bool = False,
        sampling: SamplingParams | None = None,
        request_id: str = "",
        enable_thinking: bool = False,
        max_slice_nums: int | None = None,
        use_image_id: bool | None = None,
    ) -> ThinkerRequest:
        """Messages -> ThinkerRequest.

        speech_output:   end the prompt with <|tts_bos|> and ask for spoken-span hidden states
        max_slice_nums / use_image_id: request-wide image options (vLLM's mm_processor_kwargs;
            Daily-Omni's interleaved frames use 1 / False); a part's own max_slice_nums wins
        """
        # Refuse on the raw image count first so nothing is decoded for a hopeless request.
        self._check_vision_count(sum(_count_raw_images(m) for m in messages))
        opts = _ImageOptions(max_slice_nums, use_image_id)
        decoded = [self._message(i, m, opts) for i, m in enumerate(messages)]
        self._check_vision_count(sum(_count_vision(m) for m in decoded))
        prompt = build_prompt(
            decoded,
            self.cfg.tokens,
            self.tokenizer.encode,
            query_num=self.cfg.query_num,
            enable_thinking=enable_thinking,
            use_tts_template=speech_output,
        )
        if len(prompt.input_ids) > self.limits.max_prompt_tokens:
            raise PromptTooLongError(
                f"prompt is {len(prompt.input_ids)} tokens after expanding media, over the "
                f"limit of {self.limits.max_prompt_tokens} tokens"
            )
        return ThinkerRequest(
            request_id=request_id,
            input_ids=prompt.input_ids,
            images=prompt.images,
            image_bounds=prompt.image_bounds,
            audios=prompt.audios,
            audio_bounds=prompt.audio_bounds,
            audio_segments=prompt.audio_segments,
            sampling=sampling if sampling is not None else SamplingParams(),
            return_hidden=speech_output,
        )

    def _check_vision_count(self, n: int) -> None:
        if n > self.limits.max_images:
            raise TooManyFramesError(
                f"request has {n} images + video frames, over the limit of {self.limits.max_images}"
            )

    # -- message normalization ---------------------------------------------------------

    def _message(self, i: int, m: dict[str, Any] | Message, opts: _ImageOptions) -> Message:
        if isinstance(m, Message):
            role, content = m.role, m.content
        elif isinstance(m, dict) and "role" in m:
            role, content = m["role"], m.get("content", "")
        else:
            raise InvalidMessageError(f"message {i} must be a dict with 'role' and 'content'")
        if role not in ROLES:  # before any media is decoded
            raise InvalidMessageError(f"message {i}: role {role!r} is not one of {ROLES}")
        if content is None:
            content = ""
        if isinstance(content, str):
            return Message(role, content)
        if not isinstance(content, list):
            raise InvalidMessageError(
                f"message {i}: content must be a string or a list, got {type(content).__name__}"
            )
        if self.decode_workers <= 1 or sum(not isinstance(p, str) for p in content) < 2:
            return Message(role, [self._part(i, j, p, opts) for j, p in enumerate(content)])
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.decode_workers, thread_name_prefix="decode")
        futures = [self._pool.submit(self._part, i, j, p, opts) for j, p in enumerate(content)]
        return Message(role, [f.result() for f in futures])  # the first bad part raises

    def _part(self, i: int, j: int, p: Any, opts: _ImageOptions) -> Part:
        if isinstance(p, (TextPart, ImagePart, AudioPart, OmniPart)):
            return p  # already decoded
        if isinstance(p, str):
            return TextPart(p)
        if isinstance(p, dict):
            kind = p.get("type")
            if kind == "text":
                return TextPart(str(p.get("text", "")))
            if kind in MEDIA_KINDS and isinstance(p.get("data"), (bytes, bytearray)):
                p = MediaBytes(kind, bytes(p["data"]), p.get("max_slice_nums"))
            else:
                raise InvalidMessageError(
                    f"message {i} part {j}: expected type text/image/audio/video with "
                    f"'text' or bytes 'data', got type {kind!r}"
                )
        if not isinstance(p, MediaBytes):
            raise InvalidMessageError(
                f"message {i} part {j}: unsupported content part {type(p).__name__}"
            )
        lim = self.limits
        if len(p.data) > lim.max_media_bytes:
            raise MediaTooLargeError(
                f"message {i} part {j}: {p.kind} is {len(p.data)} bytes, over the limit of "
                f"{lim.max_media_bytes} bytes"
            )
        if p.kind == "image":
            return self._image(p, opts)
        if p.kind == "audio":
            clip = process_audio(decode_audio(p.data, max_seconds=lim.max_audio_seconds))
            return AudioPart(clip, clip_num_tokens(clip), chunked=self.chunked_audio)
        video = decode_video(
            p.data,
            max_frames=lim.max_video_frames,
            max_seconds=lim.max_video_seconds,
            max_pixels=lim.max_image_pixels,
        )
        base = hashlib.sha256(p.data).hexdigest()
        return pack_omni(video, self.cfg.slicing, base, merge_audio=self.merge_video_audio)

    def _image(self, p: MediaBytes, opts: _ImageOptions) -> ImagePart:
        slicing = self.cfg.slicing
        max_slices = next(
            int(v)
            for v in (p.max_slice_nums, opts.max_slice_nums, slicing.max_slice_nums)
            if v is not None
        )
        if not 1 <= max_slices <= slicing.max_slice_nums:
            raise InvalidMessageError(
                f"max_slice_nums must be in [1, {slicing.max_slice_nums}], got {max_slices}"
            )
        img = decode_image(p.data, max_pixels=self.limits.max_image_pixels)
        content_hash = image_content_hash(p.data, slicing, max_slices)
        processed = process_image(img, slicing, content_hash, max_slice_nums=max_slices)
        use_id = self.cfg.use_image_id if opts.use_image_id is None else opts.use_image_id
        return ImagePart(processed, use_image_id=use_id)


def _count_vision(m: Message) -> int:
    if isinstance(m.content, str):
        return 0
    n = 0
    for p in m.content:
        if isinstance(p, ImagePart):
            n += 1
        elif isinstance(p, OmniPart):
            n += sum(isinstance(q, ImagePart) for q in p.parts)
    return n


def _count_raw_images(m: Any) -> int:
    content = (
        m.content if isinstance(m, Message) else m.get("content") if isinstance(m, dict) else None
    )
    if not isinstance(content, list):
        return 0
    n = 0
    for p in content:
        kind = (
            p.kind if isinstance(p, MediaBytes) else p.get("type") if isinstance(p, dict) else None
        )
        n += kind == "image" or isinstance(p, ImagePart)
    return n

"""Processor: OpenAI-style messages with raw media bytes -> ThinkerRequest.

Stages per request (each check before the costlier stage it protects):
1. normalize messages: content is a string or a list of parts, each a string, a
   `MediaBytes(kind, data)` or a dict {"type": "text", "text"} / {"type": kind, "data": bytes};
   check roles, part shapes, text validity (no lone surrogates) and media byte sizes
2. count the prompt before decoding anything (`count_prompt_tokens`): the text runs with an
   early-stopping counter, each image from its header, audio / video at their minimum;
   a lower bound, so over `max_prompt_tokens` is a refusal nothing later could undo
3. decode and process each media part (image.py / audio.py / video.py), or take it from
   the MediaCache when the same bytes were processed with the same options before
4. count vision items (images + video frames) against `max_images`
5. build the ChatML prompt (template.py), check `max_prompt_tokens` exactly
6. wrap everything into a ThinkerRequest (handoff.py)

Special-token strings typed in text (`<|im_start|>`, `<image>`, `<unk>`...) are encoded as
plain text unless `special_tokens_in_text=True`: the template inserts every real special
token as an id, so only client text goes through the tokenizer.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from pipeline.config import ThinkerConfig
from pipeline.handoff import AudioInput, ImageInput, SamplingParams, ThinkerRequest
from pipeline.processing.audio import clip_num_tokens, decode_audio, process_audio
from pipeline.processing.errors import (
    InvalidMessageError,
    MediaTooLargeError,
    PromptTooLongError,
    TooManyFramesError,
)
from pipeline.processing.image import (
    MAX_ASPECT_RATIO,
    ProcessedImage,
    decode_image,
    get_sliced_grid,
    image_content_hash,
    open_image,
    process_image,
)
from pipeline.processing.media_cache import MediaCache
from pipeline.processing.template import (
    ROLES,
    AudioPart,
    ImagePart,
    MediaStub,
    Message,
    OmniPart,
    Part,
    TextPart,
    build_prompt,
    count_prompt_tokens,
    spoken_banned_ids,
)
from pipeline.processing.video import HANDOFF_FRAMES, decode_video, frame_parts, pack_omni

MEDIA_KINDS = ("image", "audio", "video")
T = TypeVar("T")
# a request's media before the whole request is decoded: a video's frames, an audio clip
OnMedia = Callable[[list[ImageInput | AudioInput]], None]


class Tokenizer(Protocol):
    """What the Processor needs (pipeline.tokenizer.TextTokenizer).

    special_tokens: whether special-token strings in the text become their ids.
    count: len(encode(text)) when <= limit, else any lower bound of it that is > limit."""

    def encode(self, text: str, *, special_tokens: bool = True) -> list[int]: ...

    def count(self, text: str, limit: int, *, special_tokens: bool = True) -> int: ...


@dataclass(frozen=True)
class MediaLimits:
    """Input limits; each violation raises a typed MediaError naming the limit."""

    max_media_bytes: int = 64 * 1024 * 1024  # per media part, before decoding
    max_image_pixels: int = 4096 * 4096  # per image / video frame, from the header
    # longest side / shortest side per image / video frame, from the header
    max_image_aspect_ratio: float = MAX_ASPECT_RATIO
    max_images: int = 128  # images + video frames in one request
    max_video_frames: int = 64  # frames sampled per video (longer videos are subsampled)
    max_video_seconds: float = 600.0
    max_audio_seconds: float = 600.0  # per audio part
    max_prompt_tokens: int = 32768  # after expanding every placeholder

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"MediaLimits.{name} must be > 0, got {value}")
        if self.max_image_aspect_ratio < 1:
            raise ValueError(
                "MediaLimits.max_image_aspect_ratio must be >= 1, got "
                f"{self.max_image_aspect_ratio}"
            )


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

    chunked_audio: audio parts use one placeholder group per 1 s instead of one group per
                   clip (plain chat default), and content parts are joined with "" instead
                   of "\n": the reference's `chat(stream_input=True)` layout.
    merge_video_audio: a video's audio track is one clip instead of one clip per second
                   (see `pack_omni`).
    decode_workers: threads that decode one message's media parts side by side (video and
                   audio decoding, resizing and log-mel release the GIL); 1 = in order, inline.
    special_tokens_in_text: special-token strings typed in message text become those
                   tokens, as the reference chat template does. Off by default: any client
                   could otherwise close its turn and open a system one (`<|im_end|>
                   <|im_start|>system`) or forge media slots (`<image>`, `<unk>`); on only
                   for trusted deployments.
    media_cache:   processed media by content hash and options (see `_cached`), so a
                   follow-up turn that re-sends a video does not decode it again; None = off.
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
        special_tokens_in_text: bool = False,
        media_cache: MediaCache | None = None,
    ):
        self.cfg = thinker_cfg
        self.tokenizer = tokenizer
        self.limits = limits
        self.chunked_audio = chunked_audio
        self.merge_video_audio = merge_video_audio
        self.decode_workers = decode_workers
        self.special_tokens_in_text = special_tokens_in_text
        self._encode = functools.partial(tokenizer.encode, special_tokens=special_tokens_in_text)
        self._count = functools.partial(tokenizer.count, special_tokens=special_tokens_in_text)
        self._pool: ThreadPoolExecutor | None = None  # made on first use
        self._pool_lock = threading.Lock()  # builds run on several ingress threads at once
        vocab, bad = getattr(tokenizer, "vocab", {}), getattr(tokenizer, "bad_token_ids", ())
        self._spoken_banned = spoken_banned_ids(vocab, thinker_cfg.tokens.unk, bad)
        self.media_cache = media_cache
        # Every Processor-wide input of the decoders: the limits (frame count, durations and
        # sizes: they pick frames or refuse), the slicing geometry, the video audio layout.
        # Options applied after decoding (chunked_audio, use_image_id) are not in the key.
        self._cache_options = (limits, thinker_cfg.slicing, merge_video_audio)

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
        on_media: OnMedia | None = None,
        frames_while_decoding: bool = True,
    ) -> ThinkerRequest:
        """Messages -> ThinkerRequest.

        speech_output:   ask for spoken-span hidden states and ban what the reference bans while
                         speaking (template.spoken_banned_ids); every prompt ends with
                         <|tts_bos|>, as the reference's streamed decode starts (template.py)
        max_slice_nums / use_image_id: request-wide image options (vLLM's mm_processor_kwargs;
            Daily-Omni's interleaved frames use 1 / False); a part's own max_slice_nums wins
        on_media:        called (on decode threads) with media as the request will hold them,
                         while something of the request still decodes, so their encoding may
                         start before this returns: a video's frames, a few at a time as they
                         are decoded (while its later frames, its audio track or other media
                         parts still decode), and an audio part's clip (while another part
                         still decodes)
        frames_while_decoding: False = a video's frames go only once all are decoded (when
                         something else of the request still decodes), not a few at a time
        """
        # Refuse on the raw image count first so nothing is decoded for a hopeless request.
        self._check_vision_count(sum(_count_raw_images(m) for m in messages))
        opts = _ImageOptions(max_slice_nums, use_image_id)
        raw = [self._normalize(i, m) for i, m in enumerate(messages)]
        self._check_prompt_bound(raw, opts, enable_thinking)
        handoff = None
        if on_media is not None:
            parts = sum(isinstance(p, MediaBytes) for m in raw if not isinstance(m.content, str)
                        for p in m.content)
            handoff = _MediaHandoff(on_media, parts,
                                    HANDOFF_FRAMES if frames_while_decoding else 0)
        decoded = [self._decode_message(m, opts, handoff) for m in raw]
        self._check_vision_count(sum(_count_vision(m) for m in decoded))
        prompt = build_prompt(
            decoded,
            self.cfg.tokens,
            self._encode,
            query_num=self.cfg.query_num,
            enable_thinking=enable_thinking,
            use_tts_template=True,
            stream_input=self.chunked_audio,
        )
        # The exact check: the bound above counted audio and video at their minimum.
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
            sampling=self._sampling(sampling, speech_output),
            return_hidden=speech_output,
        )

    def _sampling(self, sampling: SamplingParams | None, speech_output: bool) -> SamplingParams:
        sampling = sampling if sampling is not None else SamplingParams()
        if not speech_output:
            return sampling
        return replace(sampling, banned_ids=sampling.banned_ids + self._spoken_banned)

    def _check_vision_count(self, n: int) -> None:
        if n > self.limits.max_images:
            raise TooManyFramesError(
                f"request has {n} images + video frames, over the limit of {self.limits.max_images}"
            )

    def _check_prompt_bound(
        self, raw: list[Message], opts: _ImageOptions, enable_thinking: bool
    ) -> None:
        """Refuse before any tokenizing of megabytes or media decoding when even a lower
        bound of the prompt's length is over max_prompt_tokens. The bound is exact for
        text (the template's own runs, counted up to the limit) and images (grid from the
        header); audio and video count as their smallest placeholder."""
        limit = self.limits.max_prompt_tokens
        stubbed = [
            m
            if isinstance(m.content, str)
            else Message(
                m.role, [self._stub(p, opts) if isinstance(p, MediaBytes) else p for p in m.content]
            )
            for m in raw
        ]
        n = count_prompt_tokens(
            stubbed,
            self.cfg.tokens,
            self._count,
            limit=limit,
            query_num=self.cfg.query_num,
            enable_thinking=enable_thinking,
            use_tts_template=True,
            stream_input=self.chunked_audio,
        )
        if n > limit:
            raise PromptTooLongError(
                f"prompt is at least {n} tokens (counted before decoding media), over the "
                f"limit of {limit} tokens"
            )

    def _stub(self, p: MediaBytes, opts: _ImageOptions) -> MediaStub:
        """A lower bound of the part's placeholder tokens, from the bytes without decoding."""
        slot = self.cfg.query_num + 2  # <image> / <slice>, query_num <unk>, closing token
        if p.kind == "audio":  # >= 1 token (short clips are padded), between two specials
            return MediaStub("audio", 3)
        if p.kind == "video":  # >= 1 frame: one unsliced image without an id
            return MediaStub("video", slot)
        lim = self.limits
        img = open_image(
            p.data, max_pixels=lim.max_image_pixels, max_aspect_ratio=lim.max_image_aspect_ratio
        )
        res = self.cfg.slicing.scale_resolution
        grid = get_sliced_grid(img.size, self._max_slices(p, opts), res)
        n = slot
        if grid is not None:  # slices, plus a "\n" run (>= 1 token) between grid rows
            cols, rows = grid
            n += cols * rows * slot + rows - 1
        if self._use_image_id(opts):  # <image_id>, the index (>= 1 token), </image_id>
            n += 3
        return MediaStub("image", n)

    # -- message normalization ---------------------------------------------------------

    def _normalize(self, i: int, m: dict[str, Any] | Message) -> Message:
        """Check a message's shape and text; media stay undecoded `MediaBytes`."""
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
            _check_text(content, f"message {i}")
            return Message(role, content)
        if not isinstance(content, list):
            raise InvalidMessageError(
                f"message {i}: content must be a string or a list, got {type(content).__name__}"
            )
        return Message(role, [self._normalize_part(i, j, p) for j, p in enumerate(content)])

    def _normalize_part(self, i: int, j: int, p: Any) -> Part | MediaBytes:
        if isinstance(p, (ImagePart, AudioPart, OmniPart)):
            return p  # already decoded
        if isinstance(p, TextPart):
            _check_text(p.text, f"message {i} part {j}")
            return p
        if isinstance(p, str):
            _check_text(p, f"message {i} part {j}")
            return TextPart(p)
        if isinstance(p, dict):
            kind = p.get("type")
            if kind == "text":
                text = str(p.get("text", ""))
                _check_text(text, f"message {i} part {j}")
                return TextPart(text)
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
        if len(p.data) > self.limits.max_media_bytes:
            raise MediaTooLargeError(
                f"message {i} part {j}: {p.kind} is {len(p.data)} bytes, over the limit of "
                f"{self.limits.max_media_bytes} bytes"
            )
        return p

    # -- media decoding ----------------------------------------------------------------

    def _decode_message(
        self, m: Message, opts: _ImageOptions, handoff: _MediaHandoff | None = None
    ) -> Message:
        if isinstance(m.content, str):
            return m
        content = m.content
        if self.decode_workers <= 1 or sum(isinstance(p, MediaBytes) for p in content) < 2:
            return Message(m.role, [self._decode(p, opts, handoff) for p in content])
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.decode_workers, thread_name_prefix="decode")
        futures = [self._pool.submit(self._decode, p, opts, handoff) for p in content]
        return Message(m.role, [f.result() for f in futures])  # the first bad part raises

    def _decode(
        self, p: Part | MediaBytes, opts: _ImageOptions, handoff: _MediaHandoff | None = None
    ) -> Part:
        if not isinstance(p, MediaBytes):
            return p
        try:
            part = self._decode_media(p, opts, handoff)
            if handoff is not None and isinstance(part, AudioPart):
                handoff.send([part.clip], pending=False)
            return part
        finally:
            if handoff is not None:
                handoff.part_done()

    def _decode_media(
        self, p: MediaBytes, opts: _ImageOptions, handoff: _MediaHandoff | None
    ) -> Part:
        if p.kind == "image":
            return self._image(p, opts)
        if p.kind == "audio":
            clip = self._cached(p, lambda: self._audio(p))
            return AudioPart(clip, clip_num_tokens(clip), chunked=self.chunked_audio)
        digest = hashlib.sha256(p.data).hexdigest()  # also the frames' encoder-cache base
        return self._cached(p, lambda: self._video(p, digest, handoff), digest=digest)

    def _cached(
        self, p: MediaBytes, build: Callable[[], T], *options: Hashable, digest: str = ""
    ) -> T:
        """build(), or a copy of what it returned for the same bytes and options before.
        The key: kind, the bytes' sha256, the Processor-wide decoder inputs and the part's
        own (`options`: an image's max_slice_nums). A refusal raises and is not stored."""
        if self.media_cache is None or not self.media_cache.enabled:
            return build()
        digest = digest or hashlib.sha256(p.data).hexdigest()
        key = (p.kind, digest, self._cache_options, options)
        return self.media_cache.get_or_build(key, build)

    def _audio(self, p: MediaBytes) -> AudioInput:
        return process_audio(decode_audio(p.data, max_seconds=self.limits.max_audio_seconds))

    def _video(
        self, p: MediaBytes, digest: str, handoff: _MediaHandoff | None = None
    ) -> OmniPart:
        lim = self.limits
        early: dict[int, ImagePart] = {}  # the frames' parts by pick, made as they decode

        def frames_ready(picks: list[int], frames: list, timestamps: list[float],
                         pending: bool) -> None:
            parts = frame_parts(frames, timestamps, self.cfg.slicing, digest)
            early.update(zip(picks, parts, strict=True))
            assert handoff is not None
            handoff.send([part.image.image for part in parts], pending)

        video = decode_video(
            p.data,
            max_frames=lim.max_video_frames,
            max_seconds=lim.max_video_seconds,
            max_pixels=lim.max_image_pixels,
            max_aspect_ratio=lim.max_image_aspect_ratio,
            on_frames=None if handoff is None else frames_ready,
            handoff_frames=0 if handoff is None else handoff.chunk,
        )
        frames = [early[i] for i in sorted(early)] or None
        if video.redecoded:  # the frames handed over may not be these: key these apart
            digest, frames = f"{digest}|redecoded", None
        assert frames is None or len(frames) == video.num_frames
        return pack_omni(
            video, self.cfg.slicing, digest, merge_audio=self.merge_video_audio, frames=frames
        )

    def _max_slices(self, p: MediaBytes, opts: _ImageOptions) -> int:
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
        return max_slices

    def _use_image_id(self, opts: _ImageOptions) -> bool:
        return self.cfg.use_image_id if opts.use_image_id is None else opts.use_image_id

    def _image(self, p: MediaBytes, opts: _ImageOptions) -> ImagePart:
        max_slices = self._max_slices(p, opts)
        processed = self._cached(p, lambda: self._slice_image(p, max_slices), max_slices)
        return ImagePart(processed, use_image_id=self._use_image_id(opts))

    def _slice_image(self, p: MediaBytes, max_slices: int) -> ProcessedImage:
        lim = self.limits
        img = decode_image(
            p.data, max_pixels=lim.max_image_pixels, max_aspect_ratio=lim.max_image_aspect_ratio
        )
        content_hash = image_content_hash(p.data, self.cfg.slicing, max_slices)
        return process_image(img, self.cfg.slicing, content_hash, max_slice_nums=max_slices)


class _MediaHandoff:
    """One request's media to `on_media`, when they are ready while something of the request
    still decodes: a video's frames while its later frames, its own audio track or another
    media part decode; an audio part's clip while another part decodes (side by side, or
    after this one). What is ready last, with nothing of the request left to decode, goes with
    the request only."""

    def __init__(self, on_media: OnMedia, parts: int, chunk: int):
        self.on_media = on_media
        self.chunk = chunk  # frames a call while later ones decode (0: none)
        self._left = parts  # media parts not decoded yet
        self._lock = threading.Lock()

    def part_done(self) -> None:
        with self._lock:
            self._left -= 1

    def send(self, items: list[ImageInput | AudioInput], pending: bool) -> None:
        """items of one part; pending: more of that part is still to come."""
        with self._lock:
            others = self._left > 1  # the sending part is one of them
        if pending or others:
            self.on_media(items)


def _check_text(text: str, where: str) -> None:
    """Refuse text the tokenizer cannot take: a lone UTF-16 surrogate (JSON "\\ud800"
    parses into one) is not encodable as UTF-8."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidMessageError(
            f"{where}: text holds a lone surrogate U+{ord(text[e.start]):04X} at character "
            f"{e.start}; text must be valid Unicode (a JSON \\u escape of a surrogate needs "
            f"its pair)"
        ) from None


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

"""Typed messages between the processing step and the stages.

Ingress (processing) -> Thinker:   ThinkerRequest (token ids + media tensors + sampling)
Thinker -> caller, every step:     ThinkerDelta (new ids, text, spoken-span hidden states)
Thinker -> Talker:                 SpokenChunk (spoken ids + their hidden states), on a
                                   stream opened with a TalkerSpec (mode, seed, limits)
Talker -> Code2Wav:                CodeChunk (speech codes, in order)
Code2Wav -> caller:                PcmChunk (24 kHz float32 PCM)
Any stage -> downstream:           StageFailure (the stage cannot serve the turn)

The outputs of a stage's `step()` (ThinkerDelta, CodeChunk, PcmChunk) all name their
stream (`request_id`) and say whether it is the stream's last (`finished`): see
pipeline/stage_engine.py.

Tensors here are CPU tensors; the engines move them to their device. ImageInput and
AudioInput pickle their tensors as numpy arrays, which Ray moves out of band and maps
zero-copy on the other side (a torch tensor is pickled through `torch.save` bytes: for a
30 s clip's 18 MB of pixels that was ~4x slower through the object store).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _tensor(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # a zero-copy view of Ray's object store is read-only
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a)


def _image_input(pixels: list[np.ndarray], tgt_sizes: np.ndarray, content_hash: str) -> ImageInput:
    return ImageInput([_tensor(a) for a in pixels], _tensor(tgt_sizes), content_hash)


def _audio_input(features: np.ndarray, content_hash: str) -> AudioInput:
    return AudioInput(_tensor(features), content_hash)


GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS


@dataclass(frozen=True)
class SamplingParams:
    """Thinker sampling. temperature 0 means greedy (the vLLM stage-0 default); so does any
    temperature below GREEDY_BELOW, as in vLLM: dividing logits by it would overflow to inf,
    and the distribution it asks for is the argmax anyway."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    repetition_penalty: float = 1.0
    # The penalty sees generated ids only: those of the reference's earlier 10-token decode
    # chunks, at most this many, plus the current chunk's (engine.sampling.penalty_history).
    # None: every generated id (the reference's offline chat(), HF generate on embeddings).
    repetition_window: int | None = 128
    max_tokens: int = 512
    stop_ids: tuple[int, ...] = (151704, 151645)
    ignore_eos: bool = False  # fixed-length benchmark mode: run exactly max_tokens
    seed: int | None = None
    # Ids whose logits are set to -inf before anything else, at every step (greedy rows
    # too): the reference's streaming decode bans the tokenizer's punctuation list and
    # `bad_token_ids` while it speaks (`ChunkPrefillChunkGenerate.chunk_generate`;
    # processing.template.spoken_banned_ids). Stored sorted and de-duplicated.
    banned_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.repetition_window is not None and self.repetition_window < 1:
            raise ValueError(
                f"repetition_window must be >= 1 or None, got {self.repetition_window}"
            )
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63 - 1], got {self.seed}")
        if not all(isinstance(i, int) and i >= 0 for i in self.banned_ids):
            raise ValueError("banned_ids must be token ids (ints >= 0)")
        # frozen: normalized once, here
        object.__setattr__(self, "banned_ids", tuple(sorted(set(self.banned_ids))))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass
class ImageInput:
    """One image (or video frame) after slicing: every slice is one vision sequence.

    pixel_values: list of (3, patch, patch * L_i) uint8 tensors, NaViT patch strips (the
                  encoder normalizes them: processing.image.normalize_pixels); float strips
                  are taken as already normalized
    tgt_sizes:    (num_slices, 2) int tensor, patch grid (h, w) of each slice
    content_hash: hash of the source bytes + slicing options, for the encoder cache
    """

    pixel_values: list[torch.Tensor]
    tgt_sizes: torch.Tensor
    content_hash: str

    @property
    def num_slices(self) -> int:
        return len(self.pixel_values)

    def __reduce__(self):
        return _image_input, (
            [_numpy(t) for t in self.pixel_values],
            _numpy(self.tgt_sizes),
            self.content_hash,
        )


@dataclass
class AudioInput:
    """One audio clip as log-mel features.

    features:     (num_mel_bins, frames) float tensor, 100 frames/s, last frame dropped
    content_hash: hash of the samples, for the encoder cache
    """

    features: torch.Tensor
    content_hash: str

    @property
    def num_frames(self) -> int:
        return int(self.features.shape[-1])

    def __reduce__(self):
        return _audio_input, (_numpy(self.features), self.content_hash)


@dataclass
class ThinkerRequest:
    """A fully processed prompt.

    input_ids has one `<unk>` per multimodal embedding; `image_bounds` / `audio_bounds`
    are (start, end) index pairs into input_ids, one per image slice / audio clip
    segment, in prompt order, each spanning exactly the slots its embeddings fill.
    `images[i]` yields `images[i].num_slices` consecutive image bounds.
    `audio_segments` maps each audio bound to (clip index, first token, num tokens)
    within that clip's pooled embeddings.
    """

    request_id: str
    input_ids: list[int]
    images: list[ImageInput] = field(default_factory=list)
    image_bounds: list[tuple[int, int]] = field(default_factory=list)
    audios: list[AudioInput] = field(default_factory=list)
    audio_bounds: list[tuple[int, int]] = field(default_factory=list)
    audio_segments: list[tuple[int, int, int]] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_hidden: bool = False  # emit hidden states of the spoken span for the Talker
    # > 0: once this many spoken rows are out (the Talker's first text chunk), the request
    # decodes only beside other work until `resume` (its turn's first audio is out) or
    # HOLD_LIMIT_S: its next tokens are not needed for the first audio, and on a GPU the
    # stages share they would slow the Talker and Code2Wav that make it. 0 = no hold.
    hold_after_spoken: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def media_bytes(self) -> int:
        """Bytes of the images' pixels and the audio clips' features it carries."""
        pixels = sum(t.nbytes for im in self.images for t in im.pixel_values)
        return pixels + sum(a.features.nbytes for a in self.audios)


@dataclass
class ThinkerDelta:
    """What one engine step produced for one request.

    token_ids:     new token ids (usually one)
    text:          decoded text delta (may be empty while a UTF-8 char is incomplete)
    spoken_ids:    ids of the spoken span (after <|tts_bos|>) fed at this step
    spoken_hidden: (len(spoken_ids), hidden) final-norm hidden states at the positions
                   where those ids were the *input* token (what the Talker conditions on)
    finished:      True on the last delta; finish_reason is then "stop" | "length" | "abort"
    timings:       wall-clock marks (time.time()) on the first token's delta and the last
                   one: admitted, vision_end, audio_end, first_token (, last_token)
    """

    request_id: str
    token_ids: list[int]
    text: str = ""
    spoken_ids: list[int] = field(default_factory=list)
    spoken_hidden: torch.Tensor | None = None
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    timings: dict[str, float] | None = None


@dataclass(frozen=True)
class TextWanted:
    """A held turn's Talker stream (TalkerSpec.hold) has no text left to decode and no
    chunk out yet (its first unit ended early): the first audio needs the text the Thinker
    holds back, so the ingress resumes the Thinker."""

    request_id: str
    finished: bool = False


# The longest a stage holds a turn's work for its first audio (`hold_after_spoken`, `hold`):
# the hold is a short priority, never a stall. It covers the Talker's first chunk, then
# Code2Wav's; under load, where Code2Wav's queue keeps the first audio waiting, a longer hold
# only delays the text.
HOLD_LIMIT_S = 0.25


@dataclass(frozen=True)
class TalkerSpec:
    """How a Talker stream decodes (`TalkerEngine.open`).

    mode:      "full_span" | "streaming"; None = the engine's configured mode
    seed:      the stream's sampling seed; None = a random one
    max_codes: fixed-length benchmark mode for random-weight checkpoints (whose EOS is
               arbitrary): EOS masked, the stream ends after exactly this many codes
    """

    mode: str | None = None
    seed: int | None = None
    max_codes: int | None = None
    # Once the stream's first chunk is released, it decodes only beside other work until
    # `resume` (the turn's first audio is out) or HOLD_LIMIT_S (see ThinkerRequest).
    hold: bool = False


@dataclass
class SpokenChunk:
    """Thinker -> Talker: the next ids of the spoken span and their hidden states.

    ids:      (n,) Thinker token ids
    hidden:   (n, llm_dim) final-norm hidden states at the steps where those ids were the
              input token; None only with no ids (a bare end of the text)
    finished: the spoken text is complete (pass it with the last ids)
    """

    ids: list[int]
    hidden: torch.Tensor | None
    finished: bool = False


@dataclass(frozen=True)
class CodeChunk:
    """Talker -> Code2Wav: speech codes of one stream, in order.

    codes:     new codes (the Talker releases 25, or the rest on the last chunk; may be empty)
    finished:  last chunk of the stream
    lookahead: the codes that follow (3, already known; they open the next chunk too)
    index:     0, 1, 2, ... per stream
    started_at / released_at: wall clock (time.time()) from the previous chunk's release (the
               first unit's start for chunk 0) to this one's: the Talker's share of the chunk
    """

    request_id: str
    codes: tuple[int, ...]
    finished: bool
    lookahead: tuple[int, ...] = ()
    index: int = 0
    started_at: float = field(default=0.0, compare=False)  # measurements, not content
    released_at: float = field(default=0.0, compare=False)


@dataclass
class PcmChunk:
    """Code2Wav -> caller: one decoded chunk of a stream, mono float32 (N,) at 24 kHz."""

    request_id: str
    pcm: np.ndarray
    finished: bool


@dataclass
class StageFailure:
    """Delivered to a request's stream when the engine step that served it raised (or a
    stage could not serve the turn). `status` is the HTTP-like status the turn ends with."""

    stage: str
    message: str
    status: int = 500
    reason: str = "stage_error"

"""One full-duplex session's Thinker: the reference `MiniCPMODuplex` LLM side, unit by unit.

    prepare(prefix, suffix, ref_audio)     system prompt (+ a voice's audio) into the KV,
                                           protected from the sliding window
    prefill_unit(audio, frames)            <unit>, each frame's <image>/<slice> rows, the
                                           unit's audio rows (streaming encoder) -> the
                                           pending logits of the decision
    generate_unit(force)                   <|listen|> or <|speak|> + up to N-1 tokens up to a
                                           chunk terminator, then </unit>; the window slides
    plan_prefill_batch(items)              the prefill rows of several sessions' units, their
                                           audio in one streaming-encoder pass and their
                                           frames in one vision call (pipeline.duplex.batch)

Exact to the reference within a session, quirks kept where noted. Numerics: the reference
feeds the system prompt one token at a time and a unit's pieces (<unit>, each image token
and slice, the audio) as separate forwards; here each of `prepare` and `prefill_unit` is one
forward over the same rows in the same order (the same values up to fp32 summation order:
the parity tests compare against the reference's goldens). Decoded tokens are fed one by
one, as there.

Sliding windows (`DuplexConfig.sliding_window_mode`): "basic" drops the oldest units once
the context passes `basic_window_high_tokens`, down to `basic_window_low_tokens`, and
re-rotates the keys that follow; "context" keeps `context_max_units` units and moves the
spoken tokens of the dropped ones into a "previous:" text between the system prompt's
prefix and suffix (the reference's `StreamDecoder` windows, op for op).

State is per session: the KV cache (`SessionKV`: blocks of a pool shared with the other
sessions of the model, and in a server with the Thinker engine's turns), the streaming mel and audio encoder
caches, the decoder's history and the session's random generator. Nothing is shared
between sessions (the reference's audio encoder cache and log-mel mode outlive its
`prepare`; here a new session starts clean).
"""

from __future__ import annotations

from collections.abc import Generator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from pipeline.duplex.audio_stream import StreamingAudioEncoder, StreamingMel, encode_batch
from pipeline.duplex.config import DuplexConfig
from pipeline.duplex.decoder import DecodeParams, DuplexDecoder
from pipeline.duplex.kv import KVPages, SessionKV, standalone_pages
from pipeline.processing.audio import process_audio
from pipeline.processing.image import process_image
from pipeline.thinker.model import ThinkerModel
from pipeline.tokenizer import TextTokenizer

FORCE_CHOICES = (None, "listen", "speak")
# The redundant mel frames the encoder cuts at a unit's edges (none in front of the first):
# the reference passes 2 whatever its `cnn_redundancy_ms` (a quirk kept on purpose).
EXTRA_FRAMES = 2
# The "context" window's marker before the text of dropped units (the reference's default).
CONTEXT_PREVIOUS_MARKER = "\n\nprevious: "
# Ids the "context" window never carries into the previous text: the reference decoder's
# own list, plus the tokenizer's special tokens (`reference_special_tokens`).
_CONTROL_TOKENS = ("<unit>", "</unit>", "<image>", "</image>", "<slice>", "</slice>",
                   "<|listen|>", "<|speak|>", "<|tts_bos|>", "<|tts_eos|>", "<|audio_start|>",
                   "<|audio_end|>", "<|chunk_eos|>", "<|chunk_tts_eos|>", "<|turn_eos|>")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")


def reference_special_tokens(tokenizer_dir: str | Path | None) -> set[str]:
    """The tokens the reference tokenizer calls special (`all_special_tokens`: the named
    special tokens and `additional_special_tokens` of tokenizer_config.json and
    special_tokens_map.json), plus the duplex control tokens. Without a folder: the
    MiniCPM-o tokenizer's eos, pad and unk tokens only."""
    import json

    texts = set(_CONTROL_TOKENS)
    if tokenizer_dir is None:
        return texts | {"<|im_end|>", "<|endoftext|>", "<unk>"}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = Path(tokenizer_dir) / name
        if not f.is_file():
            continue
        d = json.loads(f.read_text())
        values = [d.get(k) for k in _SPECIAL_KEYS] + list(d.get("additional_special_tokens") or [])
        for v in values:
            text = v.get("content") if isinstance(v, dict) else v
            if isinstance(text, str):
                texts.add(text)
    return texts


@dataclass
class ThinkerUnit:
    is_listen: bool
    end_of_turn: bool
    text: str  # the reference's generated_text
    token_ids: list[int]  # every id appended to total_ids this unit
    spoken: list[tuple[int, torch.Tensor]]  # (id, final hidden [hidden_size]) for the Talker
    # the unit's prefill schema: ids and ("audio", n) / ("img", 64) for embedded rows
    prefill: list = field(default_factory=list)


@dataclass
class Draw:
    """A step's request for the next id, drawn from `logits` (1, V) by the session's decoder:
    answered by `DuplexDecoder.decode` alone, by one `decode_batch` for the sessions of a
    batch (pipeline.duplex.batch)."""

    logits: torch.Tensor


# Out: (token to append, wants its logits), answered with (its hidden row, its logits or
# None); or a Draw, answered with the id drawn.
UnitSteps = Generator[tuple[int, bool] | Draw,
                      "tuple[torch.Tensor, torch.Tensor | None] | int", ThinkerUnit]


@dataclass
class UnitPrefill:
    """A unit's input rows, planned (`DuplexThinker.plan_prefill`) but not yet in the KV."""

    rows: torch.Tensor  # (T, H): <unit>, the frames' rows, the audio rows
    ok: bool  # False: the audio did not complete a chunk (the rows go in, nothing pends)
    mode: str  # "AUDIO" | "VISION" | "OMNI"
    schema: list


@dataclass(frozen=True)
class PreparedFrames:
    """A unit's frames sliced for the vision encoder (`prepare_frames`): what a unit takes in
    place of its frames, so that a server slices them (the images' resize: milliseconds of
    CPU a frame) before the unit reaches the thread that steps the GPU."""

    images: list  # pipeline.handoff.ImageInput, one a frame
    max_slice_nums: int | list[int]

    def __len__(self) -> int:
        return len(self.images)


def prepare_frames(slicing, frames: list, max_slice_nums) -> PreparedFrames:
    """Each frame (an (H, W, 3) uint8 array or a PIL image) sliced at its `max_slice_nums`
    (an int for all, or one per frame) under the model's `slicing` config; ValueError for a
    bad frame or option. Touches no session: any thread may run it."""
    if isinstance(max_slice_nums, int):
        per_frame = [max_slice_nums] * len(frames)
    else:
        per_frame = list(max_slice_nums)
        if len(per_frame) != len(frames):
            raise ValueError(
                f"max_slice_nums list length ({len(per_frame)}) must match the frames "
                f"({len(frames)})"
            )
    images = []
    for frame, n in zip(frames, per_frame):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_slice_nums must be an int >= 1, got {n!r}")
        if isinstance(frame, np.ndarray):
            if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
                raise ValueError(
                    f"a frame array must be (H, W, 3) uint8, got {frame.shape} {frame.dtype}"
                )
            frame = Image.fromarray(frame)
        if not isinstance(frame, Image.Image):
            raise ValueError(
                f"a frame must be a PIL image or an (H, W, 3) uint8 array, got {type(frame)}"
            )
        images.append(process_image(frame.convert("RGB"), slicing, "", n).image)
    return PreparedFrames(images, max_slice_nums)


@dataclass
class _UnitInput:
    """A unit's checked input, before it touches the session: its audio (None: none), its
    frames sliced for the vision encoder, and the unit's mode."""

    audio: np.ndarray | None
    images: list
    mode: str  # "AUDIO" | "VISION" | "OMNI"


@dataclass
class _Unit:
    length: int
    kind: str
    generated: list[int]
    text: str
    is_listen: bool


class DuplexThinker:
    def __init__(self, model: ThinkerModel, tokenizer: TextTokenizer,
                 cfg: DuplexConfig | None = None, *, seed: int | None = None,
                 generator: torch.Generator | None = None,
                 special_tokens: set[str] | None = None, pages: KVPages | None = None,
                 max_tokens: int | None = None):
        self.model = model
        self.max_tokens = max_tokens  # the session's context at most (None: the model's)
        # the KV pool the session's blocks come from: a server passes its engine's; alone,
        # the model's standalone pool (shared by the sessions of one model, so they batch)
        self.pages = pages or standalone_pages(model.llm)
        self.kv: SessionKV | None = None
        self.tokenizer = tokenizer
        self._cfg = c = cfg or DuplexConfig()
        # what every draw passes the decoder: built once, as the config is frozen and cannot
        # be swapped (`cfg` has no setter)
        self.decode_params = DecodeParams(
            mode=c.decode_mode, temperature=c.temperature, top_k=c.top_k, top_p=c.top_p,
            listen_top_k=c.listen_top_k, listen_prob_scale=c.listen_prob_scale,
            repetition_penalty=c.text_repetition_penalty,
            repetition_window=c.text_repetition_window_size,
        )
        tc = model.cfg
        self.tokens = tc.tokens
        w = model.llm.lm_head.weight
        self.device, self.dtype = w.device, w.dtype
        if generator is None:
            generator = torch.Generator(device=self.device)
            if seed is None:
                generator.seed()
            else:
                generator.manual_seed(seed)
        self.generator = generator
        t = self.tokens
        self.chunk_terminators = (t.listen, t.chunk_eos, t.chunk_tts_eos)
        # `<|tts_pad|>` and the tokenizer's bad ids are never decoded; the decoder adds
        # `<|chunk_eos|>` (its own first draw decides a chunk end).
        self.forbidden = [t.tts_pad, *tokenizer.bad_token_ids, t.chunk_eos]
        # the "context" window's filter; pass `reference_special_tokens(tokenizer_dir)` for
        # the checkpoint's own list (from_checkpoint does)
        self.special_texts = special_tokens or reference_special_tokens(None)
        self.special_ids = {tokenizer.vocab[x] for x in self.special_texts if x in tokenizer.vocab}
        self.marker_ids = tokenizer.encode(CONTEXT_PREVIOUS_MARKER)
        self._reset()

    @classmethod
    def from_checkpoint(cls, path: str | Path | None, cfg: DuplexConfig | None = None,
                        device: str | torch.device = "cpu", seed: int | None = 0,
                        dtype: torch.dtype = torch.float32) -> DuplexThinker:
        """A session over freshly loaded weights (tests, scripts; a server shares one
        ThinkerModel between its sessions)."""
        from pipeline.checkpoint import ModelSource

        source = ModelSource.open(None if path is None else str(path))
        model = ThinkerModel.load(source, device=device, dtype=dtype)
        tok = TextTokenizer.from_dir(source.tokenizer_dir)
        return cls(model, tok, cfg, seed=seed,
                   special_tokens=reference_special_tokens(source.tokenizer_dir))

    # -- state ---------------------------------------------------------------------------
    def _reset(self) -> None:
        c = self.cfg
        if self.kv is not None:
            self.kv.release()
        self.kv = SessionKV(self.pages, self.max_tokens)
        self.mel = StreamingMel(c.chunk_ms, c.first_chunk_ms, c.cnn_redundancy_ms, c.sample_rate)
        self.audio_encoder = StreamingAudioEncoder(self.model.audio)
        self.decoder = DuplexDecoder(
            chunk_eos=self.tokens.chunk_eos, turn_eos=self.tokens.turn_eos,
            listen_id=self.tokens.im_end, forbidden=self.forbidden, generator=self.generator,
        )
        self.audio_buffer = np.zeros(0, np.float32)
        self.audio_chunk_idx = 0
        self.pending_logits: torch.Tensor | None = None
        self.current_mode: str | None = None
        self.current_turn_ended = True
        self.generate_count = 0
        self.speaking: list[int] = []  # the unit's spoken ids as they are drawn
        self.preserve = 0  # system prompt length, never slid out
        self.units: list[_Unit] = []
        self.unit_start: int | None = None
        self.last_prefill: list = []  # the last unit's prefill schema
        self.slides = 0  # window slides so far (a counter for tests and stats)
        self.dropped_units = 0
        # "context" window: [prefix] [marker + previous] [suffix] [units...]
        self.ctx_prefix = 0
        self.ctx_suffix: list[int] = []
        self.ctx_marker: list[int] = []  # set when a system prompt is registered
        self.ctx_previous: list[int] = []  # marker + the dropped units' tokens
        self.ctx_previous_len = 0

    def close(self) -> None:
        """Frees the session's caches (KV, audio encoder, buffers); `prepare` starts anew."""
        self._reset()

    @property
    def context_length(self) -> int:
        return self.kv.length

    @property
    def cfg(self) -> DuplexConfig:
        """The session's options, fixed for its life."""
        return self._cfg

    def _embed(self, ids: list[int]) -> torch.Tensor:
        return self.model.llm.embed(torch.tensor(ids, dtype=torch.long, device=self.device))

    def _logits(self, hidden_row: torch.Tensor) -> torch.Tensor:
        return self.model.llm.compute_logits(hidden_row.reshape(1, -1))  # (1, V)

    # -- prepare -------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, prefix: str | None = None, suffix: str | None = None,
                ref_audio: np.ndarray | None = None) -> None:
        """A new session: clean state, then the system prompt prefix, the reference
        voice's audio rows (the offline encoder) and the suffix, registered as the part
        the sliding window keeps."""
        if ref_audio is not None:
            ref_audio = np.asarray(ref_audio, dtype=np.float32)
            if ref_audio.ndim != 1 or ref_audio.size == 0 or not np.isfinite(ref_audio).all():
                raise ValueError(
                    "ref_audio must be non-empty finite 1-D 16 kHz samples, "
                    f"got shape {ref_audio.shape}"
                )
        self._reset()
        parts: list[torch.Tensor] = []
        if prefix:
            parts.append(self._embed(self.tokenizer.encode(prefix)))
        if ref_audio is not None:
            parts.append(self.model.encode_audios([process_audio(ref_audio)])[0])
        suffix_ids = self.tokenizer.encode(suffix) if suffix else []
        if parts:
            self.kv.forward(torch.cat([p.to(self.dtype) for p in parts], dim=0))
        registered = bool(prefix or suffix or ref_audio is not None)
        if registered and self.cfg.sliding_window_mode == "context":
            # the previous text will go between the prefix (+ voice) and the suffix
            self.ctx_prefix = self.kv.length
            self.ctx_suffix = suffix_ids
            self.ctx_marker = list(self.marker_ids)
        if suffix_ids:
            self.kv.forward(self._embed(suffix_ids))
        if registered:
            self.preserve = self.kv.length

    # -- prefill -------------------------------------------------------------------------
    def _check_input(self, audio: np.ndarray | None, frames: list | None,
                     max_slice_nums) -> _UnitInput | None:
        """The unit's input checked and its frames sliced, touching no session state (bad
        input is refused here). None: neither audio nor frames. `frames`: a list of frames,
        PreparedFrames, or a future of them (a server slices them in a worker thread)."""
        if isinstance(frames, Future):
            frames = frames.result()  # raises what refused a frame
        has_frames = frames is not None and len(frames) > 0
        if audio is not None:
            audio = np.asarray(audio, dtype=np.float32)
            if audio.ndim != 1:
                raise ValueError(f"audio must be 1-D 16 kHz samples, got shape {audio.shape}")
            if not np.isfinite(audio).all():
                raise ValueError("audio holds NaN or infinite samples")
        has_audio = audio is not None and len(audio) > 0
        if has_frames and has_audio:
            mode = "OMNI"
        elif has_frames:
            mode = "VISION"
        elif has_audio:
            mode = "AUDIO"
        else:
            return None
        images = self._frame_images(frames, max_slice_nums) if has_frames else []
        return _UnitInput(audio if has_audio else None, images, mode)

    def _frame_images(self, frames: list | PreparedFrames, max_slice_nums) -> list:
        """Each frame sliced at its `max_slice_nums` (`prepare_frames`), or as it was."""
        if isinstance(frames, PreparedFrames):
            if frames.max_slice_nums != max_slice_nums:
                raise ValueError(f"frames prepared at max_slice_nums {frames.max_slice_nums!r} "
                                 f"for a unit at {max_slice_nums!r}")
            return frames.images
        return prepare_frames(self.model.cfg.slicing, frames, max_slice_nums).images

    def _frame_rows(self, embs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        """Each encoded frame: <image> source </image> then <slice> s </slice> per grid slice."""
        t, q = self.tokens, self.model.cfg.query_num
        rows, schema = [], []
        for emb in embs:
            for s in range(emb.shape[0] // q):
                open_, close = (t.image, t.image_end) if s == 0 else (t.slice, t.slice_end)
                rows += [self._embed([open_]), emb[s * q : (s + 1) * q], self._embed([close])]
                schema += [open_, ("img", q), close]
        return rows, schema

    @torch.inference_mode()
    def prefill_unit(self, audio: np.ndarray | None, frames: list | None = None,
                     max_slice_nums: int | list[int] = 1) -> bool:
        """One unit's input. Returns False (nothing pending) when the unit has neither
        audio nor frames, or its audio does not complete a chunk yet."""
        plan = self.plan_prefill(audio, frames, max_slice_nums)
        if plan is None:
            return False
        hidden = self.kv.forward(plan.rows)
        return self.finish_prefill(plan, self._logits(hidden[-1]) if plan.ok else None)

    def plan_prefill(self, audio: np.ndarray | None, frames: list | None = None,
                     max_slice_nums: int | list[int] = 1) -> UnitPrefill | None:
        """The unit's input rows (its audio and frames encoded, the session's audio state
        advanced), to append to the KV and then hand to `finish_prefill` with the logits of
        the last row. None: nothing to prefill. Split from `prefill_unit` so a batch can
        run many sessions' rows in one forward (pipeline.duplex.batch); a batch of one of
        `plan_prefill_batch`."""
        plan = plan_prefill_batch([(self, audio, frames, max_slice_nums)])[0]
        if isinstance(plan, BaseException):
            raise plan
        return plan

    def finish_prefill(self, plan: UnitPrefill, logits: torch.Tensor | None) -> bool:
        """After `plan.rows` went into the KV: `logits` (1, V) of its last row (None when
        `plan.ok` is False) become the decision's pending logits."""
        if not plan.ok:
            # the reference has fed <unit> and the frames when it finds the audio short
            return False
        self.pending_logits = logits
        self.current_mode = plan.mode
        if plan.mode == "VISION":
            self.audio_chunk_idx += 1  # the reference counts a frame-only unit as a chunk
        self.last_prefill = plan.schema
        return True

    def _begin_unit(self) -> None:
        self.pending_logits = None
        self.unit_start = self.kv.length

    def _take_audio(self, audio: np.ndarray) -> tuple[torch.Tensor, int] | None:
        """The unit's audio into the session's buffer and streaming mel: (the mel frames to
        encode, their redundant frames in front), or None when no chunk is complete."""
        c = self.cfg
        self.audio_buffer = np.concatenate([self.audio_buffer, audio])
        if self.audio_chunk_idx == 0:
            required = int(c.first_chunk_ms * c.sample_rate / 1000)
            if len(self.audio_buffer) < required:  # the first chunk is left-padded with silence
                pad = np.zeros(required - len(self.audio_buffer), np.float32)
                self.audio_buffer = np.concatenate([pad, self.audio_buffer])
        need = self.mel.chunk_size()
        if len(self.audio_buffer) < need:
            return None
        mel = self.mel.push(self.audio_buffer[:need])
        if mel.shape[-1] == 0:
            return None
        prefix = 0 if self.audio_chunk_idx == 0 else EXTRA_FRAMES
        if self.audio_chunk_idx == 0:
            # the reference rounds the aligned first chunk through whole milliseconds
            ms = int(self.mel.first_chunk_consumed / c.sample_rate * 1000.0)
            consumed = int(ms * c.sample_rate / 1000)
        else:
            consumed = int(c.chunk_ms * c.sample_rate / 1000)
        self.audio_buffer = self.audio_buffer[consumed:]
        self.audio_chunk_idx += 1
        return mel, prefix

    def _assemble(self, inp: _UnitInput, frame_embs: list[torch.Tensor],
                  audio_emb: torch.Tensor | None) -> UnitPrefill:
        """<unit>, the frames' rows, the audio rows (none when the audio completed no chunk:
        then nothing pends after the rows go in)."""
        frame_rows, frame_schema = self._frame_rows(frame_embs)
        rows = [self._embed([self.tokens.unit]), *frame_rows]
        schema: list = [self.tokens.unit, *frame_schema]
        if audio_emb is not None:
            rows.append(audio_emb)
            schema.append(("audio", audio_emb.shape[0]))
        ok = inp.audio is None or audio_emb is not None
        return UnitPrefill(torch.cat([r.to(self.dtype) for r in rows], dim=0), ok, inp.mode,
                           schema)

    # -- generate ------------------------------------------------------------------------
    def _feed_token(self, token: int) -> torch.Tensor:
        return self.kv.forward(self._embed([token]))[-1]

    @torch.inference_mode()
    def generate_unit(self, force: str | None = None) -> ThinkerUnit:
        """The unit's decision and speech tokens. `force`: None (the model decides),
        "listen" (as the reference's force_listen), or "speak" (omniray's option for
        benchmarks and tests on random weights: the first decision is <|speak|>, the rest
        is decoded as usual)."""
        steps = self.unit_steps(force)
        try:
            ask = next(steps)
            while True:
                if isinstance(ask, Draw):
                    ask = steps.send(self.decoder.decode(ask.logits, self.decode_params))
                    continue
                token, wants_logits = ask
                hidden = self._feed_token(token)
                logits = self._logits(hidden) if wants_logits else None
                ask = steps.send((hidden, logits))
        except StopIteration as done:
            return done.value

    def unit_steps(self, force: str | None = None) -> UnitSteps:
        """`generate_unit` as steps: yields (token, wants_logits), one token to append to
        the KV, and takes back (its final hidden row [H], its logits (1, V) or None when
        not wanted), or a Draw, and takes back the id the session's decoder draws; returns
        the ThinkerUnit. `generate_unit` answers each step alone; a batch feeds the tokens
        of many sessions in one forward and draws their ids in one `decode_batch`
        (pipeline.duplex.batch)."""
        if force not in FORCE_CHOICES:
            raise ValueError(f"force must be one of {FORCE_CHOICES}, got {force!r}")
        return self._unit_steps(force)

    def _unit_steps(self, force: str | None) -> UnitSteps:
        self.speaking = []  # the chunk's spoken ids as they are drawn, for a server to stream
        if self.pending_logits is None:  # nothing prefilled: the reference answers listen
            return ThinkerUnit(True, False, "", [], [], [])
        c, t = self.cfg, self.tokens
        logits, self.pending_logits = self.pending_logits, None
        force_listen = force == "listen" or self.generate_count < c.force_listen_count
        self.generate_count += 1

        ids: list[int] = []  # the reference's total_ids entries of this unit
        spoken: list[tuple[int, torch.Tensor]] = []
        is_listen = end_of_turn = False
        n = c.max_new_speak_tokens_per_chunk
        for j in range(n):
            if j == n - 1:
                yield t.chunk_eos, False
                ids.append(t.chunk_eos)
                break
            if force_listen:
                last = t.listen
            elif force == "speak" and j == 0:
                last = t.speak
            else:
                last = yield Draw(logits)
                if last == t.listen and not self.current_turn_ended:
                    last = t.tts_bos  # a turn in progress may not listen
            ids.append(last)
            is_listen = last == t.listen
            if last in self.chunk_terminators:
                # the reference feeds the terminator and drops the logits it gets
                yield last, False
                break
            if j != 0:  # the decision token itself is not spoken
                self.speaking.append(last)
            self.current_turn_ended = False
            hidden, logits = yield last, True
            end_of_turn = last == t.turn_eos
            if end_of_turn:
                self.current_turn_ended = True
            if j != 0:
                spoken.append((last, hidden))

        yield t.unit_end, False
        ids.append(t.unit_end)
        spoken_ids = self.speaking
        text = self.tokenizer.decode(spoken_ids, skip_special_tokens=True) if spoken_ids else ""
        self._register_unit_end(spoken_ids, is_listen, text)
        if c.sliding_window_mode == "basic":
            self._enforce_window()
        elif c.sliding_window_mode == "context":
            self._enforce_context_window()
        prefill = self.last_prefill
        if is_listen:
            return ThinkerUnit(True, False, "", ids, [], prefill)
        return ThinkerUnit(False, end_of_turn, text, ids, spoken, prefill)

    # -- sliding window ------------------------------------------------------------------
    def _register_unit_end(self, generated: list[int], is_listen: bool, text: str) -> None:
        if self.unit_start is None:
            return
        length = self.kv.length - self.unit_start
        if length > 0:
            kind = (self.current_mode or "audio").lower()
            self.units.append(_Unit(length, kind, generated, text, is_listen))
        self.unit_start = None

    def _drop_unit(self, unit: _Unit) -> bool:
        # the reference drops the span right after the system prompt, of the unit's length
        available = self.kv.length - min(self.preserve, self.kv.length)
        if unit.length <= 0 or available < unit.length:
            return False
        self.kv.drop(min(self.preserve, self.kv.length), unit.length)
        self.units.remove(unit)
        return True

    def _enforce_window(self) -> bool:
        c = self.cfg
        if self.kv.length <= c.basic_window_high_tokens:
            return False
        dropped = 0
        while self.kv.length > c.basic_window_low_tokens:
            if not any(self._drop_unit(u) for u in list(self.units)):
                break
            dropped += 1
        if dropped:
            self.slides += 1
            self.dropped_units += dropped
        return dropped > 0

    def _enforce_context_window(self) -> bool:
        """Past `context_max_units` units, the oldest units leave the context and their
        spoken tokens join the previous text between the prefix and the suffix (at most
        `context_previous_max_tokens` of them, the newest kept)."""
        c = self.cfg
        if len(self.units) <= c.context_max_units:
            return False
        dropped = 0
        while len(self.units) > c.context_max_units:
            unit = self.units.pop(0)
            tokens, text = [], ""
            if not unit.is_listen:
                tokens = [i for i in unit.generated if i not in self.special_ids]
                text = unit.text
                for st in self.special_texts:
                    text = text.replace(st, "")
            self._update_previous(tokens, not text.strip())
            dropped += 1
        self.slides += 1
        self.dropped_units += dropped
        return True

    def _update_previous(self, tokens: list[int], no_text: bool) -> None:
        if not tokens and no_text:
            self._rebuild_with_previous(self.ctx_previous)
            return
        marker = len(self.ctx_marker)
        if not self.ctx_previous:
            self.ctx_previous = list(self.ctx_marker) + tokens
        else:
            self.ctx_previous.extend(tokens)
        extra = len(self.ctx_previous) - marker - self.cfg.context_previous_max_tokens
        if extra > 0:  # keep the marker and the newest tokens
            self.ctx_previous = list(self.ctx_marker) + self.ctx_previous[marker + extra :]
        self._rebuild_with_previous(self.ctx_previous)

    def _rebuild_with_previous(self, previous: list[int]) -> None:
        keep = sum(u.length for u in self.units)
        if not previous and self.ctx_previous_len == 0:
            # nothing to recompute: the prefix and suffix stay, the kept units move down
            preserve = self.ctx_prefix + len(self.ctx_suffix)
            dropped = self.kv.length - preserve - keep
            if keep > 0:
                if dropped > 0:
                    self.kv.drop(preserve, dropped)
            else:
                self.kv.truncate(preserve)
            return
        rows = previous + self.ctx_suffix
        self.kv.rebuild(self.ctx_prefix, self._embed(rows) if rows else None, keep)
        self.ctx_previous_len = len(previous)
        self.preserve = self.ctx_prefix + len(previous) + len(self.ctx_suffix)


@torch.inference_mode()
def plan_prefill_batch(
    items: list[tuple[DuplexThinker, np.ndarray | None, list | None, int | list[int]]],
) -> list[UnitPrefill | None | BaseException]:
    """`plan_prefill` of several sessions (each once: (thinker, audio, frames,
    max_slice_nums)), their encoders batched: every session's frames in one vision
    encoder call and every session's audio unit in one streaming-encoder pass
    (`audio_stream.encode_batch`), per shared model. Per item its UnitPrefill, None
    (nothing to prefill) or the exception that failed it.

    Bad input fails its own item before any of its session's state changes; a failure of
    a shared encoder call fails the items in it (the vision call before their sessions'
    state changes, the audio pass after their audio state advanced, as alone)."""
    if len({id(th) for th, *_ in items}) != len(items):
        raise ValueError("a session may have one unit in a batch")
    out: list[UnitPrefill | None | BaseException] = [None] * len(items)
    inputs: dict[int, _UnitInput] = {}
    for i, (th, audio, frames, max_slice_nums) in enumerate(items):
        try:
            inp = th._check_input(audio, frames, max_slice_nums)
        except Exception as e:  # noqa: BLE001 - bad input fails its own unit
            out[i] = e
            continue
        if inp is not None:
            inputs[i] = inp

    def fail(group: list[int], e: BaseException) -> None:
        for i in group:
            out[i] = e
            inputs.pop(i, None)

    # every frame of the batch in one vision call per model
    frame_embs: dict[int, list[torch.Tensor]] = {i: [] for i in inputs}
    by_model: dict[int, list[int]] = {}
    for i, inp in inputs.items():
        if inp.images:
            by_model.setdefault(id(items[i][0].model), []).append(i)
    for group in by_model.values():
        model = items[group[0]][0].model
        try:
            embs = model.encode_images([im for i in group for im in inputs[i].images],
                                       model.cfg.vision_batch_size)
        except Exception as e:  # noqa: BLE001 - the sessions of this call fail
            fail(group, e)
            continue
        k = 0
        for i in group:
            n = len(inputs[i].images)
            frame_embs[i], k = embs[k : k + n], k + n

    # the sessions' audio state advances, then every unit's mel in one encoder pass
    mels: dict[int, tuple[torch.Tensor, int]] = {}
    for i, inp in list(inputs.items()):
        th = items[i][0]
        th._begin_unit()
        if inp.audio is None:
            continue
        try:
            taken = th._take_audio(inp.audio)
        except Exception as e:  # noqa: BLE001
            fail([i], e)
            continue
        if taken is not None:
            mels[i] = taken
    audio_embs: dict[int, torch.Tensor] = {}
    by_encoder: dict[int, list[int]] = {}
    for i in mels:
        by_encoder.setdefault(id(items[i][0].audio_encoder.audio), []).append(i)
    for group in by_encoder.values():
        try:
            embs = encode_batch([items[i][0].audio_encoder for i in group],
                                [mels[i][0] for i in group], [mels[i][1] for i in group],
                                [EXTRA_FRAMES] * len(group))
        except Exception as e:  # noqa: BLE001 - the sessions of this pass fail
            fail(group, e)
            continue
        audio_embs.update(zip(group, embs))

    for i, inp in inputs.items():
        th = items[i][0]
        try:
            out[i] = th._assemble(inp, frame_embs[i], audio_embs.get(i))
        except Exception as e:  # noqa: BLE001
            out[i] = e
    return out

"""Thinker engine: multimodal requests in, per-step text deltas and spoken-span hidden
states out.

Each `step()`:
  1) admits new requests to the LLM engine at once, with every `<unk>` slot run keyed by
     its media's content hash (`MediaSpan`) so the LLM's prefix cache can tell the same
     placeholders with other media apart. Media whose slots all lie inside the prompt's
     cached prefix are not encoded at all (a follow-up question about the same video
     computes only the new turn); should that prefix be evicted before the request runs,
     the LLM engine calls back for the rows;
  2) encodes the admitted requests' media (FIFO over requests, each request's media in
     prompt order, a content-hash LRU in front of the encoders, the images batched in one
     vision pass and the clips in one audio pass) and hands their rows to the LLM engine,
     which computes each prompt only up to its first slot still waiting for rows. Media
     sent ahead of their request (`prefetch`: a video's frames, an audio part's clip, while
     the ingress still decodes the rest) go in the same batches, after the admitted
     requests' media, and wait for their request;
  3) runs one continuous-batching step of the LLM engine; with media to encode while an
     LLM step launched ahead is in flight, the step only returns that one's outputs
     (encoders wait for the device, and those ids should not wait for the encoders);
  4) turns new ids into text deltas (no half UTF-8 characters) and pairs each spoken-span
     token with the hidden state computed when it was the input token (what the Talker
     conditions on: spec section 2.2).

A request with `hold_after_spoken` n is held once n spoken rows are out (the Talker's first
text chunk): its decodes run only in steps other work calls for, until `resume` (its first
audio is out) or HOLD_LIMIT_S; the last step launched for it is drained, none launched.
What it computes is unchanged, only when: on a GPU shared with the Talker and Code2Wav,
its turn's first audio comes sooner.

Synchronous and single-threaded: the deployment drives it in a loop.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace

import torch

from pipeline.checkpoint import ModelSource
from pipeline.thinker.llm_engine.engine import EngineConfig, LLMEngine
from pipeline.thinker.llm_engine.runner import GuestRows
from pipeline.thinker.llm_engine.scheduler import MediaSpan
from pipeline.handoff import (
    HOLD_LIMIT_S,
    AudioInput,
    ImageInput,
    SamplingParams,
    ThinkerDelta,
    ThinkerRequest,
)
from pipeline.stage_engine import Holds
from pipeline.thinker.model import AudioGraphs, ThinkerModel
from pipeline.tokenizer import IncrementalDetokenizer, TextTokenizer
from pipeline.utils import resolve_device, resolve_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ThinkerEngineConfig:
    llm: EngineConfig = field(default_factory=EngineConfig)
    encoder_cache_size: int = 256  # images / audio clips kept by content hash; 0 = off
    vision_batch_size: int = 16  # slices per vision forward
    # Media encoded ahead of their request (`prefetch`: a video's frames, an audio clip,
    # while the ingress still decodes the rest) wait for it here, outside the LRU above, at
    # most this many (oldest dropped first: a request that never came). 512 (~256 MiB of
    # bf16 rows) holds the frames of 8 clips at the 64-frame limit, all on their way at once.
    prefetch_capacity: int = 512
    dtype: str = "auto"  # bf16 on CUDA, fp32 on CPU
    # CUDA only: two short requests before serving (warm_up), so that what a first request
    # would pay (FlashInfer kernels built on first use, compiled helpers at prefill shapes)
    # is paid at start.
    warm_up: bool = True

    def __post_init__(self) -> None:
        if self.encoder_cache_size < 0 or self.vision_batch_size < 1 or self.prefetch_capacity < 0:
            raise ValueError(
                "encoder_cache_size >= 0, vision_batch_size >= 1, prefetch_capacity >= 0"
            )


class EncoderCache:
    """Bounded LRU of encoder outputs keyed by media content hash."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> torch.Tensor | None:
        if self.capacity == 0:
            return None
        t = self._items.get(key)
        if t is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return t

    def put(self, key: str, value: torch.Tensor) -> None:
        if self.capacity == 0:
            return
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:  # a peek: no hit/miss counted, no reordering
        return key in self._items


@dataclass(frozen=True, eq=False)
class _Slot:
    """One run of `<unk>` slots: rows [first_row, first_row + len) of `media`'s encoding."""

    span: MediaSpan
    media: ImageInput | AudioInput
    first_row: int

    def rows(self, encoded: torch.Tensor) -> torch.Tensor:
        return encoded[self.first_row : self.first_row + self.span.end - self.span.start]


@dataclass
class _Stream:
    """Per-request decode state."""

    request: ThinkerRequest
    detok: IncrementalDetokenizer
    slots: list[_Slot] = field(default_factory=list)  # media slot runs, in prompt order
    todo: list[ImageInput | AudioInput] = field(default_factory=list)  # to encode, in order
    output_ids: list[int] = field(default_factory=list)
    span_start: int | None = None  # index into output_ids where the spoken span begins
    span_end: int | None = None  # index of the token that ended it
    num_hidden: int = 0  # output tokens whose hidden rows have been seen
    marks: dict[str, float] = field(default_factory=dict)  # wall-clock stage marks
    last_token_t: float | None = None  # perf_counter time of the last delta with tokens
    spoken_out: int = 0  # spoken rows handed out
    held_since: float = 0.0  # monotonic start of its hold (hold_after_spoken); 0 = not held
    hold_done: bool = False  # a request is held once at most


@dataclass(frozen=True)
class ThinkerStats:
    """`ThinkerEngine.stats()`: these fields over the LLM engine's (`EngineStats`)."""

    open_streams: int  # requests the engine holds (queued, encoding, waiting or running)
    num_waiting_encode: int  # requests not admitted yet (those encoding count in the LLM's)
    encoder_cache_hits: int
    encoder_cache_misses: int
    encoder_cache_items: int
    media_skipped: int  # images / clips not encoded: all their slots inside a cached prefix
    prefetched: int  # images and clips encoded ahead of their request (`prefetch`)
    prefetch_hits: int  # ... whose request took the rows
    prefetch_held: int  # ... waiting for their request now
    max_step_ms: float  # the longest step(): encoders + LLM step
    max_decode_gap_ms: float  # the longest time between two token deltas of one request
    holds: int  # requests held for their first audio (hold_after_spoken)
    holds_timed_out: int  # ... whose hold ran out before a resume came (HOLD_LIMIT_S)
    llm_prefill_graph_steps: int  # LLM steps but pure decodes run as whole-step graphs
    audio_graph_replays: int = 0  # audio clips run as CUDA graphs (CUDA)
    audio_graph_captures: int = 0
    audio_graph_fallbacks: int = 0  # ... encoder calls run eagerly (several clips in a step)


class ThinkerEngine:
    """Implements StageEngine (pipeline/stage_engine.py); see the module docstring."""

    config_cls = ThinkerEngineConfig

    def __init__(
        self,
        model: ThinkerModel,
        tokenizer: TextTokenizer,
        config: ThinkerEngineConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.llm = LLMEngine(model.llm, config.llm, self.device, dtype, self._load_media)
        self.cache = EncoderCache(config.encoder_cache_size)
        self.audio_graphs = AudioGraphs.of(model) if self.device.type == "cuda" else None
        self.tokens = model.cfg.tokens
        self._pending: list[ThinkerRequest] = []
        self._prefetch: dict[str, ImageInput | AudioInput] = {}  # to encode ahead
        self._ahead: OrderedDict[str, torch.Tensor] = OrderedDict()  # encoded, not yet taken
        self.prefetched = self.prefetch_hits = 0
        self._streams: dict[str, _Stream] = {}
        self.media_skipped = 0
        self._max_step_ms = 0.0
        self._max_gap_ms = 0.0
        self.holds = Holds(HOLD_LIMIT_S)

    @classmethod
    def from_source(
        cls, source: ModelSource, config: ThinkerEngineConfig | None = None, device: str = "auto"
    ) -> ThinkerEngine:
        config = config or ThinkerEngineConfig()
        dev = resolve_device(device)
        dtype = resolve_dtype(config.dtype, dev)
        cuda = dev.type == "cuda"  # compiling on the CPU only costs start-up time
        model = ThinkerModel.load(source, dev, dtype, compile_mm_encoder=cuda)
        # After the weights are final: fusing makes the Linear weights views of fused tensors.
        model.llm.fuse_projections()
        if cuda:
            model.llm.compile_ops()
        model.llm.fuse_qk_rope_kv()  # where its kernel runs (CUDA)
        if cuda:
            t0 = time.perf_counter()
            passes = model.warm_up_vision(config.vision_batch_size)
            log.info("vision encoder compiled for %d batch kinds in %.1f s",
                     len(passes), time.perf_counter() - t0)
        engine = cls(model, TextTokenizer.from_dir(source.tokenizer_dir), config, dev, dtype)
        if config.warm_up and dev.type == "cuda":
            t0 = time.perf_counter()
            engine.warm_up()
            log.info("Thinker warmed up in %.1f s", time.perf_counter() - t0)
        return engine

    def warm_up(self) -> None:
        """Serve two short requests before any user's: one with an image of a full vision
        batch of 448x448 slices (a video's frames come in such batches, and the encoder's
        largest activations are those of a full one), a clip as long as the audio encoder's
        window (30 s: the length most turns bring, so its kernels are chosen now) and text
        (sampled, penalised, with the spoken span's hidden states), and, while its decode
        runs, its prompt again plus a few tokens (a prefix-cache hit in a mixed step,
        greedy). Every kind of step a turn takes then has run once, at a turn's sizes.
        Leaves the engine idle, with its step and gap maxima from zero."""
        cfg, tokens, q = self.model.cfg, self.model.cfg.tokens, self.model.cfg.query_num
        side = cfg.slicing.scale_resolution // cfg.slicing.patch_size
        n = self.config.vision_batch_size
        image = self.model.blank_image([(side, side)] * n, content_hash="warm-up:image")
        window = self.model.audio.apm.max_mel_frames
        audio = AudioInput(torch.zeros(cfg.audio.num_mel_bins, window), "warm-up:audio")
        n_audio = self.model.audio.num_tokens(audio.num_frames)
        text = self.tokenizer.encode("Warm up: what do you see and hear?")
        ids = text + [tokens.unk] * (n * q) + text + [tokens.unk] * n_audio + text
        first = ThinkerRequest(
            "warm-up:0",
            ids + [tokens.tts_bos],
            images=[image],
            image_bounds=[(len(text) + j * q, len(text) + (j + 1) * q) for j in range(n)],
            audios=[audio],
            audio_bounds=[(2 * len(text) + n * q, 2 * len(text) + n * q + n_audio)],
            audio_segments=[(0, 0, n_audio)],
            sampling=SamplingParams(temperature=0.7, top_p=0.8, top_k=100,
                                    repetition_penalty=1.05, max_tokens=6, ignore_eos=True,
                                    seed=0),
            return_hidden=True,
        )
        second = replace(first, request_id="warm-up:1", input_ids=ids + text + [tokens.tts_bos],
                         sampling=SamplingParams(max_tokens=3, ignore_eos=True))
        if self.audio_graphs is not None:
            self.audio_graphs.capture()
        self.open(first.request_id, first)
        self.step()  # the first request's prefill: it decodes from the next step on
        self.open(second.request_id, second)
        while self.has_work():
            self.step()
        self._max_step_ms = self._max_gap_ms = 0.0

    # -- the StageEngine protocol (pipeline/stage_engine.py) -----------------------------
    def open(self, rid: str, spec: ThinkerRequest) -> None:
        """Queue a request: its whole prompt, media and sampling (`spec.request_id` is rid)."""
        if spec.request_id != rid:
            raise ValueError(f"request id {spec.request_id!r} opened as {rid!r}")
        if rid in self._streams or any(p.request_id == rid for p in self._pending):
            raise ValueError(f"duplicate request id {rid!r}")
        if not spec.input_ids:
            raise ValueError("empty prompt")
        limit = self.model.cfg.llm.max_position_embeddings
        if spec.num_prompt_tokens + spec.sampling.max_tokens > limit:
            raise ValueError(
                f"prompt ({spec.num_prompt_tokens} tokens) + max_tokens "
                f"({spec.sampling.max_tokens}) exceeds the context of {limit} tokens"
            )
        self._check_bounds(spec)
        self._pending.append(spec)

    def prefetch(self, items: list[ImageInput | AudioInput]) -> None:
        """Encode `items` before the request that holds them arrives (a video's frames, an
        audio part's clip, while the ingress still decodes the rest): the next step encodes
        them, after the admitted requests' media, and their rows wait for the request (`open`)
        in a store of `prefetch_capacity` items. Items already encoded or waiting are
        skipped."""
        if not self.config.prefetch_capacity:
            return
        for m in items:
            key = m.content_hash
            if key not in self._ahead and key not in self.cache:
                self._prefetch.setdefault(key, m)

    def feed(self, rid: str, msg: object) -> None:
        raise ValueError(
            f"request {rid!r}: the Thinker takes its whole prompt at open(), not as a feed"
        )

    def abort(self, rid: str) -> None:
        """Drop the request wherever it is: its blocks are freed now, nothing more comes."""
        self._pending = [p for p in self._pending if p.request_id != rid]
        if self._streams.pop(rid, None) is not None:
            self.llm.abort(rid)

    def has_work(self) -> bool:
        """Anything to do but the decodes of held requests (those run beside other work)."""
        if self._pending or self._prefetch:
            return True
        return self.llm.has_unfinished() and (self.llm.in_flight or not self._all_held())

    def resume(self, rid: str) -> None:
        """End the request's hold (its turn's first audio is out); unknown ids are ignored."""
        st = self._streams.get(rid)
        if st is not None:
            st.held_since, st.hold_done = 0.0, True  # a resume that came first cancels it

    def _all_held(self) -> bool:
        """Every admitted request is held (a hold that ran out ends here)."""
        for st in self._streams.values():
            st.held_since = self.holds.check(st.held_since)
        return bool(self._streams) and all(st.held_since for st in self._streams.values())

    def step(self, guests: GuestRows | None = None) -> list[ThinkerDelta]:
        """One step of the turns; `guests` (decode rows of duplex sessions in the LLM's KV
        pool) run in its LLM forward (`LLMEngine.step`), or in a decode step of their own
        when this step launches none."""
        t0 = time.perf_counter()
        deltas: list[ThinkerDelta] = []
        if self._pending:
            admit = self._pending[: self.config.llm.max_num_seqs]
            self._pending = self._pending[len(admit) :]
            self._admit(admit)
        if self.llm.in_flight and (
            self._prefetch or any(st.todo for st in self._streams.values())
        ):
            # The encoders wait for the device, behind the LLM step launched ahead: return
            # that step's ids first (the next step encodes, then launches), or they would
            # wait for the encoders too.
            outs = self.llm.drain()
        elif self.llm.in_flight and self._all_held():
            outs = self.llm.drain()  # the last step launched for them: launch no more
        else:
            self._encode_step()
            outs = self.llm.step(guests)
            guests = None  # they ran in that step
        if guests:
            self.llm.run_guests(guests)
        for out in outs:
            st = self._streams.get(out.request_id)
            if st is None:  # aborted by us: the LLM engine's own abort notice
                continue
            if out.token_ids:
                now = time.perf_counter()
                if st.last_token_t is not None:
                    self._max_gap_ms = max(self._max_gap_ms, 1e3 * (now - st.last_token_t))
                st.last_token_t = now
            deltas.append(
                self._delta(st, out.token_ids, out.hidden, out.finished, out.finish_reason)
            )
            if out.finished:
                del self._streams[out.request_id]
        self._max_step_ms = max(self._max_step_ms, 1e3 * (time.perf_counter() - t0))
        return deltas

    def _admit(self, reqs: list[ThinkerRequest]) -> None:
        """Hand each request to the LLM engine with no media rows yet; `_encode_step` supplies
        them. Media with a slot past the prompt's cached prefix are queued for encoding."""
        admitted = time.time()
        for r in reqs:
            sl = self._media_slots(r)
            hit = self.llm.cached_prefix_len(r.input_ids, [x.span for x in sl]) if sl else 0
            todo: dict[str, ImageInput | AudioInput] = {}
            for x in sl:  # in prompt order: media by their first slot
                if x.span.end > hit:
                    todo.setdefault(x.media.content_hash, x.media)
            self.media_skipped += len({x.media.content_hash for x in sl} - set(todo))
            st = _Stream(
                r,
                IncrementalDetokenizer(self.tokenizer),
                slots=sl,
                todo=list(todo.values()),
                marks={"admitted": admitted},
            )
            self._mark_done(st, admitted, admitted)
            if r.input_ids[-1] == self.tokens.tts_bos:
                st.span_start = 0
            self.llm.add_request(
                r.request_id,
                r.input_ids,
                r.sampling,
                return_hidden=r.return_hidden,
                mm_spans=[x.span for x in sl],
                num_ready=self._num_ready(st),
            )
            self._streams[r.request_id] = st

    def _encode_step(self) -> None:
        """Encode the admitted requests' media (requests in admission order, media in prompt
        order; media already encoded or in the encoder cache cost nothing), then the media
        sent ahead, and hand every request the rows of its media that now exist."""
        chosen: dict[str, ImageInput | AudioInput] = {}  # by key, in encoding order
        for st in self._streams.values():
            for m in st.todo:
                chosen.setdefault(m.content_hash, m)
        ahead: list[str] = []  # media encoded for requests still on their way
        for key, m in self._prefetch.items():
            if key not in chosen and key not in self._ahead and key not in self.cache:
                chosen[key] = m
                ahead.append(key)
        self._prefetch.clear()
        if not chosen:
            return
        images = {k: m for k, m in chosen.items() if isinstance(m, ImageInput)}
        audios = {k: m for k, m in chosen.items() if isinstance(m, AudioInput)}
        have, vision_end, audio_end = self._encode(images, audios, time.time())
        for key in ahead:
            self._hold(key, have[key])
        for rid, st in self._streams.items():
            done = [m for m in st.todo if m.content_hash in have]
            if not done:
                continue
            keys = {m.content_hash for m in done}
            st.todo = [m for m in st.todo if m.content_hash not in keys]
            sl = [x for x in st.slots if x.media.content_hash in keys]
            rows = [x.rows(have[x.media.content_hash]).to(self.dtype) for x in sl]
            self.llm.supply_media(rid, [x.span for x in sl], rows, self._num_ready(st))
            self._mark_done(st, vision_end, audio_end)

    @staticmethod
    def _num_ready(st: _Stream) -> int | None:
        """Prompt positions before the first slot whose media is still to encode."""
        keys = {m.content_hash for m in st.todo}
        return min((x.span.start for x in st.slots if x.media.content_hash in keys), default=None)

    @staticmethod
    def _mark_done(st: _Stream, vision_end: float, audio_end: float) -> None:
        """Stage marks once a request's last image / last media left the encoders (kept in
        order: the audio mark never precedes the vision mark)."""
        if "vision_end" not in st.marks and not any(isinstance(m, ImageInput) for m in st.todo):
            st.marks["vision_end"] = vision_end
        if "audio_end" not in st.marks and not st.todo:
            st.marks["audio_end"] = max(audio_end, st.marks["vision_end"])

    def _media_slots(self, r: ThinkerRequest) -> list[_Slot]:
        """Every `<unk>` run of the prompt with the media rows that fill it, in prompt order.
        The key names the rows by content: same media bytes and options -> same rows."""
        q = self.model.cfg.query_num
        slots, bounds = [], iter(r.image_bounds)
        for im in r.images:
            for j in range(im.num_slices):
                s, e = next(bounds)
                slots.append(_Slot(MediaSpan(s, e, f"image:{im.content_hash}:{j * q}"), im, j * q))
        for (s, e), (clip, first, _) in zip(r.audio_bounds, r.audio_segments):
            a = r.audios[clip]
            slots.append(_Slot(MediaSpan(s, e, f"audio:{a.content_hash}:{first}"), a, first))
        return sorted(slots, key=lambda x: x.span.start)

    def _encode(
        self, images: dict[str, ImageInput], audios: dict[str, AudioInput], start: float
    ) -> tuple[dict[str, torch.Tensor], float, float]:
        """Encoder outputs by content hash (cache first), with the vision / audio end times."""
        have: dict[str, torch.Tensor] = {}
        for key in list(images) + list(audios):
            hit = self._ahead.pop(key, None)
            if hit is not None:  # encoded ahead of this request: into the LRU like its own
                self.prefetch_hits += 1
                self.cache.put(key, hit)
            else:
                hit = self.cache.get(key)
            if hit is not None:
                have[key] = hit
        todo_images = {k: v for k, v in images.items() if k not in have}
        todo_audios = {k: v for k, v in audios.items() if k not in have}
        if todo_images:
            rows = self.model.encode_images(
                list(todo_images.values()), self.config.vision_batch_size
            )
            have.update(zip(todo_images, rows))
        vision_end = _synced_time(self.device) if todo_images else start
        if todo_audios:
            rows = self.model.encode_audios(list(todo_audios.values()), self.audio_graphs)
            have.update(zip(todo_audios, rows))
        audio_end = _synced_time(self.device) if todo_audios else vision_end
        for key in list(todo_images) + list(todo_audios):
            self.cache.put(key, have[key])
        return have, vision_end, audio_end

    def _hold(self, key: str, rows: torch.Tensor) -> None:
        """Keep an item's rows, encoded ahead, until its request takes them."""
        self.prefetched += 1
        self._ahead[key] = rows
        while len(self._ahead) > self.config.prefetch_capacity:
            self._ahead.popitem(last=False)

    def _load_media(self, request_id: str, spans: list[MediaSpan]) -> list[torch.Tensor]:
        """The LLM engine's callback for rows left out at admission (their cached prefix
        was evicted before the request ran, or it was preempted and must recompute)."""
        by_span = {x.span: x for x in self._streams[request_id].slots}
        slots = [by_span[sp] for sp in spans]
        images = {x.media.content_hash: x.media for x in slots if isinstance(x.media, ImageInput)}
        audios = {x.media.content_hash: x.media for x in slots if isinstance(x.media, AudioInput)}
        have, _, _ = self._encode(images, audios, time.time())
        return [x.rows(have[x.media.content_hash]).to(self.dtype) for x in slots]

    def _delta(
        self,
        st: _Stream,
        new_ids: list[int],
        hidden: torch.Tensor | None,
        finished: bool,
        reason: str | None,
    ) -> ThinkerDelta:
        tk = self.tokens
        for t in new_ids:
            i = len(st.output_ids)
            st.output_ids.append(t)
            if st.span_start is None and t == tk.tts_bos:
                st.span_start = i + 1
            elif (
                st.span_start is not None
                and st.span_end is None
                and i >= st.span_start
                and t in (tk.tts_eos, tk.im_end)
            ):
                st.span_end = i
        spoken_ids: list[int] = []
        spoken_rows: list[torch.Tensor] = []
        if hidden is not None:
            for j in range(hidden.shape[0]):
                i = st.num_hidden + j  # output index whose input-step hidden this is
                in_span = (
                    st.span_start is not None
                    and i >= st.span_start
                    and (st.span_end is None or i < st.span_end)
                )
                if in_span:
                    spoken_ids.append(st.output_ids[i])
                    spoken_rows.append(hidden[j])
            st.num_hidden += hidden.shape[0]
        st.spoken_out += len(spoken_rows)
        hold = st.request.hold_after_spoken
        if hold and not st.hold_done and not finished and st.spoken_out >= hold:
            st.hold_done = True
            st.held_since = self.holds.start()
        timings = None
        if new_ids and "first_token" not in st.marks:
            st.marks["first_token"] = time.time()
            timings = dict(st.marks)
        if finished:
            st.marks["last_token"] = time.time()
            timings = dict(st.marks)
        visible = [t for t in new_ids if t not in (tk.tts_eos, tk.im_end, tk.endoftext)]
        text = st.detok.push(visible) if visible else ""
        if finished:
            text += st.detok.flush()
        return ThinkerDelta(
            request_id=st.request.request_id,
            token_ids=list(new_ids),
            text=text,
            spoken_ids=spoken_ids,
            spoken_hidden=torch.stack(spoken_rows).float() if spoken_rows else None,
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=st.request.num_prompt_tokens,
            num_output_tokens=len(st.output_ids),
            timings=timings,
        )

    def _check_bounds(self, req: ThinkerRequest) -> None:
        n_slices = sum(im.num_slices for im in req.images)
        if len(req.image_bounds) != n_slices:
            raise ValueError(f"{len(req.image_bounds)} image bounds for {n_slices} slices")
        if len(req.audio_bounds) != len(req.audio_segments):
            raise ValueError("audio_bounds and audio_segments differ in length")
        q = self.model.cfg.query_num
        for s, e in req.image_bounds:
            if e - s != q:
                raise ValueError(f"image slot [{s}, {e}) holds {e - s} tokens, expected {q}")
        for (s, e), (clip, _, n) in zip(req.audio_bounds, req.audio_segments):
            if e - s != n or not 0 <= clip < len(req.audios):
                raise ValueError(
                    f"audio slot [{s}, {e}) does not match segment of clip {clip} ({n} tokens)"
                )

    def stats(self) -> dict[str, float]:
        graphs = self.llm.runner.graphs
        own = ThinkerStats(
            open_streams=len(self._pending) + len(self._streams),
            num_waiting_encode=len(self._pending),
            encoder_cache_hits=self.cache.hits,
            encoder_cache_misses=self.cache.misses,
            encoder_cache_items=len(self.cache),
            media_skipped=self.media_skipped,
            prefetched=self.prefetched,
            prefetch_hits=self.prefetch_hits,
            prefetch_held=len(self._ahead),
            max_step_ms=self._max_step_ms,
            max_decode_gap_ms=self._max_gap_ms,
            holds=self.holds.started,
            holds_timed_out=self.holds.timed_out,
            llm_prefill_graph_steps=graphs.prefill_steps if graphs else 0,
            **(self.audio_graphs.runner.counts("audio") if self.audio_graphs else {}),
        )
        return {**asdict(self.llm.stats()), **asdict(own)}


def _synced_time(device: torch.device) -> float:
    """Wall time once the device's queued work is done (the encoders are asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time()

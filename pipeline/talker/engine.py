"""TalkerEngine: many Talker streams decoded together, one code per stream per step.

The StageEngine protocol (pipeline/stage_engine.py), per stream (one slot = one KV-cache
row + one sampler-state row):
  open(rid, TalkerSpec)         reserve a slot; a torch.Generator seeded per request
  feed(rid, SpokenChunk)        condition rows c_i (Talker dtype) are built at once
  step()                        1. one batched decode over the slots that are decoding
                                   (a CUDA graph per (rows, read_len) bucket, or eager)
                                2. start every unit whose text is ready: prefill its prompt
                                   (one stream at a time, attention without cuDNN's
                                   per-shape graphs: pipeline/sdpa.py) and draw its first code
                                3. release 25-code chunks once 25 + 3 lookahead codes exist;
                                   the last chunk flushes the rest (finished=True)
  abort(rid)                    free the slot (also cancels a running stream)
  resume(rid)                   end the stream's hold (below): its first audio is out

A stream opened with `TalkerSpec.hold` is held once its first chunk is released: its work
runs only in steps that another stream's work calls for, until `resume` or HOLD_LIMIT_S, so
that on a GPU shared with Code2Wav the first chunk's audio comes sooner (the same codes).
Should its first unit end before that chunk, the stream waits for text its Thinker holds
for the same first audio: step() says so once (TextWanted).

A "unit" is what the reference decodes from one prompt:
  full_span   the whole spoken span: prompt [c_1..c_n, text_eos, audio_bos] once the text is
              finished; EOS masked for the first `min_new_tokens` draws; at most
              `max_new_tokens` draws, and, like `MiniCPMTTS.generate` (which returns
              `new_tokens[:, :t]`), a code drawn at the cap is dropped.
  streaming   one 10-token text chunk (`TTSStreamingGenerator.generate_with_buffer`,
              attention_type sliding_recompute): chunk k's prompt is
              [c_chunk, (text_eos if it is the last), audio_bos]; for k >= 1 the KV is
              rebuilt from scratch over [prev prompt, emb_code(prev chunk's codes), prompt]
              with positions from 0 (the reference resets `text_start_pos` to 0 before every
              recompute). A chunk ends on EOS (not emitted) or after 500 draws; the stream
              ends with its last chunk. No EOS mask. A chunk starts as soon as 10 text rows
              are waiting; the last chunk takes the rest (0..10) once the text is finished,
              so feeders should mark the SpokenChunk with the last ids `finished`.
The repetition penalty sees the stream's last 16 codes across chunks; a stream's first
draw is temperature-only.

Prefill and decode run on fused.py's forward (compiled on CUDA). On CUDA, unless
`cuda_graphs` is off, the decode step is a CUDA graph per (rows, read_len) bucket, and a
prompt of up to PREFILL_GRAPH_ROWS rows is padded at its end to a power of two and prefilled
in a one-slot staging cache as a graph per length, its K / V then copied into the stream's
slot: a graph replaces the host work of an eager prefill, and the padding after the prompt
changes none of its rows' values (only, on a GPU, the order in which their products sum).

Not thread-safe: one caller drives open/feed/step/abort.
"""

from __future__ import annotations

import heapq
import secrets
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from pipeline.config import TalkerConfig
from pipeline.graphs import GraphRunner
from pipeline.handoff import HOLD_LIMIT_S, CodeChunk, SpokenChunk, TalkerSpec, TextWanted
from pipeline.sdpa import any_shape
from pipeline.stage_engine import Holds
from pipeline.talker.fused import FusedTalker
from pipeline.talker.model import TalkerKVCache, TalkerModel
from pipeline.talker.sampling import CodeSampler, SamplerState, TalkerSamplingParams

CHUNK_CODES = 25  # codes per released chunk (1 s of audio)
LOOKAHEAD_CODES = 3  # a chunk is released once this many later codes exist
STREAMING_CHUNK_MAX_CODES = 500  # draws per text chunk (generate_with_buffer's cap)
PREFILL_GRAPH_ROWS = 128  # the longest prompt prefilled padded (a graph per length)
TalkerMode = Literal["full_span", "streaming"]
MODES: tuple[str, ...] = ("full_span", "streaming")


@dataclass(frozen=True)
class TalkerEngineConfig:
    """What an operator sets; the rest follows from the model config and the device."""

    mode: TalkerMode = "streaming"  # default for open()
    max_streams: int = 8  # slots: streams decoded together
    kv_cache_bytes: int = 0  # KV budget; 0 = what max_streams slots need (less: refused)
    cuda_graphs: bool = True  # decode steps and short prefills as CUDA graphs (False: eager)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {self.max_streams}")
        if self.kv_cache_bytes < 0:
            raise ValueError(f"kv_cache_bytes must be >= 0, got {self.kv_cache_bytes}")


def bucket_up(value: int, sizes: Sequence[int]) -> int:
    """Smallest size >= value; `sizes` is sorted ascending. Graphs or not, a step runs at its
    bucket's shape, so turning graphs off never changes the codes."""
    for size in sizes:
        if size >= value:
            return size
    raise ValueError(f"{value} exceeds the largest bucket {sizes[-1]}")


def power_of_two_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2*lo, 4*lo, ... below hi, then hi itself."""
    sizes = []
    while lo < hi:
        sizes.append(lo)
        lo *= 2
    return (*sizes, hi)


@dataclass(frozen=True)
class TalkerStats:
    """`TalkerEngine.stats()`, as a dict of these fields: counters since the engine was
    built, plus the current occupancy."""

    open_streams: int
    decoding_streams: int
    free_slots: int
    capacity: int  # slots (max_streams)
    steps: int  # batched decode steps
    graph_replays: int  # CUDA graph replays: decode steps and padded prefills
    prefills: int  # units started (one prefill each)
    codes: int  # codes kept (EOS excluded)
    unaccounted_slots: int = 0  # slots neither free nor held by an unfinished stream (a leak)
    holds: int = 0  # streams held after their first chunk (TalkerSpec.hold)
    holds_timed_out: int = 0  # ... whose hold ran out before a resume came (HOLD_LIMIT_S)
    # wall ms inside unit starts (prefill + first draw) and decode calls (replay + codes
    # read back); both end on the host reading the GPU's result, so they hold the GPU time
    prefill_ms: float = 0.0
    decode_ms: float = 0.0


@dataclass
class _Stream:
    stream_id: str
    slot: int
    mode: TalkerMode
    generator: torch.Generator
    pending: torch.Tensor  # (n, E) condition rows not yet used by a unit
    text_finished: bool = False
    decoding: bool = False
    finished: bool = False
    started_units: int = 0
    unit_final: bool = False  # the unit being decoded is the stream's last
    unit_prompt: torch.Tensor | None = None  # streaming: this chunk's [c, (eos), bos]
    unit_codes: list[int] = field(default_factory=list)
    unit_draws: int = 0
    prev_prompt: torch.Tensor | None = None  # streaming: previous chunk, for the recompute
    prev_codes: list[int] = field(default_factory=list)
    position: int = 0  # cache position of the next decode input (mirrors the device buffer)
    codes: list[int] = field(default_factory=list)  # every kept code (EOS excluded)
    max_codes: int | None = None  # fixed-length mode: EOS ignored, exactly this many codes
    released: int = 0
    chunk_started_at: float = 0.0  # wall clock the chunk being decoded started
    chunks_sent: int = 0
    done_sent: bool = False
    hold: bool = False  # TalkerSpec.hold: held once its first chunk is out, until resumed
    text_wanted: bool = False  # told that it waits for held text (TextWanted), once
    held_since: float = 0.0  # monotonic start of the hold; 0 = not held


class TalkerEngine:
    """Batched Talker decode over slots; implements StageEngine. See the module docstring."""

    config_cls = TalkerEngineConfig

    def __init__(self, model: TalkerModel, config: TalkerEngineConfig | None = None) -> None:
        self.model = model.eval()
        self.cfg: TalkerConfig = model.cfg
        weight = model.emb_code[0].weight
        self.device, self.dtype = weight.device, weight.dtype
        self.config = config or TalkerEngineConfig()
        slots, self.max_len = self.config.max_streams, self.cfg.max_position_embeddings
        self._check_capacity()
        self.cache = TalkerKVCache(self.cfg, slots, self.max_len, self.dtype, self.device)
        self.decoder = FusedTalker(model)  # compiled, with the RoPE kernel, on CUDA
        self.batch_sizes = power_of_two_buckets(1, slots)  # decode graphs' row buckets
        self.kv_lengths = power_of_two_buckets(min(256, self.max_len), self.max_len)
        self.params = TalkerSamplingParams.from_config(self.cfg)
        self.eos = self.cfg.eos_code
        vocab = self.cfg.num_audio_tokens
        self.sampler = CodeSampler(self.params, vocab, self.eos, self.device)
        self.state = SamplerState.empty(slots, self.params.repetition_window, vocab, self.device)
        # Static decode buffers: row r = slot r.
        self._in_codes = torch.zeros(slots, dtype=torch.long, device=self.device)
        self._positions = torch.zeros(slots, dtype=torch.long, device=self.device)
        self._active = torch.zeros(slots, dtype=torch.bool, device=self.device)
        self._out_codes = torch.zeros(slots, dtype=torch.long, device=self.device)
        self._one_active = torch.ones(1, dtype=torch.bool, device=self.device)
        self._streams: dict[str, _Stream] = {}
        self._free: list[int] = list(range(slots))  # a heap: lowest slot first keeps R small
        self._steps = self._prefills = self._codes = 0
        self._prefill_ms = self._decode_ms = 0.0
        self.holds = Holds(HOLD_LIMIT_S)
        self.prefill_lengths: tuple[int, ...] = ()  # prompts padded to these (_pad_prefills)
        self.graphs: GraphRunner | None = None
        if self.config.cuda_graphs and self.device.type == "cuda":
            self._pad_prefills(PREFILL_GRAPH_ROWS)
            self._capture()
        if self.decoder.compiled:
            self._compile_now()

    def _check_capacity(self) -> None:
        """Refuse to build when the KV budget cannot hold max_streams streams."""
        budget, streams = self.config.kv_cache_bytes, self.config.max_streams
        per_slot = TalkerKVCache.bytes_per_slot(self.cfg, self.max_len, self.dtype)
        if budget and budget < streams * per_slot:
            raise ValueError(
                f"talker: kv_cache_bytes {budget} holds {budget // per_slot} streams of "
                f"{per_slot} bytes ({self.max_len} positions), not max_streams {streams}: "
                f"raise kv_cache_bytes (and the stage's memory_fraction) or lower max_streams "
                f"(the capacity)")

    def _pad_prefills(self, top: int) -> None:
        """Prefill prompts of up to `top` rows padded to a power of two in a one-slot staging
        cache (see the module docstring); longer prompts prefill as they are."""
        top = min(top, self.max_len)
        self.prefill_lengths = power_of_two_buckets(min(16, top), top)
        self.staging = TalkerKVCache(self.cfg, 1, top, self.dtype, self.device)
        self._last = torch.zeros(1, dtype=torch.long, device=self.device)

    @torch.no_grad()
    def _capture(self) -> None:
        """Capture the decode step per (rows, read_len) bucket and the padded prefills. The
        step runs on static buffers only, never syncs with the host, and leaves idle rows
        untouched: every row is idle now, so the warm-up runs change nothing."""
        keys = [(r, n) for r in self.batch_sizes for n in self.kv_lengths]
        self.graphs = GraphRunner(max_graphs=len(keys) + len(self.prefill_lengths))
        for key in sorted(keys, reverse=True):  # largest first: smaller ones reuse its pool
            self.graphs.add(key, lambda key=key: self._decode_rows(*key))
        for n in reversed(self.prefill_lengths):
            rows = torch.zeros(n, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
            with any_shape():
                self.graphs.add(("prefill", n), self._prefill_padded, (rows, self._last))
        torch.cuda.synchronize()

    @classmethod
    def from_source(
        cls, source: Any, config: TalkerEngineConfig | None = None, device: str = "cpu"
    ) -> TalkerEngine:
        """The engine of a ModelSource's Talker (the checkpoint's `tts.` part, strictly
        loaded) in bf16 on CUDA, fp32 on the CPU."""
        from pipeline.checkpoint import load_into, load_part, talker_schema
        from pipeline.utils import resolve_dtype

        cfg = source.config.talker
        model = TalkerModel(cfg)
        part = load_part(source.tensors, "tts.", talker_schema(cfg), "cpu", torch.float32)
        load_into(model, part, "talker")
        return cls(model.to(device=device, dtype=resolve_dtype("auto", device)), config)

    @torch.no_grad()
    def _compile_now(self) -> None:
        """Compile what the decode graphs' warm-up runs did not, so that no request waits
        for Inductor: the prefill's parts (prompt length dynamic; slot 0 is free and its
        next prefill rewrites these positions) and, without graphs, the decode's at one row
        and at many (every row idle: nothing changes, as in a graph capture)."""
        warm = torch.zeros(7, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        with any_shape():
            self.decoder.prefill(self.cache, 0, warm)
            if self.prefill_lengths:  # the padded prefill (a replay where it was captured)
                self._prefill(0, warm)
        if self.graphs is None:
            for rows in sorted({1, self.batch_sizes[-1]}):
                self._decode_rows(rows, self.kv_lengths[0])

    # -- public API ----------------------------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def has_work(self) -> bool:
        """True while a step() would decode, start a unit or release a chunk for a stream
        that is not held (a held stream's work runs only beside another's)."""
        return any(
            (s.decoding or (not s.finished and self._ready(s) is not None)
             or self._releasable(s)) and not self._held(s)
            for s in self._streams.values()
        )

    def resume(self, rid: str) -> None:
        """End the stream's hold (its first audio is out); unknown ids are ignored."""
        s = self._streams.get(rid)
        if s is not None:
            s.held_since = 0.0

    def _held(self, s: _Stream) -> bool:
        s.held_since = self.holds.check(s.held_since)
        return bool(s.held_since)

    def capacity(self) -> dict[str, int | str]:
        """The streams this engine's memory holds: one KV slot of every position a stream
        may reach (max_position_embeddings) each, all allocated at build."""
        per_slot = TalkerKVCache.bytes_per_slot(self.cfg, self.max_len, self.dtype)
        slots = self.config.max_streams
        return {"streams": slots, "stream_bytes": per_slot, "budget_bytes": slots * per_slot,
                "holder": f"KV slots of {self.max_len} positions"}

    def stats(self) -> dict[str, float]:
        streams = self._streams.values()
        return asdict(TalkerStats(
            open_streams=len(self._streams),
            decoding_streams=sum(s.decoding for s in streams),
            free_slots=len(self._free),
            capacity=self.config.max_streams,
            steps=self._steps,
            graph_replays=self.graphs.replays if self.graphs is not None else 0,
            prefills=self._prefills,
            codes=self._codes,
            unaccounted_slots=self.config.max_streams - len(self._free)
            - sum(not s.finished for s in streams),
            holds=self.holds.started,
            holds_timed_out=self.holds.timed_out,
            prefill_ms=round(self._prefill_ms, 3),
            decode_ms=round(self._decode_ms, 3),
        ))

    def stream_codes(self, stream_id: str) -> list[int]:
        """Every code the stream kept so far (released or not), EOS excluded."""
        return list(self._streams[stream_id].codes)

    def open(self, rid: str, spec: TalkerSpec | None = None) -> None:
        """Reserve a slot for the stream (spec None: the configured mode, a random seed)."""
        spec = spec or TalkerSpec()
        max_codes, seed = spec.max_codes, spec.seed
        if max_codes is not None and max_codes < 1:
            raise ValueError(f"max_codes must be >= 1, got {max_codes}")
        if rid in self._streams:
            raise ValueError(f"stream {rid!r} is already open")
        mode = spec.mode or self.config.mode
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "streaming" and self.cfg.attention_type != "sliding_recompute":
            raise ValueError(f"streaming mode implements attention_type 'sliding_recompute' "
                             f"only, the checkpoint says {self.cfg.attention_type!r}; use mode "
                             f"'full_span'")
        if seed is not None and not 0 <= seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63 - 1], got {seed}")
        if not self._free:
            raise RuntimeError(f"no free Talker slot ({self.config.max_streams} in use)")
        # Everything that can fail comes before the slot is taken: a refused open holds nothing.
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed if seed is not None else secrets.randbits(63))
        pending = torch.empty(0, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        slot = heapq.heappop(self._free)
        self._streams[rid] = _Stream(rid, slot, mode, generator, pending, max_codes=max_codes,
                                     hold=spec.hold)
        min_new = self.cfg.min_new_tokens if mode == "full_span" else 0
        self.state.reset_row(slot, max(min_new, max_codes or 0))
        self._active[slot] = False

    @torch.no_grad()
    def feed(self, rid: str, msg: SpokenChunk) -> None:
        """The next spoken ids (n,) and their hidden states (n, llm_dim)."""
        s = self._streams.get(rid)
        if s is None:
            raise KeyError(f"no Talker stream {rid!r}")
        if s.text_finished:
            raise ValueError(f"stream {rid!r}: text already finished")
        if s.finished:  # fixed-length mode spoke its max_codes: the rest is not spoken
            s.text_finished = msg.finished
            return
        ids = torch.as_tensor(msg.ids, dtype=torch.long).reshape(-1).to(self.device)
        hidden = torch.zeros(0, self.cfg.llm_dim) if msg.hidden is None else msg.hidden
        if hidden.shape != (ids.numel(), self.cfg.llm_dim):
            raise ValueError(f"hidden must be ({ids.numel()}, {self.cfg.llm_dim}), "
                             f"got {tuple(hidden.shape)}")
        total = s.pending.shape[0] + ids.numel()
        if s.mode == "full_span" and total + 2 >= self.max_len:
            # the prompt (span + text_eos + audio_bos) and at least one code must fit
            raise ValueError(f"stream {rid!r}: spoken span of {total} rows does not fit "
                             f"the {self.max_len} positions of a slot")
        if ids.numel():
            rows = self.model.build_condition(ids, hidden.to(self.device))
            s.pending = torch.cat([s.pending, rows], dim=0)
        s.text_finished = msg.finished

    @torch.no_grad()
    def step(self) -> list[CodeChunk | TextWanted]:
        decoding = [s for s in self._streams.values() if s.decoding]
        if decoding:
            self._decode(decoding)
        for s in list(self._streams.values()):
            if not s.decoding and not s.finished:
                unit = self._ready(s)
                if unit is not None:
                    self._start(s, *unit)
        out: list[CodeChunk | TextWanted] = []
        for s in self._streams.values():
            out.extend(self._release(s))
            if self._wants_held_text(s):
                s.text_wanted = True
                out.append(TextWanted(s.stream_id))
        return out

    def _wants_held_text(self, s: _Stream) -> bool:
        """A held turn's stream whose first unit ended before its first chunk: it waits for
        text its Thinker holds until the first audio, which needs this stream's chunk."""
        return (s.hold and not s.text_wanted and s.started_units and not s.chunks_sent
                and not s.decoding and not s.text_finished and self._ready(s) is None)

    def abort(self, rid: str) -> None:
        s = self._streams.pop(rid, None)
        if s is not None and not s.finished:
            self._free_slot(s)

    # -- units ---------------------------------------------------------------------------

    def _ready(self, s: _Stream) -> tuple[int, bool] | None:
        """(pending rows the next unit takes, is_last_unit) if its text is there, else None."""
        n = s.pending.shape[0]
        if s.mode == "full_span":
            return (n, True) if s.text_finished and not s.started_units else None
        size = self.cfg.streaming_text_chunk
        if n > size or (n == size and not s.text_finished):
            return size, False
        return (n, True) if s.text_finished else None

    def _start(self, s: _Stream, take: int, final: bool) -> None:
        """Prefill the next unit's prompt into the slot and draw its first code."""
        t0 = time.perf_counter()
        text_rows, s.pending = s.pending[:take], s.pending[take:]
        if s.mode == "full_span":
            prompt = self.model.offline_prompt(text_rows)
        else:
            s.unit_prompt = self.model.streaming_prompt(text_rows, final)
            prompt = s.unit_prompt
            if s.prev_prompt is not None:  # sliding_recompute: rebuild from the previous chunk
                parts = [s.prev_prompt]
                if s.prev_codes:
                    prev = torch.tensor(s.prev_codes, dtype=torch.long, device=self.device)
                    parts.append(self.model.embed_codes(prev))
                prompt = torch.cat([*parts, s.unit_prompt], dim=0)
        length = prompt.shape[0]
        if length >= self.max_len:
            raise RuntimeError(
                f"stream {s.stream_id!r}: prompt of {length} does not fit the {self.max_len} "
                f"positions of a slot")
        if not s.started_units:
            s.chunk_started_at = time.time()
        s.started_units += 1
        self._prefills += 1
        s.unit_final, s.unit_codes, s.unit_draws, s.decoding = final, [], 0, True
        s.position = length
        with any_shape():  # a chunk's recompute prompt has any length
            logits = self._prefill(s.slot, prompt)  # (V,)
        self.state.noise[s.slot].exponential_(generator=s.generator)
        rows = self.state.rows(s.slot, s.slot + 1)
        code = self.sampler(logits[None], rows, self._one_active)  # (1,)
        self._in_codes[s.slot : s.slot + 1].copy_(code)
        self._positions[s.slot] = length
        self._active[s.slot] = True
        self._accept(s, int(code.item()))
        self._prefill_ms += 1e3 * (time.perf_counter() - t0)

    def _prefill(self, slot: int, prompt: torch.Tensor) -> torch.Tensor:
        """A unit's prompt (L, E) into `slot` from position 0; its logits at the last row.
        With L within the padded lengths: padded to a length's rows in the staging slot (that
        length's CUDA graph where there are graphs), then rows [0, L) of its K / V copied
        into `slot`."""
        length = prompt.shape[0]
        if not self.prefill_lengths or length > self.prefill_lengths[-1]:
            return self.decoder.prefill(self.cache, slot, prompt)
        rows = F.pad(prompt, (0, 0, 0, bucket_up(length, self.prefill_lengths) - length))
        self._last.fill_(length - 1)
        if self.graphs is not None:
            logits = self.graphs.run(("prefill", rows.shape[0]), (rows, self._last),
                                     self._prefill_padded)
        else:
            logits = self._prefill_padded(rows, self._last)
        self.cache.kv[:, :, slot, :, :length].copy_(self.staging.kv[:, :, 0, :, :length])
        return logits

    def _prefill_padded(self, rows: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return self.decoder.prefill_padded(self.staging, rows, last)

    def _decode(self, decoding: list[_Stream]) -> None:
        t0 = time.perf_counter()
        rows = bucket_up(max(s.slot for s in decoding) + 1, self.batch_sizes)
        read_len = bucket_up(max(s.position for s in decoding) + 1, self.kv_lengths)
        for s in decoding:
            self.state.noise[s.slot].exponential_(generator=s.generator)
        self._steps += 1
        if self.graphs is not None:
            self.graphs.run((rows, read_len), (), lambda: self._decode_rows(rows, read_len))
        else:
            self._decode_rows(rows, read_len)
        codes = self._out_codes[:rows].tolist()
        self._decode_ms += 1e3 * (time.perf_counter() - t0)
        for s in decoding:
            s.position += 1
            self._accept(s, codes[s.slot])

    def _decode_rows(self, rows: int, read_len: int) -> None:
        """One step over slots [0, rows) on static buffers (captured as a CUDA graph)."""
        codes_in = self._in_codes[:rows]
        active = self._active[:rows]
        logits = self.decoder.decode(self.cache, codes_in, self._positions[:rows], active, read_len)
        codes = self.sampler(logits, self.state.rows(0, rows), active)
        self._out_codes[:rows].copy_(codes)
        self._in_codes[:rows].copy_(torch.where(active, codes, codes_in))
        self._positions[:rows].add_(active.long())

    def _accept(self, s: _Stream, code: int) -> None:
        """Book one drawn code; end the unit on EOS or a cap."""
        s.unit_draws += 1
        if code == self.eos:
            self._end_unit(s)
            return
        if s.mode == "full_span" and s.unit_draws >= self.cfg.max_new_tokens:
            self._end_unit(s)  # the reference drops the code drawn at the cap
            return
        s.codes.append(code)
        s.unit_codes.append(code)
        self._codes += 1
        if s.max_codes is not None and len(s.codes) >= s.max_codes:
            s.unit_final = True  # fixed-length mode: the stream is done
            self._end_unit(s)
            return
        # a text chunk's draws stop at generate_with_buffer's cap, or at the checkpoint's
        # whole-answer cap where that is lower (the embedded tiny default's)
        cap = min(STREAMING_CHUNK_MAX_CODES, self.cfg.max_new_tokens)
        capped = s.mode == "streaming" and s.unit_draws >= cap
        if capped or s.position >= self.max_len:
            self._end_unit(s)

    def _end_unit(self, s: _Stream) -> None:
        s.decoding = False
        self._active[s.slot] = False
        if s.mode == "streaming":
            s.prev_prompt, s.prev_codes = s.unit_prompt, s.unit_codes
            s.unit_prompt, s.unit_codes = None, []
        if s.unit_final:
            s.finished = True
            self._free_slot(s)

    def _free_slot(self, s: _Stream) -> None:
        self._active[s.slot] = False
        heapq.heappush(self._free, s.slot)

    # -- chunk release -------------------------------------------------------------------

    def _releasable(self, s: _Stream) -> bool:
        need = CHUNK_CODES + LOOKAHEAD_CODES
        return len(s.codes) - s.released >= need or (s.finished and not s.done_sent)

    def _release(self, s: _Stream) -> list[CodeChunk]:
        size, ahead = CHUNK_CODES, LOOKAHEAD_CODES
        out = []
        while len(s.codes) - s.released >= size + ahead:
            a, now = s.released, time.time()
            out.append(CodeChunk(s.stream_id, tuple(s.codes[a : a + size]), False,
                                 tuple(s.codes[a + size : a + size + ahead]), s.chunks_sent,
                                 s.chunk_started_at, now))
            s.chunk_started_at = now
            s.released += size
            s.chunks_sent += 1
            if s.hold and s.chunks_sent == 1:
                s.held_since = self.holds.start()
        if s.finished and not s.done_sent:
            out.append(CodeChunk(s.stream_id, tuple(s.codes[s.released :]), True, (),
                                 s.chunks_sent, s.chunk_started_at, time.time()))
            s.released = len(s.codes)
            s.chunks_sent += 1
            s.done_sent = True
        return out

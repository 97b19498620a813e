"""Code2WavEngine: many concurrent code streams -> 24 kHz PCM chunks, batched across streams.

The StageEngine protocol (pipeline/stage_engine.py):

    engine.open("s1", voice)                        # a slot, filled from the voice's template
    engine.feed("s1", CodeChunk("s1", codes, final)) # Talker output as it arrives
    for chunk in engine.step():                     # PcmChunk: every ready chunk in one step
        ...
    engine.abort("s1")                              # frees the stream's state and slot
    engine.warmup()                                 # at deployment start: template + graph captures

Every stream's flow caches live in a slot pool (slots.py), one slot a stream, `max_streams`
slots: a turn beyond them is refused at open. Every ready chunk, of any phase, voice or final
length, is one padded row of a single step, and the step is padded up to one of a few batch
sizes (`batch_sizes`). The step's flow runs as one CUDA graph per (batch size, DiT window) and
the vocoder, a group of equal state split into those sizes, as CUDA graphs per chunk shape on
CUDA, eagerly elsewhere;
the DiT blocks and the vocoder's Snakes are compiled on CUDA only. The padded rows reorder
float sums only (masked softmax over padded keys): tests/test_code2wav_slots.py bounds the
step against one stream at a time through the reference modules.
"""

from __future__ import annotations

import contextlib
import time
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import torch

from pipeline.code2wav.causal_hift import CausalHiFT
from pipeline.code2wav.dit import compile_dit_blocks, compile_slot_blocks
from pipeline.code2wav.flow import Flow
from pipeline.code2wav.graphs import CausalVocoderGraphs, HiFTGraphRunner
from pipeline.code2wav.hift import HiFTGenerator, freeze_weight_norms, fuse_snakes
from pipeline.code2wav.slots import FlowSlotPool, Row, flatten, index_to, unflatten
from pipeline.code2wav.stream import (
    DEFAULT_REFERENCE,
    CodeCursor,
    Crossfade,
    StreamState,
    Token2WavReference,
    initial_state,
    vocode,
)
from pipeline.code2wav.voice import VoiceCache, VoicePrompt
from pipeline.config import Code2WavConfig
from pipeline.graphs import GraphRunner
from pipeline.handoff import CodeChunk, PcmChunk

MAX_GRAPHS = 96  # per runner, at least; the vocoder's holds ~2 per batch size + 52 last chunks
# Graphs kept per batch size (max_graphs scales with the batch sizes past MAX_GRAPHS): the flow's
# WARMUP_CHUNKS growing DiT windows and a first-and-last chunk's window at each size, so
# none that the warm-up captured is evicted and captured again under load.
GRAPHS_PER_BATCH = 6
VOICE_TEMPLATES = 8  # unpinned voice templates kept (least recently used evicted)
# `warmup` decodes this many throwaway full chunks at each batch size, so the first requests
# find the graphs captured and the compiled blocks built
WARMUP_CHUNKS = 4
POLL_S = 0.0002  # `Landing.wait` with a timeout: how often it asks the GPU


def batch_sizes(max_streams: int) -> tuple[int, ...]:
    """The step's batch sizes (each a flow graph per DiT window and vocoder graphs of its
    own): every size up to 4, then 6, 8 and every 4th, and `max_streams`. A step of other
    sizes pads its flow rows up to the next one and splits a vocoder group into these sizes,
    so the warm-up captures 12 sizes at 32 streams instead of 32, and a padded flow step
    does at most a third more rows than it needs."""
    sizes = [b for b in (1, 2, 3, 4, 6, 8) if b < max_streams]
    sizes += range(12, max_streams, 4)
    return tuple(sorted({*sizes, max_streams}))


def split_sizes(n: int, sizes: tuple[int, ...]) -> list[int]:
    """`n` rows as a sum of `sizes` (largest first; 1 is always one of them)."""
    parts = []
    while n:
        part = max(b for b in sizes if b <= n)
        parts.append(part)
        n -= part
    return parts


@dataclass(frozen=True)
class Code2WavEngineConfig:
    # fp32: every matmul and conv in fp32, as the reference computes on CPU (cuDNN's default
    # TF32 convs off); tf32: TF32 tensor cores for the flow's matmuls and convs; bf16: the DiT
    # estimator's weights, activations and caches in bf16 (it is ~all of the flow's work; the
    # encoder, the Euler update and the vocoder stay fp32); fp16: the reference's own
    # `Token2wav(float16=True)`: the whole flow (encoder, DiT, noise, caches, Euler update) in
    # half precision under CUDA fp16 autocast, the vocoder in fp32 (on CPU, where the
    # reference's autocast does not apply, every flow op runs in fp16). tf32, bf16 and fp16
    # are opt-in: they change the audio (SNR in docs/performance.md). The TF32 flags are set
    # for the whole process on CUDA; bf16 and fp16 convert the flow in place.
    token2wav_precision: Literal["fp32", "tf32", "bf16", "fp16"] = "fp32"
    # Euler steps of the CFM (the reference's `n_timesteps`; its cosine schedule over them):
    # fewer steps, less flow work a chunk, other audio. The slot pool holds caches per step.
    n_timesteps: int = 10
    # Turns held at once, one slot each (a step batches up to this many ready chunks), and the
    # longest voice prompt a slot holds (mel frames, 50 a second): both size the slot pool's
    # memory. A longer reference voice is refused at open.
    max_streams: int = 8
    slot_prompt_frames: int = 500
    # which reference's streaming a turn follows (stream.py): prompt lookahead, leading zeros
    token2wav_reference: Token2WavReference = DEFAULT_REFERENCE
    hift_seed: int | None = 0  # per-stream HiFT noise generators; None = global RNG (reference)

    def __post_init__(self):
        if self.n_timesteps <= 0:
            raise ValueError(f"n_timesteps must be positive, got {self.n_timesteps}")


@dataclass
class _Stream:
    state: StreamState  # `state.flow` is None: the caches are in the slot
    cursor: CodeCursor
    slot: int | None  # None once its last chunk is decoded


def batch_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x's `rows` (ascending): a view when they are consecutive (a step's streams usually
    share one vocoder shape), else a gather through an index copied from pinned memory.
    Indexing a CUDA tensor with a list copies the list with a blocking copy, which waits
    for the stream's queued work: the host would wait for the flow's graph to finish before
    preparing the vocoder, and the GPU for the host."""
    first = rows[0]
    if rows == list(range(first, first + len(rows))):
        return x[first : first + len(rows)]
    index = torch.tensor(rows, dtype=torch.long)
    if x.is_cuda:
        index = index.pin_memory().to(x.device, non_blocking=True)
    return x.index_select(0, index)


class Landing:
    """A launched Code2Wav step (`Code2WavEngine.launch`): its PCM lands in pinned host
    memory behind the step's kernels; `ready()` asks without waiting, `result()` waits and
    returns {id: (pcm, last)} as `decode` does. It holds the tensors the step reads (the
    streams' states before it) until then."""

    def __init__(self, engine: Code2WavEngine, ids: list[str], last: list[bool],
                 held: list[StreamState]):
        self.engine, self.ids, self.last, self.held = engine, ids, last, held
        self.pieces: list[tuple[list[int], torch.Tensor]] = []
        self.event: torch.cuda.Event | None = None
        self.started = 0.0
        self.out: dict[str, tuple[np.ndarray, bool]] | None = None

    def copy(self, members: list[int], speech: torch.Tensor) -> None:
        """Rows `members` of the step get `speech` (B, N), copied off the device after the
        kernels enqueued so far."""
        speech = speech.float()
        if speech.is_cuda:
            host = torch.empty(speech.shape, dtype=speech.dtype, pin_memory=True)
            host.copy_(speech, non_blocking=True)
        else:
            host = speech.clone()
        self.pieces.append((members, host))

    def record(self) -> None:
        """Mark the end of the step's work on the current stream (CUDA)."""
        if self.engine.device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()

    def ready(self) -> bool:
        return self.out is not None or self.event is None or self.event.query()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the step is done on the GPU, or `timeout` seconds (polling); whether
        it is done."""
        if timeout is None:
            if self.event is not None:
                self.event.synchronize()
            return True
        end = time.perf_counter() + timeout
        while not self.ready():
            if time.perf_counter() >= end:
                return False
            time.sleep(POLL_S)
        return True

    def result(self) -> dict[str, tuple[np.ndarray, bool]]:
        if self.out is None:
            self.wait()
            pcm: dict[int, np.ndarray] = {}
            for members, host in self.pieces:
                rows = host.numpy()
                for j, r in enumerate(members):
                    pcm[r] = rows[j]
            self.out = {sid: (pcm[r], self.last[r]) for r, sid in enumerate(self.ids)}
            self.held = []
            self.engine._landed(self)
        return self.out


class Code2WavEngine:
    """Implements StageEngine; see the module docstring."""

    config_cls = Code2WavEngineConfig

    def __init__(
        self,
        flow: Flow,
        hift: HiFTGenerator | CausalHiFT,
        cfg: Code2WavConfig,
        engine_cfg: Code2WavEngineConfig = Code2WavEngineConfig(),
        clock: Callable[[], float] = time.monotonic,
        voices: VoiceCache | None = None,
    ):
        self.flow, self.hift, self.cfg, self.ecfg = flow, hift, cfg, engine_cfg
        self.voices = voices  # default voice + reference-audio LRU (open(rid, None))
        self.device = next(flow.parameters()).device
        self.crossfade = Crossfade(cfg.mel_overlap_frames * cfg.hift.hop_length, self.device)
        cuda = self.device.type == "cuda"
        estimator = flow.decoder.estimator
        flow.decoder.n_timesteps = engine_cfg.n_timesteps  # before the pool: caches per step
        if engine_cfg.token2wav_precision == "bf16":
            estimator.to(torch.bfloat16)
        elif engine_cfg.token2wav_precision == "fp16":
            flow.half()  # [MU7] Token2wav(float16=True): `self.flow.half()`, its buffers too
        estimator.prepare_slot_path()  # after the dtype change, which replaces the parameters
        if cuda:
            # in place; compiles lazily on first use (setup_cache, the graph runner's warm-up)
            compile_dit_blocks(estimator)
            compile_slot_blocks(estimator)
            tf32 = engine_cfg.token2wav_precision == "tf32"
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
        self.fp16_autocast = cuda and engine_cfg.token2wav_precision == "fp16"
        self.graph_sizes = batch_sizes(engine_cfg.max_streams)
        self.max_graphs = max(MAX_GRAPHS, GRAPHS_PER_BATCH * len(self.graph_sizes))
        self.pool = FlowSlotPool(flow, engine_cfg.max_streams, engine_cfg.slot_prompt_frames,
                                 self.device, next(flow.parameters()).dtype)
        self.graphs = GraphRunner(self.max_graphs) if cuda else None
        freeze_weight_norms(hift)  # exact: the weights a chunk's forward would compute
        fuse_snakes(hift, cuda)
        self.hift_graphs = None
        if cuda:
            runner = CausalVocoderGraphs if isinstance(hift, CausalHiFT) else HiFTGraphRunner
            self.hift_graphs = runner(hift, self.graph_sizes, self.max_graphs)
            if isinstance(self.hift_graphs, CausalVocoderGraphs):
                self.hift_graphs.capture_last = False  # the warm-up captures them
        self.time_table = self._time_table()
        self.streams: OrderedDict[str, _Stream] = OrderedDict()
        self.templates: OrderedDict[str, StreamState] = OrderedDict()
        self.pinned: set[str] = set()  # voice keys whose template the LRU never evicts
        self.counters: Counter = Counter()
        self.clock = clock
        self._pending: Landing | None = None  # the step `launch` left in flight

    def _autocast(self):
        """The flow's precision context: CUDA fp16 autocast in the fp16 mode on CUDA, as
        [MU7]'s Token2wav runs its `.half()` flow (LayerNorms, softmax and normalisations in
        fp32 there, matmuls and convs in fp16); nothing elsewhere."""
        if self.fp16_autocast:
            return torch.autocast("cuda", torch.float16)
        return contextlib.nullcontext()

    def _time_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The CFM's per-step table, computed once: nothing step-dependent is built inside a
        step (or a graph)."""
        with torch.inference_mode(), self._autocast():
            t_emb, dt = self.flow.decoder.time_table(
                self.device, next(self.flow.parameters()).dtype
            )
        return t_emb.clone(), dt.clone()

    @classmethod
    def from_source(
        cls, source: Any, config: Code2WavEngineConfig | None = None, device: str = "cpu"
    ) -> Code2WavEngine:
        """The engine of a ModelSource's token2wav (a random full-size flow + the causal
        vocoder for a source without files), with its VoiceCache, warmed up."""
        from pipeline.code2wav.assets import token2wav_dir, token2wav_from_source

        config = config or Code2WavEngineConfig()
        # fp32 on every device: the reference runs the flow and HiFT in fp32, and a lower
        # precision would change the audio.
        flow, hift, c2w_cfg, voice_dir = token2wav_from_source(source, device)
        engine = cls(flow, hift, c2w_cfg, config, voices=VoiceCache(token2wav_dir(voice_dir)))
        engine.warmup()  # default voice's template; graph captures before the first request
        return engine

    # -- streams -----------------------------------------------------------------------

    def _template(self, voice: VoicePrompt) -> StreamState:
        """`voice`'s initial state (encoder + a full CFM over the prompt), built once."""
        key = voice.key
        tpl = self.templates.get(key)
        if tpl is None:
            self.counters["template_builds"] += 1
            tpl = self.templates[key] = self._build_state(voice)
            self._evict()
        else:
            self.counters["template_hits"] += 1
            self.templates.move_to_end(key)
        return tpl

    def check_voice(self, voice: VoicePrompt) -> None:
        """Build `voice`'s template now; ValueError when its prompt is longer than a slot
        holds (what `open` would refuse)."""
        self.pool.check_prompt(self._template(voice).prompt_frames)

    def initial_state(self, voice: VoicePrompt) -> StreamState:
        """A fresh stream state for `voice`: a clone of its template."""
        return self._template(voice).clone()

    def pin_voice(self, voice: VoicePrompt) -> None:
        """Build `voice`'s template now and keep it until `unpin_voice` (stored voices: built
        once, whatever the ad-hoc reference voices do to the LRU)."""
        self.pinned.add(voice.key)
        self._template(voice)

    def unpin_voice(self, voice: VoicePrompt) -> None:
        self.pinned.discard(voice.key)
        self.templates.pop(voice.key, None)

    def _evict(self) -> None:
        """Drop the least recently used unpinned templates beyond VOICE_TEMPLATES."""
        unpinned = [k for k in self.templates if k not in self.pinned]
        for key in unpinned[: max(0, len(unpinned) - VOICE_TEMPLATES)]:
            del self.templates[key]

    def _build_state(self, voice: VoicePrompt) -> StreamState:
        v = voice.to(self.device)
        dtype = next(self.flow.parameters()).dtype
        with self._autocast():
            return initial_state(
                self.flow,
                self.cfg,
                v.prompt_tokens,
                v.prompt_mel.to(dtype),  # in fp16 what fp16 autocast's in_proj would round
                v.spk_emb.float(),  # normalized in fp32 (Flow.speaker), as [MU7]'s x-vector
                reference=self.ecfg.token2wav_reference,
                vocoder=self.hift,
            )

    def open(self, rid: str, spec: VoicePrompt | None = None,
             generator: torch.Generator | None = None) -> None:
        """Start a turn in voice `spec`: None = the checkpoint's default voice (needs
        `voices`); for a request's reference audio pass `engine.voices.from_audio(wav, rate)`.
        `generator`: the vocoder's noise for this turn (default: one seeded from `hift_seed`
        and `rid`). Raises NoFreeSlot when every slot is taken, ValueError for a voice prompt
        longer than a slot holds."""
        if rid in self.streams:
            raise ValueError(f"stream {rid!r} is already open")
        self.settle()
        voice = spec
        if voice is None:
            if self.voices is None:
                raise ValueError(
                    "no voice given and the engine has no VoiceCache for the default voice"
                )
            voice = self.voices.default()
        tpl = self._template(voice)
        slot = self.pool.admit(tpl.flow, tpl.prompt_frames)
        state = replace(tpl, flow=None, vocoder=tpl.vocoder.clone())
        if generator is not None:
            state.generator = generator
        elif self.ecfg.hift_seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(self.ecfg.hift_seed * 1_000_003 + zlib.crc32(rid.encode()))
            state.generator = gen
        self.streams[rid] = _Stream(state, CodeCursor.start(self.cfg), slot)
        self.counters["streams_opened"] += 1

    def grow(self, streams: int) -> None:
        """Hold `streams` turns at once (more than now): the slot pool grows (its resident
        streams copied), and the flow's graphs, captured over the old pool, are dropped;
        batch sizes up to the new count."""
        self.settle()
        self.pool.grow(streams)
        self.ecfg = replace(self.ecfg, max_streams=streams)
        self.graph_sizes = batch_sizes(streams)
        self.max_graphs = max(MAX_GRAPHS, GRAPHS_PER_BATCH * len(self.graph_sizes))
        if self.graphs is not None:
            self.graphs = GraphRunner(self.max_graphs)
        if self.hift_graphs is not None:
            self.hift_graphs.batch_sizes = self.graph_sizes
            self.hift_graphs.max_graphs = self.max_graphs

    def feed(self, rid: str, msg: CodeChunk) -> None:
        """The stream's next codes, in order (`msg.finished`: no more will come)."""
        s = self.streams.get(rid)
        if s is None:
            raise KeyError(f"no Code2Wav stream {rid!r}")
        if msg.request_id != rid:
            raise ValueError(f"codes of stream {msg.request_id!r} fed to {rid!r}")
        s.cursor.push(list(msg.codes), msg.finished)

    def abort(self, rid: str) -> None:
        self.settle()
        s = self.streams.pop(rid, None)
        if s is not None and s.slot is not None:
            self.pool.release(s.slot)

    def has_work(self) -> bool:
        return any(s.cursor.next_chunk(self.cfg) is not None for s in self.streams.values())

    def capacity(self) -> dict[str, int | str]:
        """The streams this engine's memory holds: the slot pool's slots (its spare row for
        padding is counted in each slot's share), all allocated at build."""
        slots, total = self.pool.slots, self.pool.nbytes()
        return {"streams": slots, "stream_bytes": -(-total // slots), "budget_bytes": total,
                "holder": f"flow slot pool ({self.ecfg.slot_prompt_frames} prompt frames, "
                          f"{self.ecfg.n_timesteps} steps)"}

    def stats(self) -> dict[str, float]:
        """Open streams, the slots (capacity) and how many are free, and the counters."""
        return {
            "open_streams": len(self.streams),
            "capacity": self.ecfg.max_streams,
            "free_slots": len(self.pool.free),
            "voice_templates": len(self.templates),
            **self.counters,
        }

    # -- decoding ------------------------------------------------------------------------

    def step(self) -> list[PcmChunk]:
        """Decode the next chunk of every stream that has one ready, in one step."""
        ready = {}
        for sid, s in self.streams.items():
            nxt = s.cursor.next_chunk(self.cfg)
            if nxt is not None:
                ready[sid] = nxt
        if not ready:
            return []
        out = []
        for sid, (pcm, last) in self.decode(ready).items():
            self.streams[sid].cursor.advance(self.cfg, last)
            out.append(PcmChunk(sid, pcm, last))
        return out

    def decode(self, windows: dict[str, tuple[list[int], bool]]
               ) -> dict[str, tuple[np.ndarray, bool]]:
        """One step over the given streams' next windows, {id: (codes, last)}: codes incl.
        the lookahead unless last (a full window, or a shorter one when the caller flushes
        a turn's start early, as the duplex speech does), any length up to a full window
        when last. Returns {id: (pcm, last)} in the same order; a stream's slot is freed
        after its last window. The code buffers are the caller's (`step`: CodeCursor)."""
        return self.launch(windows).result()

    def launch(self, windows: dict[str, tuple[list[int], bool]],
               stream: torch.cuda.Stream | None = None) -> Landing:
        """`decode` without waiting for the GPU: the step is enqueued (on `stream`, after
        the work the current stream has queued, when given) and its `Landing` returns the
        PCM once the GPU is done. The host reads nothing of the GPU on the way, so the
        caller's thread goes on (the duplex speech lane enqueues Token2Wav on a stream of
        its own and steps the Thinker meanwhile). Until the landing's `result()` nothing else
        may touch the engine's tensors: open, abort, grow, warmup and the next launch wait
        for it first."""
        self.settle()
        t0 = time.perf_counter()
        ids = list(windows)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            landing = self._slot_step(ids, windows)
        landing.started = t0
        for sid, last in zip(ids, landing.last, strict=True):
            if last:  # nothing of the stream is read again (the landing holds its tensors)
                s = self.streams[sid]
                self.pool.release(s.slot)
                s.slot = None
        self.counters["batches"] += 1
        self.counters["chunks"] += len(ids)
        self.counters[f"batch_size_{len(ids)}"] += 1
        for name, runner in (("cfm", self.graphs), ("hift", self.hift_graphs)):
            if runner is not None:
                for key, total in runner.counts(name).items():  # running totals: set
                    self.counters[key] = total
        self._pending = landing
        return landing

    def settle(self) -> None:
        """Wait for the step `launch` left in flight, if any (see `launch`)."""
        if self._pending is not None:
            self._pending.result()

    def _landed(self, landing: Landing) -> None:
        # wall time of decoding, launch to PCM on the host: busy share = its rate
        self.counters["busy_ms"] += round((time.perf_counter() - landing.started) * 1e3, 3)
        if self._pending is landing:
            self._pending = None

    def _slot_step(self, ids: list[str], ready: dict) -> Landing:
        """One padded flow step for the ready streams, then the vocoder per shape, enqueued;
        the PCM copied to pinned host memory behind them."""
        streams = [self.streams[i] for i in ids]
        if any(s.slot is None for s in streams):
            raise ValueError("a window for a stream whose last window is decoded")
        rows = [Row(s.slot, *ready[i]) for i, s in zip(ids, streams)]
        # the states the step reads, held until it lands: their memory may belong to another
        # stream's allocations (a state opened on the caller's stream)
        held = [s.state for s in streams]
        # padding rows (the pool's spare slot, speaker zeros) up to a captured batch size
        batch = min(b for b in self.graph_sizes if b >= len(rows))
        plan = self.pool.plan(rows, batch)
        spk = torch.cat([s.state.spk for s in streams])
        spk = torch.cat([spk, spk.new_zeros(batch - len(rows), *spk.shape[1:])])
        mel = self._flow_slots(plan, spk)
        self.pool.commit(plan)
        groups: dict[tuple, list[int]] = {}
        for row, s in enumerate(streams):
            key = (plan.mel_frames[row], *s.state.vocoder_key(rows[row].last))
            groups.setdefault(key, []).append(row)
        pieces = []  # each group in pieces of captured batch sizes
        for (frames, *_), members in groups.items():
            for n in split_sizes(len(members), self.graph_sizes):
                pieces.append((frames, members[:n]))
                members = members[n:]
        landing = Landing(self, list(ids), [r.last for r in rows], held)
        for frames, members in pieces:
            last = rows[members[0]].last
            speech, states = vocode(
                self.hift_graphs or self.hift,
                self.cfg,
                [streams[r].state for r in members],
                batch_rows(mel, members)[:, :, :frames],
                last,
                self.crossfade,
            )
            for j, r in enumerate(members):
                streams[r].state = replace(states[j], chunks=states[j].chunks + 1)
            landing.copy(members, speech)
        landing.record()
        return landing

    def _flow_slots(self, plan, spk: torch.Tensor) -> torch.Tensor:
        """mel (B, 80, T) of a planned slot step, through its CUDA graph when there is one (its
        static buffers take the plan's host tensors directly)."""
        if self.graphs is None:
            ix = index_to(plan.index, self.device, non_blocking=True)
            tokens = plan.tokens.to(self.device, non_blocking=True)
            with self._autocast():
                mel = self.flow.forward_slots(tokens, spk, self.pool.pool, ix, self.time_table)
            return mel.float()  # the vocoder takes fp32 mel ([MU7]: `part.float()`)

        def run(tokens, spk, *tensors):
            with self._autocast():
                return self.flow.forward_slots(
                    tokens, spk, self.pool.pool, unflatten(plan.index, tensors), self.time_table
                )

        key = (len(plan.tokens), plan.index.dit.window)
        example = None
        if key not in self.graphs:  # capture on padding rows: the warm-up runs write nothing
            blank = self.pool.blank_plan(*key)
            example = [
                blank.tokens.to(self.device),
                torch.zeros_like(spk),
                *flatten(index_to(blank.index, self.device)),
            ]
        with torch.inference_mode():
            mel = self.graphs.run(key, [plan.tokens, spk, *flatten(plan.index)], run, example)
        return mel.to(torch.float32, copy=True)  # off the graph's output buffer, fp32

    def warmup(self, voice: VoicePrompt | None = None, last_chunks: bool = True) -> None:
        """Build `voice`'s template and, when graphs are on (CUDA), decode WARMUP_CHUNKS full
        chunks of silence at each batch size on throwaway streams (the DiT window grows over
        the first chunks, then trimming fixes it: each window is a graph), then, with
        `last_chunks`, the last chunks (`_warm_last_chunks`; without, those run eagerly).
        Outputs of later streams do not depend on it (their state is a template clone, their
        slot's valid frames are their own and their noise generator is seeded by stream id
        or given)."""
        if voice is None and self.voices is None:
            raise ValueError("warmup needs a voice (or a VoiceCache with the default voice)")
        voice = voice or self.voices.default()
        self.settle()
        self._template(voice)
        if WARMUP_CHUNKS <= 0 or (self.graphs is None and self.hift_graphs is None):
            return
        silence = [self.cfg.silence_code] * self.cfg.chunk_size
        for b in self.graph_sizes:
            ids = [f"__warmup_{b}_{i}" for i in range(b)]
            for sid in ids:
                self.open(sid, voice)
            try:
                for _ in range(WARMUP_CHUNKS):
                    for sid in ids:
                        self.feed(sid, CodeChunk(sid, tuple(silence), False))
                    self.drain()
            finally:
                for sid in ids:
                    self.abort(sid)
        self.counters["warmup_streams"] += sum(self.graph_sizes)
        if last_chunks and isinstance(self.hift_graphs, CausalVocoderGraphs):
            self._warm_last_chunks(voice)

    def _warm_last_chunks(self, voice: VoicePrompt) -> None:
        """A turn's last chunk has any length from `pre_lookahead` codes (the lookahead
        carried over, nothing new) to a full window, and the vocoder's state differs for a
        stream that ends in its first chunk and one that ends later: each (length, state) is
        a vocoder graph of its own at batch 1, and a step of streams that all end in their
        first chunk has a flow window of its own per batch size. Decode them all on throwaway
        streams, in steps of every batch size, while the vocoder captures last chunks;
        afterwards a last chunk of another key (batch > 1) runs eagerly instead of capturing
        mid-turn."""
        lo = self.cfg.pre_lookahead
        window = self.cfg.chunk_size + lo
        silence = [self.cfg.silence_code] * window
        lengths = list(range(lo, window + 1))
        sizes = self.graph_sizes
        parts: list[list[int]] = []
        done = 0
        while done < len(lengths) or len(parts) < len(sizes):
            b = sizes[len(parts) % len(sizes)]
            parts.append([lengths[(done + j) % len(lengths)] for j in range(b)])
            done += b
        self.hift_graphs.capture_last = True
        try:
            for after_a_chunk in (False, True):
                for n, part in enumerate(parts):
                    # a part wider than the lengths repeats one: name streams by position
                    ids = [f"__warmup_last_{int(after_a_chunk)}_{n}_{j}" for j in range(len(part))]
                    for sid in ids:
                        self.open(sid, voice)
                    try:
                        if after_a_chunk:
                            for sid in ids:
                                self.feed(sid, CodeChunk(sid, tuple(silence[:-lo]), False))
                            self.drain()
                        for sid, k in zip(ids, part):
                            self.feed(sid, CodeChunk(sid, tuple(silence[: k - lo]), True))
                        self.drain()
                    finally:
                        for sid in ids:
                            self.abort(sid)
                    self.counters["warmup_streams"] += len(ids)
        finally:
            self.hift_graphs.capture_last = False

    def drain(self, max_steps: int = 10_000) -> dict[str, list[np.ndarray]]:
        """Step until no chunk is ready (tests, offline use). Returns pcm pieces per stream."""
        pieces: dict[str, list[np.ndarray]] = {}
        for _ in range(max_steps):
            if not self.has_work():
                break
            for chunk in self.step():
                pieces.setdefault(chunk.request_id, []).append(chunk.pcm)
        return pieces

"""Code2WavEngine: many concurrent code streams -> 24 kHz PCM chunks, batched across streams.

The StageEngine protocol (pipeline/stage_engine.py):

    engine.open("s1", voice)                        # template state per voice (cloned, or rebuilt)
    engine.feed("s1", CodeChunk("s1", codes, final)) # Talker output as it arrives
    for chunk in engine.step():                     # PcmChunk: every ready chunk, coalesced by shape
        ...
    engine.abort("s1")                              # frees the stream's state and slot
    engine.warmup()                                 # at deployment start: template + graph captures

Two decoding paths:
  plain (default)   : streams whose next chunks have equal shapes batch together and run
                      eagerly through `stream_step` (stream.py), exactly as one stream at a time
  token2wav_slot_pool: every stream's flow caches live in a slot pool (slots.py); every ready
                      chunk of any phase, voice or final length is one padded row of a single
                      step, up to `max_batch_size` rows. Reorders float sums only (masked
                      softmax over padded keys): tests/test_code2wav_slots.py bounds it.

Fast-path knobs (each bounded against the plain path in tests/test_code2wav*.py):
  token2wav_initial_state_cache : build a voice's initial state (setup_cache: encoder + a full
                                  10-step CFM over the prompt) once and clone it per stream
  token2wav_cfm_cuda_graph      : replay the slot-pool step (encoder, 10-step CFM with guidance)
                                  as one CUDA graph per (batch size, DiT window) (needs the pool)
  token2wav_compile_estimator   : regional torch.compile of the DiT blocks (dit.py): the plain
                                  path's `forward`, and the slot path's parts around the pool
  token2wav_hift_cuda_graph     : replay the HiFT vocoder as a CUDA graph per (batch, mel frames,
                                  cached source) shape; the source noise is drawn eagerly from
                                  the streams' generators and fed in, so it is the same draw
  token2wav_vocoder_gemm_convs  : the causal vocoder's convs as matmuls over unfolded windows
                                  (fp32 cuDNN convs of these sizes are several times slower)
  token2wav_dit_split_matmuls   : the slot path's DiT matmuls shaped for a few chunks: q|k|v as
                                  one product, the large-K products split over K and summed
                                  (dit.py `linear_split_k`; fp32 SIMT kernels fill few SMs)
  token2wav_dit_pool_attention  : the slot path's attention as one Triton kernel reading K / V in
                                  place from the pool (pool_attention.py; fp32, CUDA; reordered
                                  sums)
  token2wav_dit_adaln_table     : the slot path's DiT adaLN modulations (SiLU + Linear(D -> 9D)
                                  per block and Euler step, the same for every row of a step)
                                  read from a table the engine computes once from its time table
                                  (dit.py `AdaLNTable`; the same products over other row counts)
  token2wav_dit_tails_in_post   : the slot path's conv tails gathered from the pool inside the
                                  compiled `slot_post` (a load of its first conv's windows
                                  kernel) instead of by a launch of their own, 160 a chunk
                                  (dit.py `gather_tails_in_post`; the same values)
  token2wav_dit_kv_write_kernel : the slot path's new keys and values written into the pool by
                                  one Triton kernel instead of two `index_put_` a block and
                                  Euler step, 160 launches fewer a chunk (pool_attention.py
                                  `write_kv`; CUDA; the same copies)
  token2wav_vocoder_fused_snakes: the vocoder's Snake activations (x + sin(a x)^2 / a, 146 a
                                  chunk) as one compiled kernel each instead of five
                                  (hift.py `fuse_snakes`; a fused multiply-add, libdevice's sin)
  token2wav_vocoder_window_kernel: under token2wav_vocoder_gemm_convs, each conv's windows
                                  (its zero padding, nearest upsampling and window copy: three
                                  or four launches) built by one Triton kernel from its input
                                  (conv_windows.py; CUDA; the same windows bit for bit)
  token2wav_vocoder_frame_major : under token2wav_vocoder_gemm_convs, each conv's windows built
                                  (B, T, C k), the order its product reads them, and multiplied
                                  by one mm: what torch.matmul computes there, after copying the
                                  (B, C k, T) windows into that order (the weights require grad,
                                  so it folds the batch); causal_hift.py `_Conv`; the same
                                  product bit for bit, without that copy
  token2wav_vocoder_fused_biases: with token2wav_vocoder_gemm_convs and _fused_snakes, each
                                  residual-block conv's bias added inside the compiled op after
                                  it (the next Snake, or the residual add) instead of by a
                                  launch of its own (hift.py `biased_snake`, `biased_residual`)
  code2wav_batch_wait_ms        : hold a lone ready chunk up to this long while another stream is
                                  a few codes short of a chunk (batching.py)
  code2wav_first_chunks_first   : a step with a stream's first audio in it leaves out the later
                                  chunks of streams that have audio in hand (see
                                  `_first_chunks_first`); each row computes what it would in
                                  any batch, so only when each chunk is made changes
"""

from __future__ import annotations

import time
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import torch

from pipeline.code2wav.batching import ChunkBatcher, ReadyChunk
from pipeline.code2wav.causal_hift import CausalHiFT
from pipeline.code2wav.dit import AdaLNTable, compile_dit_blocks, compile_slot_blocks
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
    stream_step,
    vocode,
)
from pipeline.code2wav.voice import VoiceCache, VoicePrompt
from pipeline.config import Code2WavConfig
from pipeline.graphs import GraphRunner
from pipeline.handoff import CodeChunk, PcmChunk


@dataclass(frozen=True)
class Code2WavEngineConfig:
    token2wav_initial_state_cache: bool = True
    # which reference's streaming a turn follows (stream.py): prompt lookahead, leading zeros
    token2wav_reference: Token2WavReference = DEFAULT_REFERENCE
    # fp32: every matmul and conv in fp32, as the reference computes on CPU (cuDNN's default
    # TF32 convs off); tf32: TF32 tensor cores for the flow's matmuls and convs; bf16: the DiT
    # estimator's weights, activations and caches in bf16 (it is ~all of the flow's work; the
    # encoder, the Euler update and the vocoder stay fp32). tf32 and bf16 are opt-in: they
    # change the audio (SNR in docs/performance.md). The TF32 flags are set for the whole
    # process on CUDA; bf16 converts the flow's estimator in place.
    token2wav_precision: Literal["fp32", "tf32", "bf16"] = "fp32"
    token2wav_slot_pool: bool = False  # every ready chunk in one padded step (slots.py)
    token2wav_cfm_cuda_graph: bool = False  # the slot-pool step as CUDA graphs (CUDA only)
    token2wav_compile_estimator: bool = False  # compiles the flow's DiT blocks in place
    token2wav_hift_cuda_graph: bool = False  # replay HiFT as a CUDA graph (graphs.py)
    token2wav_vocoder_gemm_convs: bool = False  # the causal vocoder's convs as matmuls
    token2wav_dit_split_matmuls: bool = False  # slot path: q|k|v joined, large K split
    token2wav_dit_pool_attention: bool = False  # slot path: attention read in place from the pool
    token2wav_dit_adaln_table: bool = False  # slot path: DiT modulations from a per-step table
    token2wav_dit_tails_in_post: bool = False  # slot path: conv tails read inside slot_post
    token2wav_dit_kv_write_kernel: bool = False  # slot path: new K and V in one launch
    token2wav_vocoder_fused_snakes: bool = False  # each vocoder Snake one compiled kernel
    token2wav_vocoder_window_kernel: bool = False  # gemm convs' windows by one Triton kernel
    token2wav_vocoder_fused_biases: bool = False  # resblock convs' biases added by the next op
    token2wav_vocoder_frame_major: bool = False  # gemm convs' windows in their product's order
    code2wav_batch_wait_ms: float = 0.0
    code2wav_first_chunks_first: bool = False  # first audio not batched behind later chunks
    max_batch_size: int = 8  # streams per decode step
    # Slot pool: resident streams and the longest voice prompt it holds (mel frames, 50 a
    # second); a longer reference voice runs on the plain path.
    max_streams: int = 8
    slot_prompt_frames: int = 500
    # Batch sizes the graph runner captures (None = every size up to max_batch_size; a batch
    # runs at the smallest captured size that holds it, with padding rows), and its LRU bound.
    graph_batch_sizes: tuple[int, ...] | None = None
    max_graphs: int = 96  # per runner; the vocoder's holds ~2 per batch size + 52 last chunks
    near_ready_codes: int = 4  # a stream this many codes short of a window counts as "close"
    max_voice_templates: int = 8
    hift_seed: int | None = 0  # per-stream HiFT noise generators; None = global RNG (reference)
    # `warmup(voice)` decodes this many throwaway full chunks at each graph batch size, so the
    # first requests find the graphs captured (and compiled blocks built); 0 = none
    warmup_chunks: int = 4


@dataclass
class _Stream:
    state: StreamState  # with the slot pool, `state.flow` is None: the caches are in the slot
    cursor: CodeCursor
    slot: int | None = None
    first_audio_at: float | None = None  # engine clock when its first samples left the engine
    audio_s: float = 0.0  # seconds of audio it has emitted


# A later chunk is left out of a step with first audio in it only while its stream has more
# than this much audio in hand (emitted, not yet played at real time from its first audio):
# enough for the first audio's step and its own, under load, with room to spare.
FIRST_CHUNKS_MARGIN_S = 0.5


def batch_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x's `rows` (ascending): a view when they are consecutive (a step's streams usually
    share one vocoder shape). Indexing a CUDA tensor with a list copies the list to the
    device with a blocking copy, which waits for the stream's queued work: the host would
    wait for the flow's graph to finish before preparing the vocoder, and the GPU for the
    host (~0.3 ms gaps around the vocoder's first kernels in a profiled step)."""
    first = rows[0]
    if rows == list(range(first, first + len(rows))):
        return x[first : first + len(rows)]
    return x[rows]


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
        if engine_cfg.token2wav_precision == "bf16":
            flow.decoder.estimator.to(torch.bfloat16)
        # set either way (engines may share the module); after the dtype change, which
        # replaces the parameters the joined q|k|v views point into
        flow.decoder.estimator.split_matmuls(
            engine_cfg.token2wav_dit_split_matmuls and engine_cfg.token2wav_slot_pool
        )
        self.pool_attention = flow.decoder.estimator.use_pool_attention(
            engine_cfg.token2wav_dit_pool_attention and engine_cfg.token2wav_slot_pool
        )
        flow.decoder.estimator.gather_tails_in_post(engine_cfg.token2wav_dit_tails_in_post)
        self.kv_write_kernel = flow.decoder.estimator.use_kv_write_kernel(
            engine_cfg.token2wav_dit_kv_write_kernel and engine_cfg.token2wav_slot_pool
        )
        if engine_cfg.token2wav_compile_estimator:
            # in place; compiles lazily on first use (setup_cache, the graph runner's warm-up)
            compile_dit_blocks(flow.decoder.estimator)
            if engine_cfg.token2wav_slot_pool:
                compile_slot_blocks(flow.decoder.estimator)
        cuda = self.device.type == "cuda"
        if cuda:
            tf32 = engine_cfg.token2wav_precision == "tf32"
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
        if engine_cfg.token2wav_cfm_cuda_graph and not engine_cfg.token2wav_slot_pool:
            raise ValueError(
                "token2wav_cfm_cuda_graph captures the slot-pool step: turn token2wav_slot_pool on"
            )
        self.graph_sizes = tuple(
            sorted(engine_cfg.graph_batch_sizes or range(1, engine_cfg.max_batch_size + 1))
        )
        if self.graph_sizes[-1] < engine_cfg.max_batch_size:
            raise ValueError("graph_batch_sizes must include a size >= max_batch_size")
        self.pool = (
            FlowSlotPool(
                flow,
                engine_cfg.max_streams,
                engine_cfg.slot_prompt_frames,
                self.device,
                next(flow.parameters()).dtype,
            )
            if engine_cfg.token2wav_slot_pool
            else None
        )
        self.graphs = (
            GraphRunner(engine_cfg.max_graphs)
            if engine_cfg.token2wav_cfm_cuda_graph and cuda
            else None
        )
        freeze_weight_norms(hift)  # exact: the weights a chunk's forward would compute
        fuse_snakes(hift, engine_cfg.token2wav_vocoder_fused_snakes)
        if isinstance(hift, CausalHiFT):  # set either way: engines may share the module
            hift.gemm_convs(engine_cfg.token2wav_vocoder_gemm_convs)
            hift.window_kernel(engine_cfg.token2wav_vocoder_window_kernel)
            hift.frame_major_windows(engine_cfg.token2wav_vocoder_frame_major)
            hift.fuse_biases(engine_cfg.token2wav_vocoder_fused_biases)  # into the Snakes
        self.hift_graphs = None
        if engine_cfg.token2wav_hift_cuda_graph and cuda:
            runner = CausalVocoderGraphs if isinstance(hift, CausalHiFT) else HiFTGraphRunner
            self.hift_graphs = runner(hift, self.graph_sizes, engine_cfg.max_graphs)
            if isinstance(self.hift_graphs, CausalVocoderGraphs):
                self.hift_graphs.capture_last = False  # the warm-up captures them
        self.time_table = self._time_table()
        self.adaln_table = self._adaln_table()
        self.batcher = ChunkBatcher(
            engine_cfg.code2wav_batch_wait_ms, engine_cfg.max_batch_size, clock
        )
        self.streams: OrderedDict[str, _Stream] = OrderedDict()
        self.templates: OrderedDict[str, StreamState] = OrderedDict()
        self.pinned: set[str] = set()  # voice keys whose template the LRU never evicts
        self.counters: Counter = Counter()
        self.clock = clock

    def _time_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The CFM's per-step table, computed once: nothing step-dependent is built inside a
        step (or a graph)."""
        with torch.inference_mode():
            t_emb, dt = self.flow.decoder.time_table(
                self.device, next(self.flow.parameters()).dtype
            )
        return t_emb.clone(), dt.clone()

    def _adaln_table(self) -> AdaLNTable | None:
        """`token2wav_dit_adaln_table`: the DiT's modulations of every Euler step from the time
        table, computed once, after any dtype change (in the estimator's dtype, as the time
        table). Held for the engine's life: its CUDA graphs read it in place. An estimator
        converted or reloaded afterwards needs both tables built again."""
        if not (self.ecfg.token2wav_dit_adaln_table and self.ecfg.token2wav_slot_pool):
            return None
        with torch.no_grad():
            return self.flow.decoder.estimator.adaln_table(self.time_table[0])

    @classmethod
    def from_source(
        cls, source: Any, config: Code2WavEngineConfig | None = None, device: str = "cpu"
    ) -> Code2WavEngine:
        """The engine of a ModelSource's token2wav (a random full-size flow + the causal
        vocoder for a source without files), with its VoiceCache, warmed up."""
        from pipeline.code2wav.assets import load_code2wav, token2wav_dir

        config = config or Code2WavEngineConfig()
        # fp32 on every device: the reference runs the flow and HiFT in fp32, and a lower
        # precision would change the audio.
        if source.path is None:  # random-full: full-size random flow + HiFT, default voice
            from pipeline.code2wav.assets import random_code2wav, random_vocoder

            c2w_cfg = source.config.code2wav
            flow, _ = random_code2wav(c2w_cfg, seed=0)
            hift = random_vocoder(c2w_cfg, 0, "minicpmo-utils-1.0.7")  # the causal one, as released
            flow, hift = flow.to(device), hift.to(device)
            voice_dir = source.tokenizer_dir  # the tiny default's assets: same voice format
        else:
            flow, hift, c2w_cfg = load_code2wav(source.path, device, torch.float32)
            voice_dir = source.path
        if torch.device(device).type != "cuda":
            # Inductor on CPU needs a C++ compiler and minutes of start-up; the knobs are for GPUs
            config = replace(config, token2wav_compile_estimator=False,
                             token2wav_vocoder_fused_snakes=False)
        engine = cls(flow, hift, c2w_cfg, config, voices=VoiceCache(token2wav_dir(voice_dir)))
        engine.warmup()  # default voice's template; CFM graph captures before the first request
        return engine

    # -- streams -----------------------------------------------------------------------

    def initial_state(self, voice: VoicePrompt) -> StreamState:
        """A fresh stream state for `voice` (template clone when the cache is on)."""
        if not self.ecfg.token2wav_initial_state_cache:
            self.counters["template_builds"] += 1
            return self._build_state(voice)
        key = voice.key
        tpl = self.templates.get(key)
        if tpl is None:
            self.counters["template_builds"] += 1
            tpl = self._build_state(voice)
            self.templates[key] = tpl
            self._evict()
        else:
            self.counters["template_hits"] += 1
            self.templates.move_to_end(key)
        return tpl.clone()

    def pin_voice(self, voice: VoicePrompt) -> None:
        """Build `voice`'s template now and keep it until `unpin_voice` (stored voices: built
        once, whatever the ad-hoc reference voices do to the LRU)."""
        self.pinned.add(voice.key)
        if self.ecfg.token2wav_initial_state_cache and voice.key not in self.templates:
            self.counters["template_builds"] += 1
            self.templates[voice.key] = self._build_state(voice)
            self._evict()

    def unpin_voice(self, voice: VoicePrompt) -> None:
        self.pinned.discard(voice.key)
        self.templates.pop(voice.key, None)

    def _evict(self) -> None:
        """Drop the least recently used unpinned templates beyond max_voice_templates."""
        unpinned = [k for k in self.templates if k not in self.pinned]
        for key in unpinned[: max(0, len(unpinned) - self.ecfg.max_voice_templates)]:
            del self.templates[key]

    def _build_state(self, voice: VoicePrompt) -> StreamState:
        v = voice.to(self.device)
        dtype = next(self.flow.parameters()).dtype
        return initial_state(
            self.flow,
            self.cfg,
            v.prompt_tokens,
            v.prompt_mel.to(dtype),
            v.spk_emb.to(dtype),
            reference=self.ecfg.token2wav_reference,
            vocoder=self.hift,
        )

    def open(self, rid: str, spec: VoicePrompt | None = None) -> None:
        """Start a turn in voice `spec`: None = the checkpoint's default voice (needs
        `voices`); for a request's reference audio pass `engine.voices.from_audio(wav, rate)`."""
        if rid in self.streams:
            raise ValueError(f"stream {rid!r} is already open")
        voice = spec
        if voice is None:
            if self.voices is None:
                raise ValueError(
                    "no voice given and the engine has no VoiceCache for the default voice"
                )
            voice = self.voices.default()
        state = self.initial_state(voice)
        if self.ecfg.hift_seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(self.ecfg.hift_seed * 1_000_003 + zlib.crc32(rid.encode()))
            state.generator = gen
        slot = None
        fits = self.pool is not None and state.prompt_frames <= self.pool.max_prompt_frames
        if fits and self.pool.free:
            slot = self.pool.admit(state.flow, state.prompt_frames)
            state.flow = None
        elif self.pool is not None:
            # a voice prompt longer than the pool holds, or every slot taken: plain path
            self.counters["streams_unslotted"] += 1
        self.streams[rid] = _Stream(state, CodeCursor.start(self.cfg), slot)
        self.counters["streams_opened"] += 1

    def feed(self, rid: str, msg: CodeChunk) -> None:
        """The stream's next codes, in order (`msg.finished`: no more will come)."""
        s = self.streams.get(rid)
        if s is None:
            raise KeyError(f"no Code2Wav stream {rid!r}")
        if msg.request_id != rid:
            raise ValueError(f"codes of stream {msg.request_id!r} fed to {rid!r}")
        s.cursor.push(list(msg.codes), msg.finished)

    def abort(self, rid: str) -> None:
        s = self.streams.pop(rid, None)
        if s is not None and s.slot is not None:
            self.pool.release(s.slot)

    def has_work(self) -> bool:
        return any(s.cursor.next_chunk(self.cfg) is not None for s in self.streams.values())

    def stats(self) -> dict[str, float]:
        """Open streams, free slot-pool slots (-1 without the pool), and the counters."""
        return {
            "open_streams": len(self.streams),
            "free_slots": len(self.pool.free) if self.pool is not None else -1,
            "voice_templates": len(self.templates),
            **self.counters,
        }

    # -- decoding ------------------------------------------------------------------------

    def _next(self, s: _Stream) -> tuple[list[int], bool, tuple] | None:
        nxt = s.cursor.next_chunk(self.cfg)
        if nxt is None:
            return None
        codes, last = nxt
        # Slot-pool chunks of any shape share a step; plain ones only with equal shapes.
        key = ("slots",) if s.slot is not None and codes else s.state.shape_key(len(codes), last)
        return codes, last, key

    def step(self) -> list[PcmChunk]:
        """Decode every chunk the batcher releases now, in batch order; each stream
        contributes at most one chunk per step."""
        ready, near, pending = [], Counter(), {}
        window = self.cfg.chunk_size + self.cfg.pre_lookahead
        for sid, s in self.streams.items():
            nxt = self._next(s)
            if nxt is not None:
                pending[sid] = nxt
                ready.append(ReadyChunk(sid, nxt[2]))
            elif (
                not s.cursor.done
                and not s.cursor.final
                and s.cursor.codes_missing(self.cfg) <= self.ecfg.near_ready_codes
            ):
                key = ("slots",) if s.slot is not None else s.state.shape_key(window, False)
                near[key] += 1
        if self.ecfg.code2wav_first_chunks_first:
            ready = self._first_chunks_first(ready)
        out = []
        for batch in self.batcher.plan(ready, near):
            t0 = time.perf_counter()
            ids = [r.stream_id for r in batch]
            if batch[0].key == ("slots",):
                pieces = self._slot_step(ids, pending)
            else:
                pieces = self._plain_step(ids, pending)
            for sid, pcm, last in pieces:
                stream = self.streams[sid]
                stream.cursor.advance(self.cfg, last)
                if len(pcm):
                    stream.audio_s += len(pcm) / self.cfg.sample_rate
                    if stream.first_audio_at is None:
                        stream.first_audio_at = self.clock()
                if last and stream.slot is not None:  # nothing of the stream is read again
                    self.pool.release(stream.slot)
                    stream.slot = None
                out.append(PcmChunk(sid, pcm, last))
            self.counters["batches"] += 1
            self.counters["chunks"] += len(ids)
            self.counters[f"batch_size_{len(ids)}"] += 1
            # wall time of decoding (the PCM is on the host by now): busy share = its rate
            self.counters["busy_ms"] += round((time.perf_counter() - t0) * 1e3, 3)
        for name, runner in (("cfm", self.graphs), ("hift", self.hift_graphs)):
            if runner is not None:
                self.counters.update(runner.counts(name))
        self.counters["batch_waits"] = self.batcher.waits
        return out

    def _first_chunks_first(self, ready: list[ReadyChunk]) -> list[ReadyChunk]:
        """The chunks to decode in this step when first audio comes first: with a stream's
        first chunk ready (its listener waits for the first sound), the later chunks of
        streams with more than FIRST_CHUNKS_MARGIN_S of audio in hand wait for the next
        step, so the first audio is a step of one or a few rows (~43 ms at one on the H200)
        instead of a step of up to max_batch_size rows (~133 ms at eight). A stream's audio in
        hand only shrinks while it waits, so no chunk waits past that margin."""
        firsts = [r for r in ready if self.streams[r.stream_id].first_audio_at is None]
        later = [r for r in ready if self.streams[r.stream_id].first_audio_at is not None]
        if not firsts or not later:
            return ready
        now = self.clock()

        def in_hand(r: ReadyChunk) -> float:
            s = self.streams[r.stream_id]
            return s.first_audio_at + s.audio_s - now

        urgent = [r for r in later if in_hand(r) <= FIRST_CHUNKS_MARGIN_S]
        self.counters["chunks_deferred"] += len(later) - len(urgent)
        return firsts + urgent

    def _plain_step(self, ids: list[str], pending: dict) -> list[tuple[str, np.ndarray, bool]]:
        _, last, _ = pending[ids[0]]
        tokens = torch.tensor(
            [pending[i][0] for i in ids], dtype=torch.long, device=self.device
        ).reshape(len(ids), -1)
        states = [self.streams[i].state for i in ids]
        speech, new_states = stream_step(
            self.flow,
            self.hift_graphs or self.hift,
            self.cfg,
            states,
            tokens,
            last,
            self.crossfade,
            time_table=self.time_table,
        )
        pcm = speech.float().cpu().numpy()
        for sid, st in zip(ids, new_states):
            self.streams[sid].state = st
        return [(sid, pcm[row], last) for row, sid in enumerate(ids)]

    def _slot_step(self, ids: list[str], pending: dict) -> list[tuple[str, np.ndarray, bool]]:
        """One padded step for every ready slot-pool stream, then the vocoder per shape."""
        streams = [self.streams[i] for i in ids]
        rows = [Row(s.slot, pending[i][0], pending[i][1]) for i, s in zip(ids, streams)]
        size = next(b for b in self.graph_sizes if b >= len(rows))
        plan = self.pool.plan(rows, size if self.graphs is not None else len(rows))
        spk = torch.zeros(
            len(plan.tokens),
            self.cfg.spk_embed_dim,
            device=self.device,
            dtype=streams[0].state.spk.dtype,
        )
        spk[: len(rows)] = torch.cat([s.state.spk for s in streams])
        mel = self._flow_slots(plan, spk)
        self.pool.commit(plan)
        groups: dict[tuple, list[int]] = {}
        for row, s in enumerate(streams):
            key = (plan.mel_frames[row], *s.state.vocoder_key(rows[row].last))
            groups.setdefault(key, []).append(row)
        voiced = []  # every group's vocoder enqueued before the first copy to the host
        for (frames, *_), members in groups.items():
            last = rows[members[0]].last
            speech, states = vocode(
                self.hift_graphs or self.hift,
                self.cfg,
                [streams[r].state for r in members],
                batch_rows(mel, members)[:, :, :frames],
                last,
                self.crossfade,
            )
            voiced.append((members, speech, states, last))
        out = {}
        for members, speech, states, last in voiced:
            pcm = speech.float().cpu().numpy()
            for j, r in enumerate(members):
                streams[r].state = replace(states[j], chunks=states[j].chunks + 1)
                out[ids[r]] = (ids[r], pcm[j], last)
        return [out[sid] for sid in ids]

    def _flow_slots(self, plan, spk: torch.Tensor) -> torch.Tensor:
        """mel (B, 80, T) of a planned slot step, through its CUDA graph when there is one (its
        static buffers take the plan's host tensors directly)."""
        if self.graphs is None:
            ix = index_to(plan.index, self.device, non_blocking=True)
            tokens = plan.tokens.to(self.device, non_blocking=True)
            return self.flow.forward_slots(tokens, spk, self.pool.pool, ix, self.time_table,
                                           self.adaln_table)

        def run(tokens, spk, *tensors):
            return self.flow.forward_slots(
                tokens, spk, self.pool.pool, unflatten(plan.index, tensors), self.time_table,
                self.adaln_table,
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
        return mel.clone()

    def warmup(self, voice: VoicePrompt | None = None) -> None:
        """Build `voice`'s template and, when graphs or compiled blocks are on, decode
        `warmup_chunks` full chunks of silence at each graph batch size on throwaway streams
        (the DiT window grows over the first chunks, then trimming fixes it: each window is a
        graph), then the last chunks (`_warm_last_chunks`). Outputs of later streams do not
        depend on it (their state is a template clone, their slot's valid frames are their own
        and their noise generator is seeded by stream id)."""
        if voice is None and self.voices is None:
            raise ValueError("warmup needs a voice (or a VoiceCache with the default voice)")
        voice = voice or self.voices.default()
        self.initial_state(voice)
        compiled = self.ecfg.token2wav_compile_estimator
        graphed = self.graphs is not None or self.hift_graphs is not None
        if self.ecfg.warmup_chunks <= 0 or not (graphed or compiled):
            return
        sizes = self.graph_sizes if graphed else (1,)
        if self.pool is not None:
            sizes = tuple(b for b in sizes if b <= self.ecfg.max_streams)
        silence = [self.cfg.silence_code] * self.cfg.chunk_size
        for b in sizes:
            ids = [f"__warmup_{b}_{i}" for i in range(b)]
            for sid in ids:
                self.open(sid, voice)
            try:
                for _ in range(self.ecfg.warmup_chunks):
                    for sid in ids:
                        self.feed(sid, CodeChunk(sid, tuple(silence), False))
                    self.drain()
            finally:
                for sid in ids:
                    self.abort(sid)
        self.counters["warmup_streams"] += sum(sizes)
        if isinstance(self.hift_graphs, CausalVocoderGraphs) and self.pool is not None:
            self._warm_last_chunks(voice)

    def _warm_last_chunks(self, voice: VoicePrompt) -> None:
        """A turn's last chunk has any length from `pre_lookahead` codes (the lookahead
        carried over, nothing new) to a full window, and the vocoder's state differs for a
        stream that ends in its first chunk and one that ends later: each (length, state) is
        a vocoder graph of its own at batch 1, and a step of streams that all end in their
        first chunk has a flow window of its own per batch size. Decode them all on throwaway
        streams, in steps of every graph batch size, while the vocoder captures last chunks;
        afterwards a last chunk of another key (batch > 1) runs eagerly instead of capturing
        mid-turn."""
        lo = self.cfg.pre_lookahead
        window = self.cfg.chunk_size + lo
        silence = [self.cfg.silence_code] * window
        lengths = list(range(lo, window + 1))
        sizes = [b for b in self.graph_sizes if b <= self.ecfg.max_streams]
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
                    ids = [f"__warmup_last_{int(after_a_chunk)}_{n}_{k}" for k in part]
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

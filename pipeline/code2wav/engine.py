"""Code2WavEngine: many concurrent code streams -> 24 kHz PCM chunks, batched across streams.

    engine.open_stream("s1", voice)           # template state per voice (cloned, or rebuilt)
    engine.push_codes("s1", codes, final)     # Talker output as it arrives
    for sid, pcm, is_last in engine.step():   # decode every ready chunk, coalesced by shape
        ...
    engine.close_stream("s1")
    engine.warmup()                           # at deployment start: template + graph captures

Fast paths (each a knob of `Code2WavEngineConfig`, each exact, see tests/test_code2wav*.py):
  token2wav_initial_state_cache : build a voice's initial state (setup_cache: encoder + a full
                                  10-step CFM over the prompt) once and clone it per stream
  token2wav_cfm_cuda_graph      : replay the whole 10-step CFM of a chunk as one CUDA graph
                                  (graphs.py) for batch 1 and 2; other shapes run eagerly, and
                                  so do final chunks past `cfm_max_final_graphs` shapes
  token2wav_compile_estimator   : regional torch.compile of the DiT blocks (dit.py,
                                  compile_dit_blocks): Inductor fuses their elementwise work,
                                  matmuls and attention unchanged; not bitwise (fused LayerNorm
                                  sums, ~1e-6 in fp32); runs inside the CUDA graph when both are on
  token2wav_hift_cuda_graph     : replay the HiFT vocoder as a CUDA graph per (batch, mel frames,
                                  cached source) shape; the source noise is drawn eagerly from
                                  the streams' generators and fed in, so it is the same draw
  code2wav_batch_wait_ms        : hold a lone ready chunk up to this long while another stream is
                                  a few codes short of a chunk with the same shape (batching.py)
"""

from __future__ import annotations

import time
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.code2wav.batching import ChunkBatcher, ReadyChunk
from pipeline.code2wav.dit import compile_dit_blocks
from pipeline.code2wav.flow import Flow
from pipeline.code2wav.graphs import CFMGraphRunner, HiFTGraphRunner
from pipeline.code2wav.hift import HiFTGenerator
from pipeline.code2wav.stream import CodeCursor, Crossfade, StreamState, initial_state, stream_step
from pipeline.code2wav.voice import VoiceCache, VoicePrompt
from pipeline.config import Code2WavConfig


@dataclass(frozen=True)
class Code2WavEngineConfig:
    token2wav_initial_state_cache: bool = True
    token2wav_cfm_cuda_graph: bool = False
    token2wav_compile_estimator: bool = False  # compiles the flow's DiT blocks in place
    token2wav_hift_cuda_graph: bool = False  # replay HiFT as a CUDA graph (graphs.py)
    code2wav_batch_wait_ms: float = 0.0
    max_batch_size: int = 4  # streams per decode batch
    cfm_graph_batch_sizes: tuple[int, ...] = (1, 2)
    cfm_max_graphs: int = 16
    # A turn's final chunk has any length (1..chunk + lookahead codes), so a graph per final
    # shape would churn the LRU above: capturing costs ~3 eager passes and each graph holds
    # its cache outputs (~0.6 GB at batch 1). At most this many final shapes get graphs, first
    # come (fixed-length benchmarks: one per batch size); the others run eagerly.
    cfm_max_final_graphs: int = 4
    near_ready_codes: int = 4  # a stream this many codes short of a window counts as "close"
    max_voice_templates: int = 8
    hift_seed: int | None = 0  # per-stream HiFT noise generators; None = global RNG (reference)
    # `warmup(voice)` decodes this many throwaway full chunks per graph batch size, so the
    # first requests find the CFM graphs captured (and compiled blocks built); 0 = none
    warmup_chunks: int = 4


@dataclass
class _Stream:
    state: StreamState
    cursor: CodeCursor


class Code2WavEngine:
    def __init__(
        self,
        flow: Flow,
        hift: HiFTGenerator,
        cfg: Code2WavConfig,
        engine_cfg: Code2WavEngineConfig = Code2WavEngineConfig(),
        clock: Callable[[], float] = time.monotonic,
        voices: VoiceCache | None = None,
    ):
        self.flow, self.hift, self.cfg, self.ecfg = flow, hift, cfg, engine_cfg
        self.voices = voices  # default voice + reference-audio LRU (open_stream(voice=None))
        self.device = next(flow.parameters()).device
        self.crossfade = Crossfade(cfg.mel_overlap_frames * cfg.hift.hop_length, self.device)
        if engine_cfg.token2wav_compile_estimator:
            # in place; compiles lazily on first use (setup_cache, the graph runner's warm-up)
            compile_dit_blocks(flow.decoder.estimator)
        self.graphs = (
            CFMGraphRunner(
                flow.decoder, engine_cfg.cfm_graph_batch_sizes, engine_cfg.cfm_max_graphs
            )
            if engine_cfg.token2wav_cfm_cuda_graph and self.device.type == "cuda"
            else None
        )
        self.hift_graphs = (
            HiFTGraphRunner(hift, engine_cfg.cfm_graph_batch_sizes, engine_cfg.cfm_max_graphs)
            if engine_cfg.token2wav_hift_cuda_graph and self.device.type == "cuda"
            else None
        )
        # With graphs on, batches larger than the biggest captured size would run eagerly, which
        # is slower than splitting them (H200: eager batch 4 ~150 ms vs 2 x graph batch 2 ~75 ms).
        max_batch = engine_cfg.max_batch_size
        if self.graphs is not None:
            max_batch = min(max_batch, max(engine_cfg.cfm_graph_batch_sizes))
        self.batcher = ChunkBatcher(engine_cfg.code2wav_batch_wait_ms, max_batch, clock)
        self.final_graph_shapes: set[tuple] = set()  # final-chunk shapes allowed a graph
        self.streams: OrderedDict[str, _Stream] = OrderedDict()
        self.templates: OrderedDict[str, StreamState] = OrderedDict()
        self.pinned: set[str] = set()  # voice keys whose template the LRU never evicts
        self.counters: Counter = Counter()

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
            self.flow, self.cfg, v.prompt_tokens, v.prompt_mel.to(dtype), v.spk_emb.to(dtype)
        )

    def open_stream(self, stream_id: str, voice: VoicePrompt | None = None) -> None:
        """Start a turn. `voice` None = the checkpoint's default voice (needs `voices`); for a
        request's reference audio pass `engine.voices.from_audio(wav, sample_rate)`."""
        if stream_id in self.streams:
            raise ValueError(f"stream {stream_id!r} is already open")
        if voice is None:
            if self.voices is None:
                raise ValueError(
                    "no voice given and the engine has no VoiceCache for the default voice"
                )
            voice = self.voices.default()
        state = self.initial_state(voice)
        if self.ecfg.hift_seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(self.ecfg.hift_seed * 1_000_003 + zlib.crc32(stream_id.encode()))
            state.generator = gen
        self.streams[stream_id] = _Stream(state, CodeCursor.start(self.cfg))
        self.counters["streams_opened"] += 1

    def push_codes(self, stream_id: str, codes: Sequence[int], final: bool = False) -> None:
        self.streams[stream_id].cursor.push(codes, final)

    def close_stream(self, stream_id: str) -> None:
        self.streams.pop(stream_id, None)

    def has_work(self) -> bool:
        return any(s.cursor.next_chunk(self.cfg) is not None for s in self.streams.values())

    # -- decoding ------------------------------------------------------------------------

    def _next(self, s: _Stream) -> tuple[list[int], bool, tuple] | None:
        nxt = s.cursor.next_chunk(self.cfg)
        if nxt is None:
            return None
        codes, last = nxt
        return codes, last, s.state.shape_key(len(codes), last)

    def step(self) -> list[tuple[str, np.ndarray, bool]]:
        """Decode every chunk the batcher releases now. Returns (stream_id, pcm float32 (N,),
        is_last) in batch order; each stream contributes at most one chunk per step."""
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
                near[s.state.shape_key(window, False)] += 1
        out = []
        for batch in self.batcher.plan(ready, near):
            ids = [r.stream_id for r in batch]
            _, last, key = pending[ids[0]]
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
                cfm=self._graphs_for(len(ids), key, last),
                time_table=None,
            )
            pcm = speech.float().cpu().numpy()
            for row, (sid, st) in enumerate(zip(ids, new_states)):
                stream = self.streams[sid]
                stream.state = st
                stream.cursor.advance(self.cfg, last)
                out.append((sid, pcm[row], last))
            self.counters["batches"] += 1
            self.counters["chunks"] += len(ids)
            self.counters[f"batch_size_{len(ids)}"] += 1
        if self.graphs is not None:
            self.counters["cfm_graph_replays"] = self.graphs.replays
            self.counters["cfm_graph_captures"] = self.graphs.captures
            self.counters["cfm_graph_fallbacks"] = self.graphs.fallbacks
        if self.hift_graphs is not None:
            self.counters["hift_graph_replays"] = self.hift_graphs.replays
            self.counters["hift_graph_captures"] = self.hift_graphs.captures
            self.counters["hift_graph_fallbacks"] = self.hift_graphs.fallbacks
        self.counters["batch_waits"] = self.batcher.waits
        return out

    def _graphs_for(self, batch: int, key: tuple, last: bool):
        """The CFM graph runner for this batch, or None to run eagerly (bounded final shapes)."""
        if self.graphs is None or not last:
            return self.graphs
        shape = (batch, *key)
        if shape not in self.final_graph_shapes:
            if len(self.final_graph_shapes) >= self.ecfg.cfm_max_final_graphs:
                self.counters["final_chunks_eager"] += 1
                return None
            self.final_graph_shapes.add(shape)
        return self.graphs

    def warmup(self, voice: VoicePrompt | None = None) -> None:
        """Build `voice`'s template and, when graphs or compiled blocks are on, decode
        `warmup_chunks` full chunks of silence per CFM graph batch size on throwaway streams
        (the cache grows over the first chunks, then trimming fixes it: each length is a graph).
        The streams are closed before their final chunk, so no final-shape graph slot is used.
        Outputs of later streams do not depend on it (their state is a template clone and their
        noise generator is seeded by stream id)."""
        if voice is None and self.voices is None:
            raise ValueError("warmup needs a voice (or a VoiceCache with the default voice)")
        voice = voice or self.voices.default()
        self.initial_state(voice)
        compiled = self.ecfg.token2wav_compile_estimator
        graphed = self.graphs is not None or self.hift_graphs is not None
        if self.ecfg.warmup_chunks <= 0 or not (graphed or compiled):
            return
        sizes = self.ecfg.cfm_graph_batch_sizes if graphed else (1,)
        silence = [self.cfg.silence_code] * self.cfg.chunk_size
        for b in sizes:
            ids = [f"__warmup_{b}_{i}" for i in range(b)]
            for sid in ids:
                self.open_stream(sid, voice)
            try:
                for _ in range(self.ecfg.warmup_chunks):
                    for sid in ids:
                        self.push_codes(sid, silence)
                    self.drain()
            finally:
                for sid in ids:
                    self.close_stream(sid)
        self.counters["warmup_streams"] += sum(sizes)

    def drain(self, max_steps: int = 10_000) -> dict[str, list[np.ndarray]]:
        """Step until no chunk is ready (tests, offline use). Returns pcm pieces per stream."""
        pieces: dict[str, list[np.ndarray]] = {}
        for _ in range(max_steps):
            if not self.has_work():
                break
            for sid, pcm, _ in self.step():
                pieces.setdefault(sid, []).append(pcm)
        return pieces

"""Duplex speech: a session's Talker chunks and Token2Wav stream, as `MiniCPMODuplex` runs them.

A speak unit's spoken rows (the Thinker's `total_hidden_in_unit`: each generated id after the
unit's first, with its last-layer hidden state) become about one second of speech:
  1. condition  [emb_text(t_i) + L2normalize(projector_semantic(h_i)) ..., emb_text(audio_bos)]
                (n + 1, E); with no rows, the audio_bos row alone (`_convert_results_to_tts_input`)
  2. Talker     `MiniCPMTTS.generate_chunk`: the condition prefilled at positions
                [text_start_pos, +n+1) on top of the turn's KV, then one code a step:
                  logits / 0.8 -> repetition penalty 1.05 over this chunk's codes (last 16;
                  not at the first draw) -> EOS (= num_audio_tokens - 1) masked while fewer
                  than `min` draws -> softmax -> one draw
                26 draws at most; a chunk ends on EOS (dropped) and the 26th code is dropped
                too, so a chunk keeps <= 25 codes. min is 26 (EOS never drawn) except at the
                turn's first chunk and at end_of_turn (0). The KV and text_start_pos carry over
                the turn's chunks and are dropped at end_of_turn.
  3. Token2Wav  `_generate_waveform_from_tokens` over minicpmo-utils 1.0.7's streaming Token2wav
                (pipeline/code2wav: Flow chunks with [MU7]'s cache trimming, the causal vocoder):
                a turn's code buffer starts as 3 x silence 4218 and its flow / vocoder caches as
                clones of the voice's template; 28-code windows advancing by 25 once 28 are
                buffered; at the turn's first chunk (force_flush) windows of
                min(28, buffered) while >= 8 are buffered, advancing by window - 3; at
                end_of_turn the rest as the last chunk. PCM goes through int16 as the reference
                returns it (clip, x 32767, truncate, / 32768) and, unless it ends the turn, is
                left-padded with zeros to 24000 samples.

Differences from the reference, all at its edges: a session without a voice speaks in the
checkpoint's default voice (the reference makes no audio then); a turn whose Talker context
would pass `max_position_embeddings` restarts that context at position 0 (the reference runs
RoPE past the trained length with an unbounded KV); sampling draws from the session's own
torch.Generator (the reference: the process-global RNG, in the same order).

Many sessions. The sessions of one `SpeechModels` keep their turns' Talker KV in one
`TalkerPool`: a row of one TalkerKVCache per session that is mid-turn, taken at the turn's
first chunk and given back at its end (and at a context restart, prepare, close). The
speak units of a batch (`speak_steps`) prefill in one forward over the pool's rows (each
session's condition right-aligned, the padding before it written to the scratch column),
then draw in lockstep: each step one `FusedTalker.decode` over the rows of every
session still drawing, and each row's own draw, on the pool's device-side state (a CUDA
graph a step on CUDA), so that a step costs one forward, one launch and one host read for
all of them. A session draws the codes it draws alone (the decode's row count moves the
logits in their last bits only: tests/test_duplex_speech_batch.py).
`speak_steps` is a generator that yields after each GPU step (the prefill, each lockstep
step, each Token2Wav round, and a round's Landing while it runs) so that a server steps its
engine in between
(pipeline/duplex/batch.py); `speak_batch` runs it with nothing in between, and `speak` is a
batch of one.

Then the Token2Wav of every session of the batch, on the Code2Wav engine's path
(`SpeechModels.token2wav`, pipeline/code2wav/engine.py): a session's turn is a stream of the
engine, its flow caches a slot of the engine's pool from the turn's first window to its
last (filled from the voice's template, its vocoder noise from the session's own generator,
restarted every turn). Each session plans its windows from its code buffer as alone
(`_windows`), and the windows run in rounds, round k being every session's k-th window (a
session's windows in order, each on the state its previous one left), each round ONE
Code2WavEngine step: every window, of any phase, length or voice, a padded row of one
flow step (a CUDA graph per batch size and DiT window on CUDA), then the vocoder per shape.
On CUDA a round is launched on the models' Token2Wav stream (`Code2WavEngine.launch`) and
`speak_steps` yields its Landing until the PCM is on the host: a caller steps other work
meanwhile, whose kernels on its own stream run beside the round's.
The padded rows move the floats in their last bits only (masked softmax over padded keys,
as the turn-based engine's: tests/test_code2wav_slots.py bounds that path against the
plain one, and tests/test_duplex_speech.py holds a session to the reference's PCM). A step
that fails fails its sessions; each stops at its last decoded window, and a failed unit
ends its session.

Memory: a Talker pool row holds, per position, K and V of every layer: at full size (20 layers,
12 kv heads x 64, bf16 on CUDA) 60 KiB a position, so 15 MiB a row at its first 256
positions (+ the scratch column) and 240 MiB at max_position_embeddings 4096. All rows share
the longest held turn's length (doubling as it grows, shrinking once long turns end), and
the row count doubles when none is free (so it stays at the most turns held at once); a row
is free again at its turn's end or the session's close, and once no row is held the pool
drops its cache (back to the allocator). Token2Wav's slots are allocated up front (per slot
its DiT caches for every Euler step at the longest voice prompt: ~0.5 GiB at full size, 5
steps, 500 prompt frames) and double when a turn finds none free.

[DEMO]: the official demo's MiniCPMO45/modeling_minicpmo.py (`MiniCPMODuplex`, `MiniCPMTTS`);
[MU7]: minicpmo-utils 1.0.7's `Token2wav` (pipeline/code2wav/stream.py). Parity:
tests/test_duplex_speech.py. Not thread-safe: one caller (thread) drives all the sessions of
one SpeechModels, as they share its pool.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.code2wav.causal_hift import CausalHiFT
from pipeline.code2wav.engine import Code2WavEngine, Code2WavEngineConfig, Landing
from pipeline.code2wav.flow import Flow
from pipeline.code2wav.hift import HiFTGenerator
from pipeline.code2wav.slots import NoFreeSlot
from pipeline.code2wav.voice import PROMPT_SR, VoiceCache, VoicePrompt
from pipeline.config import Code2WavConfig
from pipeline.duplex.decoder import aligned_empty
from pipeline.graphs import GraphRunner
from pipeline.sdpa import any_shape
from pipeline.talker.engine import bucket_up, power_of_two_buckets
from pipeline.talker.fused import FusedTalker
from pipeline.talker.model import AttentionBatch, TalkerKVCache, TalkerModel
from pipeline.talker.sampling import apply_repetition_penalty
from pipeline.utils import drain

if TYPE_CHECKING:
    from pipeline.duplex.config import DuplexConfig

CHUNK_CODES = 25  # codes a Token2Wav chunk decodes; a Talker chunk keeps at most this many
CHUNK_DRAWS = CHUNK_CODES + 1  # generate_chunk's max_new_token (the last draw is dropped)
REPETITION_WINDOW = 16  # gen_logits' past_window
FLUSH_MIN_CODES = 5  # force_flush decodes while lookahead + this many codes are buffered
PCM_SR = 24000
_STREAM_IDS = itertools.count()  # a session's Token2Wav stream id in its SpeechModels' engine
FIRST_KV_POSITIONS = 256  # a turn's Talker KV starts this long and doubles as needed


@dataclass
class SpeechChunk:
    codes: list[int]  # the Talker's new speech codes for this chunk
    pcm: np.ndarray  # float32 24 kHz PCM this chunk produced (may be empty)


@dataclass
class SpeechModels:
    """What every session's DuplexSpeech shares: the Talker, its KV rows, and Token2Wav.

    `token2wav` is a Code2WavEngine over the sessions' turns: a turn's flow caches live in a
    slot of its pool from the turn's first window to its last (a session's stream), and the
    windows of a round run as its steps (the slot path: one padded flow step, its graphs on
    CUDA, the vocoder per shape). `terminator_ids` are the Thinker's chunk terminators
    (<|listen|>, <|chunk_eos|>, <|chunk_tts_eos|>): the reference looks for them among the
    speech codes before decoding (see `DuplexSpeech._windows`)."""

    talker: FusedTalker
    token2wav: Code2WavEngine
    terminator_ids: tuple[int, ...] = ()
    pool: TalkerPool = field(init=False)  # the sessions' Talker KV rows
    # CUDA: the stream Token2Wav's steps run on, beside the Thinker's and the Talker's work
    # on the thread's current stream (`_token2wav_steps`)
    token2wav_stream: torch.cuda.Stream | None = field(init=False)

    def __post_init__(self) -> None:
        self.pool = TalkerPool(self.talker)
        device = self.token2wav.device
        self.token2wav_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def flow(self) -> Flow:
        return self.token2wav.flow

    @property
    def vocoder(self) -> CausalHiFT | HiFTGenerator:
        return self.token2wav.hift

    @property
    def code2wav(self) -> Code2WavConfig:
        return self.token2wav.cfg

    @property
    def voices(self) -> VoiceCache | None:
        return self.token2wav.voices

    @classmethod
    def from_checkpoint(cls, path: str | Path | None, device: str = "cpu",
                        **kw: Any) -> SpeechModels:
        """The Talker (bf16 on CUDA, fp32 on the CPU) and Token2Wav (fp32 unless told) of a
        checkpoint folder (None: the embedded default), with its default voice: `from_source`."""
        from pipeline.checkpoint import ModelSource

        return cls.from_source(ModelSource.open(None if path is None else str(path)), device,
                               **kw)

    @classmethod
    def from_source(cls, source: Any, device: str = "cpu", n_timesteps: int = 10,
                    streams: int = 4, prompt_frames: int = 500,
                    precision: str = "fp32") -> SpeechModels:
        """As `from_checkpoint`, from an opened pipeline.checkpoint.ModelSource (a server's).
        Token2Wav runs `n_timesteps` Euler steps (the reference's `n_timesteps`:
        `MiniCPMODuplex`'s default 10, the demo's duplex example and server 5) in `precision`
        (fp32, or fp16: the reference's `enable_float16`); its slot pool starts with
        `streams` slots (turns at once; it grows when more speak) of voice prompts up to
        `prompt_frames` mel frames."""
        from pipeline.checkpoint import load_into, load_part, talker_schema
        from pipeline.code2wav.assets import token2wav_dir, token2wav_from_source
        from pipeline.tokenizer import TextTokenizer
        from pipeline.utils import resolve_dtype

        model = TalkerModel(source.config.talker)
        part = load_part(source.tensors, "tts.", talker_schema(model.cfg), "cpu", torch.float32)
        load_into(model, part, "talker")
        model = model.to(device=device, dtype=resolve_dtype("auto", device)).eval()
        flow, vocoder, cfg, voice_dir = token2wav_from_source(source, device)
        engine = Code2WavEngine(
            flow, vocoder, cfg,
            Code2WavEngineConfig(token2wav_precision=precision, n_timesteps=n_timesteps,
                                 max_streams=max(1, streams), slot_prompt_frames=prompt_frames),
            voices=VoiceCache(token2wav_dir(voice_dir)))
        tok = TextTokenizer.from_dir(source.tokenizer_dir)
        ids = tuple(tok.token_id(t) for t in ("<|listen|>", "<|chunk_eos|>", "<|chunk_tts_eos|>"))
        return cls(FusedTalker(model), engine, ids)


class TalkerPool:
    """The Talker KV of every session of one `SpeechModels`: a row of one TalkerKVCache per
    session that is mid-turn, so that one `FusedTalker.decode` steps many sessions at once.

    A session takes a row at its turn's first chunk and gives it back at the turn's end, at a
    context restart, at prepare and at close; a session dropped without closing loses its row
    to the next `take` (the pool holds its sessions weakly). Rows go out lowest first, so the
    rows a step spans stay few. All rows share one length, grown by doubling (from
    FIRST_KV_POSITIONS up to max_position_embeddings) when a turn needs more and shrunk
    when the turns that needed it have ended (`give_back`); the row count doubles when no
    row is free. Once no row is held the cache is dropped.

    The lockstep (`begin`, `first_draw`, `step`, `end`): each row's draw state lives on the
    device (`LockstepRows`), so that a step (the decode of every drawing row's code, then each
    row's draw) runs on static tensors: on CUDA a graph per (rows, keys read) bucket,
    captured on first use; the graphs read the cache's tensors, so a resize drops them. The
    host adds each drawing row's noise from its session's generator before a step and reads
    the step's codes once after it.
    """

    def __init__(self, decoder: FusedTalker) -> None:
        self.decoder = decoder
        self.model: TalkerModel = decoder.model
        weight = self.model.emb_code[0].weight
        self.dtype, self.device = weight.dtype, weight.device
        self.limit = self.model.cfg.max_position_embeddings
        self.cache: TalkerKVCache | None = None
        self._owners: list[weakref.ref | None] = []  # per row: the context holding it
        self.rows: LockstepRows | None = None  # the rows' draw state, one per cache row
        self.graphs: GraphRunner | None = None  # the steps' graphs over this cache (CUDA)
        self.use_graphs = self.device.type == "cuda"
        self.graph_steps = 0  # lockstep steps replayed as graphs

    def _held(self, row: int) -> bool:
        ref = self._owners[row]
        return ref is not None and ref() is not None

    @property
    def rows_in_use(self) -> int:
        return sum(self._held(r) for r in range(len(self._owners)))

    def take(self, owner: _TalkerContext) -> int:
        """A free row for `owner` (the lowest; the rows double when none is free)."""
        free = [r for r in range(len(self._owners)) if not self._held(r)]
        if not free:
            rows = len(self._owners)
            length = min(FIRST_KV_POSITIONS, self.limit) if self.cache is None else (
                self.cache.max_len)
            self._resize(max(1, 2 * rows), length)
            self._owners += [None] * (self.cache.slots - rows)
            free = [rows]
        self._owners[free[0]] = weakref.ref(owner)
        return free[0]

    def give_back(self, row: int) -> None:
        """Free `row`. With no row held the cache goes; when the longest turn still held
        fills a quarter of the rows' length or less, the rows shrink to twice its length
        (so one long turn does not keep every row long)."""
        self._owners[row] = None
        held = [ref() for ref in self._owners if ref is not None]
        lengths = [c.length for c in held if c is not None]
        if not lengths:
            self.cache, self._owners, self.rows, self.graphs = None, [], None, None
            return
        assert self.cache is not None
        first = min(FIRST_KV_POSITIONS, self.limit)
        if self.cache.max_len > first and 4 * max(lengths) <= self.cache.max_len:
            size = first
            while size < 2 * max(lengths):
                size *= 2
            self._resize(self.cache.slots, min(size, self.cache.max_len))

    def reserve(self, length: int) -> TalkerKVCache:
        """The cache, its rows at least `length` positions long (at most the limit)."""
        assert self.cache is not None, "reserve with no row taken"
        if length > self.cache.max_len:
            size = max(min(FIRST_KV_POSITIONS, self.limit), self.cache.max_len)
            while size < length:
                size *= 2
            self._resize(self.cache.slots, min(size, self.limit))
        return self.cache

    def _resize(self, slots: int, max_len: int) -> None:
        grown = TalkerKVCache(self.model.cfg, slots, max_len, self.dtype, self.device)
        old = self.cache
        if old is not None:
            n = min(old.max_len, max_len)
            grown.kv[:, :, : old.slots, :, :n].copy_(old.kv[:, :, :, :, :n])
        self.cache = grown
        self.graphs = None  # captured over the old cache's tensors
        if self.rows is None or self.rows.slots != slots:
            # rows grow only when a turn takes one, before its lockstep lays its rows out
            self.rows = LockstepRows.of(slots, self.model.cfg, self.device)

    def extend(self, contexts: list[_TalkerContext], conditions: list[torch.Tensor]
               ) -> list[torch.Tensor]:
        """Each context's rows (L_i, E) at its next L_i positions (a turn's first chunk
        takes a row), attending to its turn's KV and causally to each other, all in ONE
        forward over rows [0, R): each session's rows right-aligned in (R, max L_i), the
        padding before them and the rows of other sessions idle (written to the scratch
        column, attending to key 0 only). Returns each context's last-row logits (V,)
        float32, in order."""
        for c in contexts:
            if c.row is None:
                c.row = self.take(c)
        longest = max(c.length + x.shape[0] for c, x in zip(contexts, conditions, strict=True))
        cache = self.reserve(longest)
        width = max(x.shape[0] for x in conditions)
        rows, read_len = self._rows_bucket(contexts), self._keys_bucket(longest)
        positions = [[0] * width for _ in range(rows)]
        writes = [[cache.scratch_pos] * width for _ in range(rows)]
        x = torch.zeros(rows, width, conditions[0].shape[1], dtype=conditions[0].dtype,
                        device=self.device)
        for c, cond in zip(contexts, conditions, strict=True):
            n = cond.shape[0]
            span = list(range(c.length, c.length + n))
            positions[c.row][width - n :] = writes[c.row][width - n :] = span
            x[c.row, width - n :] = cond
        at = torch.tensor([positions, writes], dtype=torch.long).to(self.device)
        keys = cache.position_ids[:read_len]
        allowed = (keys <= at[0][..., None])[:, None]  # (R, 1, L, read_len)
        mask = torch.zeros(allowed.shape, dtype=x.dtype, device=self.device)
        mask.masked_fill_(allowed.logical_not(), float("-inf"))
        batch = AttentionBatch(slice(0, rows), cache.row_ids[:rows], at[1], read_len, mask)
        with any_shape():
            logits = self.model.head(self.decoder._forward(x, at[0], cache, batch))
        for c, cond in zip(contexts, conditions, strict=True):
            c.length += cond.shape[0]
        return [logits[c.row] for c in contexts]

    # -- the lockstep ----------------------------------------------------------------------

    def begin(self, chunks: list[_Chunk]) -> None:
        """Lay out the chunks' rows for a lockstep: each one's prefill logits, position,
        sampler settings and an empty repetition window; no other row draws."""
        st = self.rows
        assert st is not None
        st.active.zero_()
        speeches = [c.speech for c in chunks]
        settings = torch.tensor([[s.talker.row, s.talker.length, c.min_draws, int(s.greedy)]
                                 for s, c in zip(speeches, chunks, strict=True)],
                                dtype=torch.long).to(self.device)
        index = settings[:, 0]
        st.positions.index_copy_(0, index, settings[:, 1])
        st.min_draws.index_copy_(0, index, settings[:, 2])
        st.drawn.index_fill_(0, index, 0)
        st.count.index_fill_(0, index, 0)
        st.temperature.index_copy_(0, index, torch.cat([s.temperature for s in speeches]))
        st.penalty.index_copy_(0, index, torch.tensor(
            [[s.repetition_penalty] for s in speeches], dtype=torch.float32).to(self.device))
        # a greedy row draws argmax(probs / 1): the argmax of its probs, with no draw
        st.noise.index_fill_(0, index[settings[:, 3].bool()], 1.0)
        st.logits.index_copy_(0, index, torch.stack([c.logits for c in chunks]))
        st.active.index_fill_(0, index, True)

    def end(self) -> None:
        """No row draws (after a lockstep, or a failed step)."""
        if self.rows is not None:
            self.rows.active.zero_()

    def first_draw(self, chunks: list[_Chunk]) -> list[int]:
        """Each chunk's first code, drawn on its prefill's logits. Returns the codes, in
        the chunks' order."""
        rows = self._noise(chunks)
        draw_rows(self.rows, self.rows.logits[:rows], rows)
        return self._read(chunks, rows)

    def step(self, chunks: list[_Chunk]) -> list[int]:
        """Feed each chunk its last code at its next position and draw its next: one
        decode over rows [0, R) (other rows idle), then each row's draw. Returns the codes,
        in the chunks' order."""
        contexts = [c.speech.talker for c in chunks]
        longest = max(c.length for c in contexts) + 1
        self.reserve(longest)
        rows, read_len = self._noise(chunks), self._keys_bucket(longest)
        with any_shape():
            if self.use_graphs:
                if self.graphs is None:
                    self.graphs = GraphRunner(max_graphs=64)
                key = (rows, read_len)
                if key not in self.graphs:
                    self._capture(key)
                self.graphs.run(key, (), lambda: self._step_rows(*key))
                self.graph_steps += 1
            else:
                self._step_rows(rows, read_len)
        for c in contexts:
            c.length += 1
        return self._read(chunks, rows)

    def _noise(self, chunks: list[_Chunk]) -> int:
        """Each sampling row's Exp(1) noise from its session's generator (the draws
        `torch.multinomial` makes for one sample); returns the rows' bucket R."""
        st = self.rows
        assert st is not None
        for c in chunks:
            s = c.speech
            if not s.greedy:
                st.noise[s.talker.row].exponential_(generator=s.generator)
        return self._rows_bucket([c.speech.talker for c in chunks])

    def _rows_bucket(self, contexts: list[_TalkerContext]) -> int:
        """The rows [0, R) a forward over these contexts' rows spans: R a power of two."""
        assert self.cache is not None
        top = max(c.row for c in contexts) + 1
        return bucket_up(top, power_of_two_buckets(1, self.cache.slots))

    def _keys_bucket(self, length: int) -> int:
        """The keys [0, N) a forward reads for positions below `length`: N a power of two
        from FIRST_KV_POSITIONS up to the rows' length."""
        assert self.cache is not None
        n = self.cache.max_len
        return bucket_up(length, power_of_two_buckets(min(FIRST_KV_POSITIONS, n), n))

    def _read(self, chunks: list[_Chunk], rows: int) -> list[int]:
        codes = self.rows.out[:rows].tolist()  # one host read for every row
        return [codes[c.speech.talker.row] for c in chunks]

    def _capture(self, key: tuple[int, int]) -> None:
        """Capture the step of `key` with every row idle, so that its warm-up runs change
        nothing (an idle row writes to the cache's scratch column and keeps its state)."""
        st = self.rows
        active = st.active.clone()
        st.active.zero_()
        self.graphs.add(key, lambda: self._step_rows(*key))
        st.active.copy_(active)

    def _step_rows(self, rows: int, read_len: int) -> None:
        """One lockstep step over rows [0, rows) on the static tensors (a graph's body)."""
        st = self.rows
        active = st.active[:rows]
        logits = self.decoder.decode(self.cache, st.codes[:rows], st.positions[:rows],
                                     active, read_len)
        st.positions[:rows].add_(active.long())
        draw_rows(st, logits, rows)


@dataclass
class LockstepRows:
    """The lockstep's state per pool row, on the device (S rows: the pool's)."""

    slots: int
    eos: int
    codes: torch.Tensor  # (S,) long: the code a row feeds at its next step
    positions: torch.Tensor  # (S,) long: where it goes
    active: torch.Tensor  # (S,) bool: the row draws at the next step
    drawn: torch.Tensor  # (S,) long: codes kept this chunk
    min_draws: torch.Tensor  # (S,) long: EOS masked while drawn < this
    history: torch.Tensor  # (S, W) long: the chunk's last codes, right-aligned
    count: torch.Tensor  # (S,) long: valid entries of history
    temperature: torch.Tensor  # (S, 1) float32
    penalty: torch.Tensor  # (S, 1) float32
    noise: torch.Tensor  # (S, V) float32: Exp(1) of the next draw (1 for greedy rows)
    logits: torch.Tensor  # (S, V) float32: a chunk's prefill logits, for its first draw
    scaled: torch.Tensor  # (S, V) float32, rows 512-byte aligned: the draw's logits
    out: torch.Tensor  # (S,) long: the codes of the last draw
    eos_column: torch.Tensor  # (1, V) bool: True at EOS

    @classmethod
    def of(cls, slots: int, cfg: Any, device: torch.device) -> LockstepRows:
        """Rows for `slots`, none drawing."""
        vocab, f32 = cfg.num_audio_tokens, torch.float32

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        eos_column = zeros(1, vocab, dtype=torch.bool)
        eos_column[0, cfg.eos_code] = True
        return cls(slots, cfg.eos_code, zeros(slots), zeros(slots),
                   zeros(slots, dtype=torch.bool), zeros(slots), zeros(slots),
                   zeros(slots, REPETITION_WINDOW), zeros(slots), zeros(slots, 1, dtype=f32),
                   zeros(slots, 1, dtype=f32), torch.ones(slots, vocab, dtype=f32, device=device),
                   zeros(slots, vocab, dtype=f32), aligned_empty(slots, eos_column.float()),
                   zeros(slots), eos_column)


def draw_rows(st: LockstepRows, logits: torch.Tensor, rows: int) -> None:
    """One draw for each active row of `st` among rows [0, rows), on their `logits`,
    as `MiniCPMTTS.generate_chunk` draws: logits / its temperature -> the repetition
    penalty over the chunk's codes (none at the first draw: it changes nothing) -> EOS
    masked while fewer than its `min_draws` codes were kept -> softmax -> the exponential
    race on its noise (`torch.multinomial`'s own; greedy rows' noise is 1). Then its
    state: a code other than EOS joins the window and is fed next, and the row draws on
    until EOS or CHUNK_DRAWS codes. The softmax runs per row, on a row laid out as a
    (1, V) tensor of its own is (`aligned_empty`), so that it sums as alone. No host sync:
    a CUDA graph captures it."""
    active = st.active[:rows]
    x = st.scaled[:rows]
    torch.div(logits, st.temperature[:rows], out=x)
    x.copy_(apply_repetition_penalty(x, st.history[:rows], st.count[:rows],
                                     st.penalty[:rows]))
    x.masked_fill_((st.drawn[:rows] < st.min_draws[:rows])[:, None] & st.eos_column,
                   -torch.inf)
    probs = torch.cat([F.softmax(x[r : r + 1], dim=-1) for r in range(rows)])
    codes = torch.argmax(probs / st.noise[:rows], dim=-1)
    st.out[:rows].copy_(codes)
    keep = active & (codes != st.eos)
    history = st.history[:rows]
    history.copy_(torch.where(keep[:, None],
                              torch.cat([history[:, 1:], codes[:, None]], dim=1), history))
    count = st.count[:rows]
    count.copy_(torch.where(keep, (count + 1).clamp_max(REPETITION_WINDOW), count))
    st.drawn[:rows].add_(keep.long())
    st.codes[:rows].copy_(torch.where(keep, codes, st.codes[:rows]))
    active.copy_(keep & (st.drawn[:rows] < CHUNK_DRAWS))


class _TalkerContext:
    """One session's Talker KV for its turn: a row of the models' TalkerPool, held from the
    turn's first chunk to its end, and the positions filled in it."""

    def __init__(self, pool: TalkerPool) -> None:
        self.pool = pool
        self.model, self.device = pool.model, pool.device
        self.limit = pool.limit
        self.row: int | None = None
        self.length = 0  # positions filled (= the reference's text_start_pos)

    @property
    def cache(self) -> TalkerKVCache | None:
        """The pool's cache while this context holds a row."""
        return None if self.row is None else self.pool.cache

    def reset(self) -> None:
        if self.row is not None:
            self.pool.give_back(self.row)
        self.row, self.length = None, 0


def as_reference_pcm(speech: np.ndarray) -> np.ndarray:
    """The float PCM the reference hands out: Token2wav's int16 bytes (clip to [-1, 1],
    x 32767, truncated) read back as int16 / 32768."""
    pcm16 = (np.clip(speech, -1.0, 1.0) * 32767.0).astype("<i2")
    return pcm16.astype(np.float32) / 32768.0


class DuplexSpeech:
    """One session's Talker + Token2Wav state over shared `SpeechModels` (module docstring).

    generator: the session's sampling generator (shared with its Thinker, so that draws come
    in the reference's order); None = one of its own seeded with `seed`. greedy: argmax codes
    instead of a draw (the parity tests' reference runs)."""

    def __init__(
        self, models: SpeechModels, seed: int = 0, generator: torch.Generator | None = None,
        temperature: float = 0.8, repetition_penalty: float = 1.05, greedy: bool = False,
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"tts temperature must be > 0, got {temperature}")
        if repetition_penalty <= 0:
            raise ValueError(f"tts repetition_penalty must be > 0, got {repetition_penalty}")
        self.models = models
        self.talker = _TalkerContext(models.pool)
        cfg = models.talker.model.cfg
        self.eos = cfg.eos_code
        self.audio_bos = cfg.audio_bos_token_id
        device = self.talker.device
        self.generator = generator or torch.Generator(device=device).manual_seed(seed)
        # The vocoder's source noise: its own generator, so it never shifts the sampling
        # draws, restarted every turn as the reference's fixed noise table is (read from the
        # turn's first sample on).
        self.noise_seed = seed + 1
        self.noise = torch.Generator(device=device)
        # (1, 1) float32 like the reference's tensor: the same division kernel
        self.temperature = torch.tensor([[temperature]], dtype=torch.float32, device=device)
        self.repetition_penalty = repetition_penalty
        self.greedy = greedy
        self.stream_id = f"duplex-{next(_STREAM_IDS)}"  # its turns' stream in models.token2wav
        # a session dropped without close gives its slot back too (as its Talker row)
        weakref.finalize(self, models.token2wav.abort, self.stream_id)
        self.voice: VoicePrompt | None = None
        self.buffer: list[int] = []  # this turn's codes not yet decoded (incl. lookahead)

    @classmethod
    def from_checkpoint(
        cls, path: str | Path | None, cfg: DuplexConfig | None = None, device: str = "cpu",
        seed: int = 0, greedy: bool = False, n_timesteps: int = 10,
    ) -> DuplexSpeech:
        """A session over freshly loaded models (tests; a server shares one SpeechModels),
        Token2Wav at `n_timesteps` Euler steps."""
        kw = {}
        if cfg is not None:
            kw = {"temperature": cfg.tts_temperature,
                  "repetition_penalty": cfg.tts_repetition_penalty}
        models = SpeechModels.from_checkpoint(path, device, n_timesteps=n_timesteps)
        return cls(models, seed=seed, greedy=greedy, **kw)

    # -- session and turns ---------------------------------------------------------------

    def prepare(self, prompt_wav: np.ndarray | str | VoicePrompt | None,
                sample_rate: int = PROMPT_SR) -> None:
        """Start the session in a voice: reference audio (samples at `sample_rate`, or a wav
        file), a voice prompt, or None for the checkpoint's default voice. Resets the Talker
        and Token2Wav state, as the reference's prepare does."""
        voice = self._voice(prompt_wav, sample_rate)
        self.models.token2wav.check_voice(voice)  # its template built; a slot holds it
        self.voice = voice
        self.talker.reset()
        self._new_turn()

    def _voice(self, prompt_wav, sample_rate: int) -> VoicePrompt:
        if isinstance(prompt_wav, VoicePrompt):
            return prompt_wav
        voices = self.models.voices
        if voices is None:
            raise ValueError("no voice given and no VoiceCache for the default voice")
        if prompt_wav is None:
            return voices.default()
        if isinstance(prompt_wav, str | Path):
            import soundfile

            wav, sample_rate = soundfile.read(str(prompt_wav), dtype="float32")
        else:
            wav = np.asarray(prompt_wav, dtype=np.float32)
        if wav.size == 0 or not np.isfinite(wav).all():
            raise ValueError("reference voice audio must be non-empty and finite")
        return voices.from_audio(wav, sample_rate)

    def _new_turn(self) -> None:
        """[DEMO] _reset_token2wav_for_new_turn: the code buffer 3 x silence; the caches
        start from the voice's template at the turn's first window (`_open_stream`)."""
        self.models.token2wav.abort(self.stream_id)  # the last turn's slot, if still held
        cfg = self.models.code2wav
        self.buffer = [cfg.silence_code] * cfg.pre_lookahead

    def _open_stream(self) -> None:
        """This turn's Token2Wav stream, if not open yet: a slot filled from the voice's
        template, the vocoder noise restarted (a slot more when none is free)."""
        engine = self.models.token2wav
        if self.stream_id in engine.streams:
            return
        assert self.voice is not None
        noise = self.noise.manual_seed(self.noise_seed)
        try:
            engine.open(self.stream_id, self.voice, generator=noise)
        except NoFreeSlot:
            engine.grow(2 * engine.pool.slots)
            engine.open(self.stream_id, self.voice, generator=noise)

    @property
    def chunks(self) -> int:
        """Token2Wav windows decoded in this turn."""
        stream = self.models.token2wav.streams.get(self.stream_id)
        return 0 if stream is None else stream.state.chunks

    def close(self) -> None:
        """Free the session's state (the shared models stay)."""
        self.talker.reset()
        self.models.token2wav.abort(self.stream_id)
        self.voice, self.buffer = None, []

    # -- a speak unit --------------------------------------------------------------------

    @torch.inference_mode()
    def speak(self, spoken: list[tuple[int, torch.Tensor]], end_of_turn: bool) -> SpeechChunk:
        """A speak unit's spoken rows -> its codes and PCM (module docstring): `speak_batch`
        of this session alone."""
        (out,) = speak_batch([(self, spoken, end_of_turn)])
        if isinstance(out, BaseException):
            raise out
        return out

    def _begin(self, spoken: list[tuple[int, torch.Tensor]], end_of_turn: bool) -> _Chunk:
        """A chunk up to its prefill: its condition, on a Talker context that holds it."""
        if self.voice is None:
            raise RuntimeError("DuplexSpeech.speak before prepare")
        condition = self._condition(spoken)
        turn_start = self.talker.length == 0
        if self.talker.length + condition.shape[0] + CHUNK_CODES > self.talker.limit:
            self.talker.reset()  # bounded (module docstring); Token2Wav goes on
        min_draws = 0 if end_of_turn or turn_start else CHUNK_DRAWS
        return _Chunk(self, end_of_turn, turn_start, min_draws, condition)

    def _finish(self, chunk: _Chunk) -> _Voicing:
        """A chunk after its draws: the turn's end, and its Token2Wav windows (planned here,
        decoded with the other sessions' windows by `_token2wav_batch`)."""
        # the code drawn last is dropped: EOS, or the one drawn at the cap, never fed back
        codes = chunk.drawn[:CHUNK_CODES]
        if chunk.end_of_turn:
            self.talker.reset()
        # Token2Wav before the turn's reset: the buffer's last codes go out with this chunk
        windows = self._windows(codes, last=chunk.end_of_turn, force_flush=chunk.turn_start)
        return _Voicing(self, codes, chunk.end_of_turn, windows)

    def _token2wav(self, codes: list[int], last: bool, force_flush: bool) -> np.ndarray:
        """[DEMO] _generate_waveform_from_tokens for this session alone: the PCM of the
        windows this unit's codes complete (the turn's reset is the caller's)."""
        voicing = _Voicing(self, codes, last, self._windows(codes, last, force_flush))
        (error,) = _token2wav_batch([voicing])
        if error is not None:
            raise error
        return voicing.pcm()

    def _condition(self, spoken: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """[DEMO] _convert_results_to_tts_input: (n + 1, E)."""
        model = self.talker.model
        device = self.talker.device
        bos = model.emb_text(torch.tensor([self.audio_bos], dtype=torch.long, device=device))
        if not spoken:
            return bos
        ids = torch.tensor([i for i, _ in spoken], dtype=torch.long, device=device)
        hidden = torch.stack([h.reshape(-1) for _, h in spoken]).to(device)
        if hidden.shape[1] != model.cfg.llm_dim:
            raise ValueError(f"spoken hidden rows must be {model.cfg.llm_dim} wide, "
                             f"got {hidden.shape[1]}")
        return torch.cat([model.build_condition(ids, hidden), bos], dim=0)

    # -- Token2Wav -------------------------------------------------------------------------

    def _windows(self, codes: list[int], last: bool, force_flush: bool) -> list[_Window]:
        """[DEMO] _generate_waveform_from_tokens' buffer: the windows this unit's codes
        complete, in order. The codes join the buffer now; each window, once decoded, leaves
        the buffer as its `rest`."""
        cfg = self.models.code2wav
        ahead, window = cfg.pre_lookahead, CHUNK_CODES + cfg.pre_lookahead
        self.buffer = buffer = self.buffer + codes
        # Kept as the reference has it: it looks for the Thinker's chunk terminators among
        # speech codes (ids of another vocabulary), which only a tiny vocabulary could match.
        flush = force_flush or any(c in self.models.terminator_ids for c in codes)
        out = []
        if flush:
            while len(buffer) >= ahead + FLUSH_MIN_CODES:
                n = min(window, len(buffer))
                out.append(_Window(buffer[:n], False, buffer[min(CHUNK_CODES, n - ahead) :]))
                buffer = out[-1].rest
        else:
            while len(buffer) >= window:
                out.append(_Window(buffer[:window], False, buffer[CHUNK_CODES:]))
                buffer = out[-1].rest
        if last and buffer:
            out.append(_Window(buffer, True, []))
        return out


@dataclass
class _Window:
    """A Token2Wav window of a session's unit: its codes (incl. lookahead), whether it ends
    the turn, and the session's code buffer once it is decoded."""

    codes: list[int]
    last: bool
    rest: list[int]


@dataclass
class _Voicing:
    """A session's Token2Wav for one speak unit: its windows and the PCM of those decoded."""

    speech: DuplexSpeech
    codes: list[int]
    end_of_turn: bool
    windows: list[_Window]
    pieces: list[np.ndarray] = field(default_factory=list)

    def pcm(self) -> np.ndarray:
        """The unit's PCM as the reference hands it out (module docstring)."""
        pieces = self.pieces
        pcm = as_reference_pcm(np.concatenate(pieces)) if pieces else np.zeros(0, np.float32)
        if pcm.size and not self.end_of_turn and pcm.size < PCM_SR:
            pcm = np.pad(pcm, (PCM_SR - pcm.size, 0))
        return pcm


def _token2wav_batch(voicings: list[_Voicing]) -> list[BaseException | None]:
    """`_token2wav_steps` run to its end, with nothing between its rounds."""
    return drain(_token2wav_steps(voicings))


def _token2wav_steps(
    voicings: list[_Voicing],
) -> Generator[Landing | None, None, list[BaseException | None]]:
    """Decode the windows of every session's unit in rounds: round k takes each session's
    k-th window (a session's windows run in order, each on the state its previous one
    left), ONE `Code2WavEngine` step per engine for all of them, launched on the models'
    Token2Wav stream (CUDA). While a round's step is on the GPU this yields its `Landing`
    (the caller steps other work meanwhile: the Thinker's kernels run beside it), and
    None after each round. Returns per voicing the exception that failed it (its step's),
    or None; a failed session stops at its last decoded window (its buffer still holds
    the rest)."""
    errors: list[BaseException | None] = [None] * len(voicings)
    k = 0
    while True:
        due = [i for i, v in enumerate(voicings) if errors[i] is None and k < len(v.windows)]
        if not due:
            return errors
        steps: dict[int, list[int]] = {}
        for i in due:
            speech = voicings[i].speech
            try:
                speech._open_stream()
            except Exception as e:  # noqa: BLE001 - this session's Token2Wav fails alone
                errors[i] = e
                continue
            steps.setdefault(id(speech.models.token2wav), []).append(i)
        for step in steps.values():
            models = voicings[step[0]].speech.models
            windows = {voicings[i].speech.stream_id: voicings[i].windows[k] for i in step}
            try:
                landing = models.token2wav.launch(
                    {sid: (w.codes, w.last) for sid, w in windows.items()},
                    models.token2wav_stream)
                while not landing.ready():
                    yield landing
                pcm = landing.result()
            except Exception as e:  # noqa: BLE001 - every session of the step failed
                for i in step:
                    errors[i] = e
                continue
            for i in step:
                v = voicings[i]
                v.pieces.append(pcm[v.speech.stream_id][0])
                v.speech.buffer = v.windows[k].rest
        k += 1
        yield None


@dataclass
class _Chunk:
    """One session's speak unit in `speak_batch`: its draws so far and the logits of the
    next."""

    speech: DuplexSpeech
    end_of_turn: bool
    turn_start: bool
    min_draws: int  # EOS is masked at draws [0, min_draws)
    condition: torch.Tensor  # (n + 1, E): the rows its prefill feeds
    logits: torch.Tensor | None = None  # the prefill's, for the first draw
    drawn: list[int] = field(default_factory=list)


def _lockstep(pool: TalkerPool, chunks: list[_Chunk],
              fail: Callable[[BaseException], None]) -> Generator[None, None, None]:
    """The chunks' draws on one pool, one `next()` a GPU step: each chunk's first draw,
    then one `TalkerPool.step` a draw for the chunks still drawing; a chunk ends at EOS (not
    kept) or at its CHUNK_DRAWS-th code. A failed step fails every chunk (`fail`)."""
    try:
        pool.begin(chunks)
        codes = pool.first_draw(chunks)
        while True:
            drawing = []
            for chunk, code in zip(chunks, codes, strict=True):
                if code != chunk.speech.eos:
                    chunk.drawn.append(code)
                    if len(chunk.drawn) < CHUNK_DRAWS:
                        drawing.append(chunk)
            yield
            if not drawing:
                return
            chunks = drawing
            codes = pool.step(chunks)
    except Exception as e:  # noqa: BLE001 - every chunk of the lockstep is mid-draw
        fail(e)
    finally:
        pool.end()


def speak_batch(
    items: list[tuple[DuplexSpeech, list[tuple[int, torch.Tensor]], bool]],
) -> list[SpeechChunk | BaseException]:
    """`speak_steps` run to its end, with nothing between its steps."""
    return drain(speak_steps(items))


@torch.inference_mode()
def speak_steps(
    items: list[tuple[DuplexSpeech, list[tuple[int, torch.Tensor]], bool]],
) -> Generator[None, None, list[SpeechChunk | BaseException]]:
    """`DuplexSpeech.speak` for several sessions, each (speech, spoken, end_of_turn), one
    GPU step a `next()` (the prefills, each lockstep step, each Token2Wav round); their
    Talker chunks ([DEMO] `MiniCPMTTS.generate_chunk` over each turn's KV) drawn in
    lockstep: per session its condition and its prefill; then per TalkerPool each one's
    first draw, and each step ONE decode over the Talker rows of every session still
    drawing with each row's own draw (`TalkerPool._sample`: its temperature, repetition
    window, EOS mask and generator, as alone); a session leaves at its EOS or its
    CHUNK_DRAWS-th draw. Then the Token2Wav windows of all of them, in rounds, a round one
    step of the Code2Wav engine (`_token2wav_steps`).

    So each session draws the codes it draws alone: only the decode's row count differs,
    which moves the logits in their last bits (and the PCM by a few LSB: the engine's padded
    rows). Returns per item its SpeechChunk or the exception that failed it. A failed
    decode fails every session it stepped; a failed session keeps its turn's Talker KV as
    its last complete prefill or step left it (a failed forward wrote only past it), and a
    failed Token2Wav step each of its sessions' Token2Wav state as its last decoded window
    left it."""
    if len({id(speech) for speech, _, _ in items}) != len(items):
        raise ValueError("a session may speak once in a batch")
    out: list[SpeechChunk | BaseException | None] = [None] * len(items)
    chunks: dict[int, _Chunk] = {}

    def fail(i: int, e: BaseException) -> None:
        out[i] = e
        chunks.pop(i)

    for i, (speech, spoken, end_of_turn) in enumerate(items):
        try:
            chunks[i] = speech._begin(spoken, end_of_turn)
        except Exception as e:  # noqa: BLE001 - this session's chunk fails, not the batch's
            out[i] = e
    by_pool: dict[int, list[int]] = {}
    for i in sorted(chunks):
        by_pool.setdefault(id(chunks[i].speech.talker.pool), []).append(i)
    for group in by_pool.values():
        pool = chunks[group[0]].speech.talker.pool
        try:
            logits = pool.extend([chunks[i].speech.talker for i in group],
                                 [chunks[i].condition for i in group])
        except Exception as e:  # noqa: BLE001 - every chunk of the forward fails
            for i in group:
                fail(i, e)
            continue
        for i, lg in zip(group, logits, strict=True):
            chunks[i].logits = lg
    if chunks:
        yield
    for group in by_pool.values():
        group = [i for i in group if i in chunks]
        if not group:
            continue
        yield from _lockstep(chunks[group[0]].speech.talker.pool, [chunks[i] for i in group],
                             lambda e, group=group: [fail(i, e) for i in group])
    voicings: dict[int, _Voicing] = {}
    for i, chunk in chunks.items():
        try:
            voicings[i] = chunk.speech._finish(chunk)
        except Exception as e:  # noqa: BLE001
            out[i] = e
    errors = yield from _token2wav_steps(list(voicings.values()))
    for (i, voicing), error in zip(voicings.items(), errors, strict=True):
        if error is not None:
            out[i] = error
            continue
        try:
            pcm = voicing.pcm()
            if voicing.end_of_turn:
                voicing.speech._new_turn()
            out[i] = SpeechChunk(voicing.codes, pcm)
        except Exception as e:  # noqa: BLE001
            out[i] = e
    return out  # type: ignore[return-value]

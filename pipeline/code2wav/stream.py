"""Chunked (streaming) Code2Wav: explicit per-stream state in, new state out (spec section 3.4).

Per turn:
  1. the stream starts from a per-voice template: `Flow.setup_cache(prompt ++ 3 lookahead codes,
     prompt_mel, spk)` and an empty vocoder cache (`initial_state`);
  2. its code buffer starts with 3 silence codes; every chunk passes 28 codes (25 decoded +
     3 lookahead) and the buffer advances by 25; the final chunk passes the remainder with
     `last=True` (the encoder zero-pads the lookahead) (`CodeCursor`);
  3. per chunk: flow chunk -> 50 mel frames and cache trimming (the slot pool's step, slots.py);
     the vocoder (`vocode`), which is the one the assets hold:
       * CosyVoice2 HiFT (hift.py) on [8 cached mel frames || new frames] with the cached
         3840-sample source; the first 3840 samples are cross-faded (hamming 7680) with the
         held-back tail of the previous chunk; the last 3840 samples are held back unless `last`;
       * the causal CosyVoice3 vocoder (causal_hift.py) on the fresh frames only: no overlap,
         no crossfade; its output lags 8 frames (3840 samples) until `last` flushes it.

Which reference a stream follows is `initial_state(reference=...)` (a property of the stream,
not of the checkpoint; both work with either vocoder):
  * "minicpmo-utils-1.0.7" ([MU7], the official demo's pin; default): the prompt's lookahead is
    its own first 3 codes, and the first chunk that has audio (unless it is also the last) is
    preceded by 3840 zeros (160 ms; with the causal vocoder this fills its delay, so every
    full chunk is 24000 samples);
  * "stepaudio2-0.1.1" ([SA] / vLLM-Omni): lookahead 3 x silence 4218, no leading zeros (the
    concatenated stream lines up sample for sample with the offline decode of the same codes).
Cache trimming follows [MU7] for both (token-rate conformer layers trimmed at their own rate;
[SA] slices the packed duplicated cache, which scrambles those layers from the third chunk on).
The turn's code buffer starts with 3 x 4218 in both: that is the caller's ([DEMO]
`token2wav_buffer = [4218] * 3`), which [MU7] does not change.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, get_args

import numpy as np
import torch

from pipeline.code2wav.causal_hift import CausalHiFT, CausalVocoderState, vocode_chunk
from pipeline.code2wav.flow import Flow, FlowCache
from pipeline.code2wav.graphs import CausalVocoderGraphs
from pipeline.code2wav.hift import HiFTGenerator
from pipeline.config import Code2WavConfig

Token2WavReference = Literal["minicpmo-utils-1.0.7", "stepaudio2-0.1.1"]
DEFAULT_REFERENCE: Token2WavReference = "minicpmo-utils-1.0.7"


@dataclass
class VocoderCache:
    """HiFT overlap state, batch B: mel (B,80,M<=8), source (B,1,S<=3840), speech (B,S<=3840)."""

    mel: torch.Tensor
    source: torch.Tensor
    speech: torch.Tensor

    @staticmethod
    def empty(batch: int, n_mels: int, device, dtype=torch.float32) -> VocoderCache:
        return VocoderCache(
            mel=torch.zeros(batch, n_mels, 0, device=device, dtype=dtype),
            source=torch.zeros(batch, 1, 0, device=device, dtype=dtype),
            speech=torch.zeros(batch, 0, device=device, dtype=dtype),
        )

    def clone(self) -> VocoderCache:
        return VocoderCache(self.mel.clone(), self.source.clone(), self.speech.clone())

    @staticmethod
    def cat(caches: list[VocoderCache]) -> VocoderCache:
        return VocoderCache(
            *(torch.cat([getattr(c, n) for c in caches]) for n in ("mel", "source", "speech"))
        )

    def split(self) -> list[VocoderCache]:
        return [
            VocoderCache(self.mel[i : i + 1], self.source[i : i + 1], self.speech[i : i + 1])
            for i in range(self.mel.shape[0])
        ]


@dataclass
class StreamState:
    """Everything one stream carries between chunks (batch 1 tensors)."""

    flow: FlowCache | None  # a voice template's; None in the engine (the caches are in a slot)
    vocoder: VocoderCache | CausalVocoderState  # the kind of the vocoder that decodes it
    spk: torch.Tensor  # (1, 192) x-vector of the voice
    prompt_frames: int  # mel frames of the voice prompt (trimming keeps them)
    generator: torch.Generator | None = None  # vocoder noise; None = global RNG (reference)
    chunks: int = 0
    leading_silence: int = 0  # zeros to put before the first audio ([MU7] 3840, [SA] 0)

    def clone(self) -> StreamState:
        flow = None if self.flow is None else self.flow.clone()
        return replace(self, flow=flow, vocoder=self.vocoder.clone())

    def vocoder_key(self, last: bool) -> tuple:
        """Streams whose next vocoder calls share this key (and mel length) batch together."""
        v = self.vocoder
        shape = (
            ("causal", *v.key())
            if isinstance(v, CausalVocoderState)
            else (v.mel.shape[2], v.speech.shape[1])
        )
        return (*shape, last, self.leading_silence > 0)


@dataclass
class CodeCursor:
    """Code buffer of one turn: what has arrived and not been decoded yet (incl. lookahead)."""

    pending: list[int]
    final: bool = False
    done: bool = False

    @staticmethod
    def start(cfg: Code2WavConfig) -> CodeCursor:
        return CodeCursor(pending=[cfg.silence_code] * cfg.pre_lookahead)

    def push(self, codes, final: bool) -> None:
        if self.final:
            raise ValueError("codes pushed after the final push")
        self.pending.extend(int(c) for c in codes)
        self.final = final

    def next_chunk(self, cfg: Code2WavConfig) -> tuple[list[int], bool] | None:
        """(codes, last) of the next chunk, or None when not ready. Codes can be empty only for a
        final vocoder flush."""
        if self.done:
            return None
        window = cfg.chunk_size + cfg.pre_lookahead
        if len(self.pending) > window or (len(self.pending) == window and not self.final):
            return self.pending[:window], False
        if self.final:
            return list(self.pending), True
        return None

    def advance(self, cfg: Code2WavConfig, last: bool) -> None:
        if last:
            self.pending, self.done = [], True
        else:
            self.pending = self.pending[cfg.chunk_size :]


def initial_state(
    flow: Flow,
    cfg: Code2WavConfig,
    prompt_tokens: torch.Tensor,
    prompt_mel: torch.Tensor,
    spk: torch.Tensor,
    reference: Token2WavReference = DEFAULT_REFERENCE,
    vocoder: HiFTGenerator | CausalHiFT | None = None,
) -> StreamState:
    """Per-voice template: prompt_tokens (1,P), prompt_mel (1,2P,80), spk (1,192).

    `reference` picks the prompt's lookahead codes and the leading silence (module doc).
    `vocoder` sizes the empty vocoder cache; None = the CosyVoice2 HiFT's, which the first
    chunk replaces when the causal vocoder decodes it (callers that predate it need not pass
    it)."""
    if reference not in get_args(Token2WavReference):
        raise ValueError(
            f"token2wav reference {reference!r}: one of {get_args(Token2WavReference)}"
        )
    n = cfg.pre_lookahead
    if reference == "minicpmo-utils-1.0.7":  # [MU7] set_stream_cache: prompt ++ prompt[:3]
        if prompt_tokens.shape[1] < n:
            raise ValueError(f"voice prompt of {prompt_tokens.shape[1]} codes: [MU7] needs >= {n}")
        pad = prompt_tokens[:, :n]
    else:  # [SA] 0.1.1: 3 x silence
        pad = torch.full(
            (1, n), cfg.silence_code, dtype=prompt_tokens.dtype, device=prompt_tokens.device
        )
    cache = flow.setup_cache(torch.cat([prompt_tokens, pad], dim=1), prompt_mel, spk)
    return StreamState(
        flow=cache,
        vocoder=_empty_vocoder(vocoder, cfg, prompt_mel.device),  # vocoders run in fp32
        spk=spk,
        prompt_frames=prompt_mel.shape[1],
        leading_silence=(
            cfg.mel_overlap_frames * cfg.hift.hop_length
            if reference == "minicpmo-utils-1.0.7"
            else 0
        ),
    )


def _empty_vocoder(vocoder, cfg: Code2WavConfig, device) -> VocoderCache | CausalVocoderState:
    if isinstance(vocoder, CausalHiFT):
        return CausalVocoderState.empty(1, vocoder, device)
    return VocoderCache.empty(1, cfg.output_size, device)


class Crossfade:
    """The reference's overlap smoothing: hamming(2*overlap) in float64, first half fades in."""

    def __init__(self, overlap_samples: int, device):
        self.n = overlap_samples
        self.window = torch.from_numpy(np.hamming(2 * overlap_samples)).to(device)

    def __call__(self, speech: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        n = self.n
        out = speech.clone()
        out[..., :n] = speech[..., :n] * self.window[:n] + tail[..., -n:] * self.window[n:]
        return out


@torch.inference_mode()
def vocode(
    hift: HiFTGenerator | CausalHiFT,
    cfg: Code2WavConfig,
    states: list[StreamState],
    mel: torch.Tensor,
    last: bool,
    crossfade: Crossfade,
) -> tuple[torch.Tensor, list[StreamState]]:
    """The vocoder half of a chunk: fresh mel (B, 80, T) of B streams with equal
    `vocoder_key(last)` -> speech (B, N) and the states with their new vocoder cache and
    leading silence (flow and `chunks` untouched). T = 0 with `last`: flush only."""
    b = len(states)
    gens = None if states[0].generator is None else [s.generator for s in states]
    causal = hift.vocoder if isinstance(hift, CausalVocoderGraphs) else hift
    if isinstance(causal, CausalHiFT):
        cur = [_as_causal(s.vocoder, causal) for s in states]
        if causal is hift:
            speech, vocs = vocode_chunk(hift, cur, mel, last, generators=gens)
        else:  # its CUDA graphs
            speech, vocs = hift(cur, mel, last, generators=gens)
    elif mel.shape[2] == 0:  # CosyVoice2 flush: release the held tail
        speech = torch.cat([s.vocoder.speech for s in states])
        vocs = [VocoderCache.empty(1, cfg.output_size, mel.device) for _ in states]
    else:
        speech, vocs = _vocode_hift(hift, cfg, states, mel, last, crossfade, gens)
    silence = states[0].leading_silence
    if silence and speech.shape[1] > 0:  # [MU7] the first chunk with audio, unless last
        if not last:
            speech = torch.cat([speech.new_zeros(b, silence), speech], dim=1)
        states = [replace(s, leading_silence=0) for s in states]
    return speech, [replace(s, vocoder=v) for s, v in zip(states, vocs)]


def _as_causal(v: VocoderCache | CausalVocoderState, hift: CausalHiFT) -> CausalVocoderState:
    if isinstance(v, CausalVocoderState):
        return v
    if v.mel.shape[2] or v.speech.shape[1]:
        raise TypeError("stream started on the CosyVoice2 HiFT; the causal vocoder cannot go on")
    return CausalVocoderState.empty(1, hift, v.mel.device)  # a fresh stream: sized here


def _vocode_hift(hift, cfg, states, mel, last, crossfade, gens):
    """HiFT on [cached mel || fresh mel] with the cached source; crossfade the overlap; hold
    back its last 3840 samples unless `last`."""
    b, mel_keep = len(states), cfg.mel_overlap_frames
    src_keep = mel_keep * cfg.hift.hop_length
    voc = states[0].vocoder if b == 1 else VocoderCache.cat([s.vocoder for s in states])
    mel = torch.cat([voc.mel, mel.to(voc.mel.dtype)], dim=2)
    speech, source = hift(mel, voc.source, gens)
    if voc.speech.shape[1] > 0:
        speech = crossfade(speech, voc.speech)
    new_voc = VocoderCache(
        mel[..., -mel_keep:].clone(),
        source[:, :, -src_keep:].clone(),
        speech[:, -src_keep:].clone(),
    )
    if not last:
        speech = speech[:, :-src_keep]
    # own the memory: a stream's state must not alias its batch-mates'
    return speech, [new_voc] if b == 1 else [v.clone() for v in new_voc.split()]

"""Chunked (streaming) Code2Wav: explicit per-stream state in, new state out (spec section 3.4).

Per turn:
  1. the stream starts from a per-voice template: `Flow.setup_cache(prompt ++ 3 x silence 4218,
     prompt_mel, spk)` and an empty vocoder cache (`initial_state`);
  2. its code buffer starts with 3 silence codes; every chunk passes 28 codes (25 decoded +
     3 lookahead) and the buffer advances by 25; the final chunk passes the remainder with
     `last=True` (the encoder zero-pads the lookahead) (`CodeCursor`);
  3. per chunk (`stream_step`): flow chunk -> 50 mel frames; cache trimming; HiFT on
     [8 cached mel frames || new frames] with the cached 3840-sample source; the first 3840
     samples are cross-faded (hamming 7680) with the held-back tail of the previous chunk;
     the last 3840 samples (160 ms) are held back unless `last`.

Reference versions (see the report): we follow [SA] 0.1.1 / vLLM-Omni for the first chunk (no
3840-sample silence left pad, so the concatenated stream lines up sample for sample with the
offline decode of the same codes and no extra 160 ms sits before the first speech) and [MU7]
for cache trimming (token-rate conformer layers trimmed at their own rate; [SA] slices the
packed duplicated cache, which scrambles those layers once trimming starts, from the third
chunk on). Both differ from the other versions only where stated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from pipeline.code2wav.flow import Flow, FlowCache
from pipeline.code2wav.hift import HiFTGenerator
from pipeline.config import Code2WavConfig

HISTORY_FRAMES = 100  # mel frames of cache kept beyond the prompt (reference constant)


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

    flow: FlowCache
    vocoder: VocoderCache
    spk: torch.Tensor  # (1, 192) x-vector of the voice
    prompt_frames: int  # mel frames of the voice prompt (trimming keeps them)
    generator: torch.Generator | None = None  # HiFT noise; None = global RNG (reference)
    chunks: int = 0

    def clone(self) -> StreamState:
        return replace(self, flow=self.flow.clone(), vocoder=self.vocoder.clone())

    def shape_key(self, n_tokens: int, last: bool) -> tuple:
        """Streams whose next chunks share this key run in one batch with no padding."""
        return (
            n_tokens,
            last,
            self.flow.token_att.shape[3],
            self.flow.est_len,
            self.vocoder.mel.shape[2],
            self.vocoder.speech.shape[1],
        )


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

    def codes_missing(self, cfg: Code2WavConfig) -> int:
        return max(0, cfg.chunk_size + cfg.pre_lookahead - len(self.pending))


def initial_state(
    flow: Flow,
    cfg: Code2WavConfig,
    prompt_tokens: torch.Tensor,
    prompt_mel: torch.Tensor,
    spk: torch.Tensor,
) -> StreamState:
    """Per-voice template: prompt_tokens (1,P), prompt_mel (1,2P,80), spk (1,192)."""
    pad = torch.full(
        (1, cfg.pre_lookahead),
        cfg.silence_code,
        dtype=prompt_tokens.dtype,
        device=prompt_tokens.device,
    )
    cache = flow.setup_cache(torch.cat([prompt_tokens, pad], dim=1), prompt_mel, spk)
    return StreamState(
        flow=cache,
        vocoder=VocoderCache.empty(1, cfg.output_size, prompt_mel.device),  # HiFT runs in fp32
        spk=spk,
        prompt_frames=prompt_mel.shape[1],
    )


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
def stream_step(
    flow: Flow,
    hift: HiFTGenerator,
    cfg: Code2WavConfig,
    states: list[StreamState],
    tokens: torch.Tensor,
    last: bool,
    crossfade: Crossfade,
    cfm=None,
    time_table=None,
) -> tuple[torch.Tensor, list[StreamState]]:
    """Decode one chunk for B streams with equal `shape_key`. tokens (B, T) -> speech (B, N)
    float32 on the model device, and the new states (inputs are not modified)."""
    b = len(states)
    mel_keep = cfg.mel_overlap_frames
    src_keep = mel_keep * cfg.hift.hop_length
    flow_cache = states[0].flow if b == 1 else FlowCache.cat([s.flow for s in states])
    spk = torch.cat([s.spk for s in states])
    if tokens.shape[1] == 0:  # final flush with nothing left to decode: release the held tail
        speech = torch.cat([s.vocoder.speech for s in states])
        return speech, [replace(s, chunks=s.chunks + 1) for s in states]
    mel, new_flow = flow.inference_chunk(
        tokens, spk, flow_cache, last, time_table=time_table, cfm=cfm
    )
    voc = states[0].vocoder if b == 1 else VocoderCache.cat([s.vocoder for s in states])
    mel = torch.cat([voc.mel, mel.to(voc.mel.dtype)], dim=2)
    gens = None if states[0].generator is None else [s.generator for s in states]
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
    flows = [new_flow] if b == 1 else new_flow.split()
    vocs = [new_voc] if b == 1 else new_voc.split()
    out = []
    for s, f, v in zip(states, flows, vocs):
        f = f.trimmed(s.prompt_frames, HISTORY_FRAMES)
        if b > 1:  # own the memory: a stream's state must not alias its batch-mates'
            f, v = f.clone(), v.clone()
        out.append(replace(s, flow=f, vocoder=v, chunks=s.chunks + 1))
    return speech, out

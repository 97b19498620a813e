"""Causal CosyVoice3 vocoder (`CausalHiFTGenerator`) and its bounded streaming ([MU7] 1.0.7).

minicpmo-utils 1.0.7 streams through this vocoder instead of the CosyVoice2 HiFT + crossfade
(spec section 3.6). Same NSF + iSTFTNet stages as hift.py, but every convolution is causal:
  * F0 predictor: first conv k=4 looks 3 frames right, then 4 x k=3 left-causal; run in float64.
  * conv_pre looks `conv_pre_look_right` (4) frames right; everything after it is left-causal
    (nearest x rate then a left-padded conv instead of a transposed conv).
  * The source is a float64 phase accumulator held per stream, one value per mel frame held
    for its 480 samples, plus uniform [0, 1) noise. [MU7] reads that noise from a fixed table
    (`torch.rand(1, 300 s, 9)` drawn at construction, indexed by absolute sample position);
    here it is an input drawn beforehand (`draw_noise`): from `noise_table` when set (parity
    tests copy the reference's), else from each stream's generator.
So audio lags the mel by 3 + 5 = 8 frames (160 ms) until the final flush.

Streaming ([MU7] `BoundedVocoder`): each call gets only the fresh mel, in blocks of 16 frames.
Per block: F0 for every frame with its 3-frame right context (window from 8 frames back), the
source for those frames, then one decode over [31 frames of history || new frames] that emits
every frame with its 5-frame right context. `finalize` flushes the rest with zero padding. The
windows (and so the numbers) depend on host integers only (frames received, sourced, emitted),
never on tensor values: a chunk's computation is fixed by `CausalVocoderState.key()` and can
be replayed as a CUDA graph (noise is an input, no .item(), iSTFT without torch's host check).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from pipeline.code2wav import conv_windows
from pipeline.code2wav.hift import ResBlock, biased_residual, compiled
from pipeline.config import HiFTConfig


@dataclass(frozen=True)
class CausalHiFTConfig(HiFTConfig):
    """`config.yaml`'s `hift:` block (CosyVoice3 CausalHiFTGenerator) + BoundedVocoder's block."""

    conv_pre_look_right: int = 4
    block_frames: int = 16  # [MU7] BoundedVocoder(block_frames=16): not in config.yaml
    noise_table_seconds: int = 300  # [MU7] SineGen2.sine_waves length (noise wraps there)


def _left(kernel: int, dilation: int = 1) -> int:
    return dilation * (kernel - 1)


def _padded(x: torch.Tensor, left: int, right: int, up: int) -> torch.Tensor:
    """x (B, C, T) upsampled `up` times (nearest), then padded with zero frames."""
    if up > 1:
        x = F.interpolate(x, scale_factor=up, mode="nearest")
    return F.pad(x, (left, right)) if left or right else x


class _Conv(nn.Conv1d):
    """Conv1d over its input upsampled (nearest) and zero-padded on either side, run as one
    matmul over its unfolded windows: fp32 and float64 cuDNN convs of these sizes are several
    times slower than the GEMM, and only the order of the sums changes. On CUDA one Triton
    kernel builds the windows from the input, the padding and upsampling included
    (conv_windows.py: the same windows bit for bit); elsewhere torch's pad and unfold do.

    With more than one batch row the windows are built (B, T, C k) and multiplied by one
    `torch.mm`: the product `torch.matmul(weight, windows)` would compute (the weight requires
    grad, so matmul folds the batch into one mm over the windows' transpose, after copying
    them out of their (B, C k, T) order), without that copy: the same product bit for bit.
    One batch row folds without a copy, the mm reading the windows transposed: it keeps
    matmul."""

    def conv(self, x: torch.Tensor, left: int = 0, right: int = 0, up: int = 1,
             bias: bool = True) -> torch.Tensor:
        """The conv; without its bias when `bias` is False (the op after it adds it)."""
        (k,), (d,), (st,) = self.kernel_size, self.dilation, self.stride
        frame_major = x.shape[0] > 1
        if conv_windows.available(x.device):
            cols = conv_windows.conv_windows(x, k, d, st, left, right, up, frame_major)
        else:
            x = _padded(x, left, right, up)
            win = x.unfold(2, d * (k - 1) + 1, st)[..., ::d]  # (B, C, T, k)
            b, c, t, _ = win.shape
            # (B, C k, T): frames innermost like x, so the product lands in the conv's own
            # (B, C_out, T) layout and the ops after it read it contiguously
            cols = (win.permute(0, 2, 1, 3).reshape(b, t, c * k) if frame_major
                    else win.transpose(2, 3).reshape(b, c * k, t))
        weight = self.weight.reshape(self.weight.shape[0], -1)
        if frame_major:  # matmul's own steps from its reshape: mm, the product's (B, C_out, T) copy
            b, t, ck = cols.shape
            out = torch.mm(cols.reshape(b * t, ck), weight.t()).view(b, t, -1)
            out = out.transpose(1, 2).contiguous()
        else:
            out = torch.matmul(weight, cols)
        return out if self.bias is None or not bias else out + self.bias[:, None]


class CausalConv1d(_Conv):
    """Conv1d padded with zeros on one side only. A 'right' conv reads real right context in
    streaming (the caller passes it) and zeros when `finalize`."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, right: bool = False):
        super().__init__(cin, cout, kernel, dilation=dilation)
        self.pad, self.right = _left(kernel, dilation), right

    def forward(self, x: torch.Tensor, finalize: bool = True, bias: bool = True) -> torch.Tensor:
        if self.right:
            return self.conv(x, right=self.pad if finalize else 0, bias=bias)
        return self.conv(x, left=self.pad, bias=bias)


class CausalUpsample(_Conv):
    """x `rate` nearest, then a left-causal conv (CosyVoice3's CausalConv1dUpsample)."""

    def __init__(self, cin: int, cout: int, kernel: int, rate: int):
        super().__init__(cin, cout, kernel)
        self.rate = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x, left=self.kernel_size[0] - 1, up=self.rate)


class CausalDownsample(_Conv):
    """Strided conv (kernel 2u, stride u) left-padded by u - 1 (CausalConv1dDownSample)."""

    def __init__(self, cin: int, cout: int, rate: int):
        super().__init__(cin, cout, 2 * rate, stride=rate)
        self.rate = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x, left=self.rate - 1)


class CausalResBlock(ResBlock):
    """hift.py's ResBlock with left-causal convs; `history` = the frames of left context its
    convs read. Each conv's bias is added by the op after it, the next Snake or the residual
    add (compiled on CUDA, `fuse_snakes`: one launch fewer a conv), the same adds."""

    def __init__(self, channels: int, kernel: int, dilations: Sequence[int]):
        super().__init__(channels, kernel, dilations)
        self.history = sum(c.pad for c in (*self.convs1, *self.convs2))

    @staticmethod
    def conv(channels: int, kernel: int, dilation: int = 1) -> CausalConv1d:
        return CausalConv1d(channels, channels, kernel, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = compiled(biased_residual) if self.activations1[0].fused else biased_residual
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            h = a2(c1(a1(x), bias=False), bias=c1.bias[:, None])
            x = residual(c2(h, bias=False), c2.bias[:, None], x)
        return x


class CausalF0Predictor(nn.Module):
    """CausalConvRNNF0Predictor: mel (B,80,T) -> f0 (B, T-3), or (B, T) when `finalize`."""

    def __init__(self, in_channels: int, channels: int):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            conv = (
                CausalConv1d(in_channels, channels, 4, right=True)
                if i == 0
                else CausalConv1d(channels, channels, 3)
            )
            layers += [weight_norm(conv), nn.ELU()]
        self.condnet = nn.Sequential(*layers)  # params at 0,2,4,6,8 like the checkpoint
        self.classifier = nn.Linear(channels, 1)

    def forward(self, x: torch.Tensor, finalize: bool) -> torch.Tensor:
        x = self.condnet[0](x, finalize)
        for layer in self.condnet[1:]:
            x = layer(x)
        return torch.abs(self.classifier(x.transpose(1, 2)).squeeze(-1))


class CausalHiFT(nn.Module):
    """The causal vocoder's modules, keys as in the released `hift.pt`. The F0 predictor is
    held in float64 ([MU7]: its precision matters for causal inference); the rest in float32."""

    def __init__(self, cfg: CausalHiFTConfig):
        super().__init__()
        self.cfg = cfg
        base, n_fft = cfg.base_channels, cfg.istft_n_fft
        self.m_source = nn.Module()
        self.m_source.l_linear = nn.Linear(cfg.nb_harmonics + 1, 1)
        self.conv_pre = weight_norm(
            CausalConv1d(cfg.in_channels, base, cfg.conv_pre_look_right + 1, right=True)
        )
        self.ups = nn.ModuleList(
            [
                weight_norm(CausalUpsample(base // 2**i, base // 2 ** (i + 1), k, u))
                for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes))
            ]
        )
        # Source branch i runs at the resolution of up-stage i: stride = product of later rates.
        down = [1] + list(cfg.upsample_rates[::-1][:-1])
        cum = [math.prod(down[: i + 1]) for i in range(len(down))][::-1]
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (u, k, d) in enumerate(
            zip(cum, cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes)
        ):
            ch = base // 2 ** (i + 1)
            self.source_downs.append(
                CausalConv1d(n_fft + 2, ch, 1) if u == 1 else CausalDownsample(n_fft + 2, ch, u)
            )
            self.source_resblocks.append(CausalResBlock(ch, k, d))
        self.resblocks = nn.ModuleList()
        for i in range(len(self.ups)):
            ch = base // 2 ** (i + 1)
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes):
                self.resblocks.append(CausalResBlock(ch, k, d))
        self.conv_post = weight_norm(CausalConv1d(ch, n_fft + 2, 7))
        self.f0_predictor = CausalF0Predictor(cfg.in_channels, cfg.f0_predictor_channels).double()
        self.register_buffer(
            "stft_window",
            torch.hann_window(n_fft, periodic=True, dtype=torch.float64).float(),
            persistent=False,
        )
        self.noise_table: torch.Tensor | None = None  # (L, 9) uniform noise by sample position
        self.f0_left = sum(c.pad for c in self.f0_predictor.condnet[2::2])  # 8 frames
        self.f0_right = self.f0_predictor.condnet[0].pad  # 3 frames
        self.decoder_right = cfg.conv_pre_look_right + 1  # conv_pre + the final iSTFT frame
        self.delay = self.f0_right + self.decoder_right
        self.history = self._history()
        # State capacities: [MU7] BoundedVocoder.limits' mel / source cache bounds.
        self.mel_capacity = max(self.history, self.f0_left - self.decoder_right) + self.delay
        self.source_capacity = self.history + self.decoder_right

    def _history(self) -> int:
        """Mel frames of left context a decode window keeps ([MU7] `context_sizes`: the
        receptive field of every causal conv, source STFT and output iSTFT, + 2 frames)."""
        cfg, k = self.cfg, len(self.cfg.resblock_kernel_sizes)
        rate = math.prod(cfg.upsample_rates)
        transform = Fraction(cfg.istft_n_fft, rate * cfg.istft_hop_len)
        history, scale = Fraction(0), 1
        for i, up in enumerate(self.ups):
            scale *= cfg.upsample_rates[i]
            history += Fraction(up.kernel_size[0] - 1, scale)
            ds = self.source_downs[i]
            source = (
                transform
                + Fraction(ds.kernel_size[0] - 1, rate)
                + Fraction(self.source_resblocks[i].history, scale)
            )
            res = max(r.history for r in self.resblocks[i * k : (i + 1) * k])
            history = max(history, source) + Fraction(res, scale)
        history += Fraction(self.conv_post.pad + 1, rate) + transform
        return math.ceil(history) + 2

    # -- the per-block computations -----------------------------------------------------------

    def source(
        self, f0: torch.Tensor, phase: torch.Tensor, noise: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """f0 (B, n) float32 per frame, phase (B, n_harm) float64 cycles, noise (B, 480n, n_harm)
        -> excitation (B, 1, 480n), new phase. One sine value per frame (its end phase), held
        for the frame's 480 samples: what SineGen2's nearest path does; the float64 running
        phase keeps long streams in tune."""
        cfg, hop = self.cfg, self.cfg.hop_length
        harmonics = torch.arange(1, cfg.nb_harmonics + 2, device=f0.device, dtype=f0.dtype)
        increments = (f0[:, :, None] * harmonics / cfg.sampling_rate).remainder(1)
        cycles = increments.double().cumsum(dim=1) * hop + phase[:, None]
        new_phase = cycles[:, -1].remainder(1)
        sine = (cycles.remainder(1) * (2 * math.pi)).sin().to(f0).repeat_interleave(hop, dim=1)
        voiced = (f0[:, :, None] > cfg.nsf_voiced_threshold).to(f0).repeat_interleave(hop, dim=1)
        amplitude = voiced * cfg.nsf_sigma + (1 - voiced) * cfg.nsf_alpha / 3
        excitation = sine * cfg.nsf_alpha * voiced + amplitude * noise
        return torch.tanh(self.m_source.l_linear(excitation)).transpose(1, 2), new_phase

    def decode(self, x: torch.Tensor, s: torch.Tensor, finalize: bool) -> torch.Tensor:
        """mel (B, 80, T), source (B, 1, 480T) -> speech (B, 480 (T - 5)), or (B, 480T) when
        `finalize` (zero right context instead of the last 5 frames)."""
        cfg, k = self.cfg, len(self.cfg.resblock_kernel_sizes)
        n, hop = cfg.istft_n_fft, cfg.istft_hop_len
        spec = torch.view_as_real(
            torch.stft(s.squeeze(1), n, hop, n, window=self.stft_window, return_complex=True)
        )
        s_stft = torch.cat([spec[..., 0], spec[..., 1]], dim=1)
        x = self.conv_pre(x, finalize)
        if not finalize:  # the look-right frames were context only: drop their source frames
            s_stft = s_stft[:, :, : -math.prod(cfg.upsample_rates) * cfg.conv_pre_look_right]
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, cfg.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft))
            xs = self.resblocks[i * k](x)
            for j in range(1, k):
                xs += self.resblocks[i * k + j](x)
            x = xs / k
        x = self.conv_post(F.leaky_relu(x))  # default slope 0.01 here, as in the reference
        half = n // 2 + 1
        magnitude = torch.clip(torch.exp(x[:, :half]), max=1e2)
        phase = torch.sin(x[:, half:])
        speech = self._istft(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        if not finalize:  # the last frame's samples still overlap the next window
            speech = speech[:, : -cfg.hop_length]
        return torch.clamp(speech, -cfg.audio_limit, cfg.audio_limit)

    def _istft(self, real: torch.Tensor, imag: torch.Tensor) -> torch.Tensor:
        """torch.istft(center=True) without its host-side window check (a sync): the same ops
        (irfft, window, overlap-add by unfold_backward, / summed squared window), bitwise."""
        n, hop, frames = self.cfg.istft_n_fft, self.cfg.istft_hop_len, real.shape[2]
        w = self.stft_window
        chunks = torch.fft.irfft(torch.complex(real, imag), n=n, dim=1) * w.view(n, 1)
        length = (frames - 1) * hop + n
        overlap_add = torch.ops.aten.unfold_backward
        y = overlap_add(chunks.transpose(1, 2), [real.shape[0], length], 1, n, hop)
        env = overlap_add(w.pow(2).expand(1, frames, n), [1, length], 1, n, hop)
        return (y / env)[:, n // 2 : length - n // 2]


# ---------------------------------------------------------------------------------------
# Streaming state and the per-chunk decode


@dataclass
class CausalVocoderState:
    """One stream's BoundedVocoder state (batch dim 1; `cat` stacks equal-key states).

    mel    (B, 80, mel_capacity): the last mel frames received (frames < 0 are zeros);
    source (B, 1, source_capacity * 480): the excitation of the last sourced frames;
    phase  (B, n_harm) float64: running phase in cycles;
    received / sourced / emitted: mel frames received, with a source, with speech out;
    clip: the vocoder's (F0 left context, decoder history): where windows stop clipping at 0.
    """

    mel: torch.Tensor
    source: torch.Tensor
    phase: torch.Tensor
    clip: tuple[int, int]
    received: int = 0
    sourced: int = 0
    emitted: int = 0
    finalized: bool = False

    @staticmethod
    def empty(batch: int, vocoder: CausalHiFT, device) -> CausalVocoderState:
        cfg = vocoder.cfg
        return CausalVocoderState(
            mel=torch.zeros(batch, cfg.in_channels, vocoder.mel_capacity, device=device),
            source=torch.zeros(batch, 1, vocoder.source_capacity * cfg.hop_length, device=device),
            phase=torch.zeros(batch, cfg.nb_harmonics + 1, device=device, dtype=torch.float64),
            clip=(vocoder.f0_left, vocoder.history),
        )

    def clone(self) -> CausalVocoderState:
        return replace(
            self, mel=self.mel.clone(), source=self.source.clone(), phase=self.phase.clone()
        )

    def key(self) -> tuple:
        """States with equal keys run the same windows for the same chunk (batchable): the
        distances between the counters, and the counters where windows clip at frame 0."""
        return (
            self.received - self.sourced,
            self.sourced - self.emitted,
            min(self.sourced, self.clip[0]),
            min(self.emitted, self.clip[1]),
            self.finalized,
        )

    @staticmethod
    def cat(states: Sequence[CausalVocoderState]) -> CausalVocoderState:
        """Stack equal-key states (counters of the first: the computation needs no others)."""
        return replace(
            states[0], **{n: torch.cat([getattr(s, n) for s in states]) for n in _TENSORS}
        )

    def split(self) -> list[CausalVocoderState]:
        return [
            replace(self, **{n: getattr(self, n)[i : i + 1] for n in _TENSORS})
            for i in range(self.mel.shape[0])
        ]


_TENSORS = ("mel", "source", "phase")


@dataclass(frozen=True)
class _Block:
    """One [MU7] `_process` call in relative frames (0 = first fresh frame of the chunk)."""

    received: int  # mel frames available (chunk-relative end)
    finalize: bool
    f0: tuple[int, int, int] | None  # (window start, new source start, new source end)
    sources: tuple[tuple[int, int], ...]  # source sub-blocks (<= block_frames each)
    decode: tuple[int, int, int] | None  # (window start, emitted before, emitted after)


def plan_chunk(vocoder: CausalHiFT, state: CausalVocoderState, frames: int, last: bool):
    """The chunk's blocks ([MU7] BoundedVocoder.stream: fresh mel in blocks of 16, each
    processed; then one final process), in frames relative to the chunk start. Host ints."""
    if state.finalized:
        raise ValueError("causal vocoder stream already finalized")
    base = state.received
    received, sourced, emitted = state.received, state.sourced, state.emitted
    bf, blocks = vocoder.cfg.block_frames, []
    steps = [(min(bf, frames - o), False) for o in range(0, frames, bf)]
    if last:
        steps.append((0, True))
    for n, fin in steps:
        received += n
        f0 = None
        sources: list[tuple[int, int]] = []
        available = received - (0 if fin else vocoder.f0_right)
        if available > sourced:
            f0 = (max(0, sourced - vocoder.f0_left) - base, sourced - base, available - base)
            for o in range(sourced, available, bf):
                sources.append((o - base, min(o + bf, available) - base))
            sourced = available
        decode = None
        speech_end = sourced - (0 if fin else vocoder.decoder_right)
        if speech_end > emitted:
            decode = (max(0, emitted - vocoder.history) - base, emitted - base, speech_end - base)
            emitted = speech_end
        blocks.append(_Block(received - base, fin, f0, tuple(sources), decode))
    return blocks, (received, sourced, emitted)


def draw_noise(
    vocoder: CausalHiFT,
    states: Sequence[CausalVocoderState],
    frames: int,
    last: bool,
    generators: Sequence[torch.Generator] | None = None,
) -> torch.Tensor:
    """The uniform source noise the next chunk consumes, (B, 480 * new source frames, n_harm):
    from `vocoder.noise_table` at each stream's sample positions when set ([MU7]: one fixed
    table, wrapping every 300 s), else from each stream's generator (None: the global RNG)."""
    hop, n = vocoder.cfg.hop_length, vocoder.cfg.nb_harmonics + 1
    device = states[0].mel.device
    _, (_, sourced, _) = plan_chunk(vocoder, states[0], frames, last)
    samples = (sourced - states[0].sourced) * hop
    if vocoder.noise_table is not None:
        table = vocoder.noise_table
        rows = []
        for s in states:
            start = s.sourced * hop
            pos = torch.arange(start, start + samples, device=table.device) % table.shape[0]
            rows.append(table[pos].to(device))
        return torch.stack(rows)
    if generators is None:
        return torch.rand(len(states), samples, n, device=device)
    return torch.cat([torch.rand(1, samples, n, device=device, generator=g) for g in generators])


def _decode_windows(vocoder: CausalHiFT, mel: torch.Tensor, mel_at: int, source: torch.Tensor,
                    source_at: int, decodes: Sequence[tuple[int, int, int, bool]]
                    ) -> list[torch.Tensor]:
    """The chunk's decode windows, (start, emitted before, end, finalize) each in frames from
    the chunk's first fresh frame, which sits at frame `mel_at` of `mel` (B, 80, .) and
    `source_at` of `source` (B, 1, 480 .). Windows of one length and kind run as one decode
    of (windows x B) rows. Returns each window's new speech (B, N_i), in order."""
    hop, b = vocoder.cfg.hop_length, mel.shape[0]
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, (start, _, end, fin) in enumerate(decodes):
        groups.setdefault((end - start, fin), []).append(i)
    speech: list[torch.Tensor | None] = [None] * len(decodes)
    for (_, fin), members in groups.items():
        feats = [mel[:, :, mel_at + decodes[i][0] : mel_at + decodes[i][2]] for i in members]
        srcs = [source[:, :, (source_at + decodes[i][0]) * hop : (source_at + decodes[i][2]) * hop]
                for i in members]
        if len(members) == 1:
            outs = [vocoder.decode(feats[0], srcs[0], fin)]
        else:
            outs = vocoder.decode(torch.cat(feats), torch.cat(srcs), fin).split(b)
        for i, out in zip(members, outs):
            start, before = decodes[i][:2]
            speech[i] = out[:, (before - start) * hop :]
    return speech  # type: ignore[return-value]


@torch.inference_mode()
def vocode_chunk(
    vocoder: CausalHiFT,
    states: Sequence[CausalVocoderState],
    mel: torch.Tensor,
    last: bool,
    noise: torch.Tensor | None = None,
    generators: Sequence[torch.Generator] | None = None,
) -> tuple[torch.Tensor, list[CausalVocoderState]]:
    """Fresh mel (B, 80, T) of B streams with equal `key` -> speech (B, N) float32 and the new
    states (inputs unchanged). `last` flushes everything. `noise`: `draw_noise(...)` drawn
    beforehand (what a CUDA graph is fed); None draws it here from `generators`."""
    if len({s.key() for s in states}) != 1:
        raise ValueError("vocode_chunk: states of one batch must have equal keys")
    frames = mel.shape[2]
    if noise is None:
        noise = draw_noise(vocoder, states, frames, last, generators)
    blocks, (received, sourced, emitted) = plan_chunk(vocoder, states[0], frames, last)
    s0, hop = states[0], vocoder.cfg.hop_length
    cap_m, cap_s = vocoder.mel_capacity, vocoder.source_capacity
    batch = s0 if len(states) == 1 else CausalVocoderState.cat(states)
    phase = batch.phase
    mel_all = torch.cat([batch.mel, mel.float()], dim=2)
    # chunk-relative frame f (0 = the chunk's first fresh frame) sits at mel_all[cap_m + f]
    # and, the source buffer ending `received - sourced` frames before it, at source frame
    # off_s + f
    off_s = cap_s + (s0.received - s0.sourced)
    src_parts = [batch.source]
    src_frames = cap_s  # source frames held in src_parts
    used = 0  # noise samples consumed
    decodes = []  # (window start, emitted before, source end, finalize), chunk-relative
    with parametrize.cached():
        # The source runs block by block (its phase carries on); each decode window reads
        # only the mel and that source, so every window of the chunk is decoded afterwards.
        for b in blocks:
            if b.f0 is not None:
                start, new, _ = b.f0
                window = mel_all[:, :, cap_m + start : cap_m + b.received]
                f0 = vocoder.f0_predictor(window.double(), b.finalize).to(window)
                f0 = f0[:, new - start :]
                for s_start, s_end in b.sources:
                    n = (s_end - s_start) * hop
                    part, phase = vocoder.source(
                        f0[:, s_start - new : s_end - new], phase, noise[:, used : used + n]
                    )
                    used += n
                    src_parts.append(part)
                    src_frames += s_end - s_start
            if b.decode is not None:
                start, before, _ = b.decode
                decodes.append((start, before, src_frames - off_s, b.finalize))
        source = torch.cat(src_parts, dim=2) if len(src_parts) > 1 else src_parts[0]
        speech = _decode_windows(vocoder, mel_all, cap_m, source, off_s, decodes)
    out = torch.cat(speech, dim=1) if speech else mel.new_zeros(len(states), 0, dtype=torch.float32)
    new_mel = mel_all[:, :, -cap_m:]
    new_src = source[:, :, -cap_s * hop :]
    d_recv, d_src, d_emit = (received - s0.received, sourced - s0.sourced, emitted - s0.emitted)
    new_states = []
    for i, s in enumerate(states):
        sl = slice(i, i + 1)
        new_states.append(
            CausalVocoderState(
                mel=new_mel[sl].clone(),
                source=new_src[sl].clone(),
                phase=phase[sl].clone(),
                received=s.received + d_recv,
                sourced=s.sourced + d_src,
                emitted=s.emitted + d_emit,
                clip=s.clip,
                finalized=last,
            )
        )
    return out, new_states


# ---------------------------------------------------------------------------------------
# config.yaml


def causal_hift_config_like(h: HiFTConfig, conv_pre_look_right: int = 4) -> CausalHiFTConfig:
    """The causal vocoder with the CosyVoice2 HiFT's geometry (the tiny default's)."""
    from dataclasses import asdict

    return CausalHiFTConfig(**asdict(h), conv_pre_look_right=conv_pre_look_right)


def causal_hift_config_from_yaml(text: str) -> CausalHiFTConfig:
    """Read `config.yaml`'s `hift: !new:...CausalHiFTGenerator` block (hyperpyyaml; scalar
    `!ref <key>` values are looked up at the top level). Absent fields keep the defaults."""
    from pipeline.config import _find_mapping, _TagTolerantLoader

    tree = yaml.load(text, Loader=_TagTolerantLoader) or {}
    hift = tree.get("hift") if isinstance(tree.get("hift"), dict) else None
    hift = hift or _find_mapping(tree, "CausalHiFTGenerator")
    if not hift or not str(hift.get("_target", "")).endswith("CausalHiFTGenerator"):
        raise ValueError("config.yaml: no `hift: !new:...CausalHiFTGenerator` block")

    def resolve(v: Any) -> Any:
        if isinstance(v, str) and v.startswith("<") and v.endswith(">"):
            return resolve(tree.get(v[1:-1]))
        if isinstance(v, list):
            return tuple(resolve(x) for x in v)
        return v

    kw = {k: resolve(v) for k, v in hift.items() if k in CausalHiFTConfig.__dataclass_fields__}
    istft = hift.get("istft_params") or {}
    if "n_fft" in istft:
        kw["istft_n_fft"] = int(resolve(istft["n_fft"]))
    if "hop_len" in istft:
        kw["istft_hop_len"] = int(resolve(istft["hop_len"]))
    f0 = hift.get("f0_predictor") or {}
    if "cond_channels" in f0:
        kw["f0_predictor_channels"] = int(resolve(f0["cond_channels"]))
    for k in ("nsf_alpha", "nsf_sigma", "nsf_voiced_threshold", "lrelu_slope", "audio_limit"):
        if k in kw:
            kw[k] = float(kw[k])
    return CausalHiFTConfig(**kw)


def causal_hift_yaml_text(c: CausalHiFTConfig) -> str:
    """A `config.yaml` that [MU7] `load_causal_vocoder` accepts (its mel check included)."""

    def v(x) -> str:
        if isinstance(x, (tuple, list)):
            return "[" + ", ".join(v(y) for y in x) + "]"
        return str(x)

    return f"""# Causal CosyVoice3 vocoder for streaming (minicpmo-utils 1.0.7 layout).
sample_rate: {c.sampling_rate}
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: {c.in_channels}
    sampling_rate: !ref <sample_rate>
    hop_size: {c.hop_length}
    win_size: 1920
    fmin: 0
    fmax: 8000
    center: False
hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
    in_channels: {c.in_channels}
    base_channels: {c.base_channels}
    nb_harmonics: {c.nb_harmonics}
    sampling_rate: !ref <sample_rate>
    nsf_alpha: {c.nsf_alpha}
    nsf_sigma: {c.nsf_sigma}
    nsf_voiced_threshold: {c.nsf_voiced_threshold}
    upsample_rates: {v(c.upsample_rates)}
    upsample_kernel_sizes: {v(c.upsample_kernel_sizes)}
    istft_params:
        n_fft: {c.istft_n_fft}
        hop_len: {c.istft_hop_len}
    resblock_kernel_sizes: {v(c.resblock_kernel_sizes)}
    resblock_dilation_sizes: {v(c.resblock_dilation_sizes)}
    source_resblock_kernel_sizes: {v(c.source_resblock_kernel_sizes)}
    source_resblock_dilation_sizes: {v(c.source_resblock_dilation_sizes)}
    lrelu_slope: {c.lrelu_slope}
    audio_limit: {c.audio_limit}
    conv_pre_look_right: {c.conv_pre_look_right}
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: 1
        in_channels: {c.in_channels}
        cond_channels: {c.f0_predictor_channels}
"""

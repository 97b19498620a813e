"""HiFT vocoder (CosyVoice2 `HiFTGenerator`: neural source filter + iSTFTNet), mel -> 24 kHz.

Stages, mel (B, 80, T) -> speech (B, 480*T):
  1. f0_predictor : 5 x (weight-normed Conv1d k3 + ELU) -> Linear -> |.|  -> f0 (B, T) in Hz
  2. source       : f0 upsampled x480 (nearest) -> SineGen2 (fundamental + 8 harmonics, random
                    initial phase, phase integrated at frame rate then linearly upsampled),
                    voiced/unvoiced noise -> Linear(9->1) + tanh -> s (B, 1, 480T).
                    A streaming cache overwrites the first samples of s (avoids phase jumps).
  3. decode       : conv_pre -> 3 x [leaky_relu, ConvTranspose up (x8, x5, x3), + source branch
                    (STFT(s) -> strided conv -> ResBlock), mean of 3 Snake ResBlocks]
                    -> leaky_relu -> conv_post -> 18 channels = log-magnitude (9) || phase (9)
                    -> iSTFT (n_fft 16, hop 4) -> clamp to +-0.99.

Weight norm uses the parametrizations API (`...parametrizations.weight.original0/1`); old
`weight_g` / `weight_v` keys are renamed by `normalize_hift_keys` (and torch's compat hook).
Randomness: `torch.rand` (initial phase) then `torch.randn` (additive noise), from the global RNG
(reference behaviour) or from one generator per batch row (so batched == one at a time). Both
are drawn before the source runs (`draw_noise`), so a CUDA graph can take them as inputs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from pipeline.config import HiFTConfig


def _pad(kernel: int, dilation: int = 1) -> int:
    return (kernel * dilation - dilation) // 2


def snake(x: torch.Tensor, alpha: torch.Tensor, inv_alpha: torch.Tensor) -> torch.Tensor:
    """Snake, x + sin(alpha x)^2 / alpha, with 1 / (alpha + 1e-9) given: `Snake`'s operations."""
    return x + inv_alpha * torch.pow(torch.sin(x * alpha), 2)


@functools.cache
def compiled(fn):
    """`fn` (`snake`, `biased_snake`, `biased_residual`) compiled once for every Snake of the
    process: one fused kernel (x read once, written once) instead of five, every dim symbolic
    (batch, channels and frames vary from call to call). The same operations; the compiler
    may join the last multiply and add into one rounding, and its sin is libdevice's (both
    within a few fp32 ulps)."""
    return torch.compile(fn, fullgraph=True, dynamic=True)


def biased_snake(x: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor,
                 inv_alpha: torch.Tensor) -> torch.Tensor:
    """`snake` of x + bias: a conv's product, its bias added here and not by a launch of its
    own (the same add, rounded once, before the same operations)."""
    return snake(x + bias, alpha, inv_alpha)


def biased_residual(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """(x + bias) + residual: a conv's product, its bias and a residual, added in that order."""
    return (x + bias) + residual


class Snake(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))
        self.inv_alpha: torch.Tensor | None = None  # set by fuse_snakes: the compiled path

    @property
    def fused(self) -> bool:
        return self.inv_alpha is not None

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Snake of x, or of x + bias (B, C, T) + (C, 1)."""
        alpha = self.alpha[None, :, None]
        if self.inv_alpha is not None:
            if bias is not None:
                return compiled(biased_snake)(x, bias, alpha, self.inv_alpha)
            return compiled(snake)(x, alpha, self.inv_alpha)
        if bias is not None:
            x = x + bias
        return x + (1.0 / (alpha + 1e-9)) * torch.pow(torch.sin(x * alpha), 2)


def fuse_snakes(vocoder: nn.Module, on: bool) -> None:
    """Every Snake of `vocoder` as `compiled(snake)` (on: the engine's choice on CUDA) or its
    eager operations (off). Its 1 / (alpha + 1e-9) is computed here, once, by the same
    operations as each eager call: fuse after the weights are loaded and on their device."""
    for m in vocoder.modules():
        if isinstance(m, Snake):
            m.inv_alpha = (1.0 / (m.alpha.detach()[None, :, None] + 1e-9)) if on else None


def freeze_weight_norms(vocoder: nn.Module) -> None:
    """Every weight-normed conv's weight computed once, here, and kept as its plain weight.
    A forward otherwise recomputes each (`parametrize.cached()` keeps them only for that
    call): 82 launches a chunk for the causal vocoder, for weights that never change while
    serving. The same operation on the same tensors, so the same values bit for bit, if it
    runs on the device the vocoder serves on: call it after the weights are loaded and moved.
    The checkpoint's keys (`parametrizations.weight.original0/1`) are gone afterwards."""
    for m in vocoder.modules():
        if parametrize.is_parametrized(m, "weight"):
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)


class ResBlock(nn.Module):
    def __init__(self, channels: int, kernel: int, dilations: Sequence[int]):
        super().__init__()
        self.convs1 = nn.ModuleList(
            [weight_norm(self.conv(channels, kernel, d)) for d in dilations]
        )
        self.convs2 = nn.ModuleList([weight_norm(self.conv(channels, kernel)) for _ in dilations])
        self.activations1 = nn.ModuleList([Snake(channels) for _ in dilations])
        self.activations2 = nn.ModuleList([Snake(channels) for _ in dilations])

    @staticmethod
    def conv(channels: int, kernel: int, dilation: int = 1) -> nn.Conv1d:
        """A same-length conv (the causal vocoder's block overrides it with a causal one)."""
        return nn.Conv1d(
            channels, channels, kernel, dilation=dilation, padding=_pad(kernel, dilation)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = c2(a2(c1(a1(x)))) + x
        return x


class F0Predictor(nn.Module):
    """ConvRNNF0Predictor: mel (B,80,T) -> f0 (B,T)."""

    def __init__(self, in_channels: int, channels: int):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            layers += [
                weight_norm(nn.Conv1d(in_channels if i == 0 else channels, channels, 3, padding=1)),
                nn.ELU(),
            ]
        self.condnet = nn.Sequential(*layers)  # params at 0,2,4,6,8 like the checkpoint
        self.classifier = nn.Linear(channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.abs(self.classifier(self.condnet(x).transpose(1, 2)).squeeze(-1))


class SourceModule(nn.Module):
    """SourceModuleHnNSF2: f0 (B, L, 1) at the sample rate -> excitation (B, L, 1)."""

    def __init__(self, cfg: HiFTConfig):
        super().__init__()
        self.cfg = cfg
        self.upsample = cfg.hop_length
        self.l_linear = nn.Linear(cfg.nb_harmonics + 1, 1)

    def draw_noise(
        self, batch: int, samples: int, device, generators: Sequence[torch.Generator] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The source's random inputs in the reference's order: initial phases (B, n) from
        `torch.rand`, then additive noise (B, samples, n) from `torch.randn`."""
        n = self.cfg.nb_harmonics + 1
        rand_ini = _draw(
            lambda g: torch.rand(1, n, device=device, generator=g),
            lambda: torch.rand(batch, n, device=device),
            generators,
        )
        # The global-RNG path is the reference's `randn_like(sines)`: sines is a (B, L, n) view
        # of a (B, n, L) tensor, and normal_ fills its storage in memory order.
        gauss = _draw(
            lambda g: torch.randn(1, samples, n, device=device, generator=g),
            lambda: torch.empty(batch, n, samples, device=device).transpose(1, 2).normal_(),
            generators,
        )
        return rand_ini, gauss

    def forward(
        self,
        f0: torch.Tensor,
        generators: Sequence[torch.Generator] | None = None,
        noise: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """f0 (B, L, 1) -> (B, L, 1). `noise` = `draw_noise(...)` drawn beforehand (a CUDA
        graph takes it as an input); None draws it here, from `generators` or the global RNG."""
        cfg, b, n = self.cfg, f0.shape[0], self.cfg.nb_harmonics + 1
        if noise is None:
            noise = self.draw_noise(b, f0.shape[1], f0.device, generators)
        rand_ini, gauss = noise
        harmonics = torch.arange(1, n + 1, device=f0.device, dtype=torch.float32)[None, None]
        rad = (f0 * harmonics / cfg.sampling_rate) % 1  # (B, L, n) phase increment per sample
        # no random phase for the fundamental
        rand_ini = torch.cat([torch.zeros_like(rand_ini[:, :1]), rand_ini[:, 1:]], dim=1)
        rad[:, 0, :] = rad[:, 0, :] + rand_ini
        # Integrate the phase at frame rate and upsample it back (cheap, no float drift).
        rad = F.interpolate(
            rad.transpose(1, 2), scale_factor=1 / self.upsample, mode="linear"
        ).transpose(1, 2)
        phase = torch.cumsum(rad, dim=1) * 2 * math.pi
        phase = F.interpolate(
            phase.transpose(1, 2) * self.upsample, scale_factor=self.upsample, mode="linear"
        )
        sines = torch.sin(phase.transpose(1, 2)) * cfg.nsf_alpha
        uv = (f0 > cfg.nsf_voiced_threshold).type(torch.float32)
        noise_amp = uv * cfg.nsf_sigma + (1 - uv) * cfg.nsf_alpha / 3
        sines = sines * uv + noise_amp * gauss
        return torch.tanh(self.l_linear(sines.to(self.l_linear.weight.dtype)))


def _draw(per_row, batched, generators):
    if generators is None:
        return batched()
    return torch.cat([per_row(g) for g in generators], dim=0)


class HiFTGenerator(nn.Module):
    def __init__(self, cfg: HiFTConfig):
        super().__init__()
        self.cfg = cfg
        base, n_fft = cfg.base_channels, cfg.istft_n_fft
        self.m_source = SourceModule(cfg)
        self.conv_pre = weight_norm(nn.Conv1d(cfg.in_channels, base, 7, 1, padding=3))
        self.ups = nn.ModuleList(
            [
                weight_norm(
                    nn.ConvTranspose1d(
                        base // 2**i, base // 2 ** (i + 1), k, u, padding=(k - u) // 2
                    )
                )
                for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes))
            ]
        )
        # Source branch i runs at the resolution of up-stage i: stride = product of later rates.
        down_rates = [1] + list(cfg.upsample_rates[::-1][:-1])
        cum = [math.prod(down_rates[: i + 1]) for i in range(len(down_rates))][::-1]
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (u, k, d) in enumerate(
            zip(cum, cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes)
        ):
            ch = base // 2 ** (i + 1)
            conv = (
                nn.Conv1d(n_fft + 2, ch, 1, 1)
                if u == 1
                else nn.Conv1d(n_fft + 2, ch, u * 2, u, padding=u // 2)
            )
            self.source_downs.append(conv)
            self.source_resblocks.append(ResBlock(ch, k, d))
        self.resblocks = nn.ModuleList()
        for i in range(len(self.ups)):
            ch = base // 2 ** (i + 1)
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes):
                self.resblocks.append(ResBlock(ch, k, d))
        self.conv_post = weight_norm(nn.Conv1d(ch, n_fft + 2, 7, 1, padding=3))
        self.f0_predictor = F0Predictor(cfg.in_channels, cfg.f0_predictor_channels)
        # scipy's periodic hann, computed in float64 then rounded like the reference's numpy path.
        self.register_buffer(
            "stft_window",
            torch.hann_window(n_fft, periodic=True, dtype=torch.float64).float(),
            persistent=False,
        )

    def _stft(self, x: torch.Tensor) -> torch.Tensor:
        n = self.cfg.istft_n_fft
        spec = torch.view_as_real(
            torch.stft(
                x, n, self.cfg.istft_hop_len, n, window=self.stft_window, return_complex=True
            )
        )
        return torch.cat([spec[..., 0], spec[..., 1]], dim=1)  # (B, n_fft+2, frames)

    def decode(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return self.istft(self.spectrum(x, s))

    def spectrum(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """mel (B, 80, T), source (B, 1, 480T) -> complex spectrum (B, n_fft/2+1, frames)."""
        cfg, k = self.cfg, len(self.cfg.resblock_kernel_sizes)
        s_stft = self._stft(s.squeeze(1))
        x = self.conv_pre(x)
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
        half = cfg.istft_n_fft // 2 + 1
        magnitude = torch.clip(torch.exp(x[:, :half]), max=1e2)
        phase = torch.sin(x[:, half:])
        return torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))

    def istft(self, spec: torch.Tensor) -> torch.Tensor:
        """Complex spectrum -> speech (B, samples). torch.istft checks the window overlap on
        the host (a sync), so a CUDA graph stops before it (graphs.HiFTGraphRunner)."""
        cfg, n = self.cfg, self.cfg.istft_n_fft
        speech = torch.istft(spec, n, cfg.istft_hop_len, n, window=self.stft_window)
        return torch.clamp(speech, -cfg.audio_limit, cfg.audio_limit)

    def draw_noise(
        self, mel: torch.Tensor, generators: Sequence[torch.Generator] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The source noise `forward(mel, ...)` would draw (see SourceModule.draw_noise)."""
        return self.m_source.draw_noise(
            mel.shape[0], mel.shape[2] * self.cfg.hop_length, mel.device, generators
        )

    @torch.inference_mode()
    def forward(
        self,
        mel: torch.Tensor,
        cache_source: torch.Tensor | None = None,
        generators: Sequence[torch.Generator] | None = None,
        noise: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """mel (B,80,T), cache_source (B,1,S) -> speech (B, 480T), source (B, 1, 480T).
        `noise`: the source noise drawn beforehand (`draw_noise`), else drawn here."""
        spec, s = self.forward_spectrum(mel, cache_source, generators, noise)
        return self.istft(spec), s

    @torch.inference_mode()
    def forward_spectrum(
        self,
        mel: torch.Tensor,
        cache_source: torch.Tensor | None = None,
        generators: Sequence[torch.Generator] | None = None,
        noise: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` up to the iSTFT: (complex spectrum, source)."""
        with parametrize.cached():
            f0 = self.f0_predictor(mel)  # (B, T)
            f0 = (
                f0[:, None].repeat_interleave(self.cfg.hop_length, dim=2).transpose(1, 2)
            )  # (B, 480T, 1)
            s = self.m_source(f0, generators, noise).transpose(1, 2)  # (B, 1, 480T)
            if cache_source is not None and cache_source.shape[2] > 0:
                s[:, :, : cache_source.shape[2]] = cache_source
            return self.spectrum(mel, s), s


def normalize_hift_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip a `generator.` prefix and rename old weight-norm keys to the parametrizations API."""
    out = {}
    for key, value in state.items():
        key = key.removeprefix("generator.")
        if key.endswith(".weight_g"):
            key = key[: -len("weight_g")] + "parametrizations.weight.original0"
        elif key.endswith(".weight_v"):
            key = key[: -len("weight_v")] + "parametrizations.weight.original1"
        out[key] = value
    return out

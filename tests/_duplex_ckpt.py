"""The duplex test checkpoint and the fixed noise both implementations share.

The reference's Token2wav draws its flow noise (`rand_noise`) and its vocoder's uniform
source-noise table (`SineGen2.sine_waves`) from the global RNG when it is built; the golden
run replaces them with these seeded draws so omniray's side can set the same tensors."""

from __future__ import annotations

import torch

FLOW_NOISE_SEED = 0  # pipeline.code2wav.flow.CausalCFM's default noise_seed
VOCODER_NOISE_SEED = 1
VOCODER_NOISE_SECONDS = 60


def flow_noise(channels: int = 80, frames: int | None = None) -> torch.Tensor:
    """(1, channels, frames): what omniray's `CausalCFM(noise_seed=0)` holds as rand_noise."""
    from pipeline.code2wav.flow import NOISE_FRAMES

    gen = torch.Generator().manual_seed(FLOW_NOISE_SEED)
    return torch.randn(1, channels, frames or NOISE_FRAMES, generator=gen)


def vocoder_noise_table(harmonics: int = 9, seconds: int = VOCODER_NOISE_SECONDS) -> torch.Tensor:
    """(24000 * seconds, harmonics) uniform noise by sample position: the reference vocoder's
    `sine_waves[0]` in the golden run, omniray's `CausalHiFT.noise_table` in the parity test
    (both wrap at its length)."""
    gen = torch.Generator().manual_seed(VOCODER_NOISE_SEED)
    return torch.rand(24000 * seconds, harmonics, generator=gen)

"""Encoders at the released geometry with small random weights, for the CUDA-only checks
that compare the shipped kernels against an fp32 eager reference."""

from __future__ import annotations

import torch

from pipeline.config import ThinkerConfig, VisionConfig
from pipeline.thinker.audio import AudioEncoder
from pipeline.thinker.vision import VisionEncoder


def init_small(module: torch.nn.Module) -> None:
    """Small random weights and unit LayerNorms: activations stay O(1) over many layers."""
    for name, p in module.named_parameters():
        if "norm" in name or name.startswith("ln_"):
            torch.nn.init.ones_(p) if name.endswith("weight") else torch.nn.init.zeros_(p)
        elif p.ndim >= 2:
            torch.nn.init.normal_(p, std=0.02)
        else:
            torch.nn.init.normal_(p, std=0.01)


def vision_encoder(device: torch.device) -> VisionEncoder:
    """The released SigLIP geometry, fp32, eager attention."""
    torch.manual_seed(0)
    with device:
        vpm = VisionEncoder.from_config(ThinkerConfig(vision=VisionConfig()), "eager").eval()
        init_small(vpm)
    return vpm


def audio_encoder(device: torch.device) -> AudioEncoder:
    """The released Whisper geometry with its projection, bf16."""
    torch.manual_seed(0)
    with device:
        enc = AudioEncoder.from_config(ThinkerConfig()).eval()
        init_small(enc)
    return enc.to(torch.bfloat16)

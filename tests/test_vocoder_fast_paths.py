"""The vocoders' exact fast paths: what they compute is bit for bit what the plain modules
compute (CPU, tiny config)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils import parametrize

from pipeline.code2wav.assets import random_vocoder, tiny_code2wav_config
from pipeline.code2wav.causal_hift import CausalHiFT, CausalVocoderState, vocode_chunk
from pipeline.code2wav.hift import freeze_weight_norms

CAUSAL, COSYVOICE2 = "minicpmo-utils-1.0.7", "cosyvoice2"


def _mel(frames: int, seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 80, frames, generator=torch.Generator().manual_seed(seed))


def _stream(vocoder: CausalHiFT, mel: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """One causal stream per batch row, a chunk a call, the last one flushing; the source
    noise from per-row generators seeded the same every time."""
    states = CausalVocoderState.empty(mel.shape[0], vocoder, "cpu").split()
    gens = [torch.Generator().manual_seed(10 + i) for i in range(mel.shape[0])]
    out, o = [], 0
    for k, n in enumerate(sizes):
        speech, states = vocode_chunk(vocoder, states, mel[:, :, o : o + n],
                                      k == len(sizes) - 1, generators=gens)
        out.append(speech)
        o += n
    return out


def _vocode(vocoder, layout: str) -> list[torch.Tensor]:
    mel = _mel(95, 3)
    if layout == CAUSAL:
        return _stream(vocoder, mel, [40, 25, 30])
    gens = [torch.Generator().manual_seed(10 + i) for i in range(mel.shape[0])]
    with torch.inference_mode():
        return list(vocoder(mel, generators=gens))


def _weight_normed(vocoder) -> int:
    return sum(parametrize.is_parametrized(m, "weight") for m in vocoder.modules())


@pytest.mark.parametrize("layout", [CAUSAL, COSYVOICE2])
def test_frozen_weight_norms_give_the_same_speech_bit_for_bit(layout):
    vocoder = random_vocoder(tiny_code2wav_config(), 0, layout)
    with torch.no_grad():  # g away from |v|, so the norm is not the identity
        for name, p in vocoder.named_parameters():
            if name.endswith("original0"):
                p.mul_(1.7)
    before = _vocode(vocoder, layout)
    assert _weight_normed(vocoder) > 0
    freeze_weight_norms(vocoder)
    assert _weight_normed(vocoder) == 0
    after = _vocode(vocoder, layout)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)


def test_the_engine_serves_with_frozen_weight_norms():
    from pipeline.code2wav.assets import random_code2wav
    from pipeline.code2wav.engine import Code2WavEngine

    cfg = tiny_code2wav_config()
    flow, _ = random_code2wav(cfg, 0)
    vocoder = random_vocoder(cfg, 0, CAUSAL)
    Code2WavEngine(flow, vocoder, cfg)
    assert _weight_normed(vocoder) == 0

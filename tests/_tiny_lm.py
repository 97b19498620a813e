"""The tiny Qwen3 the engine tests share: its geometry, its random weights and the FlashInfer
check of the CUDA tests."""

from __future__ import annotations

import torch

from pipeline.config import LLMConfig
from pipeline.thinker.llm import Qwen3LM


def tiny_llm_config(**overrides) -> LLMConfig:
    """2 layers, GQA 4/2; `overrides` change any field (the CUDA tests use head_dim 128, the
    size FlashInfer's kernels are built for)."""
    kw = {
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
    }
    return LLMConfig(**{**kw, **overrides})


CUDA_LLM = tiny_llm_config(hidden_size=256, intermediate_size=512, head_dim=128)


def random_lm(cfg: LLMConfig, std: float = 0.2, seed: int = 0) -> Qwen3LM:
    """Qwen3LM(cfg) in eval mode with larger weights than the init: logits far apart, so
    greedy is stable under reordered sums."""
    torch.manual_seed(seed)
    m = Qwen3LM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, std) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return m


def has_flashinfer() -> bool:
    from pipeline.thinker.llm_engine.attention import flashinfer_available

    return torch.cuda.is_available() and flashinfer_available()

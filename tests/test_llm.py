"""Qwen3 decoder vs transformers' Qwen3ForCausalLM (same weights, fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import LLMConfig
from pipeline.thinker.llm_engine.engine import EngineConfig, LLMEngine
from pipeline.handoff import SamplingParams
from pipeline.thinker.llm import Qwen3LM

transformers = pytest.importorskip("transformers")

TINY = {
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
}


def _pair(seed: int = 0, **over):
    torch.manual_seed(seed)
    kw = {**TINY, **over}
    hf = transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(**kw, tie_word_embeddings=False, attention_bias=False)
    ).eval()
    # Random norm weights too, so a swapped/misplaced norm cannot hide behind all-ones.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    ours = Qwen3LM(LLMConfig(**kw)).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


def _close(a: torch.Tensor, b: torch.Tensor, atol: float, what: str) -> None:
    d = (a - b).abs()
    assert d.max() <= atol, f"{what}: max diff {d.max():.3e}, mean {d.mean():.3e}"


def test_state_dict_keys_match_checkpoint_names():
    m = Qwen3LM(LLMConfig(**TINY))
    keys = set(m.state_dict())
    assert (
        "model.embed_tokens.weight" in keys
        and "lm_head.weight" in keys
        and "model.norm.weight" in keys
    )
    for suffix in (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ):
        assert f"model.layers.1.{suffix}" in keys
    assert not any("rotary" in k for k in keys)


@torch.no_grad()
def test_logits_match_transformers():
    hf, ours = _pair()
    ids = torch.randint(0, TINY["vocab_size"], (1, 37))
    ref = hf(ids).logits[0]
    hidden = ours(ours.embed(ids[0]), torch.arange(37))
    _close(ours.compute_logits(hidden), ref, 1e-4, "logits vs HF")
    ref_h = hf.model(ids).last_hidden_state[0]
    _close(hidden, ref_h, 1e-5, "final-norm hidden vs HF")


@torch.no_grad()
def test_engine_greedy_matches_hf_generate():
    hf, ours = _pair(seed=1)
    ids = torch.randint(0, TINY["vocab_size"], (1, 23))
    ref = hf.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)[
        0, ids.shape[1] :
    ].tolist()
    eng = LLMEngine(ours, EngineConfig(num_blocks=32, block_size=4))
    got = eng.generate({"r": ids[0].tolist()}, SamplingParams(max_tokens=20, stop_ids=()))["r"]
    assert got == ref


@torch.no_grad()
def test_engine_hidden_rows_match_hf_hidden_states():
    """return_hidden: one final-norm row per decode step, at the fed output token."""
    hf, ours = _pair(seed=2)
    ids = torch.randint(0, TINY["vocab_size"], (12,)).tolist()
    eng = LLMEngine(ours, EngineConfig(num_blocks=32, block_size=4))
    eng.add_request("r", ids, SamplingParams(max_tokens=6, stop_ids=()), return_hidden=True)
    toks, rows = [], []
    while eng.has_unfinished():
        for o in eng.step():
            toks += o.token_ids
            if o.hidden is not None:
                rows.append(o.hidden)
    hidden = torch.cat(rows)
    assert hidden.shape == (5, TINY["hidden_size"])  # the last sampled token is never fed
    full = torch.tensor([ids + toks[:-1]])
    ref = hf.model(full).last_hidden_state[0, len(ids) :]
    _close(hidden, ref, 1e-5, "decode hidden rows vs HF")


@torch.no_grad()
def test_fused_projections_same_output_and_keys():
    _, ours = _pair(seed=3)
    ids = torch.randint(0, TINY["vocab_size"], (19,))
    before = ours.compute_logits(ours(ours.embed(ids), torch.arange(19)))
    keys = list(ours.state_dict())
    ours.fuse_projections()
    assert list(ours.state_dict()) == keys
    after = ours.compute_logits(ours(ours.embed(ids), torch.arange(19)))
    _close(after, before, 1e-5, "fused vs separate projections")
    # loading after fusing writes through the views into the fused weights
    hf2, _ = _pair(seed=4)
    ours.load_state_dict(hf2.state_dict(), strict=True)
    ref = hf2(ids[None]).logits[0]
    _close(
        ours.compute_logits(ours(ours.embed(ids), torch.arange(19))),
        ref,
        1e-4,
        "fused after reload vs HF",
    )

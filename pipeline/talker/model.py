"""Talker (`tts`, MiniCPMTTS): a Llama over speech codes, conditioned on the Thinker.

Stages:
  1. condition   c_i = emb_text(t_i) + L2normalize(projector_semantic(h_i))        (n, E)
                 t_i: Thinker ids of the spoken span; h_i (n, llm_dim): Thinker final-norm
                 hidden states where t_i was the input token
  2. prompt      full_span:  [c_1..c_n, emb_text(text_eos), emb_text(audio_bos)]    (n+2, E)
                 streaming:  [c_chunk, (emb_text(text_eos) if text ended), emb_text(audio_bos)]
  3. backbone    Llama (RMSNorm, RoPE, MHA, SwiGLU) over inputs_embeds, with a static
                 per-slot KV cache; prefill a prompt, then one emb_code(prev_code) per step
                 (the forward: fused.py; restated plainly in tests/_talker_ref.py)
  4. head        logits = head_code(hidden), a weight-normed Linear(E -> 6562)    (., 6562)
                 6561 speech codes + EOS (= num_audio_tokens - 1)

Full size: E=768, 20 layers, 12 heads x 64, intermediate 3072, rope theta 1e4.
state_dict keys are the checkpoint's `tts.*` keys with `tts.` stripped. `model.embed_tokens`
and `projector_spk` are loaded but unused (inputs are always embeddings; no speaker slot).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import TalkerConfig

# ---------------------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalize in float32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(head_dim: int, theta: float, num_positions: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (num_positions, head_dim) float32, Llama "default" RoPE."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # (D/2,)
    positions = torch.arange(num_positions, device=device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # (P, D/2)
    angles = torch.cat([freqs, freqs], dim=-1)  # (P, D)
    return angles.cos(), angles.sin()


@torch.no_grad()
def concat_rows(*linears: nn.Linear) -> torch.Tensor:
    """One weight with the rows of `linears` (bias-free) in order; each Linear's weight
    becomes a Parameter viewing its rows, so the module keeps its checkpoint name, loading
    copies into the concatenated weight, and no second copy of the weights exists."""
    weight = torch.cat([lin.weight for lin in linears], dim=0)
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[start : start + rows], lin.weight.requires_grad)
        start += rows
    return weight


class _Fusable(nn.Module):
    """A module whose projections can be concatenated in place (`fuse()`); the concatenated
    weights are rebuilt after `.to()` (which converts each Parameter separately) and after
    `load_state_dict` (which may assign new Parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = False
        self.register_load_state_dict_post_hook(lambda module, _keys: module._refuse())

    def fuse(self) -> None:
        raise NotImplementedError

    def _refuse(self) -> None:
        if self.fused:
            self.fuse()

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._refuse()
        return out


class TalkerKVCache:
    """Static KV cache, one row of `max_len + 1` positions per slot (stream).

    kv: (layers, 2, slots, kv_heads, max_len + 1, head_dim) in the model dtype: k and v of
    each layer in one tensor, so each head's keys are contiguous rows for attention and one
    write stores k and v together. Position `max_len` is a scratch column: decode rows of
    idle slots write there, so a batched step over slots [0, R) never touches the cache of
    a slot that is not decoding.
    rope_cs: (max_len + 1, 2, head_dim) in the model dtype: cos, and sin with its first half
    negated (rotate-half's sign folded into the table).
    """

    def __init__(
        self, cfg: TalkerConfig, slots: int, max_len: int, dtype: torch.dtype, device: torch.device,
    ) -> None:
        if max_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_len {max_len} exceeds max_position_embeddings {cfg.max_position_embeddings}"
            )
        layers, kv_heads, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        shape = (layers, 2, slots, kv_heads, max_len + 1, d)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.slots = slots
        self.max_len = max_len
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, max_len + 1, device)
        # Cast like transformers casts its gathered rows; negating is exact, so
        # x2 * (-sin) here equals rotate-half's (-x2) * sin bit for bit.
        signed = torch.cat([-sin[:, : d // 2], sin[:, d // 2 :]], dim=-1)
        self.rope_cs = torch.stack([cos, signed], dim=1).to(dtype)
        # Built once, sliced per step: key positions for masks, row ids for cache writes.
        self.position_ids = torch.arange(max_len + 1, device=device)
        self.row_ids = torch.arange(slots, device=device)[:, None]  # (slots, 1)

    @property
    def scratch_pos(self) -> int:
        return self.max_len

    @staticmethod
    def bytes_per_slot(cfg: TalkerConfig, max_len: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        per_pos = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem
        return per_pos * (max_len + 1)


@dataclass
class AttentionBatch:
    """What every layer's attention needs for one forward, built once per forward.

    rows:      cache rows [rows.start, rows.stop) of the B sequences
    row_ids:   (B, 1) 0..B-1, the row index of each sequence within those rows
    write_pos: (B, L) cache positions of the L new tokens
    read_len:  keys [0, read_len) are attended
    mask:      (B, 1, L, read_len) additive, or None: causal attention over the L new tokens
               only (a prefill from an empty cache)
    """

    rows: slice
    row_ids: torch.Tensor
    write_pos: torch.Tensor
    read_len: int
    mask: torch.Tensor | None


class Attention(_Fusable):
    """Llama self-attention's weights (no bias); fused.py runs it over a `TalkerKVCache`.

    After `fuse()`, `qkv_weight` holds the q|k|v rows (q_proj / k_proj / v_proj view it)."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.qkv_weight: torch.Tensor | None = None
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        e, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(e, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(e, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(e, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, e, bias=False)

    def fuse(self) -> None:
        self.qkv_weight = concat_rows(self.q_proj, self.k_proj, self.v_proj)
        self.fused = True


class MLP(_Fusable):
    """SwiGLU. After `fuse()`, `gate_up_weight` holds the gate|up rows."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.gate_up_weight: torch.Tensor | None = None
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def fuse(self) -> None:
        self.gate_up_weight = concat_rows(self.gate_proj, self.up_proj)
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Backbone(nn.Module):
    """transformers `LlamaModel` layout (keys `embed_tokens`, `layers.N.*`, `norm`)."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        # Allocated in the checkpoint but never used: the Talker always feeds embeddings.
        self.embed_tokens = nn.Embedding(cfg.backbone_vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class _WeightNormParams(nn.Module):
    """Holds weight_norm's (g, v) under the names the parametrizations API saves."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.original0 = nn.Parameter(torch.ones(out_features, 1))  # g
        self.original1 = nn.Parameter(torch.empty(out_features, in_features))  # v


class WeightNormLinear(nn.Module):
    """`weight_norm(Linear(in, out, bias=False), dim=0)` with the weight materialized once.

    Keys: `parametrizations.weight.original0` (out, 1) and `.original1` (out, in). The
    inference weight `torch._weight_norm(v, g, 0)` is recomputed after every
    `load_state_dict` and by `materialize()`; it is not part of the state_dict.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.parametrizations = nn.ModuleDict(
            {"weight": _WeightNormParams(out_features, in_features)}
        )
        nn.init.kaiming_uniform_(self.parametrizations["weight"].original1, a=5**0.5)
        with torch.no_grad():
            v = self.parametrizations["weight"].original1
            self.parametrizations["weight"].original0.copy_(v.norm(dim=1, keepdim=True))
        self.register_buffer("_weight", torch.empty(out_features, in_features), persistent=False)
        self.register_load_state_dict_post_hook(lambda module, _keys: module.materialize())
        self.materialize()

    @torch.no_grad()
    def materialize(self) -> None:
        p = self.parametrizations["weight"]
        w = torch._weight_norm(p.original1.float(), p.original0.float(), 0)
        self._weight = w.to(device=p.original1.device, dtype=p.original1.dtype)

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / .half() convert g and v; rebuild the weight from them.
        out = super()._apply(fn, recurse)
        self.materialize()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._weight)


class SemanticProjector(nn.Module):
    """projector_type "mlp": Linear(llm_dim, E) -> ReLU -> Linear(E, E)."""

    def __init__(self, llm_dim: int, hidden: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(llm_dim, hidden)
        self.linear2 = nn.Linear(hidden, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.relu(self.linear1(h)))


# ---------------------------------------------------------------------------------------
# The Talker


class TalkerModel(nn.Module):
    """MiniCPMTTS with a static KV cache. See the module docstring for the stages."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        if cfg.num_vq != 1:
            raise ValueError(f"only num_vq == 1 is supported, got {cfg.num_vq}")
        if cfg.projector_type != "mlp":
            raise ValueError(f"only projector_type 'mlp' is supported, got {cfg.projector_type!r}")
        if cfg.condition_type != "hidden_text_merge":
            raise ValueError(f"only condition_type 'hidden_text_merge', got {cfg.condition_type!r}")
        if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
            raise ValueError("head_dim * num_attention_heads must equal hidden_size (LlamaConfig)")
        self.cfg = cfg
        e = cfg.hidden_size
        self.emb_text = nn.Embedding(cfg.num_text_tokens, e)
        self.emb_code = nn.ModuleList([nn.Embedding(cfg.num_audio_tokens, e)])
        self.head_code = nn.ModuleList([WeightNormLinear(e, cfg.num_audio_tokens)])
        self.model = Backbone(cfg)
        self.projector_semantic = SemanticProjector(cfg.llm_dim, e)
        self.projector_spk = SemanticProjector(cfg.llm_dim, e)  # unused at inference

    def fuse_projections(self) -> None:
        """Concatenate each layer's q|k|v and gate|up weights in place (idempotent), for
        fused.py. The checkpoint's names stay: q_proj, ..., up_proj remain Linears whose
        weights are row views of the concatenated ones, and `load_state_dict` / `.to()`
        keep the concatenation."""
        for layer in self.model.layers:
            if not layer.self_attn.fused:
                layer.self_attn.fuse()
            if not layer.mlp.fused:
                layer.mlp.fuse()

    # -- conditioning --------------------------------------------------------------------

    def build_condition(self, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """ids (n,) Thinker ids, hidden (n, llm_dim) -> condition rows (n, E)."""
        proj = self.projector_semantic(hidden.to(self.emb_text.weight.dtype))
        if self.cfg.normalize_projected_hidden:
            proj = F.normalize(proj, p=2, dim=-1)
        return self.emb_text(ids) + proj

    def _text_rows(self, token_id: int) -> torch.Tensor:
        ids = torch.tensor([token_id], dtype=torch.long, device=self.emb_text.weight.device)
        return self.emb_text(ids)  # (1, E)

    def offline_prompt(self, condition: torch.Tensor) -> torch.Tensor:
        """full_span prompt: (n, E) -> (n + 2, E) with text_eos and audio_bos appended."""
        tail = [
            self._text_rows(self.cfg.text_eos_token_id),
            self._text_rows(self.cfg.audio_bos_token_id),
        ]
        return torch.cat([condition, *tail], dim=0)

    def streaming_prompt(self, condition: torch.Tensor, text_finished: bool) -> torch.Tensor:
        """One text chunk's condition: [c_chunk, (text_eos if finished), audio_bos]."""
        parts = [condition]
        if text_finished:
            parts.append(self._text_rows(self.cfg.text_eos_token_id))
        parts.append(self._text_rows(self.cfg.audio_bos_token_id))
        return torch.cat(parts, dim=0)

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        return self.emb_code[0](codes)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., E) -> (..., V) float32 logits (computed in the model dtype, like the reference)."""
        return self.head_code[0](hidden).float()

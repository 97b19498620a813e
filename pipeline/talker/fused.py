"""The Talker's forward: model.py's Llama with few, large kernels, on the same weights.

  * q|k|v and gate|up each as one GEMM: `TalkerModel.fuse_projections()` concatenates the
    loaded weights in place (the checkpoint's Linears keep their names and view them);
  * the residual add and the next RMSNorm as one step (`add_rms_norm`);
  * RoPE from a per-position table in the model dtype (cos, and sin with rotate-half's sign
    folded in) and a roll by half instead of neg + cat, on q and k at once, in place;
  * k and v written into the TalkerKVCache by one `scatter_` per layer;
  * attention: SDPA over contiguous per-head key rows, with the mask built once per forward
    (additive, as SDPA converts a bool mask itself);
  * on CUDA, the rotation and the cache write as one Triton kernel a layer (rope_kv.py), and
    the pure parts of a layer (up to the q|k|v GEMM, and after attention: `mlp_post`) and
    `final_norm` compiled with Inductor, shared by every layer, rows and prompt length
    dynamic (3 graphs each: prefill, decode at one row, decode at many); attention stays
    eager. Nothing in them syncs with the host, so the decode graphs capture them after
    they compile in the graphs' warm-up runs. The CPU runs the same ops eagerly.

Numerics. Every elementwise op rounds where transformers' Llama rounds (bf16 products, sums
and casts in the same order), so this forward differs from a plain one only where the
concatenated GEMMs' kernels sum in another order (none on CPU: tests/test_talker_model.py
checks bitwise equality against tests/_talker_ref.py there). Compiled parts keep eager's bf16
roundings (emulate_precision_casts) but Inductor's own reduction order in the norms and its
own SiLU, bounded by the tests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pipeline.talker.model import AttentionBatch, TalkerKVCache, TalkerModel
from pipeline.talker.rope_kv import available, rope_kv_


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta)) with model.RMSNorm's ops; delta None: no add."""
    if delta is not None:
        x = x + delta
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return x, weight * h.to(x.dtype)


def attn_pre(
    x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor,
    cs: torch.Tensor | None, eps: float, heads: int, kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer up to attention. x, delta (B, L, E): residual stream and the previous layer's
    MLP output; cs (B, L, 2, D) rope rows, or None where rope_kv.py rotates q and k (and
    writes the cache). Returns (x + delta, qkv (B, L, H + 2 Hkv, D))."""
    x, h = add_rms_norm(x, delta, norm_weight, eps)
    return x, _qkv(h, qkv_weight, cs, heads, kv_heads)


def first_attn_pre(
    x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor,
    cs: torch.Tensor | None, eps: float, heads: int, kv_heads: int,
) -> torch.Tensor:
    """attn_pre of the first layer (nothing to add): its own compiled function, so that
    neither needs a graph per `delta is None` case."""
    return _qkv(add_rms_norm(x, None, norm_weight, eps)[1], qkv_weight, cs, heads, kv_heads)


def _qkv(
    h: torch.Tensor, qkv_weight: torch.Tensor, cs: torch.Tensor | None, heads: int, kv_heads: int
) -> torch.Tensor:
    qkv = F.linear(h, qkv_weight).unflatten(-1, (heads + 2 * kv_heads, -1))
    if cs is not None:  # rotate q and k in place: x * cos + rotate_half(x) * sin
        qk = qkv[:, :, : heads + kv_heads]
        cos, sin = cs[:, :, None, 0], cs[:, :, None, 1]
        rotated = qk.roll(qk.shape[-1] // 2, dims=-1) * sin
        qk.mul_(cos).add_(rotated)
    return qkv


def mlp_post(
    x: torch.Tensor, attn: torch.Tensor, o_weight: torch.Tensor, norm_weight: torch.Tensor,
    gate_up_weight: torch.Tensor, down_weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer after attention: (x + o_proj(attn), the MLP's output to add next)."""
    x = x + F.linear(attn, o_weight)
    _, h = add_rms_norm(x, None, norm_weight, eps)
    gate, up = F.linear(h, gate_up_weight).chunk(2, dim=-1)
    return x, F.linear(F.silu(gate) * up, down_weight)


def final_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """The final norm of the last position only (B, L, E) -> (B, E): the norm is per row."""
    return add_rms_norm(x[:, -1], delta[:, -1], weight, eps)[1]


def _compiled(fn: Callable, dynamic_args: tuple[int, ...]) -> Callable:
    """`fn` compiled once; the rows and length dims (0, 1) of the tensor arguments at
    `dynamic_args` are symbolic from the first call, so batch buckets and prompt lengths
    share graphs (sizes 1 get their own, as Dynamo specializes them)."""
    compiled = torch.compile(fn, fullgraph=True, options={"emulate_precision_casts": True})

    def call(*args):
        for i in dynamic_args:
            if args[i] is not None:
                torch._dynamo.maybe_mark_dynamic(args[i], 0)
                torch._dynamo.maybe_mark_dynamic(args[i], 1)
        return compiled(*args)

    return call


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as SDPA converts it (0 where allowed, -inf elsewhere), once per forward."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(allowed.logical_not(), float("-inf"))


class FusedTalker:
    """The Talker's `prefill` / `decode` over a TalkerKVCache. Fuses the model's projections
    in place. `compile` and `rope_kernel` default to the device: on for CUDA (the kernel where
    Triton runs), off elsewhere; tests set them to run either on the CPU."""

    def __init__(
        self, model: TalkerModel, compile: bool | None = None, rope_kernel: bool | None = None
    ) -> None:
        model.fuse_projections()
        self.model = model
        cfg = model.cfg
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.eps = cfg.rms_norm_eps
        device = model.emb_code[0].weight.device
        on_cuda = device.type == "cuda"
        self.compiled = on_cuda if compile is None else compile
        self.rope_kernel = on_cuda and available(device) if rope_kernel is None else rope_kernel
        self._first, self._pre = first_attn_pre, attn_pre
        self._post, self._final = mlp_post, final_norm
        if self.compiled:  # the rope rows (args 3 and 4) are None with the kernel
            self._first = _compiled(first_attn_pre, (0, 3))
            self._pre = _compiled(attn_pre, (0, 1, 4))
            self._post = _compiled(mlp_post, (0, 1))
            self._final = _compiled(final_norm, (0, 1))

    def prefill(self, cache: TalkerKVCache, slot: int, embeds: torch.Tensor) -> torch.Tensor:
        """Run `embeds` (L, E) at positions [0, L) of `slot`'s cache row (causal attention
        over them alone). Returns the last position's logits (V,) float32."""
        length = embeds.shape[0]
        if length > cache.max_len:
            raise ValueError(f"prompt of {length} does not fit max_len {cache.max_len}")
        positions = cache.position_ids[:length][None, :]  # (1, L)
        batch = AttentionBatch(slice(slot, slot + 1), cache.row_ids[:1], positions, length, None)
        # a copy, not a view: compiled parts see the same kind of input at every layer
        hidden = self._forward(embeds[None].clone(), positions, cache, batch)
        return self.model.head(hidden[0])  # a vector, as transformers' head sees it

    def prefill_padded(
        self, staging: TalkerKVCache, embeds: torch.Tensor, last: torch.Tensor
    ) -> torch.Tensor:
        """`prefill` of a prompt padded at its end to P rows, into slot 0 of `staging` (a
        one-slot cache): embeds (P, E), `last` (1,) the prompt's last row. The padding comes
        after the prompt, so causal attention keeps it out of the prompt's rows, and its K / V
        land past the prompt. Returns the logits at `last` (V,). Every shape is fixed by P: a
        CUDA graph per P replays it (the engine's padded prefills)."""
        length = embeds.shape[0]
        positions = staging.position_ids[:length][None, :]  # (1, P)
        batch = AttentionBatch(slice(0, 1), staging.row_ids[:1], positions, length, None)
        hidden = self._forward(embeds[None].clone(), positions, staging, batch, last)
        return self.model.head(hidden[0])

    def decode(
        self, cache: TalkerKVCache, codes: torch.Tensor, positions: torch.Tensor,
        active: torch.Tensor, read_len: int,
    ) -> torch.Tensor:
        """One step for cache rows [0, R): feed codes (R,) at positions (R,).

        Rows with active False are idle slots: they write to the scratch column, read only
        key 0, and their logits are meaningless. read_len must exceed every active
        position. Returns logits (R, V) float32.
        """
        r = codes.shape[0]
        x = self.model.embed_codes(codes[:, None])  # (R, 1, E), not a view (see prefill)
        pos = torch.where(active, positions, 0)
        write_pos = torch.where(active, positions, cache.scratch_pos)
        keys = cache.position_ids[:read_len]
        allowed = (keys[None, :] <= pos[:, None])[:, None, None, :]  # (R, 1, 1, read_len)
        mask = _additive_mask(allowed, x.dtype)
        batch = AttentionBatch(slice(0, r), cache.row_ids[:r], write_pos[:, None], read_len, mask)
        return self.model.head(self._forward(x, pos[:, None], cache, batch))

    def _forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: TalkerKVCache, batch: AttentionBatch,
        last: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (B, L, E) -> final-norm hidden of the last position (B, E), or of position
        `last` (1,)."""
        b, length, _ = x.shape
        h, hkv = self.heads, self.kv_heads
        cs = index = None
        if not self.rope_kernel:
            cs = cache.rope_cs[positions]  # (B, L, 2, D)
            index = batch.write_pos[None, :, None, :, None].expand(2, b, hkv, length, cs.shape[-1])
        delta = None
        for i, layer in enumerate(self.model.model.layers):
            x, qkv = self._layer_qkv(layer, x, delta, cs)
            kv_rows = cache.kv[i, :, batch.rows]  # (2, B, Hkv, T, D)
            if self.rope_kernel:  # rotate q and k, write k and v: one launch
                rope_kv_(qkv, cache.rope_cs, positions, batch.write_pos, cache.kv[i],
                         batch.rows.start, h, hkv)
            else:  # q and k were rotated in _layer_qkv; k and v written by one scatter
                new_kv = qkv[:, :, h:].unflatten(2, (2, hkv)).permute(2, 0, 3, 1, 4)
                kv_rows.scatter_(3, index, new_kv)
            x, delta = self._attend_and_mlp(layer, x, qkv, kv_rows, batch)
        assert delta is not None
        if last is not None:
            x, delta = x.index_select(1, last), delta.index_select(1, last)
        return self._final(x, delta, self.model.model.norm.weight, self.eps)

    def _layer_qkv(
        self, layer, x: torch.Tensor, delta: torch.Tensor | None, cs: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer up to attention: (x + delta, qkv), q and k rotated unless rope_kernel."""
        args = (layer.input_layernorm.weight, layer.self_attn.qkv_weight, cs, self.eps,
                self.heads, self.kv_heads)
        if delta is None:
            return x, self._first(x, *args)
        return self._pre(x, delta, *args)

    def _attend_and_mlp(
        self, layer, x: torch.Tensor, qkv: torch.Tensor, kv_rows: torch.Tensor,
        batch: AttentionBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer from its rotated qkv, with this step's K / V in the cache: attend, then
        mlp_post."""
        attn, mlp = layer.self_attn, layer.mlp
        return self._post(x, self._attend(qkv, kv_rows, batch), attn.o_proj.weight,
                          layer.post_attention_layernorm.weight, mlp.gate_up_weight,
                          mlp.down_proj.weight, self.eps)

    def _attend(self, qkv: torch.Tensor, kv_rows: torch.Tensor, batch: AttentionBatch
                ) -> torch.Tensor:
        """SDPA of the rotated q over the new keys (mask None: causal prefill from an empty
        cache) or the cached keys [0, read_len). Returns (B, L, H * D)."""
        h, hkv = self.heads, self.kv_heads
        q = qkv[:, :, :h].transpose(1, 2)  # (B, H, L, D)
        if batch.mask is None:
            keys = qkv[:, :, h : h + hkv].transpose(1, 2)
            values = qkv[:, :, h + hkv :].transpose(1, 2)
        else:
            keys, values = kv_rows[0, :, :, : batch.read_len], kv_rows[1, :, :, : batch.read_len]
        if hkv != h:
            keys = keys.repeat_interleave(h // hkv, dim=1)
            values = values.repeat_interleave(h // hkv, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=batch.mask,
                                             is_causal=batch.mask is None)
        return out.transpose(1, 2).flatten(2)

"""NaViT SigLIP vision encoder (`vpm.*` in the checkpoint).

Stages of `VisionEncoder.forward`:
1. Patch embedding: Conv2d(3, D, k=14, s=14) over packed strips (B, 3, 14, 14*L) -> (B, L, D).
2. + learned position embedding at NaViT-bucketized ids: a (h, w) patch grid is mapped onto
   the fixed num_patches_per_side^2 table (70 x 70 for the release) by bucketizing i/h, j/w.
3. `num_layers_run` pre-LN transformer layers (26 in the release: the checkpoint drops the
   27th) with a key-padding mask when strips in a batch have different L.
4. post_layernorm. No pooling head: the resampler (resampler.py) pools to 64 tokens.

Attention: "sdpa" (F.scaled_dot_product_attention with an additive key-padding mask, None
when unpadded), what serves; "eager" (matmul + additive mask + fp32 softmax, exactly the
reference SiglipAttention) is the reference the tests compare it with.

Padded rows (beyond a strip's L) carry garbage, as in the reference; only the resampler
reads this output and it masks them.

`compile_vision_layers(encoder)` applies regional torch.compile from outside (one compiled
layer forward shared by all layers); see its docstring for the dynamic-shape policy.

`forward` = `run(pixels, plan(sizes, ...))`: `plan` does the host's part of a batch (position
ids, masks, packing indices, all put on the device), `run` only device work, so a CUDA graph
can capture `run` for a batch shape and replay it with the plan made once.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import ThinkerConfig, VisionConfig
from pipeline.sdpa import any_shape

ATTN_BACKENDS = ("eager", "sdpa")

POS_ID_CACHE_SIZE = 256  # distinct (h, w) slice grids whose position ids are kept


# ---------------------------------------------------------------------------------------
# Loading


def load_stripped(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], prefix: str = ""
) -> None:
    """Strict-load the entries of `state_dict` under `prefix` (e.g. "vpm.") into `module`.

    Keys outside the prefix are ignored, so a whole-checkpoint dict can be passed."""
    sub = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    module.load_state_dict(sub, strict=True)


# ---------------------------------------------------------------------------------------
# Position ids and packing


def navit_position_ids(h: int, w: int, num_patches_per_side: int) -> torch.Tensor:
    """(h*w,) int64 row-major ids into the num_patches_per_side^2 position table.

    Restates the reference bit for bit: the step 1/h is a float32 tensor (the reference
    divides by an int32 `tgt_sizes` entry) and arange runs on CPU. A python-float step or
    `arange(h)/h` (transformers' get_vision_nearest_position_ids) picks a different bucket
    at exact boundaries for some sizes (h = 25, 49, 50, 55, 58, ... with 70 buckets)."""
    n = num_patches_per_side
    cpu = torch.device("cpu")
    boundaries = torch.arange(1 / n, 1.0, 1 / n, device=cpu)  # float32, n-1 inner edges
    step_h = 1 / torch.tensor(h, dtype=torch.int32, device=cpu)
    step_w = 1 / torch.tensor(w, dtype=torch.int32, device=cpu)
    bucket_h = torch.bucketize(
        torch.arange(0, 1 - 1e-6, step_h, device=cpu), boundaries, right=True
    )
    bucket_w = torch.bucketize(
        torch.arange(0, 1 - 1e-6, step_w, device=cpu), boundaries, right=True
    )
    return (bucket_h[:, None] * n + bucket_w).flatten()


def pack_strips(
    strips: Sequence[torch.Tensor], tgt_sizes: Sequence[Sequence[int]] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad a list of per-slice strips into one batch for `VisionEncoder.forward`.

    strips[i]: (3, P, P*L_i), patches in row-major order (the processor's reshape_by_patch).
    Returns pixel_values (B, 3, P, P*L_max) zero-padded on the right, tgt_sizes (B, 2) int32
    and patch_attention_mask (B, 1, L_max) bool (True = real patch)."""
    sizes = torch.as_tensor(tgt_sizes, dtype=torch.int32).reshape(-1, 2)
    assert len(strips) == sizes.shape[0], "one (h, w) per strip"
    patch = strips[0].shape[1]
    lens = [int(h) * int(w) for h, w in sizes.tolist()]
    for s, n in zip(strips, lens):
        assert s.shape[1:] == (patch, patch * n), (
            f"strip {tuple(s.shape)} does not hold {n} patches"
        )
    l_max = max(lens)
    first = strips[0]
    pixel_values = first.new_zeros(len(strips), first.shape[0], patch, patch * l_max)
    mask = torch.zeros(len(strips), 1, l_max, dtype=torch.bool, device=first.device)
    for i, (s, n) in enumerate(zip(strips, lens)):
        pixel_values[i, :, :, : patch * n] = s
        mask[i, 0, :n] = True
    return pixel_values, sizes, mask


# ---------------------------------------------------------------------------------------
# Attention kernels


def _eager_attention(q, k, v, mask, scale):
    # q, k, v: (B, H, L, hd); mask: additive, broadcastable to (B, 1, L, L), or None
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if mask is not None:
        scores = scores + mask
    # the reference upcasts the softmax to fp32
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


# ---------------------------------------------------------------------------------------
# Modules


@dataclass
class VisionPlan:
    """The host's part of one vision batch, on the device: what `VisionEncoder.run` needs
    besides the pixels."""

    seq_len: int  # patches per strip in the batch (the longest strip's)
    padded_len: int  # seq_len rounded up to pad_multiple (under a static compile)
    pos_ids: torch.Tensor  # (B, padded_len) int64
    mask: torch.Tensor | None  # additive key-padding (B, 1, 1, padded_len); None = all real


class VisionEmbeddings(nn.Module):
    """Patch conv + learned position table (num_patches_per_side^2, D)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.patch_size = cfg.patch_size
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, cfg.hidden_size, kernel_size=cfg.patch_size, stride=cfg.patch_size
        )
        self.position_embedding = nn.Embedding(cfg.num_patches_per_side**2, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # pixel_values: (B, 3, P, P*L); position_ids: (B, L)
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))  # (B, D, 1, L)
        x = x.flatten(2).transpose(1, 2)  # (B, L, D)
        return x + self.position_embedding(position_ids)


class VisionAttention(nn.Module):
    """Multi-head self-attention with q/k/v/out projections (all with bias)."""

    def __init__(self, cfg: VisionConfig, backend: str = "sdpa"):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim**-0.5
        self.backend = backend
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, d = x.shape
        # (B, L, D) -> (B, H, L, hd)
        q = self.q_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        if self.backend == "eager":
            o = _eager_attention(q, k, v, attn_mask, self.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scale)
        return self.out_proj(o.transpose(1, 2).reshape(b, n, d))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        assert cfg.hidden_act == "gelu_pytorch_tanh", f"unsupported act {cfg.hidden_act}"
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VisionEncoderLayer(nn.Module):
    """Pre-LN block: x + attn(ln1(x)), then x + mlp(ln2(x)), on (B, L, D)."""

    def __init__(self, cfg: VisionConfig, backend: str = "sdpa"):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg, backend)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), attn_mask)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoderStack(nn.Module):
    """Holds `layers` so the keys read `encoder.layers.N.*` as in the checkpoint."""

    def __init__(self, cfg: VisionConfig, backend: str):
        super().__init__()
        self.layers = nn.ModuleList(
            VisionEncoderLayer(cfg, backend) for _ in range(cfg.num_layers_run)
        )


class VisionEncoder(nn.Module):
    """NaViT SigLIP: packed strips + tgt_sizes -> (B, L, D) patch features after post-LN."""

    def __init__(self, cfg: VisionConfig, attn_backend: str = "sdpa"):
        super().__init__()
        self.cfg = cfg
        self.embeddings = VisionEmbeddings(cfg)
        self.encoder = VisionEncoderStack(cfg, attn_backend)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        # (h, w) -> navit_position_ids, least recently used first. Bounded: the sizes come
        # from requests, and an unbounded dict keyed by them only ever grows.
        self._pos_id_cache: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()
        # When set, L is padded up to a multiple of this: bounds the
        # number of distinct shapes a static-shape compile sees. See compile_vision_layers.
        self.pad_multiple: int | None = None
        self.set_attn_backend(attn_backend)

    @classmethod
    def from_config(
        cls, cfg: VisionConfig | ThinkerConfig, attn_backend: str = "sdpa"
    ) -> VisionEncoder:
        return cls(cfg.vision if isinstance(cfg, ThinkerConfig) else cfg, attn_backend)

    @property
    def attn_backend(self) -> str:
        return self._attn_backend

    def set_attn_backend(self, backend: str) -> None:
        if backend not in ATTN_BACKENDS:
            raise ValueError(f"vision attention must be one of {ATTN_BACKENDS}, got {backend!r}")
        self._attn_backend = backend
        for layer in self.encoder.layers:
            layer.self_attn.backend = backend

    def position_ids(self, tgt_sizes: list[tuple[int, int]], seq_len: int) -> torch.Tensor:
        """(B, seq_len) ids on CPU; the padded tail gets id 0 as in the reference."""
        out = torch.zeros(len(tgt_sizes), seq_len, dtype=torch.long, device="cpu")
        n = self.cfg.num_patches_per_side
        cache = self._pos_id_cache
        for i, (h, w) in enumerate(tgt_sizes):
            ids = cache.get((h, w))
            if ids is None:
                ids = cache[h, w] = navit_position_ids(h, w, n)
                if len(cache) > POS_ID_CACHE_SIZE:
                    cache.popitem(last=False)
            else:
                cache.move_to_end((h, w))
            out[i, : h * w] = ids
        return out

    def forward(
        self,
        pixel_values: torch.Tensor,
        tgt_sizes: torch.Tensor | Sequence[Sequence[int]],
        patch_attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """pixel_values (B, 3, P, P*L), tgt_sizes (B, 2) patch grid (h, w) per strip,
        patch_attention_mask (B, 1, L) or (B, L) bool, True on real patches (derived from
        tgt_sizes when omitted; real patches must come first) -> (B, L, D)."""
        seq_len = pixel_values.shape[-1] // self.cfg.patch_size
        plan = self.plan(tgt_sizes, seq_len, pixel_values.device, patch_attention_mask)
        return self.run(pixel_values, plan)

    def plan(
        self,
        tgt_sizes: torch.Tensor | Sequence[Sequence[int]],
        seq_len: int,
        device: torch.device | str,
        patch_attention_mask: torch.Tensor | None = None,
    ) -> VisionPlan:
        """The host's part of a batch of strips of `tgt_sizes` padded to `seq_len` patches."""
        sizes = [(int(h), int(w)) for h, w in torch.as_tensor(tgt_sizes).reshape(-1, 2).tolist()]
        b, lens = len(sizes), [h * w for h, w in sizes]
        device = torch.device(device)
        padded_len = seq_len
        if self.pad_multiple:
            padded_len = math.ceil(seq_len / self.pad_multiple) * self.pad_multiple
        pos_ids = self.position_ids(sizes, padded_len).to(device, non_blocking=True)

        # which keys are real: the first h*w of each row. tgt_sizes is the source of truth;
        # a CPU patch_attention_mask is checked against it (a GPU one is not read, to avoid
        # a sync).
        lens_t = torch.tensor(lens, device="cpu")
        valid_cpu = torch.arange(padded_len, device="cpu")[None, :] < lens_t[:, None]  # (B, L)
        if patch_attention_mask is not None and patch_attention_mask.device.type == "cpu":
            given = patch_attention_mask.reshape(b, -1).bool()
            if not torch.equal(given, valid_cpu[:, :seq_len]):
                raise ValueError(
                    "patch_attention_mask must mark the first h*w patches of each strip"
                )
        mask = None
        if min(lens) != padded_len:
            # additive key-padding mask, (B, 1, 1, L): broadcasts over heads and queries
            dtype = self.embeddings.patch_embedding.weight.dtype
            mask = torch.zeros(b, 1, 1, padded_len, dtype=dtype, device=device)
            pad = ~valid_cpu.to(device, non_blocking=True)
            mask.masked_fill_(pad[:, None, None, :], torch.finfo(dtype).min)
        return VisionPlan(seq_len, padded_len, pos_ids, mask)

    def run(self, pixel_values: torch.Tensor, plan: VisionPlan) -> torch.Tensor:
        """The device work of `forward` for a batch planned by `plan`: no host syncs."""
        p = self.cfg.patch_size
        if plan.padded_len != plan.seq_len:
            pixel_values = F.pad(pixel_values, (0, (plan.padded_len - plan.seq_len) * p))
        x = self.embeddings(pixel_values, plan.pos_ids)  # (B, L, D)
        # a vision batch's B and L change (a clip's last partial batch, frame sizes)
        with any_shape():
            for layer in self.encoder.layers:
                x = layer(x, plan.mask)
        x = self.post_layernorm(x)
        return x[:, : plan.seq_len]


def build_vision_encoder(
    cfg: ThinkerConfig | VisionConfig,
    attn_backend: str = "sdpa",
    state_dict: Mapping[str, torch.Tensor] | None = None,
    prefix: str = "vpm.",
) -> VisionEncoder:
    """Build from config; if `state_dict` is given, strict-load the keys under `prefix`."""
    enc = VisionEncoder.from_config(cfg, attn_backend)
    if state_dict is not None:
        load_stripped(enc, state_dict, prefix)
    return enc


# ---------------------------------------------------------------------------------------
# Regional compile


def compile_vision_layers(
    encoder: VisionEncoder,
    *,
    dynamic: bool = True,
    pad_multiple: int | None = None,
    backend: str = "inductor",
    mode: str | None = None,
) -> VisionEncoder:
    """Regional torch.compile: compile each encoder layer's forward in place.

    All layers share one code object, and with inlined nn.Module parameters (the default
    since torch 2.5) Dynamo reuses the same compiled graph for every layer, so compile
    time is that of one layer, not 26.

    Shapes: B (strips per batch) and L (patches per strip, ~1024 for a 448x448 slice but
    anything from a few dozen to 4900) both vary. With `dynamic=True` the graph is traced
    with symbolic B and L, so new sizes do not recompile; only the 0/1 specialization of
    B and mask-vs-no-mask add graphs (at most ~4 in total). With `dynamic=False` every new
    (B, L) compiles again; then pass `pad_multiple` (e.g. 64) so L is padded up to a bucket
    and masked, which bounds the shape count at the cost of some padding compute. Padding
    also forces a mask, which keeps SDPA off its flash kernel, so the dynamic default
    leaves L exact.
    """
    encoder.pad_multiple = pad_multiple
    for layer in encoder.encoder.layers:
        layer.compile(dynamic=dynamic, backend=backend, mode=mode)
    return encoder

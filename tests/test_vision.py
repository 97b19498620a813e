"""NaViT SigLIP encoder and perceiver resampler vs references (tiny fp32 configs, CPU).

- encoder layers vs transformers' SiglipEncoderLayer (same weights, 4-D additive mask);
- NaViT position ids vs a literal restatement of the reference rule;
- whole encoder vs a plain restatement of the reference forward (per-row embedding loop,
  (B, 1, L, L) mask, HF layers);
- backends: sdpa == eager on padded batches, compiled layer == eager layer;
- resampler vs an nn.MultiheadAttention restatement; sin-cos layout; strict loading.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from pipeline.config import LLMConfig, ThinkerConfig, VisionConfig
from pipeline.thinker.resampler import Resampler, build_resampler, sincos_pos_embed_2d
from pipeline.thinker.vision import (
    VisionEncoder,
    build_vision_encoder,
    compile_vision_layers,
    navit_position_ids,
    pack_strips,
)

TINY = VisionConfig(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=2,
    num_hidden_layers=3,
    num_layers_run=2,
)


def assert_close(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float = 0.0, what: str = ""):
    diff = (a.float() - b.float()).abs()
    ok = torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol)
    assert ok, f"{what}: max diff {diff.max().item():.3e}, mean diff {diff.mean().item():.3e}"


def _randomize(module: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def _rand_strips(sizes, patch=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, patch, patch * h * w, generator=g) for h, w in sizes]


@pytest.fixture(scope="module")
def encoder() -> VisionEncoder:
    torch.manual_seed(0)
    enc = VisionEncoder(TINY, attn_backend="eager").eval()
    _randomize(enc, 1)
    return enc


# ---------------------------------------------------------------------------------------
# Layer parity with transformers


def _hf_layer(cfg: VisionConfig):
    from transformers import SiglipVisionConfig
    from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer

    hf_cfg = SiglipVisionConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        layer_norm_eps=cfg.layer_norm_eps,
        hidden_act=cfg.hidden_act,
        attention_dropout=0.0,
    )
    hf_cfg._attn_implementation = "eager"
    return SiglipEncoderLayer(hf_cfg).eval()


def _hf_4d_mask(lens, seq_len, dtype=torch.float32):
    valid = torch.arange(seq_len)[None, :] < torch.tensor(lens)[:, None]
    m = torch.zeros(len(lens), 1, seq_len, seq_len, dtype=dtype)
    return m.masked_fill(~valid[:, None, None, :], torch.finfo(dtype).min)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_each_layer_matches_hf_siglip_layer(encoder, backend):
    lens, seq_len = [12, 7, 3], 12
    hf = _hf_layer(TINY)
    x = torch.randn(3, seq_len, TINY.hidden_size)
    mask4 = _hf_4d_mask(lens, seq_len)
    ours_mask = mask4[:, :, :1, :]  # (B, 1, 1, L), what VisionEncoder builds
    for i, layer in enumerate(encoder.encoder.layers):
        hf.load_state_dict(layer.state_dict(), strict=True)
        layer.self_attn.backend = backend
        with torch.no_grad():
            ref = hf(x, mask4)
            out = layer(x, ours_mask)
        layer.self_attn.backend = "eager"
        # only real rows are defined outputs; compare those
        for b, n in enumerate(lens):
            assert_close(out[b, :n], ref[b, :n], atol=1e-5, what=f"layer {i} {backend} row {b}")


# ---------------------------------------------------------------------------------------
# Position ids


def _reference_position_ids(h: int, w: int, n: int) -> torch.Tensor:
    # modeling_navit_siglip.py, SiglipVisionEmbeddings.forward, one row of the loop:
    # tgt_sizes is int32, so 1 / nb_patches is a float32 tensor.
    tgt = torch.tensor([[h, w]], dtype=torch.int32)
    boundaries = torch.arange(1 / n, 1.0, 1 / n)
    frac_h = torch.arange(0, 1 - 1e-6, 1 / tgt[0][0])
    frac_w = torch.arange(0, 1 - 1e-6, 1 / tgt[0][1])
    bh = torch.bucketize(frac_h, boundaries, right=True)
    bw = torch.bucketize(frac_w, boundaries, right=True)
    return (bh[:, None] * n + bw).flatten()


@pytest.mark.parametrize(
    "h,w",
    [
        (1, 1),
        (32, 32),
        (23, 45),
        (45, 23),
        (25, 49),
        (50, 55),
        (58, 14),
        (70, 70),
        (69, 70),
        (70, 1),
        (80, 71),
        (3, 140),
    ],
)
def test_navit_position_ids_match_reference_rule(h, w):
    n = 70
    ids = navit_position_ids(h, w, n)
    ref = _reference_position_ids(h, w, n)
    assert ids.shape == (h * w,)
    assert torch.equal(ids, ref), f"(h, w)=({h}, {w}): {(ids != ref).sum()} ids differ"
    assert ids.min() >= 0 and ids.max() < n * n


def test_navit_position_ids_identity_at_full_grid():
    # a 70 x 70 slice uses every table row once, in row-major order
    assert torch.equal(navit_position_ids(70, 70, 70), torch.arange(4900))


# ---------------------------------------------------------------------------------------
# Whole encoder


def _reference_encoder(enc: VisionEncoder, pixel_values, tgt_sizes, patch_mask):
    """Restatement of SiglipVisionTransformer.forward with HF layers."""
    n = TINY.num_patches_per_side
    b = pixel_values.shape[0]
    x = enc.embeddings.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
    pos = torch.zeros(b, x.shape[1], dtype=torch.long)
    for i, m in enumerate(patch_mask):
        pos[i][m.view(-1)] = _reference_position_ids(int(tgt_sizes[i][0]), int(tgt_sizes[i][1]), n)
    x = x + enc.embeddings.position_embedding(pos)
    flat = patch_mask.view(b, -1)
    mask = None
    if not flat.all():
        mask = torch.zeros(b, 1, x.shape[1], x.shape[1]).masked_fill(
            ~flat[:, None, None, :], torch.finfo(x.dtype).min
        )
    hf = _hf_layer(TINY)
    for layer in enc.encoder.layers:
        hf.load_state_dict(layer.state_dict())
        x = hf(x, mask)
    return enc.post_layernorm(x)


SIZES = [(4, 5), (3, 3), (2, 6), (1, 1)]


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_encoder_matches_reference_restatement(encoder, backend):
    pixel_values, tgt, mask = pack_strips(_rand_strips(SIZES), SIZES)
    assert pixel_values.shape == (4, 3, 14, 14 * 20) and mask.shape == (4, 1, 20)
    encoder.set_attn_backend(backend)
    with torch.no_grad():
        out = encoder(pixel_values, tgt, mask)
        ref = _reference_encoder(encoder, pixel_values, tgt, mask)
    encoder.set_attn_backend("eager")
    assert out.shape == (4, 20, TINY.hidden_size)
    for b, (h, w) in enumerate(SIZES):
        assert_close(out[b, : h * w], ref[b, : h * w], atol=1e-5, what=f"{backend} strip {b}")


def test_batched_equals_one_at_a_time(encoder):
    strips = _rand_strips(SIZES, seed=3)
    encoder.set_attn_backend("sdpa")
    with torch.no_grad():
        pv, tgt, mask = pack_strips(strips, SIZES)
        batched = encoder(pv, tgt, mask)
        for b, (s, hw) in enumerate(zip(strips, SIZES)):
            pv1, tgt1, _ = pack_strips([s], [hw])
            single = encoder(pv1, tgt1)
            n = hw[0] * hw[1]
            assert_close(batched[b, :n], single[0], atol=1e-5, what=f"strip {b}")
    encoder.set_attn_backend("eager")


def test_sdpa_equals_eager_on_padded_batch(encoder):
    pv, tgt, mask = pack_strips(_rand_strips(SIZES, seed=5), SIZES)
    with torch.no_grad():
        encoder.set_attn_backend("eager")
        eager = encoder(pv, tgt, mask)
        encoder.set_attn_backend("sdpa")
        sdpa = encoder(pv, tgt, mask)
    encoder.set_attn_backend("eager")
    for b, (h, w) in enumerate(SIZES):
        assert_close(sdpa[b, : h * w], eager[b, : h * w], atol=2e-6, what=f"strip {b}")


def test_pad_multiple_does_not_change_real_rows(encoder):
    pv, tgt, mask = pack_strips(_rand_strips(SIZES, seed=6), SIZES)
    with torch.no_grad():
        ref = encoder(pv, tgt, mask)
        encoder.pad_multiple = 16
        padded = encoder(pv, tgt, mask)
        encoder.pad_multiple = None
    assert padded.shape == ref.shape
    for b, (h, w) in enumerate(SIZES):
        assert_close(padded[b, : h * w], ref[b, : h * w], atol=2e-6, what=f"strip {b}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SDPA's kernel choice is CUDA's")
@pytest.mark.parametrize("sizes", [[(32, 32)] * 3, [(32, 32), (24, 42), (16, 20)]],
                         ids=["equal slices", "mixed slices"])
def test_sdpa_without_cudnn_attention_matches_on_cuda(monkeypatch, sizes):
    """The encoder keeps SDPA off cuDNN attention on CUDA (a graph built per new batch
    shape); the kernels it uses instead (flash for equal slices, memory-efficient with the
    padding mask) are as close to an fp32 eager encoder as cuDNN's, at the released geometry,
    eager and compiled."""
    from torch.nn.attention import SDPBackend

    from tests._full_size import vision_encoder
    from pipeline import sdpa

    vpm = vision_encoder(torch.device("cuda"))
    ref = VisionEncoder.from_config(vpm.cfg, "eager").cuda().eval()
    ref.load_state_dict(vpm.state_dict())
    vpm = vpm.to(torch.bfloat16)
    vpm.set_attn_backend("sdpa")
    g = torch.Generator(device="cuda").manual_seed(3)
    strips = [torch.randn(3, 14, 14 * h * w, device="cuda", generator=g) for h, w in sizes]
    pv, tgt, mask = pack_strips(strips, sizes)
    lens = [h * w for h, w in sizes]

    def rows(x):
        return torch.cat([x[i, :n] for i, n in enumerate(lens)]).float()

    with torch.inference_mode():
        want = rows(ref(pv, tgt, mask))
        shipped = rows(vpm(pv.bfloat16(), tgt, mask))
        monkeypatch.setattr(sdpa, "KERNELS", [SDPBackend.CUDNN_ATTENTION])
        cudnn = rows(vpm(pv.bfloat16(), tgt, mask))
        monkeypatch.setattr(sdpa, "KERNELS", sdpa.NO_CUDNN_ATTENTION)
        torch._dynamo.reset()
        compile_vision_layers(vpm)
        compiled = rows(vpm(pv.bfloat16(), tgt, mask))
    scale = want.abs().mean().item()
    err = {name: (x - want).abs().mean().item() / scale
           for name, x in (("shipped", shipped), ("cuDNN", cudnn), ("compiled", compiled))}
    assert err["shipped"] <= 1.5 * err["cuDNN"] + 1e-4, err
    assert err["compiled"] <= 1.5 * err["cuDNN"] + 1e-4, err
    assert err["shipped"] < 2e-2, err


def test_bad_patch_mask_is_rejected(encoder):
    pv, tgt, mask = pack_strips(_rand_strips(SIZES), SIZES)
    mask[1, 0, 0] = False
    with pytest.raises(ValueError):
        encoder(pv, tgt, mask)


def test_compiled_layer_matches_eager():
    # a counting backend (runs Dynamo's graph as is, no codegen) keeps this fast; Inductor
    # on CPU takes ~40 s for one tiny layer here, so test_sdpa_without_cudnn_attention_matches_on_cuda covers it on CUDA.
    cfg = VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_hidden_layers=2,
        num_layers_run=2,
    )
    enc = VisionEncoder(cfg, attn_backend="sdpa").eval()
    _randomize(enc, 2)
    sizes = [(4, 5), (3, 3)]
    pv, tgt, mask = pack_strips(_rand_strips(sizes, seed=7), sizes)
    with torch.no_grad():
        ref = enc(pv, tgt, mask)
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    t0 = time.perf_counter()
    for layer in enc.encoder.layers:
        layer.compile(dynamic=True, backend=counter)
    with torch.no_grad():
        out = enc(pv, tgt, mask)
        sizes2 = [(5, 5), (2, 3)]  # new L: must not recompile
        pv2, tgt2, mask2 = pack_strips(_rand_strips(sizes2, seed=8), sizes2)
        enc(pv2, tgt2, mask2)
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 2 layers x 2 shapes"
    for b, (h, w) in enumerate(sizes):
        assert_close(out[b, : h * w], ref[b, : h * w], atol=1e-6, what=f"compiled strip {b}")
    torch._dynamo.reset()
    assert time.perf_counter() - t0 < 60


def test_compile_vision_layers_helper():
    cfg = VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_hidden_layers=1,
        num_layers_run=1,
    )
    enc = VisionEncoder(cfg, attn_backend="sdpa").eval()
    _randomize(enc, 4)
    sizes = [(3, 4), (2, 2)]
    pv, tgt, mask = pack_strips(_rand_strips(sizes, seed=9), sizes)
    with torch.no_grad():
        ref = enc(pv, tgt, mask)
        torch._dynamo.reset()
        compile_vision_layers(enc, backend="aot_eager")
        out = enc(pv, tgt, mask)
    torch._dynamo.reset()
    for b, (h, w) in enumerate(sizes):
        assert_close(out[b, : h * w], ref[b, : h * w], atol=1e-6, what=f"strip {b}")


def test_strict_load_with_checkpoint_keys(encoder):
    sd = {"vpm." + k: v for k, v in encoder.state_dict().items()}
    sd["llm.model.norm.weight"] = torch.ones(3)  # other prefixes are ignored
    keys = {k[4:] for k in sd if k.startswith("vpm.")}
    assert "embeddings.position_embedding.weight" in keys
    assert "encoder.layers.1.self_attn.out_proj.bias" in keys and "post_layernorm.weight" in keys
    assert not any(k.startswith("encoder.layers.2.") for k in keys), "num_layers_run layers only"
    enc2 = build_vision_encoder(TINY, "eager", sd)
    for k, v in enc2.state_dict().items():
        assert torch.equal(v, encoder.state_dict()[k]), k


# ---------------------------------------------------------------------------------------
# Resampler


def _thinker_cfg(llm_hidden=128, vision_hidden=32, query_num=8) -> ThinkerConfig:
    return ThinkerConfig(
        llm=LLMConfig(hidden_size=llm_hidden),
        vision=VisionConfig(hidden_size=vision_hidden, intermediate_size=64, num_attention_heads=2),
        query_num=query_num,
    )


def _reference_pos_embed(dim, h, w):
    import numpy as np

    gh, gw = np.arange(h, dtype=np.float32), np.arange(w, dtype=np.float32)
    grid = np.stack(np.meshgrid(gw, gh), axis=0)

    def one(d, pos):
        omega = np.arange(d // 2, dtype=np.float32)
        omega /= d / 2.0
        omega = 1.0 / 10000**omega
        out = np.einsum("hw,d->hwd", pos, omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=-1)

    return torch.from_numpy(
        np.concatenate([one(dim // 2, grid[0]), one(dim // 2, grid[1])], axis=-1)
    ).float()


def test_sincos_layout():
    dim = 16
    pos = sincos_pos_embed_2d(dim, 5, 7)
    assert pos.shape == (5, 7, dim)
    assert_close(pos, _reference_pos_embed(dim, 5, 7), atol=2e-6, what="vs numpy reference")
    # first half depends on the column only, second half on the row only
    assert torch.equal(pos[0, 3, : dim // 2], pos[4, 3, : dim // 2])
    assert torch.equal(pos[2, 0, dim // 2 :], pos[2, 6, dim // 2 :])
    # [sin, cos] per half: at column 0 the first quarter is sin(0) = 0, the second cos(0) = 1
    assert torch.all(pos[:, 0, : dim // 4] == 0) and torch.all(pos[:, 0, dim // 4 : dim // 2] == 1)


def _reference_resampler(r: Resampler, x, tgt_sizes):
    """Restatement of the reference Resampler.forward with nn.MultiheadAttention."""
    mha = nn.MultiheadAttention(r.embed_dim, r.num_heads)
    mha.load_state_dict(r.attn.state_dict())
    bs = x.shape[0]
    patch_len = tgt_sizes[:, 0] * tgt_sizes[:, 1]
    kpm = torch.zeros(bs, int(patch_len.max()), dtype=torch.bool)
    h_max, w_max = int(tgt_sizes[:, 0].max()), int(tgt_sizes[:, 1].max())
    table = _reference_pos_embed(r.embed_dim, max(70, h_max), max(70, w_max))
    pos = []
    for i in range(bs):
        h, w = int(tgt_sizes[i][0]), int(tgt_sizes[i][1])
        pos.append(table[:h, :w].reshape(h * w, -1))
        kpm[i, patch_len[i] :] = True
    pos = nn.utils.rnn.pad_sequence(pos, batch_first=True).permute(1, 0, 2)
    kv = r.ln_kv(r.kv_proj(x)).permute(1, 0, 2)
    q = r.ln_q(r.query).unsqueeze(1).repeat(1, bs, 1)
    out = mha(q, kv + pos, kv, key_padding_mask=kpm)[0].permute(1, 0, 2)
    return r.ln_post(out) @ r.proj


@pytest.mark.parametrize("sizes", [[(4, 5), (3, 3), (1, 7)], [(72, 2), (2, 71)]])
def test_resampler_matches_multihead_attention(sizes):
    cfg = _thinker_cfg()
    torch.manual_seed(0)
    r = Resampler.from_config(cfg).eval()
    _randomize(r, 3)
    assert r.num_heads == 1
    tgt = torch.tensor(sizes, dtype=torch.int32)
    seq_len = max(h * w for h, w in sizes)
    x = torch.randn(len(sizes), seq_len, 32)
    with torch.no_grad():
        out = r(x, tgt)
        ref = _reference_resampler(r, x, tgt)
    assert out.shape == (len(sizes), 8, 128)
    assert_close(out, ref, atol=2e-5, what=f"resampler {sizes}")
    assert r.pos_embed.shape[:2] == (70, 70), "larger slices never grow the buffer"


def test_resampler_multi_head_and_padding_invariance():
    cfg = _thinker_cfg(llm_hidden=256)
    r = Resampler.from_config(cfg).eval()
    _randomize(r, 4)
    assert r.num_heads == 2
    sizes = [(4, 5), (2, 3)]
    x = torch.randn(2, 20, 32)
    with torch.no_grad():
        out = r(x, torch.tensor(sizes))
        ref = _reference_resampler(r, x, torch.tensor(sizes))
        alone = r(x[1:, :6], torch.tensor(sizes[1:]))
    assert_close(out, ref, atol=2e-5, what="2 heads")
    assert_close(out[1], alone[0], atol=2e-6, what="padded vs alone")


def test_resampler_strict_load_keys():
    cfg = _thinker_cfg()
    r = Resampler.from_config(cfg)
    expected = {
        "query",
        "kv_proj.weight",
        "attn.in_proj_weight",
        "attn.in_proj_bias",
        "attn.out_proj.weight",
        "attn.out_proj.bias",
        "ln_q.weight",
        "ln_q.bias",
        "ln_kv.weight",
        "ln_kv.bias",
        "ln_post.weight",
        "ln_post.bias",
        "proj",
    }
    assert set(r.state_dict()) == expected
    ref = nn.MultiheadAttention(128, 1)
    assert {"attn." + k for k in ref.state_dict()} <= expected
    sd = {"resampler." + k: torch.randn_like(v) for k, v in r.state_dict().items()}
    r2 = build_resampler(cfg, sd)
    assert torch.equal(r2.proj, sd["resampler.proj"])


def test_warm_up_vision_traces_every_graph_requests_need(tiny_source):
    """After the start-up warm-up, requests of other batch sizes, slice sizes and mixes
    compile nothing more: the first request pays no compile."""
    from torch._dynamo.testing import CompileCounter

    from pipeline.handoff import ImageInput
    from pipeline.thinker.model import ThinkerModel

    model = ThinkerModel.load(tiny_source)
    torch._dynamo.reset()
    counter = CompileCounter()
    for layer in model.vpm.encoder.layers:
        layer.compile(dynamic=True, backend=counter)
    try:
        assert model.warm_up_vision(batch_size=16) == [(1, False), (2, False), (2, True)]
        warmed = counter.frame_count
        assert warmed >= 1
        p = model.cfg.slicing.patch_size

        def image(sizes: list[tuple[int, int]], seed: int) -> ImageInput:
            g = torch.Generator().manual_seed(seed)
            strips = [torch.randint(0, 256, (3, p, p * h * w), generator=g, dtype=torch.uint8)
                      for h, w in sizes]
            return ImageInput(strips, torch.tensor(sizes, dtype=torch.int32), f"im{seed}")

        for batch in ([(20, 24)], [(32, 32)] * 3, [(32, 32), (16, 40), (8, 8)], [(5, 7)] * 2):
            model.encode_images([image(batch, len(batch))], batch_size=16)
        assert counter.frame_count == warmed, "a request compiled again after the warm-up"
    finally:
        torch._dynamo.reset()

"""Whisper audio encoder + projection + pooling vs references (tiny fp32 configs, CPU).

- each layer vs transformers' WhisperEncoderLayer (same weights, additive 4-D mask);
- full encoder vs a plain reimplementation of the reference forward on one clip;
- block-causal mask structure; batched == one-at-a-time; eager == sdpa;
- pooled token counts vs the processor's placeholder formula; > 30 s windows;
- strict loading with the checkpoint's key names.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import AudioConfig, LLMConfig, ThinkerConfig
from pipeline.thinker.audio import (
    AudioEncoder,
    block_causal_mask,
    build_audio_encoder,
    num_audio_tokens,
    num_audio_tokens_for_samples,
    pooled_tokens,
)

TINY = AudioConfig(
    d_model=32,
    encoder_layers=2,
    encoder_attention_heads=2,
    encoder_ffn_dim=128,
    num_mel_bins=8,
    max_source_positions=150,
)


def assert_close(a: torch.Tensor, b: torch.Tensor, atol: float, what: str = ""):
    diff = (a.float() - b.float()).abs()
    assert torch.allclose(a.float(), b.float(), atol=atol, rtol=0), (
        f"{what}: max diff {diff.max().item():.3e}, mean diff {diff.mean().item():.3e}"
    )


def _thinker(audio: AudioConfig = TINY, chunk: float = 1.0) -> ThinkerConfig:
    return ThinkerConfig(llm=LLMConfig(hidden_size=48), audio=audio, audio_chunk_length=chunk)


@pytest.fixture(scope="module")
def encoder() -> AudioEncoder:
    torch.manual_seed(0)
    enc = AudioEncoder.from_config(_thinker()).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in enc.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return enc


def _hf_layer(cfg: AudioConfig):
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoderLayer

    hf_cfg = WhisperConfig(
        d_model=cfg.d_model,
        encoder_attention_heads=cfg.encoder_attention_heads,
        encoder_ffn_dim=cfg.encoder_ffn_dim,
        encoder_layers=cfg.encoder_layers,
        num_mel_bins=cfg.num_mel_bins,
        max_source_positions=cfg.max_source_positions,
        activation_function=cfg.activation_function,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    hf_cfg._attn_implementation = "eager"
    return WhisperEncoderLayer(hf_cfg).eval()


def _additive(mask_bool: torch.Tensor) -> torch.Tensor:
    return torch.zeros(mask_bool.shape).masked_fill(~mask_bool, float("-inf"))


# ---------------------------------------------------------------------------------------
# Layers and mask


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_each_layer_matches_hf_whisper_layer(encoder, backend):
    hf = _hf_layer(TINY)
    lens, t = [120, 75], 120
    mask = block_causal_mask(lens, t, chunk=50)
    x = torch.randn(2, t, TINY.d_model)
    for i, layer in enumerate(encoder.apm.layers):
        hf.load_state_dict(layer.state_dict(), strict=True)
        layer.self_attn.backend = backend
        with torch.no_grad():
            ref = hf(x, _additive(mask))
            out = layer(x, mask)
        layer.self_attn.backend = "sdpa"
        for b, n in enumerate(lens):
            assert_close(out[b, :n], ref[b, :n], atol=1e-5, what=f"layer {i} {backend} clip {b}")


def test_block_causal_mask_structure():
    m = block_causal_mask([120, 70], 120, chunk=50)[:, 0]  # (B, L, L)
    assert m.shape == (2, 120, 120) and m.dtype == torch.bool
    # clip 0: frame 0 and 49 see keys 0..49; frame 50 sees 0..99; frame 100+ sees all 120
    for q, end in [(0, 50), (49, 50), (50, 100), (99, 100), (100, 120), (119, 120)]:
        assert m[0, q, :end].all() and not m[0, q, end:].any(), f"query {q}"
    # clip 1 (70 frames): keys >= 70 are padding for every query
    assert not m[1, :, 70:].any()
    assert m[1, 60, :70].all() and m[1, 10, :50].all() and not m[1, 10, 50:].any()
    # every row has at least one key
    assert m.any(-1).all()
    # chunk <= 0: full attention over real keys
    full = block_causal_mask([5, 3], 5, chunk=0)[:, 0]
    assert full[0].all() and full[1, :, :3].all() and not full[1, :, 3:].any()


# ---------------------------------------------------------------------------------------
# Whole encoder


def _reference_tokens(
    enc: AudioEncoder, mel: torch.Tensor, chunk_frames: int = 50, pool: int = 5
) -> torch.Tensor:
    """One clip (n_mels, T), restating MiniCPMWhisperEncoder.forward + get_audio_embedding
    with transformers' WhisperEncoderLayer."""
    apm = enc.apm
    x = mel[None]
    x = F.gelu(apm.conv1(x))
    x = F.gelu(apm.conv2(x)).permute(0, 2, 1)
    t = x.shape[1]
    x = x + apm.embed_positions.weight[:t]
    # subsequent_chunk_mask(size=t, chunk_size=chunk_frames, num_left_chunks=-1)
    allowed = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        allowed[i, : min((i // chunk_frames + 1) * chunk_frames, t)] = True
    mask = torch.zeros(1, 1, t, t).masked_fill(~allowed, float("-inf"))
    hf = _hf_layer(apm.cfg)
    for layer in apm.layers:
        hf.load_state_dict(layer.state_dict())
        x = hf(x, mask)
    x = apm.layer_norm(x)
    x = enc.audio_projection_layer(x)
    x = nn.AvgPool1d(pool, stride=pool)(x.transpose(1, 2)).transpose(1, 2)
    n_tok = ((mel.shape[1] - 1) // 2 + 1 - pool) // pool + 1
    return x[0, :n_tok]


@pytest.mark.parametrize("t", [237, 100, 9])
def test_encoder_matches_reference_one_clip(encoder, t):
    mel = torch.randn(TINY.num_mel_bins, t)
    with torch.no_grad():
        out = encoder(mel[None], [t])
        ref = _reference_tokens(encoder, mel)
    assert len(out) == 1 and out[0].shape == (num_audio_tokens(t), 48)
    assert_close(out[0], ref, atol=1e-5, what=f"T={t}")


def test_batched_equals_one_at_a_time(encoder):
    lens = [237, 100, 61, 9]
    mels = [torch.randn(TINY.num_mel_bins, n) for n in lens]
    batch = torch.zeros(len(lens), TINY.num_mel_bins, max(lens))
    for i, m in enumerate(mels):
        batch[i, :, : m.shape[1]] = m
        batch[i, :, m.shape[1] :] = 3.0  # junk padding must not matter
    with torch.no_grad():
        batched = encoder(batch, torch.tensor(lens))
        for i, m in enumerate(mels):
            single = encoder(m[None], [lens[i]])[0]
            assert batched[i].shape == single.shape == (num_audio_tokens(lens[i]), 48)
            assert_close(batched[i], single, atol=1e-5, what=f"clip {i} (T={lens[i]})")


def test_sdpa_equals_eager(encoder):
    lens = [237, 120]
    batch = torch.randn(2, TINY.num_mel_bins, 237)
    with torch.no_grad():
        encoder.apm.set_attn_backend("eager")
        eager = encoder(batch, lens)
        encoder.apm.set_attn_backend("sdpa")
        sdpa = encoder(batch, lens)
    for i in range(2):
        assert_close(sdpa[i], eager[i], atol=2e-6, what=f"clip {i}")


def test_long_clip_is_encoded_in_30s_windows(encoder):
    # tiny config: 150 positions -> windows of 300 mel frames ("30 s")
    window = 2 * TINY.max_source_positions
    n = 2 * window + 73
    mel = torch.randn(1, TINY.num_mel_bins, n)
    with torch.no_grad():
        out = encoder(mel, [n])[0]
        parts = [
            encoder(mel[:, :, s : s + window], [min(window, n - s)])[0] for s in range(0, n, window)
        ]
    assert out.shape[0] == num_audio_tokens(n, window=window) == sum(p.shape[0] for p in parts)
    assert_close(out, torch.cat(parts), atol=1e-5, what="windowed")
    with pytest.raises(ValueError):
        encoder.apm(mel, [n])  # the bare Whisper encoder refuses > max positions


# ---------------------------------------------------------------------------------------
# Counts and loading


def test_pooled_token_counts_match_processor_formula():
    for samples in [1, 159, 160, 161, 1600, 16000, 16000 * 7 + 123, 480000, 480001, 16000 * 75 + 5]:
        n = samples
        expected = ((math.ceil(n / 160) - 1) // 2 + 1 - 5) // 5 + 1
        assert num_audio_tokens_for_samples(samples) == expected, samples
        assert num_audio_tokens(math.ceil(n / 160)) == expected, samples
    assert (
        num_audio_tokens(100) == 10 and num_audio_tokens(3000) == 300 and pooled_tokens(3000) == 300
    )
    assert num_audio_tokens(0) == 0


def test_strict_load_with_checkpoint_keys(encoder):
    keys = set(encoder.state_dict())
    assert "apm.layers.0.self_attn.k_proj.weight" in keys
    assert "apm.layers.0.self_attn.k_proj.bias" not in keys, "k_proj has no bias"
    assert {
        "apm.conv1.weight",
        "apm.conv2.bias",
        "apm.embed_positions.weight",
        "apm.layer_norm.weight",
    } <= keys
    assert {"audio_projection_layer.linear1.weight", "audio_projection_layer.linear2.bias"} <= keys
    assert encoder.apm.embed_positions.weight.shape == (TINY.max_source_positions, TINY.d_model)
    sd = dict(encoder.state_dict())
    sd["vpm.post_layernorm.weight"] = torch.ones(3)  # other prefixes are ignored
    enc2 = build_audio_encoder(_thinker(), sd)
    for k, v in enc2.state_dict().items():
        assert torch.equal(v, sd[k]), k
    # every key name matches transformers' WhisperEncoder (minus what 4.5 does not use)
    hf = _hf_layer(TINY)
    assert {"apm.layers.0." + k for k in hf.state_dict()} <= keys


def test_projection_input_width_comes_from_ffn_dim():
    bad = AudioConfig(
        d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=8
    )
    with pytest.raises(ValueError):
        AudioEncoder.from_config(_thinker(bad))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN attention is CUDA-only")
def test_sdpa_without_cudnn_attention_matches_on_cuda(monkeypatch):
    """The encoder keeps SDPA off cuDNN attention on CUDA (a graph built per new clip
    length); the kernels it uses instead are as close to an fp32 eager encoder as cuDNN's
    are, at the released geometry."""
    from torch.nn.attention import SDPBackend

    from tests._full_size import audio_encoder as build
    from pipeline import sdpa

    enc = build(torch.device("cuda"))
    ref = copy.deepcopy(enc).float()
    ref.apm.set_attn_backend("eager")
    mel = torch.randn(2, enc.apm.cfg.num_mel_bins, 1234, device="cuda")
    lens = [1234, 777]
    with torch.inference_mode():
        want = torch.cat(ref(mel, lens))
        shipped = torch.cat(enc(mel.bfloat16(), lens)).float()
        monkeypatch.setattr(sdpa, "KERNELS", [SDPBackend.CUDNN_ATTENTION])
        cudnn = torch.cat(enc(mel.bfloat16(), lens)).float()
    err_cudnn = (cudnn - want).abs().mean().item()
    err_shipped = (shipped - want).abs().mean().item()
    assert err_shipped <= 1.5 * err_cudnn + 1e-4, (err_shipped, err_cudnn)
    assert err_shipped / want.abs().mean().item() < 2e-2


def test_audio_graphs_pad_a_clip_to_its_bucket(encoder):
    """AudioGraphs (a CUDA graph of one clip per bucket of mel frames; on the CPU the runner
    stand-in keeps GraphRunner's static buffers): a clip zero-padded to its bucket and masked
    as a shorter clip of a batch gives the tokens it gets alone, for lengths across the
    buckets and at their edges, each bucket one graph that every length of it reuses."""
    from pipeline.thinker.model import AudioGraphs
    from tests.test_thinker import _StaticRunner

    graphs = AudioGraphs(encoder, torch.float32, buckets=(64, 128, 512))
    assert graphs.buckets == (64, 128, 300)  # the window (300 frames here) is always the last
    assert graphs.bucket(300) == 300 and graphs.bucket(301) is None
    graphs.runner = _StaticRunner()
    g = torch.Generator().manual_seed(5)
    lengths = (10, 37, 64, 65, 128, 200, 299, 300)
    for n in lengths:
        feats = torch.randn(TINY.num_mel_bins, n, generator=g)
        got = graphs.encode(feats)
        want = encoder(feats[None], torch.tensor([n]))[0]
        assert got.shape == want.shape == (num_audio_tokens(n), 48)
        assert_close(got, want, atol=1e-5, what=f"T={n}")
    assert graphs.runner.captures == 3 and graphs.runner.replays == len(lengths)
    assert graphs.runner.keys == [64, 64, 64, 128, 128, 300, 300, 300]


def test_the_audio_graphs_function_never_reads_the_device_back(encoder):
    """What AudioGraphs captures (the encoder's `run`, projection and pooling over static
    inputs) must not read a tensor's value on the host: a CUDA graph cannot capture a sync.
    Every aten op of one call, on the CPU: no scalar read-back, no data-dependent shape."""
    from _graph_ops import HOST_READS, AtenOps

    from pipeline.thinker.model import AudioGraphs

    graphs = AudioGraphs(encoder, torch.float32, buckets=(128,))
    feats = torch.randn(1, TINY.num_mel_bins, 128)
    mel_valid, mask = encoder.apm.masks([77], 128, torch.device("cpu"))
    with torch.inference_mode(), AtenOps() as ops:
        out = graphs._forward(feats, mel_valid, mask)
    assert out.shape == (1, pooled_tokens(128), 48)
    assert {"linear", "conv1d", "avg_pool1d"} <= ops.names  # the mode saw the ops
    assert not ops.names & HOST_READS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_audio_graphs_match_the_eager_encoder_on_cuda():
    """Captured audio graphs at the released geometry (bf16, random weights) against the
    eager encoder: a clip per bucket, at its edge and inside it, each bucket captured once
    and replayed for every later length; the tokens within bf16 rounding of the eager ones
    (the kernels over the padded bucket may sum in another order)."""
    from tests._full_size import audio_encoder as build
    from pipeline.thinker.model import AudioGraphs

    enc = build(torch.device("cuda"))
    graphs = AudioGraphs(enc, torch.bfloat16)
    graphs.capture()
    assert graphs.runner.captures == len(graphs.buckets)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for n in (97, 256, 257, 1003, 2048, 2999, 3000):
            feats = torch.randn(enc.apm.cfg.num_mel_bins, n, generator=gen).bfloat16()
            want = enc(feats[None].cuda(), [n])[0].float()
            got = graphs.encode(feats).float()
            assert got.shape == want.shape == (num_audio_tokens(n), want.shape[1])
            diff = (got - want).abs()
            mean = (diff.mean() / want.abs().mean()).item()
            peak = (diff.max() / want.abs().max()).item()
            assert mean < 1e-2 and peak < 5e-2, (n, mean, peak)
    assert graphs.runner.captures == len(graphs.buckets)  # no capture while serving

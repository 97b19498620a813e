"""Attention of varying shapes runs without cuDNN attention (pipeline/sdpa.py): the Talker's
prefills, the resampler, the vision and audio encoders. Attention a CUDA graph captures per
shape (the Talker's decode) keeps SDPA's own choice. On the CPU the flags are observable at
each SDPA call (the kernels themselves are CUDA's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_audio_encoder import TINY as AUDIO
from test_audio_encoder import _thinker
from test_talker_engine import make_talker, spoken, tiny_cfg
from test_vision import TINY, _rand_strips

from pipeline import sdpa
from pipeline.handoff import SpokenChunk, TalkerSpec
from pipeline.talker.engine import TalkerEngine, TalkerEngineConfig
from pipeline.thinker.audio import AudioEncoder
from pipeline.thinker.resampler import Resampler
from pipeline.thinker.vision import VisionEncoder, pack_strips


@pytest.fixture
def calls(monkeypatch) -> list[tuple[int, bool]]:
    """(query length, cuDNN attention allowed) of every SDPA call."""
    seen: list[tuple[int, bool]] = []
    sdpa_fn = F.scaled_dot_product_attention

    def recording(q, *args, **kwargs):
        seen.append((q.shape[-2], torch.backends.cuda.cudnn_sdp_enabled()))
        return sdpa_fn(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return seen


def test_any_shape_leaves_cudnn_attention_out_then_restores(monkeypatch):
    b = torch.backends.cuda
    assert b.cudnn_sdp_enabled()
    with sdpa.any_shape():
        assert not b.cudnn_sdp_enabled()
        assert b.flash_sdp_enabled() and b.mem_efficient_sdp_enabled() and b.math_sdp_enabled()
    assert b.cudnn_sdp_enabled()
    monkeypatch.setattr(sdpa, "KERNELS", None)  # SDPA's own choice
    with sdpa.any_shape():
        assert b.cudnn_sdp_enabled()


def test_talker_prefills_leave_cudnn_out_decodes_keep_sdpa_choice(calls):
    cfg = tiny_cfg()
    engine = TalkerEngine(make_talker(cfg, eos_bias=2.0), TalkerEngineConfig(max_streams=2))
    ids, hidden = spoken(23, cfg, seed=3)
    engine.open("s", TalkerSpec(mode="streaming", seed=5))
    engine.feed("s", SpokenChunk(ids, hidden, True))
    for _ in range(400):
        engine.step()
        if not engine.has_work():
            break
    assert engine._prefills >= 3  # chunks [0:10], [10:20], [20:23]: recompute prompts
    prefills = [ok for n, ok in calls if n > 1]
    decodes = [ok for n, ok in calls if n == 1]
    assert prefills and not any(prefills)
    assert decodes and all(decodes)


def test_encoders_and_resampler_leave_cudnn_out(calls):
    sizes = [(4, 5), (3, 3)]
    enc = VisionEncoder(TINY, attn_backend="sdpa").eval()
    res = Resampler(8, 128, TINY.hidden_size, max_size=(8, 8)).eval()
    pv, tgt, mask = pack_strips(_rand_strips(sizes), sizes)
    audio = AudioEncoder.from_config(_thinker()).eval()
    with torch.no_grad():
        assert res(enc(pv, tgt, mask), tgt).shape == (2, 8, 128)
        audio(torch.randn(2, AUDIO.num_mel_bins, 150), [150, 97])
    assert len(calls) == TINY.num_layers_run + 1 + AUDIO.encoder_layers
    assert not any(ok for _, ok in calls)


def _mel(frames: int) -> torch.Tensor:
    return torch.randn(AUDIO.num_mel_bins, frames)


def test_the_duplex_streaming_audio_encoder_leaves_cudnn_out(calls):
    """A duplex session's audio encoder attends over its cache, a new key length every
    unit: every call without cuDNN attention, one a layer, batched (equal lengths, then
    unequal: a key mask) and alone."""
    from pipeline.duplex.audio_stream import StreamingAudioEncoder, encode_batch

    audio = AudioEncoder.from_config(_thinker()).eval()
    a, b = StreamingAudioEncoder(audio), StreamingAudioEncoder(audio)
    with torch.no_grad():
        encode_batch([a, b], [_mel(102), _mel(102)], [0, 0], [2, 2])
        encode_batch([a, b], [_mel(104), _mel(98)], [2, 2], [2, 2])
        encode_batch([a], [_mel(104)], [2], [2])
    assert len(calls) == 3 * AUDIO.encoder_layers
    assert not any(ok for _, ok in calls)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_talker_prefill_without_cudnn_is_as_close_as_cudnn_on_cuda(monkeypatch):
    """At the released Talker geometry (bf16 on CUDA), a prefill's logits without cuDNN
    attention are as close to an fp32 prefill as with it."""
    from torch.nn.attention import SDPBackend

    from pipeline.config import TalkerConfig
    from pipeline.talker.fused import FusedTalker
    from pipeline.talker.model import TalkerKVCache, TalkerModel

    torch.manual_seed(0)
    cfg = TalkerConfig()
    ref = TalkerModel(cfg).eval().cuda()
    model = TalkerModel(cfg).eval().cuda()
    model.load_state_dict(ref.state_dict())
    model = model.to(torch.bfloat16)
    want_d, got_d = FusedTalker(ref, compile=False), FusedTalker(model, compile=False)
    want_c = TalkerKVCache(cfg, 1, cfg.max_position_embeddings, torch.float32, "cuda")
    got_c = TalkerKVCache(cfg, 1, cfg.max_position_embeddings, torch.bfloat16, "cuda")
    prompt = torch.randn(57, cfg.hidden_size, device="cuda")
    with torch.no_grad():
        want = want_d.prefill(want_c, 0, prompt).float()
        with sdpa.any_shape():
            shipped = got_d.prefill(got_c, 0, prompt.bfloat16()).float()
        monkeypatch.setattr(sdpa, "KERNELS", [SDPBackend.CUDNN_ATTENTION])
        with sdpa.any_shape():
            cudnn = got_d.prefill(got_c, 0, prompt.bfloat16()).float()
    err_shipped = (shipped - want).abs().mean().item()
    err_cudnn = (cudnn - want).abs().mean().item()
    assert err_shipped <= 1.5 * err_cudnn + 1e-4, (err_shipped, err_cudnn)
    assert err_shipped / want.abs().mean().item() < 2e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_streaming_audio_encoder_without_cudnn_is_as_close_as_cudnn_on_cuda(monkeypatch):
    """At the released audio encoder's geometry (24 layers, bf16 on CUDA), 40 units of two
    sessions (their caches past a restart at 1500 positions): the encoder's output without
    cuDNN attention is as close to an fp32 run as with it, unit after unit."""
    from torch.nn.attention import SDPBackend

    from pipeline.config import AudioConfig, LLMConfig, ThinkerConfig
    from pipeline.duplex.audio_stream import StreamingAudioEncoder, encode_batch

    torch.manual_seed(0)
    cfg = ThinkerConfig(llm=LLMConfig(hidden_size=4096), audio=AudioConfig())
    ref = AudioEncoder.from_config(cfg).eval().cuda()
    half = AudioEncoder.from_config(cfg).eval().cuda()
    half.load_state_dict(ref.state_dict())
    half = half.to(torch.bfloat16)
    runs = {"fp32": (ref, None), "shipped": (half, sdpa.NO_CUDNN_ATTENTION),
            "cudnn": (half, [SDPBackend.CUDNN_ATTENTION])}
    encoders = {k: [StreamingAudioEncoder(m), StreamingAudioEncoder(m)]
                for k, (m, _) in runs.items()}
    g = torch.Generator().manual_seed(1)
    err = {"shipped": [], "cudnn": []}
    with torch.no_grad():
        for u in range(40):
            mels = [torch.randn(cfg.audio.num_mel_bins, n, generator=g).cuda()
                    for n in ((102, 102) if u == 0 else (104, 104))]  # no mask: cuDNN runs
            pre = [0, 0] if u == 0 else [2, 2]
            out = {}
            for k, (m, kernels) in runs.items():
                monkeypatch.setattr(sdpa, "KERNELS", kernels)
                out[k] = [o.float() for o in encode_batch(encoders[k], mels, pre, [2, 2])]
            for k, errs in err.items():
                errs.append(max((a - b).abs().mean().item()
                                for a, b in zip(out[k], out["fp32"], strict=True)))
    scale = max(o.abs().mean().item() for o in out["fp32"])
    print(f"mean abs error a unit: shipped {max(err['shipped']):.3g}, cudnn "
          f"{max(err['cudnn']):.3g} (outputs ~{scale:.3g})")
    assert max(err["shipped"]) <= 1.5 * max(err["cudnn"]) + 1e-4
    assert max(err["shipped"]) / scale < 2e-2

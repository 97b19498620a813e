"""Code2Wav modules vs the PyPI reference (stepaudio2-minicpmo==0.1.1), CPU fp32, shared weights.

Needs `pip install --no-deps stepaudio2-minicpmo==0.1.1 einops scipy`; skipped otherwise.
The reference's streaming path hard-codes DiT buffers (512 hidden, 8x64 heads, depth <= 16),
so the streaming test uses a 512-wide, 1-deep DiT with a tiny encoder and HiFT.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.code2wav.assets import tiny_code2wav_config
from pipeline.code2wav.flow import Flow
from pipeline.code2wav.hift import HiFTGenerator
from pipeline.code2wav.stream import CodeCursor, Crossfade, initial_state
from pipeline.config import Code2WavConfig, DiTConfig
from tests._code2wav_plain import (
    dit_offline,
    encoder_offline,
    flow_inference,
    from_reference,
    stream_step,
)
from tests._code2wav_ref import build_reference_flow, build_reference_hift, load_reference

REF = load_reference()
pytestmark = pytest.mark.skipif(REF is None, reason="stepaudio2-minicpmo reference not installed")

ATOL = 2e-5


def _close(a: torch.Tensor, b: torch.Tensor, what: str, atol: float = ATOL) -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    d = (a.float() - b.float()).abs()
    assert d.max().item() <= atol, (
        f"{what}: max diff {d.max().item():.3g}, mean {d.mean().item():.3g} (scale {b.abs().mean().item():.3g})"
    )


def _perturb(module: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    """Make every parameter non-trivial (the reference zero-inits adaLN and the final layer)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def _pair(cfg: Code2WavConfig, seed: int = 0):
    torch.manual_seed(seed)
    ref = build_reference_flow(REF, cfg)
    _perturb(ref, seed)
    ours = Flow(cfg).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    ours.decoder.rand_noise.copy_(ref.decoder.rand_noise)
    return ref, ours


def _hift_pair(cfg: Code2WavConfig, seed: int = 1):
    torch.manual_seed(seed)
    ref = build_reference_hift(REF, cfg.hift)
    _perturb(ref, seed, 0.1)
    ours = HiFTGenerator(cfg.hift).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_code2wav_config()
    return (cfg, *_pair(cfg))


def test_state_dict_keys_and_shapes_match_reference(tiny):
    cfg, ref, ours = tiny
    want = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert want == got
    rh, h = _hift_pair(cfg)
    assert {k: tuple(v.shape) for k, v in rh.state_dict().items()} == {
        k: tuple(v.shape) for k, v in h.state_dict().items()
    }
    assert any(k.endswith("parametrizations.weight.original0") for k in h.state_dict())


def test_encoder_offline_and_chunk(tiny):
    cfg, ref, ours = tiny
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 23, cfg.input_size, generator=g)
    with torch.inference_mode():
        a, _ = ref.encoder(x, torch.tensor([23]))
        b = encoder_offline(ours.encoder, x, torch.tensor([23]))
        _close(b, a, "encoder offline")
        # chunk mode: prompt chunk then a 28-code chunk with cache
        ra, rcnn, ratt = ref.encoder.forward_chunk(x[:, :13], last_chunk=False)
        oa, new = ours.encoder.forward_chunk(x[:, :13], False, None)
        _close(oa, ra, "encoder chunk 1")
        cache = from_reference(
            {
                "conformer_att_cache": ratt,
                "conformer_cnn_cache": rcnn,
                "estimator_cnn_cache": torch.zeros(1, 1),
                "estimator_att_cache": torch.zeros(1, 1),
            },
            cfg.encoder.num_blocks,
            1,
            1,
        )
        for k in ("token_att", "mel_att", "lookahead_cnn", "up_cnn"):
            _close(new[k], getattr(cache, k), f"encoder cache {k}")
        rb, _, _ = ref.encoder.forward_chunk(
            x[:, 10:], last_chunk=True, cnn_cache=rcnn, att_cache=ratt
        )
        ob, _ = ours.encoder.forward_chunk(x[:, 10:], True, cache)
        _close(ob, rb, "encoder chunk 2 (last)")


def test_dit_one_cfm_step(tiny):
    cfg, ref, ours = tiny
    g = torch.Generator().manual_seed(4)
    b, t = 2, 17
    x, mu, cond = (torch.randn(b, 80, t, generator=g) for _ in range(3))
    spk = torch.randn(b, 80, generator=g)
    tt = torch.tensor([0.3, 0.3])
    with torch.inference_mode():
        est_r, est_o = ref.decoder.estimator, ours.decoder.estimator
        v_ref = est_r(x, torch.ones(b, 1, t), mu, tt, spk, cond)
        v_our = dit_offline(est_o, x, mu, est_o.time_embedding(tt), spk, cond, torch.ones(b, 1, t))
        _close(v_our, v_ref, "DiT offline step")
        # streaming step against an existing cache (newest-first)
        v1, cnn, att = est_o.forward_chunk(x, mu, est_o.time_embedding(tt), spk, cond)
        v2, cnn2, att2 = est_o.forward_chunk(
            x[..., :9], mu[..., :9], est_o.time_embedding(tt), spk, cond[..., :9], cnn, att
        )
        _close(v1, v_ref, "DiT chunk without cache == offline")
    assert att2.shape[3] == t + 9


def test_offline_decode(tiny):
    cfg, ref, ours = tiny
    g = torch.Generator().manual_seed(5)
    tok = torch.randint(0, cfg.vocab_size, (1, 31), generator=g)
    pt = torch.randint(0, cfg.vocab_size, (1, 9), generator=g)
    pm, spk = torch.randn(1, 18, 80, generator=g), torch.randn(1, 192, generator=g)
    a = ref.inference(
        tok, torch.tensor([31]), pt, torch.tensor([9]), pm, torch.tensor([18]), spk, 10
    )
    b = flow_inference(ours, tok, pt, pm, spk)
    _close(b, a, "offline mel")
    assert b.shape == (1, 80, 62)


def test_hift(tiny):
    cfg = tiny[0]
    rh, h = _hift_pair(cfg)
    mel = torch.randn(1, 80, 30, generator=torch.Generator().manual_seed(6))
    torch.manual_seed(11)
    s_ref, src_ref = rh(mel)
    torch.manual_seed(11)
    s, src = h(mel)
    _close(s, s_ref, "hift speech", 1e-6)
    _close(src, src_ref, "hift source", 1e-6)
    assert s.shape == (1, 30 * 480)
    cache = src_ref[:, :, -3840:]
    torch.manual_seed(12)
    s_ref, _ = rh(mel, cache)
    torch.manual_seed(12)
    s, _ = h(mel, cache)
    _close(s, s_ref, "hift speech with cached source", 1e-6)


def test_single_final_chunk_equals_offline(tiny):
    """Where the reference agrees: from an empty state, one final chunk (encoder chunk mode with
    zero lookahead padding, CFM from noise offset 0, DiT without cache) is the offline decode."""
    cfg, _, ours = tiny
    g = torch.Generator().manual_seed(7)
    tok = torch.randint(0, cfg.vocab_size, (1, 20), generator=g)
    spk = torch.randn(1, 192, generator=g)
    with torch.inference_mode():
        chunk, _ = ours._chunk(tok, spk, None, True, None)
    offline = flow_inference(ours, tok, tok[:, :0], torch.zeros(1, 0, 80), spk)
    _close(chunk, offline, "one final chunk vs offline", 1e-5)


def _ref_stream(ref_flow, ref_hift, cfg, prompt_tokens, prompt_mel, spk, chunks):
    """Drives the reference modules like Token2wav.stream ([SA] first chunk, [MU7] trimming)."""
    pad = torch.full((1, 3), cfg.silence_code)
    cache = {
        k: v.clone()
        for k, v in ref_flow.setup_cache(
            torch.cat([prompt_tokens, pad], 1), prompt_mel, spk
        ).items()
    }
    window = torch.from_numpy(np.hamming(7680))
    hc = dict(mel=torch.zeros(1, 80, 0), source=torch.zeros(1, 1, 0), speech=torch.zeros(1, 0))
    pm, nb = prompt_mel.shape[1], cfg.encoder.num_blocks
    outs = []
    for k, (codes, last) in enumerate(chunks):
        mel, cache = ref_flow.inference_chunk(
            torch.tensor([codes]), spk, cache, last_chunk=last, n_timesteps=10
        )
        cache = {kk: v.clone() for kk, v in cache.items()}
        a = cache["estimator_att_cache"]
        if a.shape[4] > pm + 100:
            cache["estimator_att_cache"] = torch.cat([a[..., :pm, :], a[..., -100:, :]], 4)
        a = cache["conformer_att_cache"]
        if a.shape[3] > pm + 100:
            tc = a[:nb, :, :, : a.shape[3] // 2]
            tc = torch.cat([tc[:, :, :, : pm // 2], tc[:, :, :, tc.shape[3] - 50 :]], 3)
            mc = torch.cat([a[nb:, :, :, :pm], a[nb:, :, :, a.shape[3] - 100 :]], 3)
            cache["conformer_att_cache"] = torch.cat([tc.repeat(1, 1, 1, 2, 1), mc], 0)
        mel = torch.cat([hc["mel"], mel], 2)
        torch.manual_seed(100 + k)
        speech, source = ref_hift(mel, hc["source"])
        if hc["speech"].shape[-1] > 0:
            faded = speech.clone()
            faded[..., :3840] = (
                speech[..., :3840] * window[:3840] + hc["speech"][..., -3840:] * window[3840:]
            )
            speech = faded
        hc = dict(
            mel=mel[..., -8:].clone(),
            source=source[:, :, -3840:].clone(),
            speech=speech[:, -3840:].clone(),
        )
        outs.append(speech if last else speech[:, :-3840])
    return outs


def test_streaming_chunk_by_chunk_matches_reference():
    base = tiny_code2wav_config()
    cfg = Code2WavConfig(
        input_size=base.input_size,
        encoder=base.encoder,
        hift=base.hift,
        dit=DiTConfig(hidden_size=512, depth=1, num_heads=8, head_dim=64),
    )
    ref, ours = _pair(cfg, seed=2)
    rh, h = _hift_pair(cfg)
    g = torch.Generator().manual_seed(8)
    p = 10
    pt = torch.randint(0, cfg.vocab_size, (1, p), generator=g)
    pm, spk = torch.randn(1, 2 * p, 80, generator=g), torch.randn(1, 192, generator=g)
    codes = torch.randint(0, cfg.vocab_size, (87,), generator=g).tolist()

    state = initial_state(ours, cfg, pt, pm, spk, reference="stepaudio2-0.1.1")
    cursor = CodeCursor.start(cfg)
    cursor.push(codes, final=True)
    chunks, outs = [], []
    xf = Crossfade(3840, "cpu")
    while (nxt := cursor.next_chunk(cfg)) is not None:
        chunks.append(nxt)
        torch.manual_seed(100 + len(outs))
        speech, (state,) = stream_step(ours, h, cfg, [state], torch.tensor([nxt[0]]), nxt[1], xf)
        outs.append(speech)
        cursor.advance(cfg, nxt[1])
    assert [len(c) for c, _ in chunks] == [28, 28, 28, 15] and [l for _, l in chunks] == [
        False
    ] * 3 + [True]
    ref_outs = _ref_stream(ref, rh, cfg, pt, pm, spk, chunks)
    for k, (a, b) in enumerate(zip(outs, ref_outs)):
        _close(a, b, f"stream chunk {k}", 1e-5)
    # [SA] first chunk: no silence pad, 160 ms held back; stream length == offline length.
    assert outs[0].shape[1] == 50 * 480 - 3840
    assert sum(o.shape[1] for o in outs) == 2 * (len(codes) + 3) * 480
    # bounded caches: prompt + 100 frames once trimming started (chunk 3 on)
    assert state.flow.est_len == 2 * p + 100 and state.flow.mel_len == 2 * p + 100
    assert state.flow.token_att.shape[3] == p + 50


def _trimmed_then_split(cache, prompt: int) -> list:
    """The plain path: [MU7]'s trim of the whole batch (`[:prompt] ++ [-100:]` along time),
    then each stream's rows of it."""
    from pipeline.code2wav.flow import HISTORY_FRAMES, FlowCache

    def keep(t, dim, p, h):
        return torch.cat([t.narrow(dim, 0, p), t.narrow(dim, t.shape[dim] - h, h)], dim)

    t = {f: getattr(cache, f) for f in ("token_att", "mel_att", "lookahead_cnn", "up_cnn",
                                        "est_cnn", "est_att")}
    if cache.est_len > prompt + HISTORY_FRAMES:
        t["est_att"] = keep(t["est_att"], 4, prompt, HISTORY_FRAMES)
    if cache.mel_len > prompt + HISTORY_FRAMES:
        t["token_att"] = keep(t["token_att"], 3, prompt // 2, HISTORY_FRAMES // 2)
        t["mel_att"] = keep(t["mel_att"], 3, prompt, HISTORY_FRAMES)
    b = cache.batch
    out = []
    for i in range(b):
        row = {}
        for name, x in t.items():
            if name.startswith("est_"):
                row[name] = torch.cat([x.narrow(2, i, 1), x.narrow(2, b + i, 1)], 2)
            else:
                row[name] = x.narrow(1 if name.endswith("_att") else 0, i, 1)
        out.append(FlowCache(**row))
    return out


@pytest.mark.parametrize("batch,est_len,mel_len", [(3, 330, 330), (3, 200, 200), (1, 330, 200),
                                                   (2, 200, 330)])
def test_flow_cache_split_trims_each_stream_as_the_batch_trimmed_then_split(batch, est_len,
                                                                            mel_len):
    from pipeline.code2wav.flow import FlowCache

    g = torch.Generator().manual_seed(batch + est_len)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    cache = FlowCache(token_att=r(2, batch, 2, mel_len // 2, 8), mel_att=r(3, batch, 2, mel_len, 8),
                      lookahead_cnn=r(batch, 4, 2), up_cnn=r(batch, 4, 4),
                      est_cnn=r(5, 2, 2 * batch, 6, 2), est_att=r(5, 2, 2 * batch, 2, est_len, 8))
    prompt = 150
    got, want = cache.split(prompt), _trimmed_then_split(cache, prompt)
    assert len(got) == len(want) == batch
    for a, b in zip(got, want):
        assert a.shapes() == b.shapes()
        for x, y in zip(a.tensors(), b.tensors()):
            assert torch.equal(x, y)
    if batch > 1:  # each stream in memory of its own
        ptrs = [{t.untyped_storage().data_ptr() for t in c.tensors()} for c in got]
        assert not ptrs[0] & ptrs[1] and not ptrs[0] & {t.untyped_storage().data_ptr()
                                                        for t in cache.tensors()}

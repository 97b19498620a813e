"""Code2Wav vs minicpmo-utils 1.0.7 (the official demo's pin) and the 0.1.1 choice, CPU fp32; and
the package's own speed options, `Token2wav(float16, n_timesteps)`, against the engine's modes.

1.0.7 installs a top-level `stepaudio2` like 0.1.1, so it lives in its own folder, never on
sys.path (tests/_code2wav_ref.py `load_reference_mu7`):
    pip install --no-deps --target .cache/minicpmo-utils-1.0.7 minicpmo-utils==1.0.7
and skips otherwise; reading its config.yaml / flow.yaml needs `hyperpyyaml` (else those
tests skip). Its streaming DiT buffers are sized for the released DiT (512 wide, 8 heads):
here they are resized to the tiny default's, which changes no number.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.code2wav.assets import load_code2wav, tiny_code2wav_config, write_token2wav_assets
from pipeline.code2wav.causal_hift import (
    CausalHiFT,
    CausalVocoderState,
    causal_hift_config_from_yaml,
    causal_hift_config_like,
    draw_noise,
    vocode_chunk,
)
from pipeline.code2wav.hift import HiFTGenerator
from pipeline.code2wav.stream import CodeCursor, Crossfade, initial_state
from pipeline.code2wav.voice import VoiceCache, VoicePrompt
from tests._code2wav_plain import stream_step
from tests._code2wav_ref import (
    build_reference_flow,
    hift_kwargs,
    load_reference,
    load_reference_mu7,
)

MU7 = load_reference_mu7()
SA = load_reference()
needs_mu7 = pytest.mark.skipif(MU7 is None, reason="minicpmo-utils 1.0.7 not installed")
needs_yaml = pytest.mark.skipif(
    MU7 is None or not MU7.has_hyperpyyaml, reason="minicpmo-utils 1.0.7 or hyperpyyaml missing"
)


def _diff(a, b, what: str, atol: float) -> float:
    a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    d = (a - b).abs().max().item() if a.numel() else 0.0
    print(f"{what}: max abs diff {d:.3g} (peak {b.abs().max().item() if b.numel() else 0:.3g})")
    assert d <= atol, f"{what}: max abs diff {d:.3g} > {atol}"
    return d


def _codes(seed: int, n: int) -> list[int]:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- the causal vocoder on random tiny weights --------------------------------------------


def _reference_vocoder(c):
    return MU7.generator.CausalHiFTGenerator(
        **hift_kwargs(c),
        conv_pre_look_right=c.conv_pre_look_right,
        f0_predictor=MU7.f0_predictor.CausalConvRNNF0Predictor(
            in_channels=c.in_channels, cond_channels=c.f0_predictor_channels
        ),
    ).eval()


@pytest.fixture(scope="module")
def vocoders():
    """(reference CausalHiFTGenerator, ours) with the same perturbed weights and noise table;
    F0 straddles the 10 Hz voiced threshold, so both excitation branches run."""
    c = causal_hift_config_like(tiny_code2wav_config().hift)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ref = _reference_vocoder(c)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
        f0 = ref.f0_predictor
        f0.classifier.weight.mul_(200.0)  # F0 spread over ~ +-6 Hz, centred on 10 Hz
        raw = f0.classifier(f0.condnet(_mels(1, 187, 2)).transpose(1, 2)) - f0.classifier.bias
        f0.classifier.bias.fill_(10.0 - raw.median().item())
    ours = CausalHiFT(c).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    ours.noise_table = ref.m_source.l_sin_gen.sine_waves[0]  # [MU7]'s fixed noise table
    return ref, ours


def _mels(n: int, frames: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 80, frames, generator=torch.Generator().manual_seed(seed))


def _reference_stream(ref, mel: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """[MU7] BoundedVocoder over one stream, one call per chunk, the last one finalizing."""
    bv = MU7.bounded_vocoder.BoundedVocoder(ref)
    out, o = [], 0
    for k, n in enumerate(sizes):
        out.append(bv.stream(mel[:, :, o : o + n], finalize=k == len(sizes) - 1))
        o += n
    return out


def _our_stream(ours, mel: torch.Tensor, sizes: list[int], states=None, generators=None):
    states = states or [CausalVocoderState.empty(mel.shape[0], ours, "cpu")]
    if len(states) == 1 and mel.shape[0] > 1:
        states = CausalVocoderState.empty(mel.shape[0], ours, "cpu").split()
    out, o = [], 0
    for k, n in enumerate(sizes):
        speech, states = vocode_chunk(
            ours, states, mel[:, :, o : o + n], k == len(sizes) - 1, generators=generators
        )
        out.append(speech)
        o += n
    return out, states


@needs_mu7
def test_causal_vocoder_matches_reference_offline_and_streaming(vocoders):
    ref, ours = vocoders
    assert (ours.history, ours.delay, ours.mel_capacity, ours.source_capacity) == (31, 8, 39, 36)
    mel = _mels(3, 187, 2)
    with torch.inference_mode():
        f0 = ours.f0_predictor(mel[:1].double(), finalize=True)
    voiced = (f0 > 10).float().mean().item()
    assert 0.2 < voiced < 0.8, f"voiced fraction {voiced:.2f}: both branches should run"
    # offline: the whole utterance in one finalizing call
    (a,) = _reference_stream(ref, mel[:1], [187])
    (b,), _ = _our_stream(ours, mel[:1], [187])
    _diff(b, a, "causal vocoder offline", 1e-6)
    assert b.shape == (1, 187 * 480)
    # chunk by chunk (50-frame chunks as the flow gives them, an odd final), batch 1 and 3
    sizes = [50, 50, 50, 37]
    ours3, _ = _our_stream(ours, mel, sizes)
    for i in range(3):
        want = _reference_stream(ref, mel[i : i + 1], sizes)
        got, _ = _our_stream(ours, mel[i : i + 1], sizes)
        assert [w.shape[1] for w in want] == [42 * 480, 50 * 480, 50 * 480, 45 * 480]
        for k in range(len(sizes)):
            _diff(got[k], want[k], f"stream {i} chunk {k}", 1e-6)
            _diff(ours3[k][i : i + 1], got[k], f"batch 3 row {i} chunk {k} vs alone", 1e-6)


@needs_mu7
def test_causal_vocoder_batches_streams_at_different_positions(vocoders):
    """Streams with equal `key` batch whatever their absolute position (the noise table is
    read at each one's own samples); an empty finalizing call flushes the delayed frames."""
    ref, ours = vocoders
    mel = _mels(2, 250, 3)
    far = _reference_stream(ref, mel[:1], [50, 50, 50, 50, 0])
    near = _reference_stream(ref, mel[1:], [50, 50, 0])
    s_far = [CausalVocoderState.empty(1, ours, "cpu")]
    for o in (0, 50, 100):
        _, s_far = vocode_chunk(ours, s_far, mel[:1, :, o : o + 50], False)
    s_near = [CausalVocoderState.empty(1, ours, "cpu")]
    _, s_near = vocode_chunk(ours, s_near, mel[1:, :, :50], False)
    assert s_far[0].key() == s_near[0].key() and s_far[0].received != s_near[0].received
    both, states = vocode_chunk(
        ours, s_far + s_near, torch.cat([mel[:1, :, 150:200], mel[1:, :, 50:100]]), False
    )
    _diff(both[0:1], far[3], "batched row at frame 150", 1e-6)
    _diff(both[1:2], near[1], "batched row at frame 50", 1e-6)
    flush, done = vocode_chunk(ours, states[1:], mel[1:, :, :0], True)
    _diff(flush, near[2], "empty final flush", 1e-6)
    assert flush.shape == (1, 8 * 480) and done[0].finalized


@needs_mu7
def test_causal_vocoder_noise_from_generators(vocoders):
    """Without a table the noise comes from each stream's generator, drawn beforehand (what a
    CUDA graph is fed) or inside: the same numbers; batched == one at a time."""
    _, ref_ours = vocoders
    ours = CausalHiFT(ref_ours.cfg).eval()
    ours.load_state_dict(ref_ours.state_dict())
    mel = _mels(3, 100, 4)

    def gens():
        return [torch.Generator().manual_seed(7 + i) for i in range(3)]

    states = CausalVocoderState.empty(3, ours, "cpu").split()
    noise = draw_noise(ours, states, 50, False, gens())
    assert noise.shape == (3, 47 * 480, 9) and 0 <= noise.min() and noise.max() < 1
    a, _ = vocode_chunk(ours, states, mel[:, :, :50], False, noise=noise)
    b, _ = vocode_chunk(ours, states, mel[:, :, :50], False, generators=gens())
    assert torch.equal(a, b)
    batched, _ = _our_stream(ours, mel, [50, 50], generators=gens())
    for i, g in enumerate(gens()):
        alone, _ = _our_stream(ours, mel[i : i + 1], [50, 50], generators=[g])
        for k in range(2):
            _diff(batched[k][i : i + 1], alone[k], f"generator noise row {i} chunk {k}", 1e-6)


# -- assets --------------------------------------------------------------------------------


@needs_yaml
def test_written_assets_load_in_minicpmo_utils(ckpt, tmp_path):
    """The tiny default is the [MU7] layout: its own loaders accept config.yaml + hift.pt
    (strict, with its mel / rate / delay checks) and flow.yaml; the weights are ours."""
    folder = ckpt / "assets" / "token2wav"
    assert {p.name for p in folder.iterdir()} >= {
        "flow.yaml",
        "flow.pt",
        "config.yaml",
        "hift.pt",
        "hift_original.pt",
    }
    _, vocoder, cfg = load_code2wav(ckpt)
    assert isinstance(vocoder, CausalHiFT) and cfg == tiny_code2wav_config()
    assert vocoder.cfg == causal_hift_config_like(cfg.hift)
    with MU7.active():
        ref, _, _ = MU7.token2wav.load_causal_vocoder(folder, "cpu")
        ref_flow = MU7.token2wav._load_config(folder / "flow.yaml")["flow"]
    want = ref.state_dict()
    got = vocoder.state_dict()
    assert set(want) == set(got) and all(torch.equal(want[k].double(), got[k]) for k in want)
    ref_flow.load_state_dict(torch.load(folder / "flow.pt", weights_only=True), strict=True)
    original = HiFTGenerator(cfg.hift)
    original.load_state_dict(torch.load(folder / "hift_original.pt", weights_only=True))
    # the 0.1.1 layout is still written on request, and loads the CosyVoice2 HiFT
    write_token2wav_assets(tmp_path / "t2w", cfg, seed=0, layout="cosyvoice2")
    assert not (tmp_path / "t2w" / "config.yaml").exists()
    _, hift, _ = load_code2wav(tmp_path / "t2w")
    assert isinstance(hift, HiFTGenerator)
    assert all(torch.equal(v, original.state_dict()[k]) for k, v in hift.state_dict().items())


def test_config_yaml_with_refs_and_a_missing_one(ckpt, tmp_path):
    text = (ckpt / "assets" / "token2wav" / "config.yaml").read_text()
    assert (
        causal_hift_config_from_yaml(
            text.replace("base_channels: 32", "base_channels: 512")
        ).base_channels
        == 512
    )
    with pytest.raises(ValueError, match="CausalHiFTGenerator"):
        causal_hift_config_from_yaml("hift: !new:cosyvoice.hifigan.generator.HiFTGenerator\n")
    folder = tmp_path / "t2w"
    write_token2wav_assets(folder, tiny_code2wav_config(), seed=0)
    (folder / "config.yaml").unlink()
    with pytest.raises(FileNotFoundError, match="config.yaml"):
        load_code2wav(folder)


# -- a whole 1.0.7 streaming turn vs the package's Token2wav -------------------------------


def _resize_dit_buffers(ref_flow, cfg) -> None:
    """The package's streaming scratch buffers fit the released DiT only (16 steps x 16 blocks
    x 8 heads x 64); give them the tiny DiT's sizes (they hold values, no weights)."""
    d = cfg.dit
    ref_flow.decoder.cnn_cache_buffer = torch.zeros(16, d.depth, 2, 2 * d.hidden_size, 2)
    ref_flow.decoder.att_cache_buffer = torch.zeros(
        16, d.depth, 2, d.num_heads, 1000, 2 * d.head_dim
    )
    est = ref_flow.decoder.estimator
    est.cnn_cache_buffer = torch.zeros(d.depth, 2, 2 * d.hidden_size, 2)
    est.att_cache_buffer = torch.zeros(d.depth, 2, d.num_heads, 1000, 2 * d.head_dim)


@pytest.fixture(scope="module")
def turn_models(ckpt):
    """(the package's Token2wav on the tiny default, our flow, vocoder, cfg): same weights,
    our flow noise and vocoder noise table copied from the package's (drawn at its build)."""
    folder = ckpt / "assets" / "token2wav"
    flow, vocoder, cfg = load_code2wav(ckpt)
    if MU7.has_hyperpyyaml:
        with MU7.active():
            ref_voc, _, _ = MU7.token2wav.load_causal_vocoder(folder, "cpu")
            ref_flow = MU7.token2wav._load_config(folder / "flow.yaml")["flow"]
    else:  # the same classes, built from our config (no yaml reader)
        ref_voc = _reference_vocoder(vocoder.cfg)
        ref_voc.load_state_dict(torch.load(folder / "hift.pt", weights_only=True), strict=True)
        ref_flow = build_reference_flow(MU7, cfg)
    ref_flow.load_state_dict(torch.load(folder / "flow.pt", weights_only=True), strict=True)
    ref_flow.eval()
    _resize_dit_buffers(ref_flow, cfg)
    flow.decoder.rand_noise.copy_(ref_flow.decoder.rand_noise)
    vocoder.noise_table = ref_voc.m_source.l_sin_gen.sine_waves[0]
    return _token2wav(ref_flow, ref_voc.float().eval()), flow, vocoder, cfg


def _token2wav(ref_flow, ref_voc, float16=False, n_timesteps=10, device="cpu"):
    """The package's Token2wav around these modules, as `Token2wav(float16, n_timesteps)`
    builds it: __init__ is CUDA-only (and loads the ONNX front ends), so set what stream()
    uses; float16 halves (a copy of) the flow, weights and buffers, as its __init__ does. The
    vocoder (fp32 in every mode) moves to `device` in place."""
    import copy

    cls = MU7.token2wav.Token2wav
    t2w = cls.__new__(cls)
    t2w.float16, t2w.n_timesteps, t2w.device = float16, n_timesteps, torch.device(device)
    if float16 or device != "cpu":
        ref_flow = copy.deepcopy(ref_flow).to(device)
        if float16:
            ref_flow.half()
    t2w.flow, t2w.hift = ref_flow, ref_voc.to(device)
    t2w.bounded_vocoder = MU7.bounded_vocoder.BoundedVocoder(t2w.hift)
    t2w.sample_rate, t2w.hop_samples = 24000, 480
    t2w.vocoder_delay_frames, t2w.vocoder_delay_samples, t2w.source_cache_len = 8, 3840, 3840
    t2w.cache, t2w.stream_cache, t2w.hift_cache_dict, t2w._stream_prompt = {}, None, {}, None
    return t2w


def _voices(ckpt) -> dict[str, VoicePrompt]:
    default = VoiceCache(ckpt / "assets" / "token2wav").default()  # 25 codes
    return {"default": default, "other": _voice_other()}


def _voice_other() -> VoicePrompt:
    """A second voice: 13 prompt codes (an odd count), random x-vector and prompt mel."""
    g = torch.Generator().manual_seed(9)
    return VoicePrompt(
        torch.randint(0, 6561, (1, 13), generator=g),
        torch.randn(1, 192, generator=g),
        torch.randn(1, 26, 80, generator=g),
    )


def _package_turn(t2w, name: str, voice: VoicePrompt, codes: list[int], flush: bool = False):
    """The demo's driving of Token2wav: buffer 3 x 4218 + codes, 28-code windows advancing by
    25, the rest with last_chunk (or, with `flush`, the rest non-final then an empty last).
    A half flow on CPU (no autocast there) takes its x-vector and prompt mel in fp16."""
    dev, half = t2w.device, t2w.float16 and t2w.device.type == "cpu"
    spk, mel = (x.to(dev, torch.float16 if half else torch.float32)
                for x in (voice.spk_emb, voice.prompt_mel))
    t2w.cache[name] = (voice.prompt_tokens.int().to(dev), None, spk, mel, None)
    with MU7.active(), torch._dynamo.config.patch(disable=True):  # its encoder is compiled
        t2w.set_stream_cache(name)
        buf, off, out = [4218] * 3 + codes, 0, []
        while len(buf) - off > 28:
            out.append(t2w.stream(buf[off : off + 28], return_waveform=True))
            off += 25
        if flush:
            out.append(t2w.stream(buf[off:], return_waveform=True))
            out.append(t2w.stream([], last_chunk=True, return_waveform=True))
        else:
            out.append(t2w.stream(buf[off:], last_chunk=True, return_waveform=True))
    return [torch.from_numpy(o).float() for o in out]


def _our_turns(flow, vocoder, cfg, voice: VoicePrompt, turns: list[list[int]], **kw):
    """Streams of one voice decoded together (batched; all turns the same length)."""
    template = initial_state(
        flow, cfg, voice.prompt_tokens, voice.prompt_mel, voice.spk_emb, vocoder=vocoder, **kw
    )
    states = [template.clone() for _ in turns]
    cursors = []
    for codes in turns:
        cursors.append(CodeCursor.start(cfg))
        cursors[-1].push(codes, final=True)
    xf, outs = Crossfade(3840, "cpu"), []
    while (nxt := cursors[0].next_chunk(cfg)) is not None:
        tokens = torch.tensor([c.next_chunk(cfg)[0] for c in cursors])
        speech, states = stream_step(flow, vocoder, cfg, states, tokens, nxt[1], xf)
        outs.append(speech)
        for c in cursors:
            c.advance(cfg, nxt[1])
    return outs


@needs_mu7
def test_streaming_turn_matches_minicpmo_utils(ckpt, turn_models):
    """Two voices, several chunks and an odd-length final chunk each: sample for sample."""
    t2w, flow, vocoder, cfg = turn_models
    voices = _voices(ckpt)
    for (name, voice), n_codes in zip(voices.items(), (87, 60)):
        codes = _codes(len(name), n_codes)
        want = _package_turn(t2w, name, voice, codes)
        (got,) = zip(*[o.split(1) for o in _our_turns(flow, vocoder, cfg, voice, [codes])])
        assert [w.shape[1] for w in want][:2] == [24000, 24000]  # 160 ms of zeros, then 1 s
        assert torch.equal(got[0][:, :3840], torch.zeros(1, 3840))
        for k, (a, b) in enumerate(zip(got, want)):
            _diff(a, b, f"voice {name} chunk {k}", 1e-6)
        _diff(torch.cat(got, 1), torch.cat(want, 1), f"voice {name} whole turn", 1e-6)
        assert torch.cat(got, 1).shape[1] == 3840 + 2 * (n_codes + 3) * 480


@needs_mu7
def test_batched_turns_and_empty_final_flush_match_minicpmo_utils(ckpt, turn_models):
    """Three turns of one voice in one batch == the package one turn at a time; a turn whose
    last codes went out non-final ends with an empty final call (vocoder flush only)."""
    t2w, flow, vocoder, cfg = turn_models
    voice = _voices(ckpt)["default"]
    turns = [_codes(20 + i, 47) for i in range(3)]
    batched = _our_turns(flow, vocoder, cfg, voice, turns)
    for i, codes in enumerate(turns):
        want = _package_turn(t2w, "default", voice, codes)
        _diff(
            torch.cat([o[i : i + 1] for o in batched], 1),
            torch.cat(want, 1),
            f"batched turn {i}",
            1e-6,
        )
    codes = _codes(30, 50)  # 3 + 50 = 28 + 25: the rest goes out as a full chunk, then flushes
    want = _package_turn(t2w, "default", voice, codes, flush=True)
    state = initial_state(
        flow, cfg, voice.prompt_tokens, voice.prompt_mel, voice.spk_emb, vocoder=vocoder
    )
    got, xf, buf = [], Crossfade(3840, "cpu"), [4218] * 3 + codes
    for off in (0, 25):
        speech, (state,) = stream_step(
            flow, vocoder, cfg, [state], torch.tensor([buf[off : off + 28]]), False, xf
        )
        got.append(speech)
    speech, (state,) = stream_step(
        flow, vocoder, cfg, [state], torch.zeros(1, 0, dtype=torch.long), True, xf
    )
    got.append(speech)
    for k, (a, b) in enumerate(zip(got, want)):
        _diff(a, b, f"flush turn chunk {k}", 1e-6)
    assert got[-1].shape == (1, 3840)  # the 8 delayed frames


# -- the package's own speed options: Token2wav(float16, n_timesteps) ------------------------


def _engine_turns(ckpt, turn_models, voice, turns, device="cpu", **engine_cfg):
    """Each turn's PCM through Code2WavEngine (the slot path) in that mode, on a fresh load of
    the weights with the fixture's noise (the engine converts and prepares the flow and
    vocoder in place; a deep copy of the vocoder would share its weight-norm classes)."""
    from pipeline.code2wav.engine import Code2WavEngine, Code2WavEngineConfig
    from pipeline.handoff import CodeChunk

    _, flow0, vocoder0, _ = turn_models
    flow, vocoder, cfg = load_code2wav(ckpt, device)
    flow.decoder.rand_noise.copy_(flow0.decoder.rand_noise)
    vocoder.noise_table = vocoder0.noise_table.to(device)
    eng = Code2WavEngine(flow, vocoder, cfg, Code2WavEngineConfig(**engine_cfg))
    assert eng.pool.pool.dit.k.shape[0] == eng.ecfg.n_timesteps  # caches per Euler step
    for i, codes in enumerate(turns):
        eng.open(f"t{i}", voice.to(device))
        eng.feed(f"t{i}", CodeChunk(f"t{i}", tuple(codes), True))
    pcm = eng.drain()
    return [torch.from_numpy(np.concatenate(pcm[f"t{i}"]))[None] for i in range(len(turns))]


@needs_mu7
def test_n_timesteps_5_matches_minicpmo_utils(ckpt, turn_models):
    """`Token2wav(n_timesteps=5)` (the duplex example's): its cosine schedule over 5 Euler
    steps. The plain path with the CFM at 5 steps equals it sample for sample; the engine
    (`n_timesteps: 5`, caches for 5 steps in the pool) within the slot path's bound; and 5
    steps differ from 10."""
    t2w, flow, vocoder, cfg = turn_models
    t2w5 = _token2wav(t2w.flow, t2w.hift, n_timesteps=5)
    voice = _voices(ckpt)["other"]
    codes = _codes(3, 60)
    want = torch.cat(_package_turn(t2w5, "other", voice, codes), 1)
    flow.decoder.n_timesteps = 5
    try:
        (got,) = zip(*[o.split(1) for o in _our_turns(flow, vocoder, cfg, voice, [codes])])
    finally:
        flow.decoder.n_timesteps = cfg.n_timesteps
    _diff(torch.cat(got, 1), want, "plain path, 5 steps", 1e-6)
    (eng,) = _engine_turns(ckpt, turn_models, voice, [codes], n_timesteps=5)
    _diff(eng, want, "engine, 5 steps", 1e-4)
    ten = torch.cat(_package_turn(t2w, "other", voice, codes), 1)
    assert (ten - want).abs().max() > 1e-4  # the step count is not ignored (beyond the bounds)


def test_n_timesteps_is_validated():
    from pipeline.code2wav.engine import Code2WavEngineConfig

    with pytest.raises(ValueError, match="n_timesteps"):
        Code2WavEngineConfig(n_timesteps=0)


def _snr_db(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(10 * torch.log10((b**2).sum() / ((a - b) ** 2).sum().clamp_min(1e-300)))


@needs_mu7
@pytest.mark.filterwarnings("ignore:.*Disabling autocast")  # the package's CUDA autocast, on CPU
def test_float16_matches_minicpmo_utils_half_flow_on_cpu(ckpt, turn_models):
    """`token2wav_precision: fp16` is `Token2wav(float16=True)`: the whole flow `.half()`
    (weights, noise, caches, the Euler update), the vocoder in fp32. The package's fp16 mode
    autocasts on CUDA only, so on CPU both run every flow op in fp16 (the package's flow
    given its x-vector and prompt mel in fp16): the engine matches that within fp16 rounding
    of other summation orders (~80 dB on the tiny default), closer than the package's fp16
    mode is to its fp32 (~72 dB), and it is as far from fp32 as that (it does run in fp16).
    Under CUDA autocast: test_float16_matches_on_cuda."""
    t2w, flow, vocoder, cfg = turn_models
    voice = _voices(ckpt)["other"]
    codes = _codes(4, 60)
    for steps in (10, 5):
        half = _token2wav(t2w.flow, t2w.hift, float16=True, n_timesteps=steps)
        assert half.flow.decoder.rand_noise.dtype == torch.float16
        want = torch.cat(_package_turn(half, "other", voice, codes), 1)
        fp32 = torch.cat(_package_turn(_token2wav(t2w.flow, t2w.hift, n_timesteps=steps),
                                       "other", voice, codes), 1)
        (got,) = _engine_turns(ckpt, turn_models, voice, [codes],
                               token2wav_precision="fp16", n_timesteps=steps)
        snr, snr_fp32, ours_fp32 = _snr_db(got, want), _snr_db(want, fp32), _snr_db(got, fp32)
        print(f"{steps} steps: engine vs package fp16 {snr:.1f} dB; package fp16 vs fp32 "
              f"{snr_fp32:.1f} dB; engine fp16 vs package fp32 {ours_fp32:.1f} dB")
        assert got.shape == want.shape
        assert snr >= snr_fp32 + 3 and ours_fp32 <= snr_fp32 + 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the package's autocast)")
@needs_mu7
def test_float16_matches_on_cuda(ckpt, turn_models):
    """On CUDA the package's fp16 mode runs its half flow under fp16 autocast; the engine's
    fp16 mode does the same (compiled blocks, CUDA graphs and Triton kernels included), with
    5 and 10 steps, against the package's Token2wav(float16=True) on the same GPU."""
    t2w = turn_models[0]
    voice = _voices(ckpt)["other"]
    codes = _codes(4, 60)
    try:
        for steps in (10, 5):
            half = _token2wav(t2w.flow, t2w.hift, float16=True, n_timesteps=steps,
                              device="cuda")
            want = torch.cat(_package_turn(half, "other", voice, codes), 1)
            fp32 = _token2wav(t2w.flow, t2w.hift, n_timesteps=steps, device="cuda")
            ref32 = torch.cat(_package_turn(fp32, "other", voice, codes), 1)
            (got,) = _engine_turns(ckpt, turn_models, voice, [codes], "cuda",
                                   token2wav_precision="fp16", n_timesteps=steps)
            got = got.cpu()
            snr, snr_fp32 = _snr_db(got, want), _snr_db(want, ref32)
            print(f"CUDA {steps} steps: engine vs package fp16 {snr:.1f} dB; package fp16 "
                  f"vs fp32 {snr_fp32:.1f} dB")
            assert snr >= snr_fp32 + 3
    finally:
        t2w.hift.to("cpu")


# -- the 0.1.1 choice ------------------------------------------------------------------------


@pytest.mark.skipif(SA is None, reason="stepaudio2-minicpmo 0.1.1 not installed")
def test_stepaudio2_0_1_1_choice_still_matches_it(tmp_path):
    """reference="stepaudio2-0.1.1" on the CosyVoice2 layout: 3 x 4218 lookahead, no leading
    zeros, HiFT + crossfade == the 0.1.1 modules driven like its Token2wav.stream; the 1.0.7
    default on the same assets differs by its lookahead and 160 ms of leading zeros."""
    from tests._code2wav_ref import build_reference_hift
    from tests.test_code2wav import _ref_stream

    write_token2wav_assets(tmp_path, tiny_code2wav_config(), seed=0, layout="cosyvoice2")
    flow, hift, cfg = load_code2wav(tmp_path)
    ref = build_reference_flow(SA, cfg)
    ref.load_state_dict(flow.state_dict(), strict=True)
    _resize_dit_buffers(ref, cfg)
    flow.decoder.rand_noise.copy_(ref.decoder.rand_noise)
    ref_hift = build_reference_hift(SA, cfg.hift)
    ref_hift.load_state_dict(hift.state_dict(), strict=True)
    voice = _voice_other()
    codes = _codes(5, 60)
    cursor = CodeCursor.start(cfg)
    cursor.push(codes, final=True)
    chunks = []
    while (nxt := cursor.next_chunk(cfg)) is not None:
        chunks.append(nxt)
        cursor.advance(cfg, nxt[1])
    outs = {}
    for reference in ("stepaudio2-0.1.1", "minicpmo-utils-1.0.7"):
        state = initial_state(
            flow, cfg, voice.prompt_tokens, voice.prompt_mel, voice.spk_emb, reference=reference
        )
        xf, outs[reference] = Crossfade(3840, "cpu"), []
        for k, (c, last) in enumerate(chunks):
            torch.manual_seed(100 + k)  # HiFT noise from the global RNG, as the reference
            speech, (state,) = stream_step(flow, hift, cfg, [state], torch.tensor([c]), last, xf)
            outs[reference].append(speech)
    want = _ref_stream(
        ref, ref_hift, cfg, voice.prompt_tokens, voice.prompt_mel, voice.spk_emb, chunks
    )
    for k, (a, b) in enumerate(zip(outs["stepaudio2-0.1.1"], want)):
        _diff(a, b, f"0.1.1 chunk {k}", 1e-5)
    new = outs["minicpmo-utils-1.0.7"]
    assert new[0].shape[1] == 24000 and torch.equal(new[0][:, :3840], torch.zeros(1, 3840))
    assert [o.shape[1] for o in new[1:]] == [o.shape[1] for o in want[1:]]
    # the other prompt lookahead changes the template, so the audio (slightly, here)
    _diff(new[1], want[1], "1.0.7 default vs 0.1.1, chunk 1 (differs)", 1.0)
    assert not torch.equal(new[1], want[1])

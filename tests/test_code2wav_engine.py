"""Code2Wav assets, strict loading, voices and the engine (CPU, fp32)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.code2wav.assets import load_code2wav, tiny_code2wav_config, write_token2wav_assets
from pipeline.code2wav.causal_hift import CausalHiFT
from pipeline.code2wav.engine import Code2WavEngine, Code2WavEngineConfig
from pipeline.code2wav.graphs import CausalVocoderGraphs
from pipeline.code2wav.hift import HiFTGenerator
from pipeline.code2wav.voice import (
    VoiceCache,
    fit_prompt_mel,
    kaldi_fbank,
    load_voice,
    mel_spectrogram_24k,
    resample,
    whisper_log_mel,
)
from pipeline.config import code2wav_config_from_yaml
from pipeline.handoff import CodeChunk
from tests._code2wav_plain import PlainEngine


@pytest.fixture(scope="module")
def model(ckpt):
    return load_code2wav(ckpt, "cpu", torch.float32)


@pytest.fixture(scope="module")
def voice(ckpt):
    return VoiceCache(ckpt / "assets" / "token2wav").default()


def _codes(seed: int, n: int) -> list[int]:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- assets and loading -------------------------------------------------------------------


def test_assets_round_trip(ckpt, model, voice):
    folder = ckpt / "assets" / "token2wav"
    assert {p.name for p in folder.iterdir()} >= {
        "flow.yaml",
        "flow.pt",
        "config.yaml",  # the minicpmo-utils 1.0.7 layout: causal vocoder for streaming
        "hift.pt",
        "hift_original.pt",
        "default_voice.safetensors",
    }
    assert (ckpt / "assets" / "HT_ref_audio.wav").is_file()
    assert code2wav_config_from_yaml((folder / "flow.yaml").read_text()) == tiny_code2wav_config()
    flow, hift, cfg = model
    assert cfg == tiny_code2wav_config()
    assert voice.prompt_mel.shape == (
        1,
        2 * voice.prompt_tokens.shape[1],
        80,
    ) and voice.spk_emb.shape == (1, 192)
    # same seed -> same weights
    write_token2wav_assets(ckpt / "again", tiny_code2wav_config(), seed=0)
    a = torch.load(folder / "flow.pt", weights_only=True)
    b = torch.load(ckpt / "again" / "flow.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # decode one chunk end to end
    eng = Code2WavEngine(flow, hift, cfg)
    eng.open("s", voice)
    eng.feed("s", CodeChunk("s", tuple(_codes(0, 25)), False))
    (chunk,) = eng.step()
    sid, pcm, last = chunk.request_id, chunk.pcm, chunk.finished
    # [MU7]: 160 ms of zeros, then the causal vocoder's first 42 frames
    assert sid == "s" and not last and pcm.shape == (24000,) and np.isfinite(pcm).all()
    assert not pcm[:3840].any() and np.abs(pcm).max() > 0


def test_released_yaml_without_hift_block_reads():
    text = (
        "flow: !new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec\n"
        "    input_size: 512\n    output_size: 80\n    vocab_size: 6561\n"
        "    encoder: !new:cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2\n"
        "        output_size: 512\n        pre_lookahead_len: 3\n"
        "    decoder: !new:cosyvoice2.flow.flow_matching.CausalConditionalCFM\n"
        "        inference_cfg_rate: 0.7\n"
        "        estimator: !new:cosyvoice2.flow.decoder_dit.DiT\n"
        "            hidden_size: 512\n            depth: 16\n"
    )
    cfg = code2wav_config_from_yaml(text)
    assert cfg.dit.depth == 16 and cfg.hift.base_channels == 512 and cfg.inference_cfg_rate == 0.7


def _copy_assets(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.is_file():
            (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_bad_keys_are_named(ckpt, tmp_path):
    folder = _copy_assets(ckpt / "assets" / "token2wav", tmp_path / "t2w")
    sd = torch.load(folder / "flow.pt", weights_only=True)
    sd.pop("encoder.after_norm.weight")
    sd["encoder.extra.weight"] = torch.zeros(1)
    sd["encoder_proj.weight"] = torch.zeros(3, 3)
    torch.save(sd, folder / "flow.pt")
    with pytest.raises(ValueError) as e:
        load_code2wav(folder)
    msg = str(e.value)
    assert "missing (1): encoder.after_norm.weight" in msg
    assert "unexpected (1): encoder.extra.weight" in msg
    assert "encoder_proj.weight: checkpoint (3, 3)" in msg


def test_hift_accepts_prefixed_and_old_weight_norm_keys(ckpt, tmp_path):
    folder = _copy_assets(ckpt / "assets" / "token2wav", tmp_path / "t2w")
    sd = torch.load(folder / "hift.pt", weights_only=True)
    old = {}
    for k, v in sd.items():
        k = k.replace("parametrizations.weight.original0", "weight_g").replace(
            "parametrizations.weight.original1", "weight_v"
        )
        old["generator." + k] = v
    torch.save(old, folder / "hift.pt")
    _, hift, _ = load_code2wav(folder)
    ref = load_code2wav(ckpt)[1]
    for k, v in ref.state_dict().items():
        assert torch.equal(hift.state_dict()[k], v), k


# -- voices ---------------------------------------------------------------------------------


def test_voice_front_end_pieces(ckpt):
    wav = torch.from_numpy(np.sin(np.arange(16000) * 2 * np.pi * 200 / 16000).astype(np.float32))
    assert whisper_log_mel(wav).shape == (128, 100)
    fb = kaldi_fbank(wav)
    assert fb.shape == (98, 80) and torch.isfinite(fb).all()
    w24 = resample(wav, 16000, 24000)
    assert w24.shape == (24000,)
    # resampling a 200 Hz tone keeps it (band-limited interpolation)
    want = np.sin(np.arange(24000) * 2 * np.pi * 200 / 24000)
    assert np.abs(w24.numpy()[100:-100] - want[100:-100]).max() < 1e-2
    mel = mel_spectrogram_24k(w24[None]).transpose(1, 2)
    assert mel.shape == (1, 50, 80)
    assert fit_prompt_mel(mel, 30).shape == (1, 60, 80) and torch.equal(
        fit_prompt_mel(mel, 30)[:, -1], mel[:, -1]
    )
    assert fit_prompt_mel(mel, 10).shape == (1, 20, 80)
    v = load_voice(ckpt / "assets" / "token2wav" / "default_voice.safetensors")
    assert v.prompt_tokens.dtype == torch.int64


def test_reference_audio_without_onnx_files_is_a_clear_error(ckpt):
    cache = VoiceCache(ckpt / "assets" / "token2wav")
    with pytest.raises((FileNotFoundError, RuntimeError), match="onnx"):
        cache.from_audio(np.zeros(16000, dtype=np.float32), 16000)


# -- the engine -------------------------------------------------------------------------------


def _run(
    engine: Code2WavEngine, feeds: dict[str, list[tuple[list[int], bool]]], voice
) -> dict[str, np.ndarray]:
    """Open streams, push each stream's pieces one per round, step after each round."""
    for sid in feeds:
        engine.open(sid, voice)
    pieces: dict[str, list[np.ndarray]] = {sid: [] for sid in feeds}
    for rnd in range(max(len(f) for f in feeds.values())):
        for sid, f in feeds.items():
            if rnd < len(f):
                codes, final = f[rnd]
                engine.feed(sid, CodeChunk(sid, tuple(codes), final))
        for chunk in engine.step():
            pieces[chunk.request_id].append(chunk.pcm)
    for sid, pcm in engine.drain().items():
        pieces[sid].extend(pcm)
    return {sid: np.concatenate(p) for sid, p in pieces.items()}


def _feeds(n_streams: int) -> dict[str, list[tuple[list[int], bool]]]:
    return {
        f"s{i}": [
            (_codes(10 + i, 25), False),
            (_codes(20 + i, 25), False),
            (_codes(30 + i, 9), True),
        ]
        for i in range(n_streams)
    }


def test_voice_templates_are_exact_and_isolated(model, voice):
    """A voice's template is built once (its clones are what a fresh build gives, bit for bit)
    and nothing a stream or a handed-out state writes reaches it or another stream."""
    flow, hift, cfg = model
    eng = Code2WavEngine(flow, hift, cfg)
    template = eng.initial_state(voice)  # builds the template
    fresh = eng._build_state(voice)
    assert all(torch.equal(a, b) for a, b in zip(template.flow.tensors(), fresh.flow.tensors()))
    snapshot = [t.clone() for t in eng.templates[voice.key].flow.tensors()]
    out = _run(eng, _feeds(2), voice)
    assert eng.counters["template_builds"] == 1 and eng.counters["template_hits"] == 2
    for t in template.flow.tensors():
        t.add_(1.0)
    for a, b in zip(eng.templates[voice.key].flow.tensors(), snapshot):
        assert torch.equal(a, b)
    s1, s2 = eng.initial_state(voice), eng.initial_state(voice)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(s1.flow.tensors(), s2.flow.tensors()))
    assert len(out["s0"]) == 3840 + 2 * (59 + 3) * 480 and not np.array_equal(out["s0"], out["s1"])


def test_batched_streams_equal_one_at_a_time(model, voice):
    """Three streams in one step each round against the plain path, one stream at a time."""
    flow, hift, cfg = model
    batched = Code2WavEngine(flow, hift, cfg, Code2WavEngineConfig(max_streams=4))
    out_b = _run(batched, _feeds(3), voice)
    out_s = _run(PlainEngine(flow, hift, cfg), _feeds(3), voice)
    assert batched.counters["batch_size_3"] == 3 == batched.counters["batches"]
    assert batched.stats()["capacity"] == 4 and batched.stats()["free_slots"] == 4
    for sid in out_s:
        d = np.abs(out_b[sid] - out_s[sid])
        assert out_b[sid].shape == out_s[sid].shape and d.max() < 1e-4, (
            f"{sid}: max {d.max():.3g} mean {d.mean():.3g}"
        )


def test_batch_sizes_cover_every_count():
    """12 captured sizes at 32 streams; any count of rows is a sum of them, a padded step is
    at most a third larger than its rows."""
    from pipeline.code2wav.engine import batch_sizes, split_sizes

    assert batch_sizes(32) == (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 28, 32)
    assert batch_sizes(4) == (1, 2, 3, 4) and batch_sizes(10) == (1, 2, 3, 4, 6, 8, 10)
    sizes = batch_sizes(32)
    for n in range(1, 33):
        parts = split_sizes(n, sizes)
        assert sum(parts) == n and all(p in sizes for p in parts)
        assert min(b for b in sizes if b >= n) <= max(n + 1, 4 * n / 3)


def test_padded_step_and_split_vocoder_equal_one_at_a_time(model, voice, monkeypatch):
    """Five streams at eight slots: the flow step runs six rows (a padding row on the pool's
    spare slot, speaker zeros) and the vocoder a group of four and one of one; each stream's
    audio is what the plain path gives it alone."""
    flow, hift, cfg = model
    eng = Code2WavEngine(flow, hift, cfg, Code2WavEngineConfig(max_streams=8))
    from pipeline.code2wav import engine as engine_mod

    planned, vocoded = [], []
    plan, vocode_fn = eng.pool.plan, engine_mod.vocode

    def spy_plan(rows, batch=None):
        out = plan(rows, batch)
        planned.append((len(rows), len(out.tokens)))
        return out

    def spy_vocode(hift_, cfg_, states, *a, **k):
        vocoded.append(len(states))
        return vocode_fn(hift_, cfg_, states, *a, **k)

    monkeypatch.setattr(eng.pool, "plan", spy_plan)
    monkeypatch.setattr(engine_mod, "vocode", spy_vocode)
    out_b = _run(eng, _feeds(5), voice)
    assert planned[0] == (5, 6) and sorted(vocoded[:2]) == [1, 4]
    out_s = _run(PlainEngine(flow, hift, cfg), _feeds(5), voice)
    for sid in out_s:
        d = np.abs(out_b[sid] - out_s[sid])
        assert out_b[sid].shape == out_s[sid].shape and d.max() < 1e-4, (sid, d.max())
    assert len(eng.pool.free) == 8


def test_final_flush_and_short_streams(model, voice):
    flow, hift, cfg = model
    eng = Code2WavEngine(flow, hift, cfg)
    out = _run(eng, {"a": [(_codes(1, 2), True)], "b": [(_codes(2, 25), True)]}, voice)
    assert len(out["a"]) == 2 * (2 + 3) * 480 and len(out["b"]) == 2 * 28 * 480


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("streams", [1, 5, 8])
def test_cuda_engine_matches_the_plain_path(ckpt, voice, streams):
    """The engine on CUDA (its captured slot step, vocoder graphs, compiled blocks and
    kernels) against the plain path, finals included: batches of 1, 5 and 8 streams."""
    flow, hift, cfg = load_code2wav(ckpt, "cuda", torch.float32)
    plain = PlainEngine(*load_code2wav(ckpt, "cuda", torch.float32))
    graph = Code2WavEngine(flow, hift, cfg)
    a, b = _run(plain, _feeds(streams), voice), _run(graph, _feeds(streams), voice)
    assert graph.counters["cfm_graph_replays"] > 0 and graph.counters["hift_graph_replays"] > 0
    assert graph.counters[f"batch_size_{streams}"] == 3  # two full chunks and the final one
    for sid in a:
        assert np.abs(a[sid] - b[sid]).max() < 1e-4


def test_hift_noise_drawn_beforehand_is_the_same_draw(model):
    """HiFT's source noise can be drawn before the call (what its CUDA graph is fed): the same
    numbers as drawing inside, per-row generators and global RNG alike."""
    hift = HiFTGenerator(model[2].hift).eval()  # the CosyVoice2 HiFT (the 0.1.1 layout's)
    mel = torch.randn(2, 80, 12, generator=torch.Generator().manual_seed(0))
    cache = torch.randn(2, 1, 960, generator=torch.Generator().manual_seed(1))

    def gens():
        return [torch.Generator().manual_seed(s) for s in (5, 6)]

    inside = hift(mel, cache, gens())
    before = hift(mel, cache, noise=hift.draw_noise(mel, gens()))
    assert all(torch.equal(x, y) for x, y in zip(inside, before))
    torch.manual_seed(3)
    inside = hift(mel, cache)
    torch.manual_seed(3)
    before = hift(mel, cache, noise=hift.draw_noise(mel))
    assert all(torch.equal(x, y) for x, y in zip(inside, before))


def _tiny_onnx_front_ends(folder: Path) -> None:
    """Stand-ins with the real I/O contract: tokenizer (1,128,T)+len -> (1,T/4) codes,
    CAMPPlus (1,T,80) fbank -> (1,192)."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    tok = helper.make_graph(
        [
            helper.make_node("Slice", ["feats", "starts", "ends", "axes", "steps"], ["sl"]),
            helper.make_node("ReduceMean", ["sl", "ax1"], ["m"], keepdims=0),
            helper.make_node("Abs", ["m"], ["a"]),
            helper.make_node("Mul", ["a", "k"], ["s"]),
            helper.make_node("Cast", ["s"], ["i"], to=TensorProto.INT64),
            helper.make_node("Mod", ["i", "vocab"], ["tokens"]),
        ],
        "tok",
        [
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, None]),
            helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1]),
        ],
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, [1, None])],
        [
            numpy_helper.from_array(np.array(v, dtype=np.int64), n)
            for n, v in (
                ("starts", [0]),
                ("ends", [1 << 30]),
                ("axes", [2]),
                ("steps", [4]),
                ("ax1", [1]),
                ("vocab", [6561]),
            )
        ]
        + [numpy_helper.from_array(np.array([1000.0], dtype=np.float32), "k")],
    )
    w = np.random.RandomState(0).randn(80, 192).astype(np.float32)
    spk = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["fbank", "ax"], ["m"], keepdims=0),
            helper.make_node("MatMul", ["m", "w"], ["emb"]),
        ],
        "campplus",
        [helper.make_tensor_value_info("fbank", TensorProto.FLOAT, [1, None, 80])],
        [helper.make_tensor_value_info("emb", TensorProto.FLOAT, [1, 192])],
        [
            numpy_helper.from_array(np.array([1], dtype=np.int64), "ax"),
            numpy_helper.from_array(w, "w"),
        ],
    )
    for graph, name in ((tok, "speech_tokenizer_v2_25hz.onnx"), (spk, "campplus.onnx")):
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        model.ir_version = 9
        onnx.save(model, str(folder / name))


def test_reference_audio_voice_through_onnx_front_ends(ckpt, model, tmp_path):
    pytest.importorskip("onnxruntime")
    folder = _copy_assets(ckpt / "assets" / "token2wav", tmp_path / "assets" / "token2wav")
    (folder / "default_voice.safetensors").unlink()  # force the default voice from the wav
    (tmp_path / "assets" / "HT_ref_audio.wav").write_bytes(
        (ckpt / "assets" / "HT_ref_audio.wav").read_bytes()
    )
    _tiny_onnx_front_ends(folder)
    cache = VoiceCache(folder, capacity=1)
    default = cache.default()
    assert default.prompt_tokens.shape == (1, 25) and default.spk_emb.shape == (1, 192)
    assert default.prompt_mel.shape == (1, 50, 80)
    wav = 0.2 * np.sin(np.arange(36000) * 2 * np.pi * 180 / 24000).astype(np.float32)
    v1 = cache.from_audio(wav, 24000)
    assert cache.from_audio(wav, 24000) is v1  # content-hash hit
    cache.from_audio(wav * 0.5, 24000)
    assert cache.from_audio(wav, 24000) is not v1  # evicted (capacity 1)
    assert v1.prompt_mel.shape[1] == 2 * v1.prompt_tokens.shape[1]
    assert abs(v1.prompt_tokens.shape[1] - 25 * 1.5) <= 1  # 25 Hz codes of 1.5 s
    flow, hift, cfg = model
    eng = Code2WavEngine(flow, hift, cfg, voices=cache)
    eng.open("ref", v1)
    eng.open("default")
    eng.feed("ref", CodeChunk("ref", tuple(_codes(5, 10)), True))
    eng.feed("default", CodeChunk("default", tuple(_codes(5, 10)), True))
    out = eng.drain()
    assert len(np.concatenate(out["ref"])) == len(np.concatenate(out["default"])) == 2 * 13 * 480


def test_kaldi_fbank_matches_kaldi_native_fbank():
    knf = pytest.importorskip("kaldi_native_fbank")
    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0
    opts.frame_opts.samp_freq = 16000
    opts.mel_opts.num_bins = 80
    fb = knf.OnlineFbank(opts)
    wav = (np.random.RandomState(0).randn(12000) * 0.1).astype(np.float32)
    fb.accept_waveform(16000, wav.tolist())
    fb.input_finished()
    ref = np.stack([fb.get_frame(i) for i in range(fb.num_frames_ready)])
    ours = kaldi_fbank(torch.from_numpy(wav)).numpy()
    d = np.abs(ref - ours)
    assert ref.shape == ours.shape and d.max() < 1e-3, f"max {d.max():.3g} mean {d.mean():.3g}"


def test_warmup_runs_full_chunks_per_batch_size_and_changes_nothing(model, voice, monkeypatch):
    from pipeline.code2wav import engine as engine_mod
    from tests.test_code2wav_slots import _EagerGraphs

    monkeypatch.setattr(engine_mod, "WARMUP_CHUNKS", 3)
    flow, hift, cfg = model
    eng = Code2WavEngine(flow, hift, cfg, Code2WavEngineConfig(max_streams=4))
    eng.graphs = runner = _EagerGraphs()
    eng.warmup(voice)
    assert not eng.streams and eng.counters["template_builds"] == 1
    assert len(eng.pool.free) == eng.pool.slots  # the warm-up's slots are back
    assert {b for b, _ in runner.keys} == {1, 2, 3, 4}
    assert eng.counters["batch_size_4"] == 3 and eng.counters["warmup_streams"] == 10
    feed = _feeds(2)
    got = _run(eng, feed, voice)
    ref = _run(Code2WavEngine(flow, hift, cfg), feed, voice)
    assert all(np.abs(got[k] - ref[k]).max() < 1e-5 for k in feed)
    assert eng.counters["template_builds"] == 1  # the streams cloned the warm-up's template


class _EagerVocoder(CausalVocoderGraphs):
    """The vocoder graphs' keys and capture rule on CPU: a key's first `run` records it as
    captured; every call runs the chunk eagerly."""

    def _eligible(self, mel, states):
        return len(states) in self.batch_sizes

    def run(self, key, inputs, fn, example=None):
        if key not in self.graphs:
            self.graphs[key] = None
            self.captures += 1
        self.replays += 1
        return fn(*inputs)


def test_warmup_captures_every_last_chunk_and_later_ones_run_eagerly(model, voice, monkeypatch):
    """A last chunk has any length from the lookahead alone to a full window, in a stream that
    ends in its first chunk or later: the warm-up captures each at batch 1; afterwards a last
    chunk of a key it did not capture (two streams ending alike in one step) runs eagerly
    instead of capturing, and the audio is what the plain path gives."""
    from pipeline.code2wav import engine as engine_mod
    from tests.test_code2wav_slots import _EagerGraphs

    monkeypatch.setattr(engine_mod, "WARMUP_CHUNKS", 1)
    flow, hift, cfg = model
    assert isinstance(hift, CausalHiFT)  # the released layout's vocoder
    eng = Code2WavEngine(flow, hift, cfg, Code2WavEngineConfig(max_streams=3))
    eng.graphs = flows = _EagerGraphs()
    eng.hift_graphs = vocoder = _EagerVocoder(hift, eng.graph_sizes)
    vocoder.capture_last = False  # as the engine sets its own
    before_last = {}
    warm_last = eng._warm_last_chunks

    def warm_last_chunks(v):
        before_last["flows"] = set(flows.keys)
        warm_last(v)

    eng._warm_last_chunks = warm_last_chunks
    eng.warmup(voice)
    assert not eng.streams and len(eng.pool.free) == eng.pool.slots
    assert vocoder.capture_last is False
    lo, window = cfg.pre_lookahead, cfg.chunk_size + cfg.pre_lookahead
    last = [(state, frames) for b, state, frames, is_last in vocoder.graphs if is_last and b == 1]
    states = {state for state, _ in last}
    assert len(states) == 2 and len(last) == 2 * (window - lo + 1)
    for state in states:  # 2 mel frames a code, from the lookahead alone to a full window
        assert sorted(f for s, f in last if s == state) == [2 * k for k in range(lo, window + 1)]
    # a step of streams that all end in their first chunk has a flow window of its own: the
    # warm-up ran one at every graph batch size
    assert {b for b, _ in set(flows.keys) - before_last["flows"]} == {1, 2, 3}

    keys, fallbacks = set(vocoder.graphs), vocoder.fallbacks
    feeds = {"a": [(_codes(1, 30), True)], "b": [(_codes(2, 30), True)],  # a first chunk each
             "c": [([], False), (_codes(3, 25), False), (_codes(4, 12), True)]}  # one step later
    got = _run(eng, feeds, voice)
    assert set(vocoder.graphs) == keys  # nothing captured after the warm-up
    assert vocoder.fallbacks == fallbacks + 1  # a and b's last chunks, one batch of 2
    ref = _run(Code2WavEngine(flow, hift, cfg), feeds, voice)
    assert all(np.abs(got[k] - ref[k]).max() < 1e-5 for k in feeds)


def test_batch_rows_is_a_view_of_consecutive_rows():
    """The vocoder's rows of a step's mel: consecutive rows are a view (no index goes to the
    device, so the host does not wait there for the flow), any others an indexed copy; the
    values are the indexed rows either way."""
    from pipeline.code2wav.engine import batch_rows

    x = torch.randn(5, 3, 4)
    for rows in ([0, 1, 2, 3, 4], [2, 3], [4], [0, 2, 3]):
        got = batch_rows(x, rows)
        assert torch.equal(got, x[rows])
        consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
        assert (got.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()) == consecutive

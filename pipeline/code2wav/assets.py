"""Code2Wav checkpoint files: writing the tiny embedded default, loading a real one strictly.

Layouts (`<checkpoint>/assets/token2wav/`):
  [MU7] minicpmo-utils 1.0.7 (the official demo's; the tiny default's):
    flow.yaml, flow.pt   hyperpyyaml (`!new:cosyvoice2...` tags) + plain state_dict of `Flow`
    config.yaml, hift.pt the causal CosyVoice3 vocoder used for streaming (causal_hift.py)
    hift_original.pt     the CosyVoice2 HiFT, [MU7]'s offline (whole utterance) vocoder
  [SA] stepaudio2-minicpmo 0.1.1 / vLLM-Omni ("cosyvoice2"):
    flow.yaml, flow.pt   as above
    hift.pt              the CosyVoice2 HiFT (keys may carry `generator.`)
and in both speech_tokenizer_v2_25hz.onnx, campplus.onnx (voice front ends, voice.py),
default_voice.safetensors (precomputed default voice, written by the tiny checkpoint) and
`<checkpoint>/assets/HT_ref_audio.wav` (the default voice recording).
`load_code2wav` returns the streaming vocoder the folder holds: `CausalHiFT` when config.yaml
is there, else `HiFTGenerator`.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from pipeline.code2wav.causal_hift import (
    CausalHiFT,
    causal_hift_config_from_yaml,
    causal_hift_config_like,
    causal_hift_yaml_text,
)
from pipeline.code2wav.flow import Flow
from pipeline.code2wav.hift import HiFTGenerator, normalize_hift_keys
from pipeline.code2wav.voice import (
    VoicePrompt,
    fit_prompt_mel,
    mel_spectrogram_24k,
    resample,
    save_voice,
)
from pipeline.config import (
    Code2WavConfig,
    DiTConfig,
    FlowEncoderConfig,
    HiFTConfig,
    code2wav_config_from_yaml,
)


def tiny_code2wav_config() -> Code2WavConfig:
    """Small widths/depths, real mel / rate constants (80 mel, 25 Hz codes, 480 hop, 6561 codes)."""
    return Code2WavConfig(
        input_size=64,
        encoder=FlowEncoderConfig(
            output_size=64, attention_heads=4, linear_units=128, num_blocks=2, num_up_blocks=2
        ),
        dit=DiTConfig(hidden_size=64, depth=2, num_heads=4, head_dim=16),
        hift=HiFTConfig(base_channels=32, f0_predictor_channels=32),
    )


def flow_yaml_text(cfg: Code2WavConfig) -> str:
    e, d, h = cfg.encoder, cfg.dit, cfg.hift
    hift_lines = "\n".join(f"    {k}: {_yaml_value(v)}" for k, v in asdict(h).items())
    return f"""# Code2Wav flow model (Step-Audio2 token2wav layout).
flow: !new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec
    input_size: {cfg.input_size}
    output_size: {cfg.output_size}
    spk_embed_dim: {cfg.spk_embed_dim}
    output_type: 'mel'
    vocab_size: {cfg.vocab_size}
    encoder: !new:cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2
        input_size: {cfg.input_size}
        output_size: {e.output_size}
        input_layer: 'linear'
        pre_lookahead_len: {e.pre_lookahead_len}
        num_blocks: {e.num_blocks}
        num_up_blocks: {e.num_up_blocks}
        up_stride: {e.up_stride}
        up_scale_factor: {e.up_scale_factor}
        attention_heads: {e.attention_heads}
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        key_bias: true
        linear_units: {e.linear_units}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: true
        activation_type: 'swish'
    decoder: !new:cosyvoice2.flow.flow_matching.CausalConditionalCFM
        inference_cfg_rate: {cfg.inference_cfg_rate}
        estimator: !new:cosyvoice2.flow.decoder_dit.DiT
            in_channels: {d.in_channels}
            out_channels: {d.out_channels}
            mlp_ratio: {d.mlp_ratio}
            depth: {d.depth}
            num_heads: {d.num_heads}
            head_dim: {d.head_dim}
            hidden_size: {d.hidden_size}

# HiFT vocoder (released assets hard-code it; this block is optional for the reader).
hift:
{hift_lines}
"""


def _yaml_value(v) -> str:
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_yaml_value(x) for x in v) + "]"
    return repr(v) if isinstance(v, str) else str(v)


def random_code2wav(cfg: Code2WavConfig, seed: int) -> tuple[Flow, HiFTGenerator]:
    """Flow + HiFT with default torch inits drawn from the global RNG forked and seeded with
    `seed` (the caller's RNG is untouched): the tiny checkpoint and full-size benchmarks."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        flow = Flow(cfg)
        hift = HiFTGenerator(cfg.hift)
    return flow.eval(), hift.eval()


def random_vocoder(cfg: Code2WavConfig, seed: int, layout: AssetsLayout) -> torch.nn.Module:
    """The streaming vocoder a layout holds, with seeded random weights (full-size runs
    without a checkpoint): the causal one for [MU7], else the CosyVoice2 HiFT."""
    if layout == "cosyvoice2":
        return random_code2wav(cfg, seed)[1]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 2)
        return CausalHiFT(causal_hift_config_like(cfg.hift)).eval()


def _tone(seconds: float, sr: int) -> np.ndarray:
    t = np.arange(int(seconds * sr)) / sr
    f0 = 150 + 30 * np.sin(2 * np.pi * 2 * t)  # gliding "voice" with two harmonics
    phase = 2 * np.pi * np.cumsum(f0) / sr
    return (0.3 * np.sin(phase) + 0.1 * np.sin(2 * phase)).astype(np.float32)


def _write_wav16(path: Path, wav: np.ndarray, sr: int) -> None:
    """Mono 16-bit PCM WAV with the standard library (no soundfile needed)."""
    import wave

    pcm = (np.clip(wav, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(sr)
        f.writeframes(pcm)


AssetsLayout = Literal["minicpmo-utils-1.0.7", "cosyvoice2"]


def write_token2wav_assets(
    dir: Path, cfg: Code2WavConfig, seed: int, layout: AssetsLayout = "minicpmo-utils-1.0.7"
) -> None:
    """Write a tiny, real-layout `assets/token2wav/` folder into `dir` (= that folder) plus
    `dir/../HT_ref_audio.wav` (1 s synthetic 16 kHz tone). The flow and the CosyVoice2 HiFT
    have the same weights in both layouts (hift.pt or hift_original.pt); the causal vocoder
    (1.0.7 layout) has the HiFT's widths and its own seeded weights."""
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    (dir / "flow.yaml").write_text(flow_yaml_text(cfg))
    flow, hift = random_code2wav(cfg, seed)
    torch.save(flow.state_dict(), dir / "flow.pt")
    if layout == "cosyvoice2":
        torch.save(hift.state_dict(), dir / "hift.pt")
    elif layout == "minicpmo-utils-1.0.7":
        torch.save(hift.state_dict(), dir / "hift_original.pt")
        causal = causal_hift_config_like(cfg.hift)
        (dir / "config.yaml").write_text(causal_hift_yaml_text(causal))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 2)
            vocoder = CausalHiFT(causal)
        # released files are float32 (the F0 predictor runs in float64 once loaded)
        torch.save({k: v.float() for k, v in vocoder.state_dict().items()}, dir / "hift.pt")
    else:
        raise ValueError(
            f"token2wav assets layout {layout!r}: 'minicpmo-utils-1.0.7' or 'cosyvoice2'"
        )
    seconds = 1.0
    _write_wav16(dir.parent / "HT_ref_audio.wav", _tone(seconds, 16000), 16000)
    n_tokens = int(seconds * 25)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (1, n_tokens), generator=gen)
    spk = torch.randn(1, cfg.spk_embed_dim, generator=gen)
    wav24 = resample(torch.from_numpy(_tone(seconds, 16000)), 16000, 24000)
    mel = fit_prompt_mel(mel_spectrogram_24k(wav24[None]).transpose(1, 2), n_tokens)
    save_voice(dir / "default_voice.safetensors", VoicePrompt(tokens, spk, mel))


# ---------------------------------------------------------------------------------------
# Loading


def token2wav_dir(checkpoint_dir: Path) -> Path:
    """Accept the model root or the token2wav folder itself."""
    checkpoint_dir = Path(checkpoint_dir)
    if (checkpoint_dir / "flow.yaml").is_file():
        return checkpoint_dir
    return checkpoint_dir / "assets" / "token2wav"


def check_state_dict(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Strict key and shape check with an error that names every offending tensor."""
    want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    missing = sorted(set(want) - set(got))
    unexpected = sorted(set(got) - set(want))
    misshaped = sorted(
        f"{k}: checkpoint {got[k]} vs model {want[k]}"
        for k in set(want) & set(got)
        if want[k] != got[k]
    )
    if missing or unexpected or misshaped:
        lines = [f"{what} does not match the model:"]
        for label, items in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("mis-shaped", misshaped),
        ):
            if items:
                lines.append(
                    f"  {label} ({len(items)}): "
                    + ", ".join(items[:20])
                    + (" ..." if len(items) > 20 else "")
                )
        raise ValueError("\n".join(lines))


def _is_causal_vocoder(folder: Path, state: dict[str, torch.Tensor]) -> bool:
    if (folder / "config.yaml").is_file() or (folder / "hift_original.pt").is_file():
        return True
    return any("look_right" in k or "causal" in k for k in state)


def load_code2wav(
    checkpoint_dir: Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    noise_seed: int = 0,
) -> tuple[Flow, HiFTGenerator | CausalHiFT, Code2WavConfig]:
    """Build Flow + the streaming vocoder from `assets/token2wav/`, load strictly, move to
    device. The flow runs in `dtype`; the vocoder stays float32 (its phase integration needs
    it; the causal one's F0 predictor float64). The vocoder is `CausalHiFT` for the [MU7]
    layout (config.yaml beside hift.pt), else `HiFTGenerator`; `cfg.hift` describes the
    CosyVoice2 HiFT either way (hift_original.pt in [MU7]), the causal one's is `vocoder.cfg`."""
    folder = token2wav_dir(checkpoint_dir)
    for name in ("flow.yaml", "flow.pt", "hift.pt"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder}: missing {name}")
    cfg = code2wav_config_from_yaml((folder / "flow.yaml").read_text())
    hift_state = normalize_hift_keys(
        torch.load(folder / "hift.pt", map_location="cpu", weights_only=True)
    )
    flow = Flow(cfg, noise_seed=noise_seed)
    flow_state = torch.load(folder / "flow.pt", map_location="cpu", weights_only=True)
    check_state_dict(flow, flow_state, f"{folder}/flow.pt")
    flow.load_state_dict(flow_state, strict=True)
    if _is_causal_vocoder(folder, hift_state):
        if not (folder / "config.yaml").is_file():
            raise FileNotFoundError(
                f"{folder}: hift.pt is the causal CosyVoice3 vocoder (minicpmo-utils 1.0.7 "
                "layout) but config.yaml, which describes it, is missing"
            )
        vocoder = CausalHiFT(causal_hift_config_from_yaml((folder / "config.yaml").read_text()))
        what = f"{folder}/hift.pt (causal vocoder of {folder}/config.yaml)"
        c = vocoder.cfg  # [MU7] load_causal_vocoder / Token2wav refuse anything else
        if (c.sampling_rate, c.hop_length, vocoder.delay) != (cfg.sample_rate, 480, 8):
            raise ValueError(
                f"{folder}/config.yaml: the causal vocoder must be 24 kHz, 480 samples per mel "
                f"frame, 8 frames of delay; got {c.sampling_rate} Hz, {c.hop_length}, "
                f"{vocoder.delay}"
            )
    else:
        vocoder = HiFTGenerator(cfg.hift)
        what = f"{folder}/hift.pt"
    check_state_dict(vocoder, hift_state, what)
    vocoder.load_state_dict(hift_state, strict=True)
    return flow.to(device=device, dtype=dtype).eval(), vocoder.to(device).eval(), cfg


def token2wav_from_source(source, device: torch.device | str = "cpu"
                          ) -> tuple[Flow, HiFTGenerator | CausalHiFT, Code2WavConfig, Path]:
    """A ModelSource's Token2Wav in fp32 (the reference's precision) and the folder its voices
    come from: the checkpoint's files, or for a source without files (random-full) a seeded
    random full-size flow + the causal vocoder as released, with the tiny default's voice."""
    if source.path is None:
        cfg = source.config.code2wav
        flow, _ = random_code2wav(cfg, seed=0)
        vocoder = random_vocoder(cfg, 0, "minicpmo-utils-1.0.7")
        return flow.to(device), vocoder.to(device), cfg, Path(source.tokenizer_dir)
    flow, vocoder, cfg = load_code2wav(source.path, device, torch.float32)
    return flow, vocoder, cfg, Path(source.path)

"""Frozen model configs, read once from a MiniCPM-o 4.5 checkpoint.

Three stages, three configs:
- ThinkerConfig: Qwen3 LLM (top level of config.json) + `vision_config` (NaViT SigLIP)
  + `audio_config` (Whisper encoder) + slicing and pooling fields + special-token ids.
- TalkerConfig: `tts_config` (Llama backbone over 6562 speech-code logits).
- Code2WavConfig: `assets/token2wav/flow.yaml` (flow encoder, DiT, CFM) + HiFT constants.

This module is the single place where HF-config defaults and spellings are resolved
(`rope_theta` vs `rope_parameters`, 2.6-era class defaults, ...). Everything downstream
reads typed fields only.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml


# ---------------------------------------------------------------------------------------
# Special tokens


@dataclass(frozen=True)
class SpecialTokens:
    """Thinker token ids of MiniCPM-o 4.5 (tokenizer_config.json / added_tokens.json)."""

    endoftext: int = 151643  # pad
    im_start: int = 151644
    im_end: int = 151645
    think: int = 151667
    think_end: int = 151668
    image: int = 151669
    image_end: int = 151670
    slice: int = 151679
    slice_end: int = 151680
    image_id: int = 151681
    image_id_end: int = 151682
    unit: int = 151683
    unit_end: int = 151684
    audio_start: int = 151697
    audio: int = 151698
    audio_end: int = 151699
    spk_bos: int = 151700
    spk: int = 151701
    spk_eos: int = 151702
    tts_bos: int = 151703
    tts_eos: int = 151704
    listen: int = 151705
    speak: int = 151706
    interrupt: int = 151707
    turn_eos: int = 151717
    chunk_eos: int = 151718
    chunk_bos: int = 151719
    chunk_tts_bos: int = 151720
    chunk_tts_eos: int = 151721
    tts_pad: int = 151722
    unk: int = 128244  # every multimodal slot is a run of <unk>

    # Token text for each field, as the tokenizer spells it.
    @staticmethod
    def text_of() -> dict[str, str]:
        return dict(
            endoftext="<|endoftext|>", im_start="<|im_start|>", im_end="<|im_end|>",
            think="<think>", think_end="</think>", image="<image>", image_end="</image>",
            slice="<slice>", slice_end="</slice>", image_id="<image_id>",
            image_id_end="</image_id>", unit="<unit>", unit_end="</unit>",
            audio_start="<|audio_start|>", audio="<|audio|>", audio_end="<|audio_end|>",
            spk_bos="<|spk_bos|>", spk="<|spk|>", spk_eos="<|spk_eos|>",
            tts_bos="<|tts_bos|>", tts_eos="<|tts_eos|>", listen="<|listen|>",
            speak="<|speak|>", interrupt="<|interrupt|>", turn_eos="<|turn_eos|>",
            chunk_eos="<|chunk_eos|>", chunk_bos="<|chunk_bos|>",
            chunk_tts_bos="<|chunk_tts_bos|>", chunk_tts_eos="<|chunk_tts_eos|>",
            tts_pad="<|tts_pad|>", unk="<unk>",
        )

    @classmethod
    def from_vocab(cls, token_to_id: dict[str, int]) -> "SpecialTokens":
        """Ids from a tokenizer's vocabulary; a missing token is an error, not a default."""
        ids = {}
        missing = []
        for name, text in cls.text_of().items():
            if text in token_to_id:
                ids[name] = token_to_id[text]
            else:
                missing.append(text)
        if missing:
            raise ValueError(f"tokenizer lacks MiniCPM-o special tokens: {', '.join(missing)}")
        return cls(**ids)

    @property
    def thinker_stop_ids(self) -> tuple[int, ...]:
        """Stage-0 stop ids: the spoken span ends at <|tts_eos|>, the turn at <|im_end|>."""
        return (self.tts_eos, self.im_end)


# ---------------------------------------------------------------------------------------
# Thinker


@dataclass(frozen=True)
class LLMConfig:
    """Qwen3 decoder (QK-norm, GQA, SwiGLU, 1-D RoPE)."""

    vocab_size: int = 151748
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    max_position_embeddings: int = 40960
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False


@dataclass(frozen=True)
class VisionConfig:
    """NaViT SigLIP-so400m/14. `num_hidden_layers` is the count the module is built with;
    `num_layers_run` drops the last one when `drop_vision_last_layer` is set."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_attention_heads: int = 16
    num_hidden_layers: int = 27
    num_layers_run: int = 26
    patch_size: int = 14
    image_size: int = 980
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass(frozen=True)
class AudioConfig:
    """Whisper encoder (pre-LN, k_proj without bias) + MiniCPM projection and pooling."""

    d_model: int = 1024
    encoder_layers: int = 24
    encoder_attention_heads: int = 16
    encoder_ffn_dim: int = 4096
    num_mel_bins: int = 80
    max_source_positions: int = 1500
    activation_function: str = "gelu"
    layer_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads


@dataclass(frozen=True)
class SliceConfig:
    max_slice_nums: int = 9
    patch_size: int = 14
    scale_resolution: int = 448


@dataclass(frozen=True)
class ThinkerConfig:
    llm: LLMConfig = field(default_factory=LLMConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    audio: AudioConfig = field(default_factory=AudioConfig)
    slicing: SliceConfig = field(default_factory=SliceConfig)
    tokens: SpecialTokens = field(default_factory=SpecialTokens)
    query_num: int = 64  # resampler queries = LLM tokens per image slice
    use_image_id: bool = True
    vision_batch_size: int = 16
    audio_pool_step: int = 5
    audio_chunk_length: float = 1.0  # seconds per block of the block-causal audio mask
    drop_vision_last_layer: bool = True

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.tokens.thinker_stop_ids


# ---------------------------------------------------------------------------------------
# Talker


@dataclass(frozen=True)
class TalkerConfig:
    """`tts_config`: a Llama over speech codes, conditioned on Thinker ids + hidden states."""

    llm_dim: int = 4096  # Thinker hidden size fed to projector_semantic
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 20
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    backbone_vocab_size: int = 32000  # tts.model.embed_tokens: allocated, never used
    num_audio_tokens: int = 6562  # 6561 codes + EOS
    num_text_tokens: int = 152064
    num_vq: int = 1
    audio_bos_token_id: int = 151687
    text_eos_token_id: int = 151692
    projector_type: str = "mlp"
    normalize_projected_hidden: bool = True
    condition_type: str = "hidden_text_merge"
    attention_type: str = "sliding_recompute"
    streaming_text_chunk: int = 10
    min_new_tokens: int = 50
    max_new_tokens: int = 2048
    # Sampling (TTSSamplingParams), applied in the reference's order.
    temperature: float = 0.8
    top_p: float = 0.85
    top_k: int = 25
    repetition_penalty: float = 1.05
    repetition_window: int = 16

    @property
    def eos_code(self) -> int:
        return self.num_audio_tokens - 1

    @property
    def num_codes(self) -> int:
        return self.num_audio_tokens - 1


# ---------------------------------------------------------------------------------------
# Code2Wav


@dataclass(frozen=True)
class FlowEncoderConfig:
    """UpsampleConformerEncoderV2."""

    output_size: int = 512
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = 4
    pre_lookahead_len: int = 3
    up_stride: int = 2
    up_scale_factor: int = 2


@dataclass(frozen=True)
class DiTConfig:
    in_channels: int = 320
    out_channels: int = 80
    hidden_size: int = 512
    depth: int = 16
    num_heads: int = 8
    head_dim: int = 64
    mlp_ratio: float = 4.0


@dataclass(frozen=True)
class HiFTConfig:
    """CosyVoice2 HiFTGenerator; the reference hard-codes these (no config file)."""

    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    istft_n_fft: int = 16
    istft_hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    f0_predictor_channels: int = 512

    @property
    def hop_length(self) -> int:
        """Samples per mel frame: prod(upsample_rates) * istft hop = 480 at 24 kHz."""
        n = self.istft_hop_len
        for r in self.upsample_rates:
            n *= r
        return n


@dataclass(frozen=True)
class Code2WavConfig:
    input_size: int = 512
    output_size: int = 80  # mel bins
    spk_embed_dim: int = 192
    vocab_size: int = 6561
    token_mel_ratio: int = 2
    encoder: FlowEncoderConfig = field(default_factory=FlowEncoderConfig)
    dit: DiTConfig = field(default_factory=DiTConfig)
    hift: HiFTConfig = field(default_factory=HiFTConfig)
    inference_cfg_rate: float = 0.7
    n_timesteps: int = 10
    t_scheduler: str = "cosine"
    # Streaming (reference semantics, spec section 3.4).
    chunk_size: int = 25  # codes decoded per chunk = 1 s of audio
    pre_lookahead: int = 3  # codes of lookahead passed with each chunk
    silence_code: int = 4218  # 3 of these prefix each turn
    mel_overlap_frames: int = 8
    sample_rate: int = 24000


# ---------------------------------------------------------------------------------------
# Reading a checkpoint


def _pick(d: dict[str, Any], cls: type, renames: dict[str, str] | None = None) -> dict[str, Any]:
    """Keep the keys of `d` that are fields of dataclass `cls` (after renames)."""
    names = {f for f in cls.__dataclass_fields__}
    out = {}
    for k, v in d.items():
        k = (renames or {}).get(k, k)
        if k in names and v is not None:
            out[k] = tuple(v) if isinstance(v, list) else v
    return out


def _rope_theta(d: dict[str, Any], default: float) -> float:
    # transformers < 5 writes `rope_theta`; 5.x writes `rope_parameters.rope_theta`.
    if d.get("rope_theta") is not None:
        return float(d["rope_theta"])
    params = d.get("rope_parameters") or {}
    return float(params.get("rope_theta", default))


def llm_config_from_hf(d: dict[str, Any]) -> LLMConfig:
    kw = _pick(d, LLMConfig)
    kw.pop("rope_theta", None)
    if kw.get("head_dim") is None and "hidden_size" in kw and "num_attention_heads" in kw:
        kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
    return LLMConfig(**kw, rope_theta=_rope_theta(d, LLMConfig.rope_theta))


def thinker_config_from_hf(d: dict[str, Any], tokens: SpecialTokens | None = None) -> ThinkerConfig:
    vision_d = dict(d.get("vision_config") or {})
    vision_kw = _pick(vision_d, VisionConfig)
    drop_last = bool(d.get("drop_vision_last_layer", True))
    n = vision_kw.get("num_hidden_layers", VisionConfig.num_hidden_layers)
    vision_kw["num_layers_run"] = n - 1 if drop_last else n
    audio_d = dict(d.get("audio_config") or {})
    slice_d = dict(d.get("slice_config") or {})
    top = _pick(d, ThinkerConfig)
    for k in ("llm", "vision", "audio", "slicing", "tokens"):
        top.pop(k, None)
    return ThinkerConfig(
        llm=llm_config_from_hf(d),
        vision=VisionConfig(**vision_kw),
        audio=AudioConfig(**_pick(audio_d, AudioConfig)),
        slicing=SliceConfig(**_pick(slice_d, SliceConfig)),
        tokens=tokens or SpecialTokens(),
        **top,
    )


def talker_config_from_hf(d: dict[str, Any]) -> TalkerConfig:
    tts = dict(d.get("tts_config") or {})
    kw = _pick(tts, TalkerConfig)
    kw.pop("rope_theta", None)
    if "head_dim" not in kw and "hidden_size" in kw and "num_attention_heads" in kw:
        kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
    if "vocab_size" in tts:
        kw["backbone_vocab_size"] = int(tts["vocab_size"])
    return TalkerConfig(**kw, rope_theta=_rope_theta(tts, TalkerConfig.rope_theta))


class _TagTolerantLoader(yaml.SafeLoader):
    """Reads hyperpyyaml files (`!new:module.Class`, `!name:...`, `!ref <x>`) as plain
    mappings: a tagged mapping becomes the mapping with its tag under `_target`."""


def _construct_tagged(loader: yaml.SafeLoader, tag_suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        value = loader.construct_mapping(node, deep=True)
        value["_target"] = tag_suffix
        return value
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


_TagTolerantLoader.add_multi_constructor("!", _construct_tagged)


def _find_mapping(tree: Any, target_suffix: str) -> dict[str, Any] | None:
    """Depth-first search for a mapping whose `_target` ends with `target_suffix`."""
    if isinstance(tree, dict):
        if str(tree.get("_target", "")).endswith(target_suffix):
            return tree
        for v in tree.values():
            found = _find_mapping(v, target_suffix)
            if found is not None:
                return found
    elif isinstance(tree, list):
        for v in tree:
            found = _find_mapping(v, target_suffix)
            if found is not None:
                return found
    return None


def code2wav_config_from_yaml(text: str) -> Code2WavConfig:
    """Parse `flow.yaml` (hyperpyyaml). Only the fields the modules need are read; absent
    sections keep the released values. An optional top-level `hift:` mapping (written by
    the tiny default checkpoint; the released assets hard-code HiFT) overrides HiFTConfig."""
    tree = yaml.load(text, Loader=_TagTolerantLoader) or {}
    flow = tree.get("flow") if isinstance(tree.get("flow"), dict) else tree
    kw = _pick(flow, Code2WavConfig)
    for k in ("encoder", "dit", "hift"):
        kw.pop(k, None)
    enc = flow.get("encoder") if isinstance(flow.get("encoder"), dict) else None
    enc = enc or _find_mapping(tree, "UpsampleConformerEncoderV2") or {}
    decoder = flow.get("decoder") if isinstance(flow.get("decoder"), dict) else {}
    cfm_params = decoder.get("cfm_params") if isinstance(decoder.get("cfm_params"), dict) else {}
    est = decoder.get("estimator") if isinstance(decoder.get("estimator"), dict) else None
    est = est or _find_mapping(tree, "DiT") or {}
    dit_kw = _pick(est, DiTConfig, {"dim": "hidden_size", "hidden_channels": "hidden_size"})
    if "hidden_size" in dit_kw and "num_heads" in dit_kw and "head_dim" not in dit_kw:
        dit_kw["head_dim"] = dit_kw["hidden_size"] // dit_kw["num_heads"]
    # Step-Audio2's CausalConditionalCFM takes `inference_cfg_rate` directly; CosyVoice2's
    # ConditionalCFM nests it under `cfm_params`.
    if "inference_cfg_rate" in decoder:
        kw["inference_cfg_rate"] = float(decoder["inference_cfg_rate"])
    if "inference_cfg_rate" in cfm_params:
        kw["inference_cfg_rate"] = float(cfm_params["inference_cfg_rate"])
    if "t_scheduler" in cfm_params:
        kw["t_scheduler"] = str(cfm_params["t_scheduler"])
    if "pre_lookahead_len" in enc:  # the streaming lookahead is the encoder's
        kw["pre_lookahead"] = int(enc["pre_lookahead_len"])
    if "pre_lookahead_len" in flow:
        kw["pre_lookahead"] = int(flow["pre_lookahead_len"])
    hift_d = tree.get("hift") if isinstance(tree.get("hift"), dict) else {}
    hift_kw = _pick(hift_d, HiFTConfig)
    for k in ("resblock_dilation_sizes", "source_resblock_dilation_sizes"):
        if k in hift_kw:
            hift_kw[k] = tuple(tuple(x) for x in hift_kw[k])
    return Code2WavConfig(
        **kw,
        encoder=FlowEncoderConfig(**_pick(enc, FlowEncoderConfig)),
        dit=DiTConfig(**dit_kw),
        hift=HiFTConfig(**hift_kw),
    )


@dataclass(frozen=True)
class ModelConfig:
    """Everything read from one checkpoint directory."""

    thinker: ThinkerConfig
    talker: TalkerConfig
    code2wav: Code2WavConfig
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{path} is not a MiniCPM-o checkpoint: no config.json")
        d = json.loads(config_file.read_text())
        if str(d.get("version", "")) != "4.5":
            raise ValueError(f"{config_file}: expected MiniCPM-o version 4.5, got {d.get('version')!r}")
        tokens = _tokens_from_dir(path)
        flow_yaml = path / "assets" / "token2wav" / "flow.yaml"
        code2wav = code2wav_config_from_yaml(flow_yaml.read_text()) if flow_yaml.is_file() else Code2WavConfig()
        return cls(
            thinker=thinker_config_from_hf(d, tokens),
            talker=talker_config_from_hf(d),
            code2wav=code2wav,
            raw=d,
        )


def _tokens_from_dir(path: Path) -> SpecialTokens:
    """Special-token ids from `added_tokens.json` (the HF layout), else the released ids."""
    added = path / "added_tokens.json"
    if added.is_file():
        vocab = json.loads(added.read_text())
        vocab.setdefault("<unk>", SpecialTokens.unk)  # <unk> is a base-vocab token
        return SpecialTokens.from_vocab(vocab)
    return SpecialTokens()


def to_dict(cfg: Any) -> dict[str, Any]:
    return asdict(cfg)

"""Checkpoint layout of MiniCPM-o 4.5: the tensor schema, strict loading, and the
embedded default model.

Layout (HF): `config.json`, `model.safetensors.index.json` + shards (or one
`model.safetensors`), tokenizer files, `assets/token2wav/{flow.yaml,flow.pt,hift.pt,...}`.
Safetensors prefixes: `llm.` (Qwen3), `vpm.` (SigLIP), `resampler.`, `apm.` (Whisper),
`audio_projection_layer.`, `tts.` (Talker).

- `thinker_schema(cfg)` / `talker_schema(cfg)`: the exact names and shapes a checkpoint
  must hold, written from the spec (section 4) and checked against our modules in tests.
- `Checkpoint`: reads a directory lazily; `load_part(prefix, schema)` returns a stripped
  state dict after strict key and shape checks that name every bad tensor.
- `RandomWeights`: the same interface, filled with seeded random tensors made directly
  on the target device (full-size benchmarks need no disk).
- `default_checkpoint()`: the tiny random-weight model in exactly the real layout,
  written once into a cache folder and reused.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ModelConfig, SpecialTokens, TalkerConfig, ThinkerConfig
from .config import talker_config_from_hf, thinker_config_from_hf

Schema = dict[str, tuple[int, ...]]

# Every name that may appear in a checkpoint without being used at inference.
OPTIONAL_PATTERNS = (
    "vpm.head.*",  # SigLIP pooling head: MiniCPM uses the sequence output
    "llm.model.rotary_emb.*",
)


class CheckpointError(ValueError):
    """A checkpoint that does not match the expected layout; the message lists tensors."""


# ---------------------------------------------------------------------------------------
# Schema


def llm_schema(cfg: ThinkerConfig) -> Schema:
    c = cfg.llm
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    s: Schema = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        s.update({
            p + "self_attn.q_proj.weight": (q, c.hidden_size),
            p + "self_attn.k_proj.weight": (kv, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, q),
            p + "self_attn.q_norm.weight": (c.head_dim,),
            p + "self_attn.k_norm.weight": (c.head_dim,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
        })
    s["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        s["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return s


def _linear(s: Schema, name: str, out_f: int, in_f: int, bias: bool = True) -> None:
    s[name + ".weight"] = (out_f, in_f)
    if bias:
        s[name + ".bias"] = (out_f,)


def _norm(s: Schema, name: str, dim: int) -> None:
    s[name + ".weight"] = (dim,)
    s[name + ".bias"] = (dim,)


def vision_layer_schema(cfg: ThinkerConfig, i: int) -> Schema:
    v = cfg.vision
    s: Schema = {}
    p = f"encoder.layers.{i}."
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        _linear(s, p + "self_attn." + proj, v.hidden_size, v.hidden_size)
    _norm(s, p + "layer_norm1", v.hidden_size)
    _norm(s, p + "layer_norm2", v.hidden_size)
    _linear(s, p + "mlp.fc1", v.intermediate_size, v.hidden_size)
    _linear(s, p + "mlp.fc2", v.hidden_size, v.intermediate_size)
    return s


def vision_schema(cfg: ThinkerConfig) -> Schema:
    v = cfg.vision
    s: Schema = {
        "embeddings.patch_embedding.weight": (v.hidden_size, v.num_channels, v.patch_size, v.patch_size),
        "embeddings.patch_embedding.bias": (v.hidden_size,),
        "embeddings.position_embedding.weight": (v.num_patches_per_side**2, v.hidden_size),
    }
    for i in range(v.num_layers_run):
        s.update(vision_layer_schema(cfg, i))
    _norm(s, "post_layernorm", v.hidden_size)
    return s


def resampler_schema(cfg: ThinkerConfig) -> Schema:
    d, kv = cfg.llm.hidden_size, cfg.vision.hidden_size
    s: Schema = {"query": (cfg.query_num, d)}
    if kv != d:
        s["kv_proj.weight"] = (d, kv)
    s["attn.in_proj_weight"] = (3 * d, d)
    s["attn.in_proj_bias"] = (3 * d,)
    _linear(s, "attn.out_proj", d, d)
    for n in ("ln_q", "ln_kv", "ln_post"):
        _norm(s, n, d)
    s["proj"] = (d, d)
    return s


def audio_schema(cfg: ThinkerConfig) -> Schema:
    a = cfg.audio
    s: Schema = {
        "conv1.weight": (a.d_model, a.num_mel_bins, 3),
        "conv1.bias": (a.d_model,),
        "conv2.weight": (a.d_model, a.d_model, 3),
        "conv2.bias": (a.d_model,),
        "embed_positions.weight": (a.max_source_positions, a.d_model),
    }
    for i in range(a.encoder_layers):
        p = f"layers.{i}."
        _linear(s, p + "self_attn.q_proj", a.d_model, a.d_model)
        _linear(s, p + "self_attn.k_proj", a.d_model, a.d_model, bias=False)
        _linear(s, p + "self_attn.v_proj", a.d_model, a.d_model)
        _linear(s, p + "self_attn.out_proj", a.d_model, a.d_model)
        _norm(s, p + "self_attn_layer_norm", a.d_model)
        _linear(s, p + "fc1", a.encoder_ffn_dim, a.d_model)
        _linear(s, p + "fc2", a.d_model, a.encoder_ffn_dim)
        _norm(s, p + "final_layer_norm", a.d_model)
    _norm(s, "layer_norm", a.d_model)
    return s


def audio_projection_schema(cfg: ThinkerConfig) -> Schema:
    s: Schema = {}
    _linear(s, "linear1", cfg.llm.hidden_size, cfg.audio.encoder_ffn_dim // 4)
    _linear(s, "linear2", cfg.llm.hidden_size, cfg.llm.hidden_size)
    return s


def talker_schema(cfg: TalkerConfig) -> Schema:
    h = cfg.hidden_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    s: Schema = {
        "emb_text.weight": (cfg.num_text_tokens, h),
        "emb_code.0.weight": (cfg.num_audio_tokens, h),
        "head_code.0.parametrizations.weight.original0": (cfg.num_audio_tokens, 1),
        "head_code.0.parametrizations.weight.original1": (cfg.num_audio_tokens, h),
        "model.embed_tokens.weight": (cfg.backbone_vocab_size, h),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        s.update({
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
    s["model.norm.weight"] = (h,)
    for proj in ("projector_semantic", "projector_spk"):
        _linear(s, proj + ".linear1", h, cfg.llm_dim)
        _linear(s, proj + ".linear2", h, h)
    return s


def thinker_parts(cfg: ThinkerConfig) -> dict[str, Schema]:
    """Prefix -> schema of each Thinker module."""
    return {
        "llm.": llm_schema(cfg),
        "vpm.": vision_schema(cfg),
        "resampler.": resampler_schema(cfg),
        "apm.": audio_schema(cfg),
        "audio_projection_layer.": audio_projection_schema(cfg),
    }


def full_schema(cfg: ModelConfig) -> Schema:
    """Every tensor of the safetensors part of a checkpoint, with its prefix."""
    s: Schema = {}
    for prefix, part in {**thinker_parts(cfg.thinker), "tts.": talker_schema(cfg.talker)}.items():
        s.update({prefix + k: v for k, v in part.items()})
    return s


def optional_patterns(cfg: ThinkerConfig) -> tuple[str, ...]:
    """Names that may be present but are not loaded: the dropped last SigLIP layer(s)."""
    dropped = tuple(
        f"vpm.encoder.layers.{i}.*"
        for i in range(cfg.vision.num_layers_run, cfg.vision.num_hidden_layers)
    )
    return OPTIONAL_PATTERNS + dropped


# ---------------------------------------------------------------------------------------
# Sources of tensors: a checkpoint directory, or random weights


class TensorSource(Protocol):
    def keys(self) -> Iterable[str]: ...
    def shape(self, key: str) -> tuple[int, ...]: ...
    def get(self, key: str, device: torch.device | str, dtype: torch.dtype | None) -> torch.Tensor: ...


class Checkpoint:
    """A checkpoint directory; tensors are read lazily from (sharded) safetensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise CheckpointError(f"{self.path}: not a checkpoint directory (no config.json)")
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif single.is_file():
            with safe_open(str(single), "pt") as f:
                weight_map = {k: single.name for k in f.keys()}
        else:
            raise CheckpointError(
                f"{self.path}: no model.safetensors.index.json or model.safetensors"
            )
        missing_shards = sorted({s for s in weight_map.values() if not (self.path / s).is_file()})
        if missing_shards:
            raise CheckpointError(f"{self.path}: missing shard files: {', '.join(missing_shards)}")
        self.weight_map: dict[str, str] = weight_map
        self._handles: dict[str, object] = {}
        self.config = ModelConfig.from_checkpoint(self.path)

    def _file(self, key: str):
        shard = self.weight_map[key]
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.path / shard), "pt", device="cpu")
        return self._handles[shard]

    def keys(self) -> Iterable[str]:
        return self.weight_map.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._file(key).get_slice(key).get_shape())

    def get(self, key: str, device="cpu", dtype=None) -> torch.Tensor:
        t = self._file(key).get_tensor(key)
        return t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else None)


def _key_seed(seed: int, key: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63)


def init_tensor(key: str, shape: tuple[int, ...], seed: int, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """Seeded random init by name: norms ~1, biases ~0, other weights N(0, 0.02).
    Each tensor has its own generator, so values do not depend on load order."""
    g = torch.Generator(device=device).manual_seed(_key_seed(seed, key))
    leaf = key.rsplit(".", 1)[-1]
    if re.search(r"(norm|ln_q|ln_kv|ln_post|layer_norm\d?)\.weight$", key):
        t = 1.0 + 0.02 * torch.randn(shape, generator=g, device=device)
    elif leaf == "bias" or leaf.endswith("_bias"):
        t = 0.02 * torch.randn(shape, generator=g, device=device)
    else:
        t = 0.02 * torch.randn(shape, generator=g, device=device)
    return t.to(dtype)


class RandomWeights:
    """Seeded random tensors for a schema, made directly on `device` (no disk)."""

    def __init__(self, schema: Schema, seed: int = 0):
        self.schema = schema
        self.seed = seed

    def keys(self) -> Iterable[str]:
        return self.schema.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return self.schema[key]

    def get(self, key: str, device="cpu", dtype=None) -> torch.Tensor:
        dtype = dtype or torch.float32
        if key.endswith("parametrizations.weight.original0"):
            # weight-norm gain = row norms of the direction, so the weight equals v
            v = self.get(key[: -len("0")] + "1", device, torch.float32)
            return v.flatten(1).norm(dim=1).reshape(self.schema[key]).to(dtype)
        return init_tensor(key, self.schema[key], self.seed, device, dtype)


# ---------------------------------------------------------------------------------------
# Strict loading


def check_part(source: TensorSource, prefix: str, schema: Schema, optional: tuple[str, ...] = ()) -> None:
    """Raise CheckpointError naming every missing, unexpected or mis-shaped tensor under
    `prefix`. Names matching `optional` (full names, fnmatch patterns) are ignored."""
    present = {k[len(prefix):] for k in source.keys() if k.startswith(prefix)}
    ignored = {k for k in present if any(fnmatch.fnmatch(prefix + k, p) for p in optional)}
    present -= ignored
    missing = sorted(set(schema) - present)
    unexpected = sorted(present - set(schema))
    bad = []
    for k in sorted(present & set(schema)):
        got = source.shape(prefix + k)
        if tuple(got) != tuple(schema[k]):
            bad.append(f"{prefix}{k}: expected {tuple(schema[k])}, found {tuple(got)}")
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): " + ", ".join(prefix + k for k in missing[:20])
                        + (" ..." if len(missing) > 20 else ""))
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensor(s): " + ", ".join(prefix + k for k in unexpected[:20])
                        + (" ..." if len(unexpected) > 20 else ""))
    if bad:
        problems.append("wrong shape: " + "; ".join(bad[:20]))
    if problems:
        raise CheckpointError(f"checkpoint part {prefix!r} does not match the model: " + " | ".join(problems))


def load_part(
    source: TensorSource,
    prefix: str,
    schema: Schema,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    optional: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """Strictly checked state dict of one module, prefix stripped."""
    check_part(source, prefix, schema, optional)
    return {k: source.get(prefix + k, device, dtype) for k in schema}


def load_into(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """load_state_dict(strict) with an error that names the module and the tensors."""
    result = module.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(
            f"{what}: module and checkpoint disagree: missing in checkpoint "
            f"{result.missing_keys[:20]}, unexpected {result.unexpected_keys[:20]}"
        )


# ---------------------------------------------------------------------------------------
# Writing a checkpoint (the embedded default)

DEFAULT_SEED = 0
LAYOUT_VERSION = 2  # bump when the written layout changes, so caches are rebuilt


def write_checkpoint(path: str | Path, hf_config: dict, seed: int = DEFAULT_SEED,
                     shard_bytes: int = 64 * 2**20, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a random-weight checkpoint in the released layout: config files, tokenizer,
    sharded safetensors + index, and the token2wav assets with a default voice."""
    from .code2wav.assets import tiny_code2wav_config, write_token2wav_assets

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf = dict(hf_config, torch_dtype=str(dtype).removeprefix("torch."))
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    (path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
         "eos_token_id": [151645, 151643], "pad_token_id": 151643}, indent=2))
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"image_feature_size": 64, "max_slice_nums": 9, "scale_resolution": 448, "patch_size": 14,
         "use_image_id": True, "slice_mode": True, "norm_mean": [0.5] * 3, "norm_std": [0.5] * 3,
         "sampling_rate": 16000, "feature_size": 80, "hop_length": 160, "n_fft": 400}, indent=2))
    write_tokenizer(path, vocab_size=hf["vocab_size"])

    thinker = thinker_config_from_hf(hf)
    talker = talker_config_from_hf(hf)
    schema: Schema = {}
    for prefix, part in {**thinker_parts(thinker), "tts.": talker_schema(talker)}.items():
        schema.update({prefix + k: v for k, v in part.items()})
    source = RandomWeights(schema, seed)
    weight_map: dict[str, str] = {}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in schema:
        t = source.get(key, "cpu", dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    total = 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        for k, t in shard.items():
            weight_map[k] = name
            total += t.numel() * t.element_size()
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    write_token2wav_assets(path / "assets" / "token2wav", tiny_code2wav_config(), seed)
    return path


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with the real special tokens at their real ids.

    Ids below the first special id are a small BPE learnt from a fixed text plus
    pronounceable filler words, so every id the (random) model can emit decodes to text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from .tokenizer import qwen2_pre_tokenizer

    specials = {v: k for k, v in SpecialTokens.text_of().items()}  # text -> field
    ids = {text: getattr(SpecialTokens, field) for text, field in specials.items()}
    first_special = min(i for t, i in ids.items() if t != "<unk>")
    # The released vocabulary names every id up to vocab_size - 1; unnamed ones are
    # reserved placeholders (e.g. 151687 `<focus>` that the Talker uses).
    for i in range(first_special, vocab_size):
        if i not in ids.values():
            ids[f"<|reserved_{i}|>"] = i

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = qwen2_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "You are a helpful assistant. Describe the image and the sound, then answer in speech.",
        "The quick brown fox jumps over the lazy dog while the video plays at one frame per second.",
        "What is happening in this clip? Choose A, B, C or D. The answer is",
    ] * 4
    trainer = trainers.BpeTrainer(vocab_size=512, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    n = len(vocab)
    taken = set(vocab)
    unk_id = ids["<unk>"]
    i = n
    while i < first_special:
        if i == unk_id:
            i += 1
            continue
        a, b, c = i % 70, (i // 70) % 70, (i // 4900) % 70
        word = "Ġ" + syllables[a] + syllables[b] + (syllables[c] if i >= 4900 else "")
        word = word if word not in taken else f"{word}{i}"
        vocab[word] = i
        taken.add(word)
        i += 1
    vocab.update(ids)
    spec["added_tokens"] = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for t, i in sorted(ids.items(), key=lambda kv: kv[1])
    ]
    (path / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    (path / "added_tokens.json").write_text(json.dumps(
        {t: i for t, i in sorted(ids.items(), key=lambda kv: kv[1]) if t != "<unk>"}, indent=2))
    (path / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<unk>"}, indent=2))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "model_max_length": 40960, "unk_token": "<unk>",
         "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}, indent=2))


def cache_dir() -> Path:
    return Path(os.environ.get("OMNIRAY_CACHE", Path.home() / ".cache" / "omniray"))


def default_checkpoint(seed: int = DEFAULT_SEED) -> Path:
    """The embedded default: a tiny random-weight checkpoint in the real layout, written
    on first use (atomically: built in a temp dir, then renamed) and reused after."""
    from .presets import tiny_hf_config

    hf = tiny_hf_config()
    digest = hashlib.sha256(json.dumps(hf, sort_keys=True).encode()).hexdigest()[:10]
    target = cache_dir() / f"minicpmo45-tiny-s{seed}-v{LAYOUT_VERSION}-{digest}"
    if (target / ".complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        write_checkpoint(tmp, hf, seed)
        (tmp / ".complete").write_text("ok\n")
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / ".complete").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


@dataclass(frozen=True)
class ModelSource:
    """Where a stage gets its weights: a checkpoint directory, or a random preset."""

    config: ModelConfig
    tensors: TensorSource
    tokenizer_dir: Path  # the checkpoint's own; random presets borrow the tiny default's

    @classmethod
    def open(cls, model: str | Path | None) -> "ModelSource":
        """`None` or "tiny" = the embedded default; "random-full" = full-size random
        weights (made on the device when loaded); else a checkpoint directory."""
        if model in (None, "", "tiny"):
            ckpt = Checkpoint(default_checkpoint())
            return cls(ckpt.config, ckpt, ckpt.path)
        if model == "random-full":
            from .config import code2wav_config_from_yaml
            from .presets import full_hf_config

            hf = full_hf_config()
            cfg = ModelConfig(thinker_config_from_hf(hf), talker_config_from_hf(hf),
                              code2wav_config_from_yaml(""), hf)
            return cls(cfg, RandomWeights(full_schema(cfg), DEFAULT_SEED), default_checkpoint())
        ckpt = Checkpoint(model)
        return cls(ckpt.config, ckpt, ckpt.path)

    @property
    def path(self) -> Path | None:
        return getattr(self.tensors, "path", None)

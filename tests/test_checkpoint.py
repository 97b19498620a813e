"""Config reading, checkpoint schema, strict loading errors, tokenizer and the default."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from pipeline.checkpoint import (
    Checkpoint,
    CheckpointError,
    RandomWeights,
    check_part,
    full_schema,
    llm_schema,
    load_part,
    optional_patterns,
    write_tokenizer,
)
from pipeline.config import (
    ModelConfig,
    SpecialTokens,
    code2wav_config_from_yaml,
    talker_config_from_hf,
    thinker_config_from_hf,
)
from pipeline.presets import full_hf_config, tiny_hf_config
from pipeline.tokenizer import IncrementalDetokenizer, TextTokenizer


def test_full_config_is_the_released_geometry():
    hf = full_hf_config()
    t = thinker_config_from_hf(hf)
    assert (t.llm.hidden_size, t.llm.num_hidden_layers, t.llm.num_key_value_heads) == (4096, 36, 8)
    assert t.vision.num_hidden_layers == 27 and t.vision.num_layers_run == 26
    assert t.audio.d_model == 1024 and t.audio_pool_step == 5
    assert t.stop_ids == (151704, 151645)
    k = talker_config_from_hf(hf)
    assert (k.hidden_size, k.num_hidden_layers, k.head_dim, k.eos_code) == (768, 20, 64, 6561)
    # Parameter count of the safetensors part is about 9.36 B (spec section 4).
    cfg = ModelConfig(t, k, code2wav_config_from_yaml(""))
    n = sum(torch.Size(s).numel() for s in full_schema(cfg).values())
    assert 9.2e9 < n < 9.5e9, n


def test_rope_theta_both_spellings():
    hf = tiny_hf_config()
    hf.pop("rope_theta")
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 123.0}
    assert thinker_config_from_hf(hf).llm.rope_theta == 123.0


def test_flow_yaml_hyperpyyaml_tags_are_read():
    text = """
flow: !new:stepaudio2.cosyvoice2.flow.flow.CausalMaskedDiffWithXvec
    input_size: 512
    output_size: 80
    spk_embed_dim: 192
    vocab_size: 6561
    encoder: !new:stepaudio2.cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2
        output_size: 256
        attention_heads: 4
        num_blocks: 3
    decoder: !new:stepaudio2.cosyvoice2.flow.flow_matching.CausalConditionalCFM
        cfm_params: !new:omegaconf.DictConfig
            content:
                inference_cfg_rate: 0.5
        estimator: !new:stepaudio2.cosyvoice2.flow.decoder_dit.DiT
            in_channels: 320
            out_channels: 80
            depth: 4
            num_heads: 8
            mlp_ratio: 4
"""
    c = code2wav_config_from_yaml(text)
    assert c.encoder.output_size == 256 and c.encoder.num_blocks == 3
    assert c.dit.depth == 4 and c.input_size == 512


def test_tokenizer_special_ids_and_streaming_decode(tmp_path):
    write_tokenizer(tmp_path, vocab_size=151748)
    tok = TextTokenizer.from_dir(tmp_path)
    assert SpecialTokens.from_vocab(tok.vocab) == SpecialTokens()
    ids = tok.encode("<|im_start|>user\nhi<unk><unk><|tts_bos|>")
    assert ids[0] == 151644 and ids[-3:] == [128244, 128244, 151703]
    assert tok.decode(ids) == "<|im_start|>user\nhi<unk><unk><|tts_bos|>"
    # Every id the random model can emit decodes to text.
    assert all(tok.decode([i]) for i in (300, 5000, 128243, 151642))
    text = "héllo 世界, ok"
    det = IncrementalDetokenizer(tok)
    pieces = [det.push([i]) for i in tok.encode(text)] + [det.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_tokenizer_from_vocab_and_merges(tmp_path):
    write_tokenizer(tmp_path, vocab_size=151748)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    (tmp_path / "vocab.json").write_text(json.dumps(spec["model"]["vocab"]))
    merges = spec["model"]["merges"]
    lines = [" ".join(m) if isinstance(m, list) else m for m in merges]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(lines) + "\n")
    (tmp_path / "tokenizer.json").unlink()
    # As released: vocab.json lacks the added tokens; <unk> is only in added_tokens_decoder.
    vocab = {t: i for t, i in spec["model"]["vocab"].items() if i < 151643 and t != "<unk>"}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {"128244": {"content": "<unk>", "special": True}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = TextTokenizer.from_dir(tmp_path)
    assert tok.encode("<|im_end|>the fox")[0] == 151645
    assert SpecialTokens.from_vocab(tok.vocab) == SpecialTokens()


def _tiny_cfg():
    hf = tiny_hf_config()
    return ModelConfig(thinker_config_from_hf(hf), talker_config_from_hf(hf), code2wav_config_from_yaml(""))


def test_strict_check_names_bad_tensors():
    cfg = _tiny_cfg()
    schema = llm_schema(cfg.thinker)
    good = RandomWeights({"llm." + k: v for k, v in schema.items()})
    check_part(good, "llm.", schema)
    bad_schema = {"llm." + k: v for k, v in schema.items()}
    del bad_schema["llm.model.norm.weight"]
    bad_schema["llm.model.extra.weight"] = (3,)
    bad_schema["llm.lm_head.weight"] = (7, 7)
    with pytest.raises(CheckpointError) as e:
        check_part(RandomWeights(bad_schema), "llm.", schema)
    msg = str(e.value)
    assert "missing 1" in msg and "llm.model.norm.weight" in msg
    assert "unexpected 1" in msg and "llm.model.extra.weight" in msg
    assert "llm.lm_head.weight: expected" in msg and "(7, 7)" in msg


def test_dropped_vision_layer_is_optional():
    cfg = _tiny_cfg()
    from pipeline.checkpoint import vision_layer_schema, vision_schema

    s = {"vpm." + k: v for k, v in vision_schema(cfg.thinker).items()}
    last = cfg.thinker.vision.num_layers_run
    s.update({"vpm." + k: v for k, v in vision_layer_schema(cfg.thinker, last).items()})
    with pytest.raises(CheckpointError):
        check_part(RandomWeights(s), "vpm.", vision_schema(cfg.thinker))
    check_part(RandomWeights(s), "vpm.", vision_schema(cfg.thinker), optional_patterns(cfg.thinker))


def test_random_weights_are_deterministic_and_weight_norm_gain_matches():
    cfg = _tiny_cfg()
    schema = full_schema(cfg)
    a, b = RandomWeights(schema, 3), RandomWeights(schema, 3)
    k = "llm.model.layers.1.mlp.up_proj.weight"
    assert torch.equal(a.get(k), b.get(k))
    assert not torch.equal(a.get(k), RandomWeights(schema, 4).get(k))
    g = a.get("tts.head_code.0.parametrizations.weight.original0")
    v = a.get("tts.head_code.0.parametrizations.weight.original1")
    torch.testing.assert_close(torch._weight_norm(v, g, 0), v)


def test_default_checkpoint_layout_and_round_trip(tiny_checkpoint, tmp_path):
    ckpt = Checkpoint(tiny_checkpoint)
    for name in ("config.json", "tokenizer.json", "added_tokens.json", "model.safetensors.index.json",
                 "assets/token2wav/flow.yaml", "assets/token2wav/flow.pt", "assets/token2wav/hift.pt"):
        assert (tiny_checkpoint / name).is_file(), name
    cfg = ckpt.config
    assert set(ckpt.keys()) == set(full_schema(cfg))
    prefixes = {k.split(".")[0] for k in ckpt.keys()}
    assert prefixes == {"llm", "vpm", "resampler", "apm", "audio_projection_layer", "tts"}
    # Values on disk are the seeded random weights (bf16 like the release).
    k = "apm.layers.0.fc1.weight"
    expected = RandomWeights(full_schema(cfg)).get(k, dtype=torch.bfloat16)
    assert torch.equal(ckpt.get(k), expected)
    state = load_part(ckpt, "llm.", llm_schema(cfg.thinker), dtype=torch.float32)
    assert state["lm_head.weight"].dtype == torch.float32

    # A copy with one shard's tensor renamed fails with the tensor's name.
    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["llm.model.norm.weight"]
    from safetensors.torch import load_file

    tensors = load_file(str(bad / shard))
    tensors["llm.model.norm.weightX"] = tensors.pop("llm.model.norm.weight")
    save_file(tensors, str(bad / shard))
    index["weight_map"]["llm.model.norm.weightX"] = index["weight_map"].pop("llm.model.norm.weight")
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="llm.model.norm.weight"):
        load_part(Checkpoint(bad), "llm.", llm_schema(cfg.thinker))


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        Checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config()))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        Checkpoint(tmp_path)

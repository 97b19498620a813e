"""HF `config.json` contents for the two built-in model sizes.

- `tiny_hf_config()`: the embedded default, a MiniCPM-o-shaped model small enough for CPU
  tests (real vocab sizes and token ids, tiny widths and depths).
- `full_hf_config()`: the released MiniCPM-o 4.5 geometry, for random-weight benchmarks.

Both are plain dicts in the released `config.json` layout, so they go through the same
`ModelConfig` reader as a real checkpoint.
"""

from __future__ import annotations

from typing import Any


def full_hf_config() -> dict[str, Any]:
    return {
        "architectures": ["MiniCPMO"],
        "model_type": "minicpmo",
        "version": "4.5",
        "vocab_size": 151748,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "query_num": 64,
        "image_size": 448,
        "patch_size": 14,
        "drop_vision_last_layer": True,
        "batch_vision_input": True,
        "use_image_id": True,
        "vision_batch_size": 16,
        "audio_pool_step": 5,
        "audio_chunk_length": 1.0,
        "slice_config": {"max_slice_nums": 9, "patch_size": 14, "scale_resolution": 448},
        "vision_config": {
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_attention_heads": 16,
            "num_hidden_layers": 27,
            "patch_size": 14,
            "image_size": 980,
            "num_channels": 3,
            "layer_norm_eps": 1e-6,
            "hidden_act": "gelu_pytorch_tanh",
            "model_type": "siglip_vision_model",
        },
        "audio_config": {
            "d_model": 1024,
            "encoder_layers": 24,
            "encoder_attention_heads": 16,
            "encoder_ffn_dim": 4096,
            "num_mel_bins": 80,
            "max_source_positions": 1500,
            "activation_function": "gelu",
            "model_type": "whisper",
        },
        "tts_config": {
            "llm_dim": 4096,
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 20,
            "num_attention_heads": 12,
            "num_key_value_heads": 12,
            "max_position_embeddings": 4096,
            "num_audio_tokens": 6562,
            "num_text_tokens": 152064,
            "num_vq": 1,
            "audio_bos_token_id": 151687,
            "text_eos_token_id": 151692,
            "backbone_model": "llama",
            "condition_type": "hidden_text_merge",
            "normalize_projected_hidden": True,
            "projector_type": "mlp",
            "attention_type": "sliding_recompute",
            "model_type": "minicpmtts",
        },
    }


def tiny_hf_config() -> dict[str, Any]:
    """Real vocabularies and ids, tiny everything else. The LLM hidden size stays a
    multiple of 128 because the resampler uses hidden // 128 heads."""
    d = full_hf_config()
    d.update(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=8192,
        torch_dtype="float32",
    )
    d["vision_config"].update(
        hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=3
    )
    d["audio_config"].update(
        d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=128
    )
    d["tts_config"].update(
        llm_dim=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        # random codes rarely draw EOS: a short cap keeps a spoken answer a few seconds
        max_new_tokens=30,
    )
    return d

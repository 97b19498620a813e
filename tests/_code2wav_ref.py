"""Import helper for the PyPI reference (`stepaudio2-minicpmo==0.1.1`, installed --no-deps).

Stubs the top `stepaudio2` package so its __init__ (token2wav -> torchaudio, s3tokenizer) does not
run; imports only the flow / DiT / HiFT submodules, which are plain torch (+ einops, scipy)."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types


def load_reference():
    """Returns a namespace with the reference modules, or None when not installed."""
    spec = importlib.util.find_spec("stepaudio2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for dep in ("einops", "scipy"):
        if importlib.util.find_spec(dep) is None:
            return None
    if "stepaudio2" not in sys.modules or not getattr(
        sys.modules["stepaudio2"], "_omniray_stub", False
    ):
        pkg = types.ModuleType("stepaudio2")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg._omniray_stub = True
        sys.modules["stepaudio2"] = pkg
    ns = types.SimpleNamespace()
    # flow_matching.py imports onnxruntime without using it: stub it only while importing.
    stub_ort = importlib.util.find_spec("onnxruntime") is None
    if stub_ort:
        import torch._dynamo  # noqa: F401  (imported by the encoder; it inspects sys.modules)

        stub = types.ModuleType("onnxruntime")
        stub.__spec__ = importlib.machinery.ModuleSpec("onnxruntime", None)
        sys.modules["onnxruntime"] = stub
    try:
        _import_all(ns)
    finally:
        if stub_ort:
            sys.modules.pop("onnxruntime", None)
    return ns


def _import_all(ns):
    ns.flow = importlib.import_module("stepaudio2.cosyvoice2.flow.flow")
    ns.fm = importlib.import_module("stepaudio2.cosyvoice2.flow.flow_matching")
    ns.dit = importlib.import_module("stepaudio2.cosyvoice2.flow.decoder_dit")
    ns.enc = importlib.import_module("stepaudio2.cosyvoice2.transformer.upsample_encoder_v2")
    ns.hift = importlib.import_module("stepaudio2.flashcosyvoice.modules.hifigan")


def build_reference_flow(ref, cfg):
    """The reference CausalMaskedDiffWithXvec built from our Code2WavConfig."""
    e, d = cfg.encoder, cfg.dit
    encoder = ref.enc.UpsampleConformerEncoderV2(
        input_size=cfg.input_size,
        output_size=e.output_size,
        pre_lookahead_len=e.pre_lookahead_len,
        num_blocks=e.num_blocks,
        num_up_blocks=e.num_up_blocks,
        up_stride=e.up_stride,
        up_scale_factor=e.up_scale_factor,
        attention_heads=e.attention_heads,
        linear_units=e.linear_units,
    )
    dit = ref.dit.DiT(
        in_channels=d.in_channels,
        out_channels=d.out_channels,
        mlp_ratio=d.mlp_ratio,
        depth=d.depth,
        num_heads=d.num_heads,
        head_dim=d.head_dim,
        hidden_size=d.hidden_size,
    )
    cfm = ref.fm.CausalConditionalCFM(dit, inference_cfg_rate=cfg.inference_cfg_rate)
    return ref.flow.CausalMaskedDiffWithXvec(
        input_size=cfg.input_size,
        output_size=cfg.output_size,
        spk_embed_dim=cfg.spk_embed_dim,
        vocab_size=cfg.vocab_size,
        encoder=encoder,
        decoder=cfm,
    ).eval()


def build_reference_hift(ref, h):
    return ref.hift.HiFTGenerator(
        in_channels=h.in_channels,
        base_channels=h.base_channels,
        nb_harmonics=h.nb_harmonics,
        sampling_rate=h.sampling_rate,
        nsf_alpha=h.nsf_alpha,
        nsf_sigma=h.nsf_sigma,
        nsf_voiced_threshold=h.nsf_voiced_threshold,
        upsample_rates=list(h.upsample_rates),
        upsample_kernel_sizes=list(h.upsample_kernel_sizes),
        istft_params={"n_fft": h.istft_n_fft, "hop_len": h.istft_hop_len},
        resblock_kernel_sizes=list(h.resblock_kernel_sizes),
        resblock_dilation_sizes=[list(x) for x in h.resblock_dilation_sizes],
        source_resblock_kernel_sizes=list(h.source_resblock_kernel_sizes),
        source_resblock_dilation_sizes=[list(x) for x in h.source_resblock_dilation_sizes],
        lrelu_slope=h.lrelu_slope,
        audio_limit=h.audio_limit,
        f0_predictor=ref.hift.ConvRNNF0Predictor(
            in_channels=h.in_channels, cond_channels=h.f0_predictor_channels
        ),
    ).eval()

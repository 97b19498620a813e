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
        # a spec, so that find_spec on a second call (another test module) still works
        pkg.__spec__ = importlib.machinery.ModuleSpec("stepaudio2", None, is_package=True)
        pkg.__spec__.submodule_search_locations = pkg.__path__
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


def hift_kwargs(h) -> dict:
    """The constructor arguments both reference vocoders (CosyVoice2 HiFTGenerator and
    CosyVoice3 CausalHiFTGenerator) take from a HiFTConfig."""
    return dict(  # noqa: C408 (keyword names, as the constructors spell them)
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
    )


def build_reference_hift(ref, h):
    return ref.hift.HiFTGenerator(
        **hift_kwargs(h),
        f0_predictor=ref.hift.ConvRNNF0Predictor(
            in_channels=h.in_channels, cond_channels=h.f0_predictor_channels
        ),
    ).eval()


# ---------------------------------------------------------------------------------------
# minicpmo-utils 1.0.7 (the official demo's pin). It installs a top-level `stepaudio2` too,
# so it cannot sit beside 0.1.1 in site-packages: it is installed with
#   pip install --no-deps --target <dir> minicpmo-utils==1.0.7
# into <dir> = $OMNIRAY_MINICPMO_UTILS, <cache_dir()>/minicpmo-utils-1.0.7 or
# <repo>/.cache/minicpmo-utils-1.0.7 (never put on sys.path), and its modules are imported
# under their own names with sys.modules swapped for the duration (`Mu7.active`).

MU7_VERSION = "1.0.7"
_MU7_MODULES = (
    "causal_vocoder.generator",
    "causal_vocoder.f0_predictor",
    "causal_vocoder.bounded_vocoder",
    "cosyvoice2.flow.flow",
    "cosyvoice2.flow.flow_matching",
    "cosyvoice2.flow.decoder_dit",
    "cosyvoice2.transformer.upsample_encoder_v2",
    "flashcosyvoice.modules.hifigan",
    "token2wav",
)


def mu7_root():
    """The --target folder holding minicpmo-utils 1.0.7, or None."""
    import os
    from pathlib import Path

    from pipeline.checkpoint import cache_dir

    repo = Path(__file__).resolve().parents[1]
    candidates = [os.environ.get("OMNIRAY_MINICPMO_UTILS")]
    candidates += [cache_dir() / "minicpmo-utils-1.0.7", repo / ".cache" / "minicpmo-utils-1.0.7"]
    for c in candidates:
        if c and (Path(c) / f"minicpmo_utils-{MU7_VERSION}.dist-info").is_dir():
            return Path(c)
    return None


class Mu7(types.SimpleNamespace):
    """The 1.0.7 modules (attributes named like `_MU7_MODULES`' last parts) and `active()`,
    which puts them back in sys.modules as `stepaudio2.*` (hyperpyyaml resolves its `!new:`
    tags by module name) and restores whatever was there after."""

    def active(self):
        import contextlib

        @contextlib.contextmanager
        def swap():
            saved = _pop_modules("stepaudio2")
            sys.modules.update(self.modules)
            try:
                yield self
            finally:
                _pop_modules("stepaudio2")
                sys.modules.update(saved)

        return swap()


def _pop_modules(prefix: str) -> dict:
    names = [n for n in sys.modules if n == prefix or n.startswith(prefix + ".")]
    return {n: sys.modules.pop(n) for n in names}


def _stub(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__dict__.update(attrs)
    return mod


def _have(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # e.g. sys.modules[name] is None: blocked
        return False


def _unavailable(*_a, **_k):
    raise RuntimeError("stubbed out by tests/_code2wav_ref.py (not needed on this path)")


def load_reference_mu7():
    """Returns a `Mu7` namespace with the 1.0.7 modules, or None when not installed."""
    root = mu7_root()
    if root is None:
        return None
    for dep in ("einops", "scipy", "yaml"):
        if not _have(dep):
            return None
    import torch._dynamo  # noqa: F401  (the encoder imports it; it inspects sys.modules)

    # Only what the prompt front end (never called here) and the package __init__ need.
    stubs = {}
    if not _have("torchaudio"):
        kaldi = _stub("torchaudio.compliance.kaldi", fbank=_unavailable)
        compliance = _stub("torchaudio.compliance", kaldi=kaldi)
        stubs.update(
            {
                "torchaudio": _stub(
                    "torchaudio",
                    compliance=compliance,
                    load=_unavailable,
                    save=_unavailable,
                    transforms=None,
                ),
                "torchaudio.compliance": compliance,
                "torchaudio.compliance.kaldi": kaldi,
            }
        )
    if not _have("s3tokenizer"):
        stubs["s3tokenizer"] = _stub("s3tokenizer", load_model=_unavailable)
    for name in ("onnxruntime", "librosa"):
        if not _have(name):
            stubs[name] = _stub(name)
    if "librosa" in stubs:
        filters = _stub("librosa.filters", mel=_unavailable)
        stubs["librosa"].filters = filters
        stubs["librosa.filters"] = filters
    if not _have("hyperpyyaml"):
        stubs["hyperpyyaml"] = _stub("hyperpyyaml", load_hyperpyyaml=_unavailable)
    saved = _pop_modules("stepaudio2")
    added = {n: m for n, m in stubs.items() if sys.modules.get(n) is None}
    before = {n: sys.modules[n] for n in added if n in sys.modules}  # None = blocked
    sys.modules.update(added)
    pkg = types.ModuleType("stepaudio2")  # skips the package __init__
    pkg.__path__ = [str(root / "stepaudio2")]
    sys.modules["stepaudio2"] = pkg
    ns = Mu7(root=root, has_hyperpyyaml="hyperpyyaml" not in stubs)
    try:
        for name in _MU7_MODULES:
            setattr(ns, name.rsplit(".", 1)[-1], importlib.import_module(f"stepaudio2.{name}"))
        ns.modules = _pop_modules("stepaudio2")
        # the names `load_reference` uses, so build_reference_flow / _hift take either
        ns.enc, ns.dit, ns.fm = ns.upsample_encoder_v2, ns.decoder_dit, ns.flow_matching
        ns.hift = ns.hifigan
    finally:
        _pop_modules("stepaudio2")
        sys.modules.update(saved)
        for n in added:
            sys.modules.pop(n, None)
        sys.modules.update(before)
    return ns

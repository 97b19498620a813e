"""Loads the official demo's `MiniCPMODuplex` on a checkpoint in the tiny layout, on CPU in
float32 with eager attention, for the duplex golden files and for side-by-side debugging.

The demo's `MiniCPMO45/` is imported from its checkout (a path; nothing of it is copied into
this project) as the package `minicpmo45_ref`. What is changed at load time, and why:

- transformers 4.51.0 (the demo's pin) from its own --target folder, first on sys.path: the
  demo reads `DynamicCache.key_cache`, gone from transformers 5 (with its tokenizers and
  hub pins, and accelerate, which its from_pretrained needs). `INSTALL_HINT` says how to
  install it: `$OMNIRAY_REF_TRANSFORMERS`, `<omniray cache>/transformers-4.51.0` or
  `<repo>/.cache/transformers-4.51.0`. It must be loaded before anything imports transformers.
- A "reference view" of the checkpoint (a folder of links in the cache plus the two files
  the demo's Auto classes read: tokenizer_config.json naming `MiniCPMOTokenizerFast`, and
  preprocessor_config.json naming the processor classes) and the demo's config, tokenizer,
  image and audio processor classes registered with the Auto classes (no remote code).
- `MiniCPMODuplex.__init__` casts the model to bfloat16: kept in float32 (the cast is skipped
  during construction; every parameter is then checked equal to the checkpoint's tensor).
  `attn_implementation="eager"` and `device="cpu"` are passed as the demo's own arguments.
- `MiniCPMO.init_tts(streaming=True)` builds `stepaudio2.Token2wav` (minicpmo-utils 1.0.7),
  whose __init__ is CUDA-only and loads the ONNX prompt front ends: the same class is built
  on CPU around the checkpoint's flow.yaml/flow.pt and config.yaml/hift.pt, with the
  package's DiT streaming scratch buffers sized for this DiT, its flow noise set to
  omniray's (`CausalCFM`'s seeded draw) and its vocoder's uniform source-noise table set to
  `tests/_duplex_ckpt.vocoder_noise_table()` (the package draws both from the global RNG at
  build). The voice prompt (speech tokens, x-vector, mel) comes from the checkpoint's
  `assets/token2wav/default_voice.safetensors` under the name `duplex.omniray_prompt_wav`:
  pass that as `prepare(prompt_wav_path=...)`.
- With `talker_argmax=True` (the default here), the Talker's `generate_chunk` takes the
  argmax of its (temperature-scaled, repetition-penalised) distribution instead of
  `torch.multinomial`: the reference has no switch for it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

TRANSFORMERS_VERSION = "4.51.0"
PACKAGE = "minicpmo45_ref"
_HERE = Path(__file__).resolve()


def _repo_root() -> Path | None:
    for p in _HERE.parents:
        if (p / "pipeline" / "checkpoint.py").is_file() and (p / "tests").is_dir():
            return p
    try:
        import pipeline

        return Path(pipeline.__file__).resolve().parents[1]
    except ImportError:
        return None


def _cache_dir() -> Path:
    from pipeline.checkpoint import cache_dir

    return cache_dir()


def transformers_candidates() -> list[Path]:
    out = []
    if os.environ.get("OMNIRAY_REF_TRANSFORMERS"):
        out.append(Path(os.environ["OMNIRAY_REF_TRANSFORMERS"]))
    out.append(_cache_dir() / f"transformers-{TRANSFORMERS_VERSION}")
    root = _repo_root()
    if root is not None:
        out.append(root / ".cache" / f"transformers-{TRANSFORMERS_VERSION}")
    out.append(_HERE.parent / "site-tf451")  # beside a published copy of this file
    return out


INSTALL_HINT = (
    f"pip install --no-deps --target .cache/transformers-{TRANSFORMERS_VERSION} "
    f"transformers=={TRANSFORMERS_VERSION} tokenizers==0.21.1 huggingface_hub==0.30.2 "
    f"accelerate==1.12.0 psutil"
)


def ensure_transformers() -> Path:
    """Puts the transformers 4.51.0 folder first on sys.path (before transformers loads)."""
    for c in transformers_candidates():
        if (c / f"transformers-{TRANSFORMERS_VERSION}.dist-info").is_dir():
            site = c
            break
    else:
        raise RuntimeError(
            f"the demo needs transformers {TRANSFORMERS_VERSION} in its own folder: {INSTALL_HINT} "
            f"(or set OMNIRAY_REF_TRANSFORMERS)"
        )
    if "transformers" in sys.modules:
        import transformers

        if transformers.__version__ != TRANSFORMERS_VERSION:
            raise RuntimeError(
                f"transformers {transformers.__version__} is already imported; load the "
                f"reference (or call ensure_transformers()) before anything imports transformers"
            )
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    return site


def demo_commit(demo_dir: str | Path) -> str | None:
    """The checkout's HEAD commit (a work tree or a bare mirror), or None."""
    import subprocess

    d = Path(demo_dir)
    try:
        return subprocess.run(
            ["git", "-C", str(d), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def materialize_demo(demo_dir: str | Path) -> Path:
    """The folder holding MiniCPMO45/*.py: `demo_dir` itself when it is a checkout, else
    (a bare mirror, as `fetch` gives) the files of its HEAD written to the cache, by commit."""
    d = Path(demo_dir)
    if (d / "MiniCPMO45" / "modeling_minicpmo.py").is_file():
        return d / "MiniCPMO45"
    if (d / "modeling_minicpmo.py").is_file():
        return d
    import subprocess

    commit = demo_commit(d)
    if commit is None:
        raise FileNotFoundError(f"{d}: neither a demo checkout nor a git mirror of one")
    out = _cache_dir() / f"minicpmo45-demo-{commit[:12]}" / "MiniCPMO45"
    if not (out / ".complete").is_file():
        out.mkdir(parents=True, exist_ok=True)
        names = subprocess.run(
            ["git", "-C", str(d), "ls-tree", "--name-only", "HEAD", "MiniCPMO45/"],
            capture_output=True, text=True, check=True,
        ).stdout.split()
        for name in names:
            if name.endswith(".py"):
                blob = subprocess.run(
                    ["git", "-C", str(d), "show", f"HEAD:{name}"], capture_output=True, check=True
                ).stdout
                (out / Path(name).name).write_bytes(blob)
        (out / ".complete").write_text(commit + "\n")
    return out


def import_demo(demo_dir: str | Path) -> types.SimpleNamespace:
    """The demo's MiniCPMO45 modules, imported as package `minicpmo45_ref`."""
    ensure_transformers()
    src = materialize_demo(demo_dir)
    pkg = sys.modules.get(PACKAGE)
    if pkg is not None and list(pkg.__path__) != [str(src)]:
        raise RuntimeError(f"{PACKAGE} already imported from {list(pkg.__path__)}, not {src}")
    if pkg is None:
        pkg = types.ModuleType(PACKAGE)
        pkg.__path__ = [str(src)]
        pkg.__spec__ = importlib.machinery.ModuleSpec(PACKAGE, None, is_package=True)
        pkg.__spec__.submodule_search_locations = pkg.__path__
        sys.modules[PACKAGE] = pkg
    ns = types.SimpleNamespace(src=src)
    for name in ("configuration_minicpmo", "tokenization_minicpmo_fast", "processing_minicpmo",
                 "utils", "modeling_minicpmo"):
        setattr(ns, name.split("_")[0], importlib.import_module(f"{PACKAGE}.{name}"))
    _register_auto(ns)
    return ns


_REGISTERED = False


def _register_auto(ns) -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AutoConfig, AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer

    cfg_cls = ns.configuration.MiniCPMOConfig
    AutoConfig.register("minicpmo", cfg_cls, exist_ok=True)
    AutoTokenizer.register(cfg_cls, fast_tokenizer_class=ns.tokenization.MiniCPMOTokenizerFast,
                           exist_ok=True)
    AutoFeatureExtractor.register(cfg_cls, ns.processing.MiniCPMAAudioProcessor, exist_ok=True)
    AutoImageProcessor.register(
        cfg_cls, slow_image_processor_class=ns.processing.MiniCPMVImageProcessor, exist_ok=True)
    _REGISTERED = True


# ---------------------------------------------------------------------------------------
# The checkpoint as the demo's loaders read it


def reference_view(ckpt_dir: str | Path) -> Path:
    """A folder of links to `ckpt_dir`'s files plus the demo's tokenizer / processor configs."""
    ckpt = Path(ckpt_dir).resolve()
    view = _cache_dir() / "duplex-ref-views" / ckpt.name
    marker = view / ".view"
    if marker.is_file() and marker.read_text() == str(ckpt):
        return view
    view.mkdir(parents=True, exist_ok=True)
    own = {"tokenizer_config.json", "preprocessor_config.json", ".view"}
    for p in ckpt.iterdir():
        if p.name in own or p.name.startswith("."):
            continue
        link = view / p.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(p)
    tok = json.loads((ckpt / "tokenizer_config.json").read_text())
    tok["tokenizer_class"] = "MiniCPMOTokenizerFast"
    (view / "tokenizer_config.json").write_text(json.dumps(tok, indent=2))
    pre = json.loads((ckpt / "preprocessor_config.json").read_text())
    pre.update({
        "image_processor_type": "MiniCPMVImageProcessor",
        "feature_extractor_type": "MiniCPMAAudioProcessor",
        "processor_class": "MiniCPMOProcessor",
        "im_start": "<image>", "im_end": "</image>", "slice_start": "<slice>",
        "slice_end": "</slice>", "unk": "<unk>", "im_id_start": "<image_id>",
        "im_id_end": "</image_id>", "audio_pool_step": 5, "version": 4.5,
    })
    (view / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    marker.write_text(str(ckpt))
    return view


# ---------------------------------------------------------------------------------------
# Token2wav (minicpmo-utils 1.0.7) on CPU


def duplex_ckpt_module():
    """tests/_duplex_ckpt.py: beside this file's folder in the repo, or beside this file in
    a published copy."""
    name = "_omniray_duplex_ckpt"
    if name in sys.modules:
        return sys.modules[name]
    for path in (_HERE.parents[1] / "_duplex_ckpt.py", _HERE.parent / "_duplex_ckpt.py"):
        if path.is_file():
            spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
            return mod
    raise FileNotFoundError("tests/_duplex_ckpt.py not found beside " + str(_HERE))


def _repo_on_path() -> None:
    root = _repo_root()
    if root is not None and str(root) not in sys.path:
        sys.path.append(str(root))


def _mu7():
    _repo_on_path()
    from tests._code2wav_ref import load_reference_mu7

    mu7 = load_reference_mu7()
    if mu7 is None:
        raise RuntimeError(
            "minicpmo-utils 1.0.7 not found: pip install --no-deps --target "
            ".cache/minicpmo-utils-1.0.7 minicpmo-utils==1.0.7"
        )
    return mu7


def build_token2wav(token2wav_dir: Path, float16: bool = False, n_timesteps: int = 10):
    """The package's `Token2wav` as its __init__ builds it, on CPU (see the module doc)."""
    import torch

    from pipeline.code2wav.flow import NOISE_FRAMES

    mu7 = _mu7()
    cls = mu7.token2wav.Token2wav
    folder = Path(token2wav_dir)
    with mu7.active():
        flow = mu7.token2wav._load_config(folder / "flow.yaml")["flow"]
        hift, ckpt_path, cfg_path = mu7.token2wav.load_causal_vocoder(folder, "cpu")
    if float16:
        flow.half()
    flow.load_state_dict(torch.load(folder / "flow.pt", map_location="cpu", weights_only=True),
                         strict=True)
    flow.eval()
    _resize_dit_buffers(flow)
    dc = duplex_ckpt_module()
    flow_noise, vocoder_noise_table = dc.flow_noise, dc.vocoder_noise_table

    flow.decoder.rand_noise = flow_noise(flow.decoder.rand_noise.shape[1], NOISE_FRAMES).to(
        flow.decoder.rand_noise.dtype)
    hift.m_source.l_sin_gen.sine_waves = vocoder_noise_table().unsqueeze(0)
    t2w = cls.__new__(cls)
    t2w.float16, t2w.n_timesteps, t2w.device = float16, int(n_timesteps), torch.device("cpu")
    t2w.model_path = folder
    t2w.flow, t2w.hift = flow, hift
    t2w.vocoder_checkpoint, t2w.vocoder_config = ckpt_path, cfg_path
    t2w.bounded_vocoder = mu7.bounded_vocoder.BoundedVocoder(hift)
    t2w.sample_rate, t2w.hop_samples = 24000, 480
    t2w.vocoder_delay_frames = (hift.f0_predictor.condnet[0].causal_padding
                                + hift.conv_pre_look_right + 1)
    t2w.vocoder_delay_samples = t2w.vocoder_delay_frames * t2w.hop_samples
    t2w.source_cache_len = t2w.vocoder_delay_samples
    t2w.original_vocoder_checkpoint = folder / "hift_original.pt"
    t2w.original_hift = None
    t2w.cache, t2w.stream_cache, t2w.hift_cache_dict, t2w._stream_prompt = {}, None, {}, None
    t2w._omniray_mu7 = mu7
    # Its streaming encoder is torch.compile'd: run eager (Dynamo would look the package up
    # under its top-level name, which is 0.1.1's in site-packages), with the 1.0.7 modules
    # in sys.modules while it runs.
    for name in ("set_stream_cache", "stream"):
        setattr(t2w, name, _eager(mu7, getattr(t2w, name)))
    return t2w


def _eager(mu7, fn):
    import functools

    import torch._dynamo

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with mu7.active(), torch._dynamo.config.patch(disable=True):
            return fn(*args, **kwargs)

    return run


def _resize_dit_buffers(flow) -> None:
    """The package's streaming scratch buffers fit the released DiT only (16 steps x 16 blocks
    x 8 heads x 64): give them this DiT's sizes (they hold values, no weights)."""
    import torch

    est = flow.decoder.estimator
    attn = est.blocks[0].attn
    depth, heads, head_dim = len(est.blocks), attn.num_heads, attn.head_dim
    hidden = attn.to_q.in_features
    flow.decoder.cnn_cache_buffer = torch.zeros(16, depth, 2, 2 * hidden, 2)
    flow.decoder.att_cache_buffer = torch.zeros(16, depth, 2, heads, 1000, 2 * head_dim)
    est.cnn_cache_buffer = torch.zeros(depth, 2, 2 * hidden, 2)
    est.att_cache_buffer = torch.zeros(depth, 2, heads, 1000, 2 * head_dim)


def register_voice(t2w, voice_path: Path) -> str:
    """Makes the Token2wav's prompt front end (`_prepare_prompt`: s3tokenizer, campplus and a
    mel of a wav) return the voice prompt saved at `voice_path` (default_voice.safetensors)
    when asked for that path; returns the name to pass as `prompt_wav_path`."""
    from pipeline.code2wav.voice import load_voice

    v = load_voice(voice_path)
    dtype = next(t2w.flow.parameters()).dtype
    name = str(voice_path)
    voices = t2w.__dict__.setdefault("_omniray_voices", {})
    voices[name] = (v.prompt_tokens.int(), _int32([v.prompt_tokens.shape[1]]),
                    v.spk_emb.to(dtype), v.prompt_mel.to(dtype),
                    _int32([v.prompt_mel.shape[1]]))

    def prepare_prompt(prompt_wav):
        if prompt_wav not in voices:
            raise ValueError(f"{prompt_wav}: not a registered voice (register_voice) ")
        return voices[prompt_wav]

    t2w._prepare_prompt = prepare_prompt
    return name


def _int32(values):
    import torch

    return torch.tensor(values, dtype=torch.int32)


# ---------------------------------------------------------------------------------------
# MiniCPMODuplex


@contextlib.contextmanager
def _patched(obj, name, value):
    had = name in vars(obj)
    old = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


def _argmax_multinomial(probs, num_samples=1, replacement=False, *, generator=None, out=None):
    assert num_samples == 1
    return probs.argmax(dim=-1, keepdim=True)


def load_reference(demo_dir: str | Path, ckpt_dir: str | Path | None = None, *,
                   talker_argmax: bool = True, generate_audio: bool = True, **duplex_kwargs):
    """`MiniCPMODuplex(name_or_path=<view of ckpt_dir>, device="cpu",
    attn_implementation="eager", **duplex_kwargs)` in float32 (see the module doc).
    `ckpt_dir` None = omniray's tiny default. The result has `omniray_prompt_wav` (the voice
    name for `prepare(prompt_wav_path=...)`), `omniray_ref_audio` (the checkpoint's
    HT_ref_audio.wav at 16 kHz, float32) and `omniray_demo` (the imported modules)."""
    ns = import_demo(demo_dir)
    import torch
    from transformers import PreTrainedModel

    if ckpt_dir is None:
        from pipeline.checkpoint import default_checkpoint

        ckpt_dir = default_checkpoint()
    ckpt = Path(ckpt_dir).resolve()
    view = reference_view(ckpt)
    MiniCPMO = ns.modeling.MiniCPMO
    t2w_kw = {"float16": bool(duplex_kwargs.get("enable_float16", False)),
              "n_timesteps": int(duplex_kwargs.get("n_timesteps", 10))}

    orig_to = PreTrainedModel.to

    def to_fp32(self, *args, **kwargs):  # the demo's `.to(torch.bfloat16)`: kept float32
        args = tuple(torch.float32 if a is torch.bfloat16 else a for a in args)
        if kwargs.get("dtype") is torch.bfloat16:
            kwargs["dtype"] = torch.float32
        return orig_to(self, *args, **kwargs)

    def init_tts(self, streaming=False, model_dir=None, enable_float16=False, n_timesteps=10):
        assert streaming, "the duplex reference builds the streaming Token2wav only"
        self.tts.config.audio_tokenizer_type = "s3tokenizer_step_audio"
        self.tts.audio_tokenizer = build_token2wav(view / "assets" / "token2wav",
                                                   float16=enable_float16, n_timesteps=n_timesteps)
        return self.tts.audio_tokenizer

    kwargs = dict(duplex_kwargs)
    kwargs.setdefault("attn_implementation", "eager")
    with _patched(PreTrainedModel, "to", to_fp32), _patched(MiniCPMO, "init_tts", init_tts):
        duplex = ns.modeling.MiniCPMODuplex(
            name_or_path=str(view), generate_audio=generate_audio, device="cpu", **kwargs
        )
    model = duplex.model
    _check_weights(model, ckpt)
    assert model.tts.audio_tokenizer.float16 == t2w_kw["float16"]
    if talker_argmax:
        tts = model.tts
        orig = tts.generate_chunk

        def generate_chunk(*a, **k):
            with _patched(torch, "multinomial", _argmax_multinomial):
                return orig(*a, **k)

        tts.generate_chunk = generate_chunk
    t2w = model.tts.audio_tokenizer
    duplex.omniray_prompt_wav = register_voice(
        t2w, ckpt / "assets" / "token2wav" / "default_voice.safetensors")
    duplex.omniray_ref_audio = _ref_audio(ckpt)
    duplex.omniray_demo = ns
    duplex.omniray_ckpt = ckpt
    return duplex


def _ref_audio(ckpt: Path):
    import numpy as np
    import soundfile

    path = ckpt / "assets" / "HT_ref_audio.wav"
    if not path.is_file():
        return None
    wav, sr = soundfile.read(str(path), dtype="float32")
    if wav.ndim > 1:
        wav = wav.mean(axis=1)
    if sr != 16000:
        import librosa

        wav = librosa.resample(wav, orig_sr=sr, target_sr=16000)
    return np.ascontiguousarray(wav, dtype=np.float32)


def _check_weights(model, ckpt: Path) -> None:
    """Every checkpoint tensor is in the model, equal and float32; every model parameter
    comes from the checkpoint (no silently random-initialised weight)."""
    import torch
    from safetensors import safe_open

    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    state = model.state_dict()
    params = {n for n, _ in model.named_parameters()}
    bad, seen = [], set()
    for shard in sorted(set(index.values())):
        with safe_open(str(ckpt / shard), "pt") as f:
            for key in f.keys():
                if key not in state:
                    bad.append(f"unused {key}")
                    continue
                seen.add(key)
                want = f.get_tensor(key).float()
                got = state[key]
                if got.dtype != torch.float32 or not torch.equal(got, want):
                    bad.append(f"differs {key}")
    missing = [n for n in params if n not in seen and not n.startswith("tts.audio_tokenizer")]
    bad += [f"not in checkpoint {n}" for n in missing]
    if bad:
        raise RuntimeError("reference weights do not match the checkpoint: " + "; ".join(bad[:20]))

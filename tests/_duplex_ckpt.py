"""The duplex test checkpoint and the fixed noise both implementations share.

The reference's Token2wav draws its flow noise (`rand_noise`) and its vocoder's uniform
source-noise table (`SineGen2.sine_waves`) from the global RNG when it is built; the golden
run replaces them with these seeded draws so omniray's side can set the same tensors."""

from __future__ import annotations

import torch

FLOW_NOISE_SEED = 0  # pipeline.code2wav.flow.CausalCFM's default noise_seed
VOCODER_NOISE_SEED = 1
VOCODER_NOISE_SECONDS = 60


def flow_noise(channels: int = 80, frames: int | None = None) -> torch.Tensor:
    """(1, channels, frames): what omniray's `CausalCFM(noise_seed=0)` holds as rand_noise."""
    from pipeline.code2wav.flow import NOISE_FRAMES

    gen = torch.Generator().manual_seed(FLOW_NOISE_SEED)
    return torch.randn(1, channels, frames or NOISE_FRAMES, generator=gen)


def vocoder_noise_table(harmonics: int = 9, seconds: int = VOCODER_NOISE_SECONDS) -> torch.Tensor:
    """(24000 * seconds, harmonics) uniform noise by sample position: the reference vocoder's
    `sine_waves[0]` in the golden run, omniray's `CausalHiFT.noise_table` in the parity test
    (both wrap at its length)."""
    gen = torch.Generator().manual_seed(VOCODER_NOISE_SEED)
    return torch.rand(24000 * seconds, harmonics, generator=gen)


# ---------------------------------------------------------------------------------------
# The duplex test checkpoint: the tiny default with a few rows and one bias replaced.
#
# Random weights never choose `<|speak|>`, `<|listen|>` or `<|turn_eos|>`. The patch gives the
# model a small, decisive duplex behaviour: the audio projection adds a fixed direction `d`
# to every audio embedding, so the position after a unit's audio is recognisable; the
# `<|speak|>` / `<|listen|>` output rows score `d` plus (or minus) a direction that
# separates loud from quiet units there; `<|tts_bos|>` and `<|turn_eos|>` embeddings carry
# directions that the `<|turn_eos|>` and `<|chunk_tts_eos|>` rows pick up. So a loud unit
# speaks; a quiet unit listens, or, inside a turn (where the reference turns a `<|listen|>`
# into `<|tts_bos|>`), says `<|turn_eos|><|chunk_tts_eos|>` and ends the turn. The rows are
# fitted once on the reference by tests/duplex_golden/make_golden.py (--fit) and committed
# as tests/duplex_golden/ckpt_patch.npz; both implementations load the files written here.

PATCH_FILE = "ckpt_patch.npz"


def patch_path():
    """tests/duplex_golden/ckpt_patch.npz (or beside this file, in a published copy)."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    for p in (here / "duplex_golden" / PATCH_FILE, here / PATCH_FILE):
        if p.is_file():
            return p
    raise FileNotFoundError(f"{PATCH_FILE} not found under {here}")


def load_patch(path=None) -> dict[str, dict]:
    """{tensor name: {"full": array or None, "rows": {i: vector}, "cols": {j: vector}}} from
    the npz (keys "<tensor>" whole, "<tensor>@<i>" row i, "<tensor>#<j>" column j)."""
    import numpy as np

    out: dict[str, dict] = {}
    with np.load(path or patch_path()) as z:
        for key in sorted(z.files):
            if "@" in key:
                name, i = key.split("@")
                kind = "rows"
            elif "#" in key:
                name, i = key.split("#")
                kind = "cols"
            else:
                name, i, kind = key, None, "full"
            entry = out.setdefault(name, {"full": None, "rows": {}, "cols": {}})
            if kind == "full":
                entry["full"] = z[key]
            else:
                entry[kind][int(i)] = z[key]
    return out


def save_patch(path, patch: dict[str, dict]) -> None:
    import numpy as np

    arrays = {}
    for name, entry in patch.items():
        if entry.get("full") is not None:
            arrays[name] = np.asarray(entry["full"], dtype=np.float32)
        for row, vec in entry.get("rows", {}).items():
            arrays[f"{name}@{int(row)}"] = np.asarray(vec, dtype=np.float32)
        for col, vec in entry.get("cols", {}).items():
            arrays[f"{name}#{int(col)}"] = np.asarray(vec, dtype=np.float32)
    np.savez(path, **arrays)


def patch_digest(patch: dict[str, dict]) -> str:
    import hashlib

    import numpy as np

    h = hashlib.sha256()
    for name in sorted(patch):
        entry = patch[name]
        if entry.get("full") is not None:
            h.update(name.encode() + np.asarray(entry["full"], np.float32).tobytes())
        for kind, sep in (("rows", "@"), ("cols", "#")):
            for i in sorted(entry.get(kind, {})):
                h.update(f"{name}{sep}{i}".encode())
                h.update(np.asarray(entry[kind][i], np.float32).tobytes())
    return h.hexdigest()[:10]


def write_patched_checkpoint(base, out, patch: dict[str, dict]):
    """`out` = `base` with `patch` applied: links to every unchanged file, the shards that
    hold a patched tensor rewritten (same dtype as stored). Written atomically."""
    import json
    import os
    import shutil
    import tempfile
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file

    base, out = Path(base).resolve(), Path(out)
    if (out / ".complete").is_file():
        return out
    index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    missing = [n for n in patch if n not in index]
    if missing:
        raise KeyError(f"patch names tensors the checkpoint lacks: {missing}")
    shards = {index[n] for n in patch}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        for p in base.iterdir():
            if p.name in shards or p.name.startswith("."):
                continue
            os.symlink(p, tmp / p.name)
        for shard in shards:
            tensors = load_file(str(base / shard))
            for name, entry in patch.items():
                if index[name] != shard:
                    continue
                t = tensors[name]
                if entry.get("full") is not None:
                    new = torch.as_tensor(entry["full"]).to(t.dtype)
                    if new.shape != t.shape:
                        raise ValueError(f"{name}: patch {tuple(new.shape)} != {tuple(t.shape)}")
                    t = new
                else:
                    t = t.clone()
                for row, vec in entry.get("rows", {}).items():
                    t[row] = torch.as_tensor(vec).to(t.dtype)
                for col, vec in entry.get("cols", {}).items():
                    t[:, col] = torch.as_tensor(vec).to(t.dtype)
                tensors[name] = t.contiguous()
            save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
        (tmp / ".complete").write_text("ok\n")
        try:
            tmp.rename(out)
        except OSError:
            if not (out / ".complete").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def duplex_test_checkpoint(patch=None):
    """The duplex test checkpoint (in the omniray cache), built from the tiny default and
    the committed patch (or `patch`, a dict as `load_patch` returns)."""
    from pipeline.checkpoint import cache_dir, default_checkpoint

    base = default_checkpoint()
    patch = load_patch() if patch is None else patch
    out = cache_dir() / f"{base.name}-duplex-{patch_digest(patch)}"
    return write_patched_checkpoint(base, out, patch)

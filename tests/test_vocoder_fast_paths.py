"""The vocoders' exact fast paths: what they compute is bit for bit what the plain modules
compute (CPU, tiny config)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch.nn.utils import parametrize

from pipeline.code2wav import conv_windows
from pipeline.code2wav.assets import random_vocoder, tiny_code2wav_config
from pipeline.code2wav.causal_hift import (
    CausalHiFT,
    CausalResBlock,
    CausalVocoderState,
    vocode_chunk,
)
from pipeline.code2wav.hift import freeze_weight_norms

CAUSAL, COSYVOICE2 = "minicpmo-utils-1.0.7", "cosyvoice2"


def _mel(frames: int, seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 80, frames, generator=torch.Generator().manual_seed(seed))


def _stream(vocoder: CausalHiFT, mel: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """One causal stream per batch row, a chunk a call, the last one flushing; the source
    noise from per-row generators seeded the same every time."""
    states = CausalVocoderState.empty(mel.shape[0], vocoder, "cpu").split()
    gens = [torch.Generator().manual_seed(10 + i) for i in range(mel.shape[0])]
    out, o = [], 0
    for k, n in enumerate(sizes):
        speech, states = vocode_chunk(vocoder, states, mel[:, :, o : o + n],
                                      k == len(sizes) - 1, generators=gens)
        out.append(speech)
        o += n
    return out


def _vocode(vocoder, layout: str) -> list[torch.Tensor]:
    mel = _mel(95, 3)
    if layout == CAUSAL:
        return _stream(vocoder, mel, [40, 25, 30])
    gens = [torch.Generator().manual_seed(10 + i) for i in range(mel.shape[0])]
    with torch.inference_mode():
        return list(vocoder(mel, generators=gens))


def _weight_normed(vocoder) -> int:
    return sum(parametrize.is_parametrized(m, "weight") for m in vocoder.modules())


@pytest.mark.parametrize("layout", [CAUSAL, COSYVOICE2])
def test_frozen_weight_norms_give_the_same_speech_bit_for_bit(layout):
    vocoder = random_vocoder(tiny_code2wav_config(), 0, layout)
    with torch.no_grad():  # g away from |v|, so the norm is not the identity
        for name, p in vocoder.named_parameters():
            if name.endswith("original0"):
                p.mul_(1.7)
    before = _vocode(vocoder, layout)
    assert _weight_normed(vocoder) > 0
    freeze_weight_norms(vocoder)
    assert _weight_normed(vocoder) == 0
    after = _vocode(vocoder, layout)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)


def test_the_engine_freezes_weight_norms_and_picks_the_portable_path_on_cpu():
    """The engine freezes the vocoder's weight norms; on CPU its Snakes stay eager (compiled
    on CUDA only) and its convs build their windows with torch's ops (the kernel: CUDA)."""
    from pipeline.code2wav.assets import random_code2wav
    from pipeline.code2wav.engine import Code2WavEngine
    from pipeline.code2wav.hift import Snake

    cfg = tiny_code2wav_config()
    flow, _ = random_code2wav(cfg, 0)
    vocoder = random_vocoder(cfg, 0, CAUSAL)
    Code2WavEngine(flow, vocoder, cfg)
    assert _weight_normed(vocoder) == 0
    assert not any(m.fused for m in vocoder.modules() if isinstance(m, Snake))
    assert not conv_windows.available(torch.device("cpu"))


# -- the conv windows kernel (Triton's interpreter on CPU) ----------------------------------

def _torch_windows(x, kernel, dilation, stride, left, right, up):
    if up > 1:
        x = torch.nn.functional.interpolate(x, scale_factor=up, mode="nearest")
    x = torch.nn.functional.pad(x, (left, right))
    win = x.unfold(2, dilation * (kernel - 1) + 1, stride)[..., ::dilation]
    b, c, t, _ = win.shape
    return win.transpose(2, 3).reshape(b, c * kernel, t)


needs_kernel = pytest.mark.skipif(not conv_windows.runs_here(torch.device("cpu")),
                                  reason="needs triton (its interpreter on CPU)")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "kernel, dilation, stride, left, right, up",
    [(3, 1, 1, 2, 0, 1), (3, 5, 1, 10, 0, 1), (7, 1, 1, 6, 0, 1), (5, 1, 1, 0, 4, 1),
     (5, 1, 1, 0, 0, 1), (1, 1, 1, 0, 0, 1), (16, 1, 8, 7, 0, 1), (6, 1, 3, 2, 0, 1),
     (11, 1, 1, 10, 0, 8), (7, 1, 1, 6, 0, 5), (7, 3, 1, 18, 0, 3)],
)
def test_conv_windows_are_the_padded_unfolded_windows(kernel, dilation, stride, left, right,
                                                      up, dtype):
    g = torch.Generator().manual_seed(kernel * 100 + up)
    for b, c, t in ((1, 3, 29), (2, 5, 131)):
        x = torch.randn(b, c, t, generator=g, dtype=dtype)
        for view in (x, torch.randn(b, t + 9, c, generator=g, dtype=dtype)[:, 4:-5].transpose(1, 2)):
            got = conv_windows.conv_windows(view, kernel, dilation, stride, left, right, up)
            want = _torch_windows(view, kernel, dilation, stride, left, right, up)
            assert got.is_contiguous() and got.shape == want.shape
            assert torch.equal(got, want)
            # the padding is +0.0, as F.pad's
            assert not torch.signbit(got[want == 0]).any()
            # frame_major: the same windows, (B, T, C k)
            fm = conv_windows.conv_windows(view, kernel, dilation, stride, left, right, up,
                                           frame_major=True)
            assert fm.is_contiguous() and torch.equal(fm, want.transpose(1, 2))
            assert not torch.signbit(fm[want.transpose(1, 2) == 0]).any()


@needs_kernel
def test_conv_windows_refuses_a_window_longer_than_its_input():
    with pytest.raises(ValueError, match="no window"):
        conv_windows.conv_windows(torch.zeros(1, 2, 3), 7)


def _matmul_conv(self, x, left=0, right=0, up=1, bias=True):
    """A conv as `torch.matmul(weight, windows)` over its (B, C k, T) windows."""
    from pipeline.code2wav.causal_hift import _padded

    (k,), (d,), (st,) = self.kernel_size, self.dilation, self.stride
    win = _padded(x, left, right, up).unfold(2, d * (k - 1) + 1, st)[..., ::d]
    b, c, t, _ = win.shape
    out = torch.matmul(self.weight.reshape(self.weight.shape[0], -1),
                       win.transpose(2, 3).reshape(b, c * k, t))
    return out + self.bias[:, None] if bias and self.bias is not None else out


@needs_kernel
def test_the_window_kernel_gives_the_same_speech_bit_for_bit(monkeypatch):
    """The causal vocoder's convs with their windows from the kernel (CUDA; Triton's
    interpreter here) against torch's ops, over a stream's first, steady and flushing chunks
    (one row: the interpreter takes ~20 ms a launch; the batch rows are the test above's)."""
    vocoder = random_vocoder(tiny_code2wav_config(), 0, CAUSAL)
    freeze_weight_norms(vocoder)
    mel, sizes = _mel(49, 3, batch=1), [24, 16, 9]
    plain = _stream(vocoder, mel, sizes)
    monkeypatch.setattr(conv_windows, "available", lambda device: True)
    fast = _stream(vocoder, mel, sizes)
    for a, b in zip(plain, fast, strict=True):
        assert torch.equal(a, b)


def test_frame_major_windows_give_the_same_speech_bit_for_bit(monkeypatch):
    """With more than one batch row each conv's windows are built (B, T, C k) and multiplied
    by one mm: against `torch.matmul` over the (B, C k, T) windows, which (the weights
    requiring grad) folds into that mm after copying them into that order, the same speech
    bit for bit over a stream of two rows (the torch windows, and the kernel's in Triton's
    interpreter)."""
    from pipeline.code2wav.causal_hift import _Conv

    vocoder = random_vocoder(tiny_code2wav_config(), 0, CAUSAL)
    freeze_weight_norms(vocoder)
    assert all(p.requires_grad for p in vocoder.parameters())  # what makes matmul fold
    mel, sizes = _mel(49, 3), [24, 16, 9]
    shipped = _stream(vocoder, mel, sizes)
    with monkeypatch.context() as m:
        m.setattr(_Conv, "conv", _matmul_conv)
        matmul = _stream(vocoder, mel, sizes)
    for a, b in zip(matmul, shipped, strict=True):
        assert torch.equal(a, b)
    if not conv_windows.runs_here(torch.device("cpu")):
        return
    monkeypatch.setattr(conv_windows, "available", lambda device: True)
    two = _mel(37, 4)
    fast = _stream(vocoder, two, [21, 16])
    monkeypatch.setattr(_Conv, "conv", _matmul_conv)
    for a, b in zip(_stream(vocoder, two, [21, 16]), fast, strict=True):
        assert torch.equal(a, b)


needs_inductor = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None,
    reason="Inductor on CPU needs a C++ compiler")


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_inductor)])
def test_biases_added_by_the_next_op_give_the_same_speech_bit_for_bit(compiled, monkeypatch):
    """The residual blocks' conv biases added by the Snake or residual add after each conv
    (compiled on CUDA, `fuse_snakes`), against each conv adding its own (hift.py's ResBlock
    forward): the same adds, the same speech bit for bit, over a stream of two rows."""
    from pipeline.code2wav.hift import ResBlock, fuse_snakes

    torch._dynamo.reset()
    vocoder = random_vocoder(tiny_code2wav_config(), 0, CAUSAL)
    freeze_weight_norms(vocoder)
    fuse_snakes(vocoder, compiled)
    mel, sizes = _mel(49, 3), [24, 16, 9]
    shipped = _stream(vocoder, mel, sizes)
    monkeypatch.setattr(CausalResBlock, "forward", ResBlock.forward)
    for a, b in zip(shipped, _stream(vocoder, mel, sizes), strict=True):
        assert torch.equal(a, b)
    torch._dynamo.reset()

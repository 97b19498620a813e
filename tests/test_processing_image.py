"""Image slicing: grid choice, resize rounding, patch strips, decoding errors."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.config import SliceConfig
from pipeline.processing.errors import (
    CorruptMediaError,
    EmptyMediaError,
    MediaTooLargeError,
    UnsupportedMediaError,
)
from pipeline.processing.image import (
    decode_image,
    get_sliced_grid,
    normalize_pixels,
    process_image,
    to_patch_strip,
)

CFG = SliceConfig()  # 9 slices, 448, patch 14


def _png(w: int, h: int, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(w * 7 + h)
    arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


# (W, H) -> (grid, tgt_sizes of every slice), worked out by hand from the reference rules:
#   ratio = W*H/448^2, multiple = min(ceil(ratio), 9); candidates m-1, m, m+1; closest log ratio
#   source: h = int(448/sqrt(W/H)), w = int(h*W/H), each rounded to a multiple of 14
CASES = {
    (448, 448): (None, [(32, 32)]),  # exactly 448^2: no slicing
    (10, 10): (None, [(32, 32)]),  # tiny: upscaled to ~448^2
    # 640x480: h = int(448/1.1547) = 387 -> 28 patches, w = int(516) -> 37; cells 320x480
    (640, 480): ((2, 1), [(28, 37), (39, 26), (39, 26)]),
    # 1344x896 = 6 x 448^2, aspect 1.5 -> 3x2 grid of exactly 448x448 cells
    (1344, 896): ((3, 2), [(26, 39)] + [(32, 32)] * 6),
    # extreme wide: ratio 1.99 -> multiple 2, candidates 2, 3 -> 3x1 grid
    (4000, 100): ((3, 1), [(5, 200)] + [(9, 116)] * 3),
    # extreme tall: the rounding is not symmetric (height is computed first):
    # h = int(448/sqrt(0.025)) = 2833 -> 202 patches, w = int(70.8) -> 5
    (100, 4000): ((1, 3), [(202, 5)] + [(117, 9)] * 3),
    # huge: capped at 9 slices, 3x3
    (3000, 3000): ((3, 3), [(32, 32)] + [(32, 32)] * 9),
}


@pytest.mark.parametrize("size", list(CASES))
def test_grid_and_tgt_sizes(size):
    grid, tgt = CASES[size]
    assert get_sliced_grid(size, 9, 448) == grid
    arr = np.zeros((size[1], size[0], 3), np.uint8)
    out = process_image(Image.fromarray(arr), CFG, "h")
    assert out.grid == grid
    assert out.image.tgt_sizes.tolist() == [list(t) for t in tgt]
    expected_slices = 1 + (0 if grid is None else grid[0] * grid[1])
    assert out.image.num_slices == expected_slices
    for strip, (h, w) in zip(out.image.pixel_values, tgt):
        assert strip.shape == (3, 14, 14 * h * w) and strip.dtype == torch.uint8


def test_max_slice_nums_one_never_slices():
    out = process_image(Image.new("RGB", (1344, 896)), CFG, "h", max_slice_nums=1)
    assert out.grid is None and out.image.num_slices == 1
    assert out.image.tgt_sizes.tolist() == [[26, 39]]


def test_grid_candidates_skip_one_and_cap():
    # ratio just over 1 -> multiple 2 -> candidates {2, 3}, never a 1x1 grid
    assert get_sliced_grid((500, 450), 9, 448) == (2, 1)
    # max_slice_nums 4 caps a 9x-area image at candidates {3, 4}: square -> 2x2
    assert get_sliced_grid((1344, 1344), 4, 448) == (2, 2)


def test_patch_strip_matches_unfold_layout():
    x = torch.randn(3, 28, 42)
    strip = to_patch_strip(x, 14)
    # reference reshape_by_patch: unfold -> (3, 14, 14, L) -> permute(0, 1, 3, 2) -> (3, 14, 14L)
    ref = torch.nn.functional.unfold(x, (14, 14), stride=(14, 14))
    ref = ref.reshape(3, 14, 14, -1).permute(0, 1, 3, 2).reshape(3, 14, -1)
    assert torch.equal(strip, ref), f"max diff {(strip - ref).abs().max()}"


def test_pixels_normalized_and_bicubic():
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 500, 3), np.uint8))
    out = process_image(img, CFG, "h")
    assert out.grid is None
    ((h, w),) = out.image.tgt_sizes.tolist()
    ref = np.asarray(img.resize((w * 14, h * 14), Image.Resampling.BICUBIC), np.float32)
    ref = torch.from_numpy(((ref / 255.0 - 0.5) / 0.5).transpose(2, 0, 1).copy())
    got = normalize_pixels(out.image.pixel_values[0])
    assert torch.equal(got, to_patch_strip(ref, 14))  # the reference's float32 ops, bit for bit
    assert got.min() >= -1 and got.max() <= 1


def test_pixel_lut_is_the_reference_formula_for_every_byte():
    x = np.arange(256, dtype=np.uint8).reshape(16, 16)
    ref = (x.astype(np.float32) / 255.0 - 0.5) / 0.5
    got = normalize_pixels(torch.from_numpy(x))
    assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(ref))


def test_decode_formats_and_errors():
    assert decode_image(_png(20, 10), max_pixels=10**6).size == (20, 10)
    assert decode_image(_png(20, 10, "JPEG"), max_pixels=10**6).mode == "RGB"
    with pytest.raises(UnsupportedMediaError, match="not a supported format"):
        decode_image(b"hello world, not an image", max_pixels=10**6)
    with pytest.raises(CorruptMediaError, match="PNG image could not be decoded"):
        decode_image(_png(64, 64)[:80], max_pixels=10**6)
    with pytest.raises(MediaTooLargeError, match=r"64x64 = 4096 pixels, over the limit of 1000"):
        decode_image(_png(64, 64), max_pixels=1000)
    with pytest.raises(EmptyMediaError):
        decode_image(b"", max_pixels=10**6)
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="ICO")
    with pytest.raises(UnsupportedMediaError, match="ICO"):
        decode_image(buf.getvalue(), max_pixels=10**6)


def test_media_inputs_pickle_as_out_of_band_numpy():
    """ImageInput / AudioInput cross Ray as numpy buffers (zero-copy there), not torch bytes."""
    import pickle

    from pipeline.handoff import AudioInput

    img = process_image(Image.new("RGB", (500, 300), (10, 200, 30)), CFG, "h").image
    aud = AudioInput(torch.randn(80, 300), "a")
    bufs = []
    data = pickle.dumps([img, aud], protocol=5, buffer_callback=bufs.append)
    assert len(bufs) == img.num_slices + 2 and len(data) < 2000  # strips, sizes, features
    img2, aud2 = pickle.loads(data, buffers=bufs)
    assert img2.content_hash == "h" and aud2.content_hash == "a"
    assert all(a.equal(b) for a, b in zip(img.pixel_values, img2.pixel_values))
    assert img2.tgt_sizes.equal(img.tgt_sizes) and aud2.features.equal(aud.features)
    assert isinstance(img2.pixel_values[0], torch.Tensor)

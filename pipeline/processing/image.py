"""Image decoding and MiniCPM-V (LLaVA-UHD) slicing for the NaViT vision encoder.

Stages, as in the reference `MiniCPMVImageProcessor` (OpenBMB demo `processing_minicpmo.py`):
1. decode bytes with Pillow -> RGB image (W, H); limits, from the header before any pixel is
   decoded: format, pixel count, aspect ratio (see `check_aspect_ratio`)
2. `get_sliced_grid`: pick a (cols, rows) grid, or None when the image is <= 448^2 in area
3. source image: resized to ~448^2 area, sides multiples of 14 (BICUBIC); upscaled when unsliced
4. refined image: resized so each grid cell is ~448^2, then cut into cols x rows slices
5. each slice: /255, normalize (x - 0.5) / 0.5, then `to_patch_strip` -> (3, 14, 14 * L)
   with tgt_size (h, w) = slice size in patches, L = h * w

Every slice becomes `query_num` (64) LLM tokens after the resampler. The token layout lives in
`template.py`; this module only reports the grid.
"""

from __future__ import annotations

import hashlib
import io
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from pipeline.config import SliceConfig
from pipeline.handoff import ImageInput
from pipeline.processing.errors import (
    AspectRatioError,
    CorruptMediaError,
    EmptyMediaError,
    MediaTooLargeError,
    UnsupportedMediaError,
)

# Formats a client may send; anything else Pillow happens to read is refused.
SUPPORTED_IMAGE_FORMATS = frozenset({"JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"})

# Longest side / shortest side accepted by default (Qwen2-VL's processor uses the same bound).
# At 200:1 the slicing rules give at most about 2 x 453 patches per slice.
MAX_ASPECT_RATIO = 200.0


@dataclass
class ProcessedImage:
    """One image after slicing.

    image:  the ImageInput handed to the Thinker (source slice first, then grid slices row-major)
    grid:   (cols, rows) of the grid slices, None when only the source slice exists
    size:   (W, H) of the decoded image
    """

    image: ImageInput
    grid: tuple[int, int] | None
    size: tuple[int, int]


# ---------------------------------------------------------------------------------------
# Decoding


def check_aspect_ratio(width: int, height: int, max_ratio: float, what: str = "image") -> None:
    """Refuse a (width, height) whose longest side / shortest side is over max_ratio.

    Why: slicing resizes every slice to an area near 448^2 with sides rounded to 14 px
    patches but at least one patch, so a 1:N image becomes a 1 x ~32 sqrt(N) patch strip
    (a 1 x 10000 PNG: 1 x 3200 patches), and the encoders' work grows with that long side.
    Sides must be > 0 (callers check zero sizes first)."""
    ratio = max(width, height) / min(width, height)
    if ratio > max_ratio:
        raise AspectRatioError(
            f"{what} is {width}x{height}, aspect ratio {ratio:.1f}:1 (longest side / shortest "
            f"side), over the limit of {max_ratio:g}:1"
        )


def open_image(
    data: bytes, *, max_pixels: int, max_aspect_ratio: float = MAX_ASPECT_RATIO
) -> Image.Image:
    """Read only the header of image bytes (Pillow opens lazily) and check the format and
    the size limits; no pixel is decoded. `decode_image` then loads the pixels."""
    if not data:
        raise EmptyMediaError("image part is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            # Pillow warns (not raises) for large images; our own limit below decides.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError as e:
        raise UnsupportedMediaError(
            f"image bytes are not a supported format (supported: "
            f"{', '.join(sorted(SUPPORTED_IMAGE_FORMATS))})"
        ) from e
    except Image.DecompressionBombError as e:
        raise MediaTooLargeError(f"image is too large: {e}") from e
    if img.format not in SUPPORTED_IMAGE_FORMATS:
        raise UnsupportedMediaError(
            f"image format {img.format} is not supported (supported: "
            f"{', '.join(sorted(SUPPORTED_IMAGE_FORMATS))})"
        )
    w, h = img.size
    # Check the header size before decoding pixels: a decompression bomb never gets loaded.
    if w * h > max_pixels:
        raise MediaTooLargeError(
            f"image has {w}x{h} = {w * h} pixels, over the limit of {max_pixels} pixels"
        )
    if w == 0 or h == 0:
        raise EmptyMediaError(f"image has zero size ({w}x{h})")
    check_aspect_ratio(w, h, max_aspect_ratio)
    return img


def decode_image(
    data: bytes, *, max_pixels: int, max_aspect_ratio: float = MAX_ASPECT_RATIO
) -> Image.Image:
    """Decode image bytes into an RGB PIL image; the first frame of animated formats.
    Every limit is checked on the header first (`open_image`)."""
    img = open_image(data, max_pixels=max_pixels, max_aspect_ratio=max_aspect_ratio)
    try:
        img.load()
        return img.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:
        raise CorruptMediaError(f"{img.format} image could not be decoded: {e}") from e


# ---------------------------------------------------------------------------------------
# Grid choice and resize rules (same rounding as the reference)


def ensure_divide(length: float, patch_size: int) -> int:
    """Round to the nearest multiple of patch_size, at least one patch."""
    return max(round(length / patch_size) * patch_size, patch_size)


def find_best_resize(
    size: tuple[float, float], scale_resolution: int, patch_size: int, allow_upscale: bool = False
) -> tuple[int, int]:
    """(W, H) with area ~scale_resolution^2 (only shrinking unless allow_upscale), keeping the
    aspect ratio, sides rounded to multiples of patch_size. `int()` truncation as in the
    reference: height first, then width from the truncated height."""
    width, height = size
    if width * height > scale_resolution * scale_resolution or allow_upscale:
        r = width / height
        height = int(scale_resolution / math.sqrt(r))
        width = int(height * r)
    return ensure_divide(width, patch_size), ensure_divide(height, patch_size)


def get_refine_size(
    size: tuple[int, int], grid: tuple[int, int], scale_resolution: int, patch_size: int
) -> tuple[int, int]:
    """Size of the image the grid slices are cut from: each cell resized to ~448^2."""
    width, height = size
    cols, rows = grid
    cell_w = ensure_divide(width, cols) / cols
    cell_h = ensure_divide(height, rows) / rows
    best_w, best_h = find_best_resize((cell_w, cell_h), scale_resolution, patch_size, True)
    return best_w * cols, best_h * rows


def get_sliced_grid(
    size: tuple[int, int], max_slice_nums: int, scale_resolution: int
) -> tuple[int, int] | None:
    """(cols, rows) grid for an image of size (W, H), or None for no slicing.

    multiple = min(ceil(W*H / 448^2), max_slice_nums); candidates are the factorizations of
    multiple-1, multiple, multiple+1 (skipping 1 and > max); the one whose log aspect ratio
    is closest to the image's wins (first one on ties, in enumeration order).
    """
    width, height = size
    log_ratio = math.log(width / height)
    ratio = width * height / (scale_resolution * scale_resolution)
    multiple = min(math.ceil(ratio), max_slice_nums)
    if multiple <= 1:
        return None
    candidates = []
    for n in (multiple - 1, multiple, multiple + 1):
        if n == 1 or n > max_slice_nums:
            continue
        candidates += [(m, n // m) for m in range(1, n + 1) if n % m == 0]
    best, best_err = (1, 1), float("inf")
    for cols, rows in candidates:
        err = abs(log_ratio - math.log(cols / rows))
        if err < best_err:
            best, best_err = (cols, rows), err
    return best


def slice_image(
    img: Image.Image, cfg: SliceConfig, max_slice_nums: int | None = None
) -> tuple[list[Image.Image], tuple[int, int] | None]:
    """[source, grid slices row-major...] and the grid; see the module docstring."""
    max_slices = cfg.max_slice_nums if max_slice_nums is None else max_slice_nums
    if max_slices < 1:
        raise ValueError(f"max_slice_nums must be >= 1, got {max_slices}")
    res, patch = cfg.scale_resolution, cfg.patch_size
    grid = get_sliced_grid(img.size, max_slices, res)
    if grid is None:
        size = find_best_resize(img.size, res, patch, allow_upscale=True)
        return [img.resize(size, resample=Image.Resampling.BICUBIC)], None
    source = img.resize(find_best_resize(img.size, res, patch), resample=Image.Resampling.BICUBIC)
    refined = img.resize(get_refine_size(img.size, grid, res, patch), Image.Resampling.BICUBIC)
    cols, rows = grid
    cell_w, cell_h = refined.width // cols, refined.height // rows
    slices = [source]
    for r in range(rows):
        for c in range(cols):
            box = (c * cell_w, r * cell_h, (c + 1) * cell_w, (r + 1) * cell_h)
            slices.append(refined.crop(box))
    return slices, grid


# ---------------------------------------------------------------------------------------
# Pixels -> NaViT patch strips


def to_patch_strip(pixels: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(3, H, W) -> (3, p, p * L): patches in row-major order laid side by side.

    strip[c, i, l * p + j] = pixels[c, ph * p + i, pw * p + j] with l = ph * (W / p) + pw,
    the layout of the reference `reshape_by_patch` (unfold + permute).
    """
    c, height, width = pixels.shape
    h, w = height // patch_size, width // patch_size
    if pixels.device.type == "cpu":  # numpy's strided copy is ~100x faster than torch's here
        a = pixels.numpy().reshape(c, h, patch_size, w, patch_size)  # (c, ph, i, pw, j)
        a = np.ascontiguousarray(a.transpose(0, 2, 1, 3, 4))  # (c, i, ph, pw, j)
        return torch.from_numpy(a.reshape(c, patch_size, h * w * patch_size))
    x = pixels.reshape(c, h, patch_size, w, patch_size).permute(0, 2, 1, 3, 4)
    return x.reshape(c, patch_size, h * w * patch_size).contiguous()


def slice_pixels(img: Image.Image) -> torch.Tensor:
    """RGB PIL -> (3, H, W) uint8. Pixels travel to the encoder as bytes (4x less to move
    between processes than float32) and are normalized there with `normalize_pixels`."""
    return torch.from_numpy(np.ascontiguousarray(np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)))


def _pixel_lut() -> torch.Tensor:
    # The reference's float32 ops, x / 255 then (x - 0.5) / 0.5, for every byte value: a
    # lookup gives the same bits on any device (a GPU divide by a scalar may round differently).
    x = np.arange(256, dtype=np.float32) / 255.0
    return torch.from_numpy((x - 0.5) / 0.5)


PIXEL_LUT = _pixel_lut()
_LUTS: dict[torch.device, torch.Tensor] = {}  # PIXEL_LUT per device


def normalize_pixels(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 pixels (any shape, any device) -> float32 in [-1, 1], bit-equal to the reference.
    The table is copied to a device once: a copy per call would be a host-to-device copy
    inside the vision pass, which a CUDA graph cannot capture."""
    lut = _LUTS.get(pixels.device)
    if lut is None:
        lut = _LUTS[pixels.device] = PIXEL_LUT.to(pixels.device)
    return lut[pixels.long()]


def image_content_hash(data: bytes, cfg: SliceConfig, max_slice_nums: int, extra: str = "") -> str:
    """sha256 of the source bytes + every option that changes the pixels."""
    h = hashlib.sha256(data)
    h.update(f"|slices={max_slice_nums}|res={cfg.scale_resolution}|patch={cfg.patch_size}".encode())
    h.update(extra.encode())
    return h.hexdigest()


def process_image(
    img: Image.Image,
    cfg: SliceConfig,
    content_hash: str,
    max_slice_nums: int | None = None,
) -> ProcessedImage:
    """Slice an RGB image and build its patch strips; max_slice_nums=1 disables slicing
    (the single-source-image path used for video frames)."""
    slices, grid = slice_image(img, cfg, max_slice_nums)
    p = cfg.patch_size
    strips, sizes = [], []
    for s in slices:
        pixels = slice_pixels(s)  # (3, H, W) uint8
        strips.append(to_patch_strip(pixels, p))  # (3, p, p * L)
        sizes.append((pixels.shape[1] // p, pixels.shape[2] // p))
    tgt_sizes = torch.tensor(sizes, dtype=torch.int32)  # (num_slices, 2)
    return ProcessedImage(ImageInput(strips, tgt_sizes, content_hash), grid, img.size)

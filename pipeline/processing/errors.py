"""Typed input errors of the processing step.

Every error is a `ValueError` (bad client input, never a server fault) whose message says
what was wrong, which limit applies and the offending value. `http_status` is what the
ingress should answer: 400 for malformed input, 413 for input over a size limit.
"""

from __future__ import annotations


class MediaError(ValueError):
    """Base class: a request the processing step refuses."""

    http_status: int = 400


class InvalidMessageError(MediaError):
    """A message or content part has the wrong shape (unknown role, unknown part type...)."""


class CorruptMediaError(MediaError):
    """The bytes look like a known format but cannot be decoded."""


class UnsupportedMediaError(MediaError):
    """The bytes are not in a format (or codec) this server decodes."""


class EmptyMediaError(MediaError):
    """The media decodes to nothing (zero audio samples, zero video frames)."""


class NoVideoStreamError(MediaError):
    """A video part whose container holds no video stream."""


class AspectRatioError(MediaError):
    """An image or video frame whose longest side / shortest side is over the limit.

    400, not 413: the refusal is about the shape, which fewer bytes or pixels do not fix
    (a 1 x 300 image is tiny). The limit exists because slicing keeps every slice's area
    near 448^2 but never narrower than one 14 px patch, so the patch grid's long side grows
    with the ratio."""


class MediaTooLargeError(MediaError):
    """Bytes, pixels or seconds over a configured limit."""

    http_status = 413


class TooManyFramesError(MediaError):
    """More images + video frames in one request than the limit allows."""

    http_status = 413


class PromptTooLongError(MediaError):
    """The processed prompt (text + multimodal slots) exceeds `max_prompt_tokens`."""

    http_status = 413

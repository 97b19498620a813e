"""Input processing for the Thinker: decode media, slice images, log-mel audio, 1 fps video,
ChatML prompt with multimodal placeholders -> ThinkerRequest. Entry point: `Processor`."""

from pipeline.processing.errors import (
    AspectRatioError,
    CorruptMediaError,
    EmptyMediaError,
    InvalidMessageError,
    MediaError,
    MediaTooLargeError,
    NoVideoStreamError,
    PromptTooLongError,
    TooManyFramesError,
    UnsupportedMediaError,
)
from pipeline.processing.processor import MediaBytes, MediaLimits, Processor

__all__ = [
    "AspectRatioError",
    "CorruptMediaError",
    "EmptyMediaError",
    "InvalidMessageError",
    "MediaBytes",
    "MediaError",
    "MediaLimits",
    "MediaTooLargeError",
    "NoVideoStreamError",
    "Processor",
    "PromptTooLongError",
    "TooManyFramesError",
    "UnsupportedMediaError",
]

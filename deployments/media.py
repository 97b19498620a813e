"""Media URIs -> bytes, with the operator's rules.

- `data:[<type>][;base64],<payload>`: always allowed; base64 is decoded strictly.
- `file:///abs/path`: only under `allowed_local_media_path` (after resolving symlinks and
  `..`), only regular files, at most `max_bytes`.
- `http(s)://host/...`: only when `host` is in `allowed_media_hosts`.
Anything else is refused with a 400 that says why. Decoding the bytes is the Processor's
job (pipeline.processing); this module never looks inside them.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
import urllib.request
import wave
from pathlib import Path

import numpy as np

from deployments.schemas import ApiError

FETCH_TIMEOUT_S = 10.0


class MediaLoader:
    def __init__(self, *, allowed_dir: str | None, allowed_hosts: list[str], max_bytes: int):
        self.allowed_dir = Path(allowed_dir).resolve() if allowed_dir else None
        self.allowed_hosts = {h.lower() for h in allowed_hosts}
        self.max_bytes = max_bytes

    def load(self, uri: str, param: str) -> bytes:
        if not isinstance(uri, str) or not uri:
            raise ApiError(400, f"{param}: expected a non-empty URI string", param=param)
        scheme = uri.split(":", 1)[0].lower() if ":" in uri else ""
        if scheme == "data":
            return self._data(uri, param)
        if scheme == "file":
            return self._file(uri, param)
        if scheme in ("http", "https"):
            return self._http(uri, param)
        raise ApiError(400, f"{param}: unsupported URI scheme {scheme or uri[:16]!r}; use a "
                            "data: URI, an allowed file:// path or an allowed http(s) host",
                       param=param)

    def _data(self, uri: str, param: str) -> bytes:
        head, sep, payload = uri[5:].partition(",")
        if not sep:
            raise ApiError(400, f"{param}: malformed data: URI (no comma)", param=param)
        if head.endswith(";base64"):
            data = b64decode(payload, param)
        else:
            data = urllib.parse.unquote_to_bytes(payload)
        return self._sized(data, param)

    def _file(self, uri: str, param: str) -> bytes:
        if self.allowed_dir is None:
            raise ApiError(400, f"{param}: file:// media is disabled on this server "
                                "(allowed_local_media_path is not set)", param=param)
        parsed = urllib.parse.urlparse(uri)
        if parsed.netloc not in ("", "localhost"):
            raise ApiError(400, f"{param}: file:// URIs must not name a host", param=param)
        path = Path(urllib.parse.unquote(parsed.path))
        if not path.is_absolute():
            raise ApiError(400, f"{param}: file:// path must be absolute", param=param)
        real = path.resolve()
        if real != self.allowed_dir and self.allowed_dir not in real.parents:
            raise ApiError(400, f"{param}: {path} is outside the allowed media folder",
                           param=param)
        if not real.is_file():
            raise ApiError(400, f"{param}: no such file: {path}", param=param)
        size = os.path.getsize(real)
        if size > self.max_bytes:
            raise ApiError(413, f"{param}: file is {size} bytes, over the limit of "
                                f"{self.max_bytes}", param=param)
        return real.read_bytes()

    def _http(self, uri: str, param: str) -> bytes:
        host = (urllib.parse.urlparse(uri).hostname or "").lower()
        if host not in self.allowed_hosts:
            raise ApiError(400, f"{param}: fetching media from {host or uri[:32]!r} is not "
                                "allowed on this server (allowed_media_hosts)", param=param)
        try:
            with urllib.request.urlopen(uri, timeout=FETCH_TIMEOUT_S) as r:
                data = r.read(self.max_bytes + 1)
        except Exception as e:
            raise ApiError(400, f"{param}: could not fetch {uri[:64]}: {e}", param=param) from e
        return self._sized(data, param)

    def _sized(self, data: bytes, param: str) -> bytes:
        if len(data) > self.max_bytes:
            raise ApiError(413, f"{param}: media is over the limit of {self.max_bytes} bytes",
                           param=param)
        if not data:
            raise ApiError(400, f"{param}: media is empty", param=param)
        return data


def b64decode(payload: str, param: str) -> bytes:
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ApiError(400, f"{param}: invalid base64 ({e})", param=param) from e


def pcm16_to_wav(data: bytes, sample_rate: int = 16000) -> bytes:
    """Raw little-endian 16-bit mono PCM (`input_audio.format: pcm16`) -> a WAV file."""
    if len(data) % 2:
        raise ApiError(400, "input_audio: pcm16 data has an odd number of bytes",
                       param="input_audio")
    return wav_bytes_int16(np.frombuffer(data, dtype="<i2"), sample_rate)


def wav_bytes_int16(samples: np.ndarray, sample_rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(samples.astype("<i2").tobytes())
    return buf.getvalue()


def float_to_int16(pcm: np.ndarray) -> np.ndarray:
    return (np.clip(pcm, -1.0, 1.0) * 32767.0).round().astype("<i2")

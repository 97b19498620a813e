"""Custom voices: the store behind `POST/GET /v1/audio/voices` and `DELETE /v1/audio/voices/{id}`.

A client uploads a reference clip once (OpenAI's `client.audio.voices.create(name=...,
audio_sample=..., consent=...)`) and later asks for it in a chat request by name or id
(`audio: {"voice": "<name or id>"}` / `{"voice": {"id": "voice_..."}}`). The store keeps the
clip decoded (16 kHz mono float32, exactly what Code2Wav's voice front end takes), so a chat
turn sends the stored samples as it would a request's decoded `ref_audio`.

Layout (folder given): per voice `<id>.wav` (float32 WAV, so a reload is bit-exact) and
`<id>.json` (the VoiceInfo plus bookkeeping). Both are written atomically (temp file in the
folder, fsync, os.replace), the WAV first and the JSON last: a voice exists once its JSON
does, so a crash mid-add leaves at most a stray WAV, never a voice that half restores.
Delete removes the JSON first, then the WAV.

Several processes (ingress replicas) may share a folder:
  * reads see the others' changes: `list` re-scans the folder, `get` re-scans when the key
    is not known or when the known voice's files changed or vanished. A scan stats the files
    and only reads JSON that is new or changed since the last scan; samples are read lazily
    on the first `get` of a voice (and checked against the stored sha256);
  * `add` and `delete` hold an advisory `flock` on `<folder>/.lock` across re-scan + check +
    write, so name uniqueness and `max_voices` hold across processes (on filesystems where
    flock works; without it, two racing adds of one name both land and the oldest wins).

Paths are only ever built from a generated id that matches `voice_[0-9a-f]{24}`; names live
in the index and never reach the filesystem.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import math
import os
import re
import secrets
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from deployments.ingress.schemas import ApiError

try:  # POSIX; elsewhere only the in-process lock applies
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

SAMPLE_RATE = 16000
MIN_SECONDS = 0.5
# The largest upload a clip of `max_seconds` needs: 96 kHz stereo float32 WAV, as base64 in
# JSON, plus the form's other fields. A body past it is refused before it is read in full.
_UPLOAD_BYTES_PER_SECOND = 96000 * 2 * 4 * 4 // 3
_UPLOAD_SLACK = 1 << 20
# An absolute path inside a message (POSIX, home-relative, or a Windows drive); not a URL.
_PATH = re.compile(
    r"""(?<![\w.~:/\\])(?:~|[A-Za-z]:)?[\\/]"""  # not inside a word, a URL or a path
    r"""(?:[^\s'"\\/:,()]+[\\/])*"""  # its folders
    r"""([^\s'",:()\\/]*)"""  # its last part: kept
)
MAX_NAME_CHARS = 64
MAX_CONSENT_CHARS = 256
FORMAT_VERSION = 1

_ID_RE = re.compile(r"voice_[0-9a-f]{24}")
_NAME_RE = re.compile(rf"[A-Za-z0-9_-][A-Za-z0-9._-]{{0,{MAX_NAME_CHARS - 1}}}")
_RESERVED_RE = re.compile(r"voice_[0-9a-f]*", re.IGNORECASE)  # looks like an id
_JSON_RE = re.compile(r"(voice_[0-9a-f]{24})\.json")
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_LOCK_NAME = ".lock"


@dataclass(frozen=True)
class VoiceInfo:
    id: str  # "voice_" + 24 hex chars, random
    name: str
    created_at: int  # unix seconds
    seconds: float  # duration of the stored 16 kHz clip
    sha256: str  # of the stored float32 samples (little-endian bytes)
    consent: str | None = None

    def as_openai(self) -> dict[str, Any]:
        """OpenAI's Voice object (+ omniray extras)."""
        return {"id": self.id, "created_at": self.created_at, "name": self.name,
                "object": "audio.voice", "type": "audio_sample",
                "omniray": {"seconds": self.seconds}}

    def as_openai_deleted(self) -> dict[str, Any]:
        """OpenAI's VoiceDeleted object."""
        return {"id": self.id, "deleted": True, "object": "audio.voice.deleted"}


@dataclass
class _Entry:
    info: VoiceInfo
    created_ns: int  # orders voices added within one second
    sig: tuple | None = None  # (json stat, wav stat) when read; None in memory
    samples: np.ndarray | None = field(default=None, repr=False)  # read-only, lazily loaded

    @property
    def order(self) -> tuple[int, str]:
        return (self.created_ns, self.info.id)


class _Corrupt(Exception):
    """A voice's files on disk are unusable (the message says why)."""


def max_upload_bytes(max_seconds: float) -> int:
    """The body size a voice upload of at most `max_seconds` may have."""
    return math.ceil(max_seconds * _UPLOAD_BYTES_PER_SECOND) + _UPLOAD_SLACK


def without_paths(message: str) -> str:
    """`message` with every absolute path cut to its last part: what a client may be told
    of a server-side failure (which file), not where the server keeps it."""
    return _PATH.sub(lambda m: m.group(1) or "<path>", message)


def _short(key: Any) -> str:
    s = repr(key)
    return s if len(s) <= 80 else s[:77] + "..."


def _sha256(samples: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(samples, dtype="<f4").tobytes()).hexdigest()


def check_name(name: Any) -> str:
    """The name rules: 1-64 chars of [A-Za-z0-9._-], not starting with '.', not voice_<hex>."""
    if not isinstance(name, str) or not name:
        raise ApiError(400, "voice name must be a non-empty string", param="name")
    if len(name) > MAX_NAME_CHARS:
        raise ApiError(400, f"voice name is {len(name)} characters long, over the limit of "
                            f"{MAX_NAME_CHARS}", param="name")
    if not _NAME_RE.fullmatch(name):
        raise ApiError(400, f"voice name {_short(name)} may only use letters, digits, '.', '_' "
                            "and '-', and may not start with '.'", param="name")
    if _RESERVED_RE.fullmatch(name):
        raise ApiError(400, f"voice name {_short(name)} looks like a voice id (voice_<hex> is "
                            "reserved for ids)", param="name")
    return name


class VoiceStore:
    """Custom voices by id and name; in memory (folder None) or persisted in a folder."""

    def __init__(self, folder: str | Path | None, *, max_seconds: float, max_voices: int = 64):
        if not max_seconds > 0:
            raise ValueError(f"max_seconds must be > 0, got {max_seconds}")
        if max_seconds < MIN_SECONDS:
            raise ValueError(f"max_seconds {max_seconds} is below the {MIN_SECONDS} s minimum clip")
        if max_voices < 1:
            raise ValueError(f"max_voices must be >= 1, got {max_voices}")
        self.max_seconds = float(max_seconds)
        self.max_voices = int(max_voices)
        self.folder = None if folder is None else Path(folder)
        self._lock = threading.RLock()
        self._entries: dict[str, _Entry] = {}  # id -> entry (all valid voices)
        self._names: dict[str, str] = {}  # name -> id (oldest voice of that name)
        self._bad: dict[str, tuple] = {}  # id -> sig of files found unusable (not re-read)
        self._dups: dict[str, tuple] = {}  # id -> sig of a hidden same-name voice (warned once)
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            with self._lock:
                self._scan()
            log.info("voice store %s: %d voice(s) restored", self.folder, len(self._entries))

    # -- public API ----------------------------------------------------------------------

    def add(self, name: str, audio: bytes, consent: str | None = None) -> VoiceInfo:
        from pipeline.processing.audio import decode_audio
        from pipeline.processing.errors import MediaError

        check_name(name)
        if consent is not None:
            if not isinstance(consent, str):
                raise ApiError(400, "consent must be a string", param="consent")
            if len(consent) > MAX_CONSENT_CHARS:
                raise ApiError(400, f"consent is {len(consent)} characters long, over the limit "
                                    f"of {MAX_CONSENT_CHARS}", param="consent")
        if not isinstance(audio, (bytes, bytearray, memoryview)):
            raise ApiError(400, "audio_sample must be the bytes of an audio file",
                           param="audio_sample")
        # Decoding is the slow part: outside the lock.
        try:
            samples = decode_audio(bytes(audio), max_seconds=self.max_seconds)
        except MediaError as e:
            raise ApiError(getattr(e, "http_status", 400), f"audio_sample: {e}",
                           param="audio_sample") from None
        except ValueError as e:
            raise ApiError(400, f"audio_sample: {e}", param="audio_sample") from None
        samples = np.ascontiguousarray(samples, dtype=np.float32).reshape(-1)
        seconds = samples.size / SAMPLE_RATE
        if seconds < MIN_SECONDS:
            raise ApiError(400, f"audio_sample is {seconds:.2f} s long, shorter than the minimum "
                                f"of {MIN_SECONDS:g} s for a voice", param="audio_sample")
        samples.flags.writeable = False
        sha = _sha256(samples)

        with self._lock, self._folder_lock():
            self._scan()
            if name in self._names:
                raise ApiError(409, f"a voice named {name!r} already exists "
                                    f"({self._names[name]}); delete it first or pick another name",
                               param="name", code="voice_name_taken")
            if len(self._entries) >= self.max_voices:
                raise ApiError(409, f"this server stores at most {self.max_voices} voices; "
                                    "delete one first", param=None, code="voice_limit_reached")
            vid = self._new_id()
            now_ns = time.time_ns()
            info = VoiceInfo(id=vid, name=name, created_at=now_ns // 1_000_000_000,
                             seconds=seconds, sha256=sha, consent=consent)
            entry = _Entry(info, now_ns, None, samples)
            if self.folder is not None:
                try:
                    self._write(entry)
                except OSError as e:
                    log.error("voice store %s: could not write %s: %s", self.folder, vid, e)
                    raise ApiError(500, f"could not store the voice: {e.strerror or e}") from None
                entry.sig = self._sig(vid)
            self._entries[vid] = entry
            self._bad.pop(vid, None)
            self._reindex()
            log.info("voice %s %r added (%.2f s)", vid, name, seconds)
            return info

    def get(self, key: str) -> tuple[VoiceInfo, np.ndarray]:
        """The voice and its 16 kHz mono float32 samples (read-only), by id or by name."""
        with self._lock:
            entry = self._find(key)
            if (entry is not None and self.folder is not None
                    and self._sig(entry.info.id) != entry.sig):
                entry = None  # changed or gone on disk: look again
            if entry is None and self.folder is not None and isinstance(key, str):
                self._scan()
                entry = self._find(key)
            if entry is not None and entry.samples is None:
                entry = self._load_samples(entry)
            if entry is None:
                raise ApiError(404, f"voice {_short(key)} does not exist", param="audio.voice",
                               code="voice_not_found")
            return entry.info, entry.samples

    def list(self) -> list[VoiceInfo]:
        """Every voice, oldest first (for a name held twice on disk, only the oldest)."""
        with self._lock:
            self._scan()
            return [e.info for e in self._ordered() if self._names.get(e.info.name) == e.info.id]

    def delete(self, key: str) -> VoiceInfo:
        with self._lock, self._folder_lock():
            self._scan()
            entry = self._find(key)
            if entry is None:
                raise ApiError(404, f"voice {_short(key)} does not exist", param="voice_id",
                               code="voice_not_found")
            vid = entry.info.id
            if self.folder is not None:
                try:
                    os.remove(self._path(vid, ".json"))  # the voice is gone once this is
                except FileNotFoundError:
                    self._drop(vid)
                    raise ApiError(404, f"voice {_short(key)} does not exist", param="voice_id",
                                   code="voice_not_found") from None
                except OSError as e:
                    raise ApiError(500, f"could not delete the voice: {e.strerror or e}") from None
                with contextlib.suppress(OSError):
                    os.remove(self._path(vid, ".wav"))
                self._fsync_dir()
            self._drop(vid)
            log.info("voice %s %r deleted", vid, entry.info.name)
            return entry.info

    def __len__(self) -> int:
        return len(self.list())

    # -- index ---------------------------------------------------------------------------

    def _find(self, key: Any) -> _Entry | None:
        if not isinstance(key, str) or not key:
            return None
        if _ID_RE.fullmatch(key):
            return self._entries.get(key)
        vid = self._names.get(key)
        return None if vid is None else self._entries.get(vid)

    def _ordered(self) -> list[_Entry]:
        return sorted(self._entries.values(), key=lambda e: e.order)

    def _reindex(self) -> None:
        names: dict[str, str] = {}
        for e in self._ordered():
            if e.info.name in names:
                if self._dups.get(e.info.id) != e.sig:
                    self._dups[e.info.id] = e.sig
                    log.warning("voice store %s: %s: name %r is also held by the older %s; "
                                "this one is hidden", self.folder, e.info.id, e.info.name,
                                names[e.info.name])
                continue
            names[e.info.name] = e.info.id
        self._names = names
        for vid in [v for v in self._dups if v not in self._entries]:
            del self._dups[vid]

    def _drop(self, vid: str) -> None:
        self._entries.pop(vid, None)
        self._reindex()

    def _new_id(self) -> str:
        while True:
            vid = "voice_" + secrets.token_hex(12)
            if vid in self._entries or vid in self._bad:
                continue
            if self.folder is not None and (self._path(vid, ".json").exists()
                                            or self._path(vid, ".wav").exists()):
                continue
            return vid

    # -- disk ----------------------------------------------------------------------------

    def _path(self, vid: str, suffix: str) -> Path:
        if not _ID_RE.fullmatch(vid):  # the only place a path is built
            raise ValueError(f"not a voice id: {vid!r}")
        return self.folder / (vid + suffix)

    @staticmethod
    def _stat(path: Path) -> tuple | None:
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _sig(self, vid: str) -> tuple:
        return (self._stat(self._path(vid, ".json")), self._stat(self._path(vid, ".wav")))

    def _scan(self) -> None:
        """Bring the index in line with the folder, reading only new or changed entries."""
        if self.folder is None:
            return
        found: set[str] = set()
        try:
            with os.scandir(self.folder) as it:
                for d in it:
                    m = _JSON_RE.fullmatch(d.name)
                    if m:
                        found.add(m.group(1))
        except OSError as e:
            log.warning("voice store %s: cannot list the folder: %s", self.folder, e)
            return  # keep what we know
        changed = False
        for vid in list(self._entries):
            if vid not in found:
                del self._entries[vid]
                changed = True
        for vid in list(self._bad):
            if vid not in found:
                del self._bad[vid]
        for vid in sorted(found):
            sig = self._sig(vid)
            known = self._entries.get(vid)
            if known is not None and known.sig == sig:
                continue
            if self._bad.get(vid) == sig:
                continue
            changed = True
            self._entries.pop(vid, None)
            if sig[0] is None:  # vanished (or replaced by a non-file) since the listing
                continue
            try:
                entry = self._read_entry(vid, sig)
            except _Corrupt as e:
                self._bad_log(vid, sig, str(e))
                continue
            self._bad.pop(vid, None)
            self._entries[vid] = entry
        if changed:
            self._reindex()

    def _bad_log(self, vid: str, sig: tuple, why: str) -> None:
        self._bad[vid] = sig
        log.warning("voice store %s: skipping %s: %s", self.folder, vid, why)

    def _read_entry(self, vid: str, sig: tuple) -> _Entry:
        """Parse and check `<vid>.json` and the header of `<vid>.wav` (samples come later)."""
        import soundfile as sf

        if sig[1] is None:
            raise _Corrupt("its .wav is missing")
        try:
            with open(self._path(vid, ".json"), "rb") as f:
                meta = json.loads(f.read(64 * 1024))
        except (OSError, ValueError) as e:
            raise _Corrupt(f"unreadable .json ({e})") from None
        try:
            info, created_ns, n = self._parse_meta(vid, meta)
        except (KeyError, TypeError, ValueError, ApiError) as e:
            raise _Corrupt(f"invalid .json ({getattr(e, 'message', e)})") from None
        try:
            hdr = sf.info(str(self._path(vid, ".wav")))
        except (OSError, RuntimeError, sf.LibsndfileError) as e:
            raise _Corrupt(f"unreadable .wav ({e})") from None
        if (hdr.samplerate, hdr.channels, hdr.subtype, hdr.frames) != (SAMPLE_RATE, 1, "FLOAT", n):
            raise _Corrupt(f".wav is {hdr.frames} x {hdr.channels} {hdr.subtype} at "
                           f"{hdr.samplerate} Hz, expected {n} x 1 FLOAT at {SAMPLE_RATE} Hz")
        return _Entry(info, created_ns, sig, None)

    @staticmethod
    def _parse_meta(vid: str, meta: Any) -> tuple[VoiceInfo, int, int]:
        if not isinstance(meta, dict):
            raise TypeError("not a JSON object")
        if meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"unknown version {meta.get('version')!r}")
        if meta.get("id") != vid:
            raise ValueError(f"id {meta.get('id')!r} does not match the file name")
        name = check_name(meta["name"])
        created_at, created_ns, n = meta["created_at"], meta["created_ns"], meta["samples"]
        for k, v in (("created_at", created_at), ("created_ns", created_ns), ("samples", n)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{k} must be a non-negative integer")
        if n < MIN_SECONDS * SAMPLE_RATE:
            raise ValueError(f"{n} samples is under the minimum clip")
        seconds = meta["seconds"]
        if not isinstance(seconds, (int, float)) or not math.isclose(seconds, n / SAMPLE_RATE):
            raise ValueError(f"seconds {seconds!r} does not match {n} samples")
        sha = meta["sha256"]
        if not isinstance(sha, str) or not _SHA_RE.fullmatch(sha):
            raise ValueError("sha256 must be 64 lowercase hex chars")
        consent = meta.get("consent")
        if consent is not None and not isinstance(consent, str):
            raise ValueError("consent must be a string or null")
        info = VoiceInfo(vid, name, created_at, n / SAMPLE_RATE, sha, consent)
        return info, created_ns, n

    def _load_samples(self, entry: _Entry) -> _Entry | None:
        import soundfile as sf

        vid = entry.info.id
        try:
            samples, rate = sf.read(str(self._path(vid, ".wav")), dtype="float32")
        except (OSError, RuntimeError, sf.LibsndfileError) as e:
            why = f"unreadable .wav ({e})"
        else:
            if rate != SAMPLE_RATE or samples.ndim != 1:
                why = f".wav is {samples.shape} at {rate} Hz"
            elif _sha256(samples) != entry.info.sha256:
                why = ".wav samples do not match the stored sha256"
            else:
                samples.flags.writeable = False
                entry.samples = samples
                return entry
        self._bad_log(vid, entry.sig, why)
        self._drop(vid)
        return None

    def _write(self, entry: _Entry) -> None:
        import soundfile as sf

        info = entry.info
        buf = io.BytesIO()
        sf.write(buf, entry.samples, SAMPLE_RATE, format="WAV", subtype="FLOAT")
        meta = {"version": FORMAT_VERSION, **asdict(info), "created_ns": entry.created_ns,
                "samples": int(entry.samples.size), "sample_rate": SAMPLE_RATE}
        wav = self._path(info.id, ".wav")
        self._atomic_write(wav, buf.getvalue())
        try:
            self._atomic_write(self._path(info.id, ".json"),
                               json.dumps(meta, indent=1).encode() + b"\n")
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(wav)
            raise
        self._fsync_dir()

    def _atomic_write(self, path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=path.suffix)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise

    def _fsync_dir(self) -> None:
        with contextlib.suppress(OSError):
            fd = os.open(self.folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    @contextlib.contextmanager
    def _folder_lock(self) -> Iterator[None]:
        """Advisory cross-process lock on the folder for add/delete (no-op in memory)."""
        if self.folder is None or fcntl is None:
            yield
            return
        try:
            fd = os.open(self.folder / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            log.warning("voice store %s: no lock file (%s); adds are not serialized across "
                        "processes", self.folder, e)
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

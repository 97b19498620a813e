"""MediaCache: decoded and preprocessed media parts by content, for follow-up turns.

A chat client re-sends the whole conversation every turn, so a follow-up question about a
video re-sends the video; once the Thinker's prefix cache skips the encoders, decoding and
preprocessing that video again (container decode, frame resizing, resampling, log-mel) is
most of the follow-up's time to first token.

Key:   the kind, the sha256 of the media bytes, and every option that changes the result or
       decides a refusal (the caller builds it; see `Processor._cache_key`). SHA-256 has
       hardware instructions on current x86 / ARM servers: ~1.6 GB/s on one core here,
       faster than hashlib's blake2b (~1 GB/s), and the video path needs that digest anyway.
Value: whatever the Processor builds from those bytes (ProcessedImage, AudioInput, a video's
       OmniPart). Only successes are stored: a bad input is decoded and refused every time.

Bounded by the bytes of the values' tensors, least recently used first out, safe to use
from several threads. Stored values are never handed out: a hit returns a copy (fresh
tensors, the same sharing between a value's own parts), so no request can change another
one's inputs; two threads missing on one key both build it, and one value is kept.

A miss stores its own copy of what it built (touching as much fresh memory as the parts
hold). With `store_in_background` (the ingress) that copy is made on a thread of the cache's own, so
the request goes on at once: the value handed back must then not be changed in place until
its store is done (`wait`); the ingress only sends it on (Ray serializes it: it reads).
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, TypeVar

import torch

from pipeline.handoff import AudioInput, ImageInput

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MediaCacheStats:
    hits: int
    misses: int
    evictions: int
    entries: int
    bytes: int
    capacity_bytes: int


class MediaCache:
    """LRU of built media values by key, at most `max_bytes` of tensors; 0 = off."""

    def __init__(self, max_bytes: int, store_in_background: bool = False):
        if max_bytes < 0:
            raise ValueError(f"media cache size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = (
            OrderedDict()
        )  # key -> (value, bytes)
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._stores = (ThreadPoolExecutor(1, thread_name_prefix="media-cache")
                        if store_in_background and max_bytes > 0 else None)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def get_or_build(self, key: Hashable, build: Callable[[], T]) -> T:
        """A copy of the value stored under key, else build() (stored when it returns, not
        when it raises). The caller owns what it gets back."""
        if not self.enabled:
            return build()
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self._hits += 1
            else:
                self._misses += 1
        if entry is not None:  # stored values are never changed, so copy outside the lock
            return copy_value(entry[0])
        value = build()
        if self._stores is None:
            self._put(key, value)
        else:
            self._stores.submit(self._store, key, value)
        return value

    def wait(self) -> None:
        """Return once every store started before this call is done."""
        if self._stores is not None:
            self._stores.submit(lambda: None).result()  # one thread: in order

    def _store(self, key: Hashable, value: Any) -> None:
        try:
            self._put(key, value)
        except Exception:  # a later turn decodes it again: that is all a lost store costs
            log.exception("media cache: storing %s failed", type(value).__name__)

    def _put(self, key: Hashable, value: Any) -> None:
        stored = copy_value(value)  # the caller keeps `value`; the cache holds its own tensors
        size = value_bytes(stored)
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:  # another thread built it meanwhile: keep the first
                self._entries.move_to_end(key)
                return
            self._entries[key] = (stored, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, freed) = self._entries.popitem(last=False)
                self._bytes -= freed
                self._evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> MediaCacheStats:
        with self._lock:
            return MediaCacheStats(
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                entries=len(self._entries),
                bytes=self._bytes,
                capacity_bytes=self.max_bytes,
            )


def copy_value(value: T) -> T:
    """A copy of a built media value: every tensor cloned, dataclasses and lists rebuilt,
    strings and numbers shared (immutable); an object reached twice (a merged audio clip
    behind several AudioParts) is copied once, so the prompt builder still sees one clip."""
    return _copy(value, {})


def _copy(obj: Any, memo: dict[int, Any]) -> Any:
    if obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return obj
    done = memo.get(id(obj))
    if done is not None:
        return done
    if isinstance(obj, torch.Tensor):
        out: Any = _copy_tensor(obj)
    elif isinstance(obj, ImageInput):  # its own __reduce__ would go through numpy
        out = ImageInput(
            [_copy(t, memo) for t in obj.pixel_values], _copy(obj.tgt_sizes, memo), obj.content_hash
        )
    elif isinstance(obj, AudioInput):
        out = AudioInput(_copy(obj.features, memo), obj.content_hash)
    elif isinstance(obj, (list, tuple)):
        out = type(obj)(_copy(x, memo) for x in obj)
    elif is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for f in fields(obj):
            object.__setattr__(out, f.name, _copy(getattr(obj, f.name), memo))
    else:
        raise TypeError(f"media cache cannot copy a {type(obj).__name__}")
    memo[id(obj)] = out
    return out


def _copy_tensor(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor through numpy's copy: one plain memcpy on this thread. torch's clone
    splits large copies over its intra-op threads, which on a busy host stalls behind the
    other threads' work."""
    if t.device.type != "cpu" or t.requires_grad or t.dtype not in _NUMPY_DTYPES:
        return t.clone()
    return torch.from_numpy(t.numpy().copy(order="K"))  # keeps the strides, as clone


_NUMPY_DTYPES = frozenset({torch.uint8, torch.int32, torch.int64, torch.float32, torch.float16})


def value_bytes(value: Any) -> int:
    """Bytes of the distinct tensor storages a value holds (what caching it keeps alive)."""
    seen: dict[int, int] = {}
    _storages(value, seen, set())
    return sum(seen.values())


def _storages(obj: Any, seen: dict[int, int], visited: set[int]) -> None:
    if id(obj) in visited or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    visited.add(id(obj))
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _storages(x, seen, visited)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            _storages(getattr(obj, f.name), seen, visited)

"""The processed-media cache: follow-up turns decode nothing and build the same request.

Compared against a Processor without a cache (the plain path): the ThinkerRequests must be
equal field by field with every tensor's bytes, dtype, shape and strides the same.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from test_api import data_uri, light_source, png_bytes, wav_bytes
from test_processing_prompt import ByteTokenizer
from test_processing_video import make_mp4

import pipeline.processing.processor as processor_module
from pipeline.config import ThinkerConfig
from pipeline.processing import (
    CorruptMediaError,
    MediaBytes,
    MediaLimits,
    Processor,
    TooManyFramesError,
)
from pipeline.processing.errors import MediaError
from pipeline.processing.media_cache import MediaCache, copy_value, value_bytes

MIB = 1024**2
VIDEO = make_mp4(3.0)
VIDEO_2 = make_mp4(2.0)
IMAGE = png_bytes(600, 500, seed=3)  # sliced: a source image and a grid
AUDIO = wav_bytes(1.3)


def proc(cache: MediaCache | None = None, **kw) -> Processor:
    limits = kw.pop("limits", MediaLimits())
    return Processor(ThinkerConfig(), ByteTokenizer(), limits, media_cache=cache, **kw)


def conversation(video: bytes = VIDEO, turns: int = 1) -> list[dict]:
    """A user turn with a video, an image and an audio clip; then `turns - 1` follow-ups."""
    media = [
        {"type": "video", "data": video},
        {"type": "image", "data": IMAGE},
        {"type": "audio", "data": AUDIO},
        "what happens here?",
    ]
    msgs = [{"role": "user", "content": media}]
    for i in range(1, turns):
        msgs += [
            {"role": "assistant", "content": f"answer {i}"},
            {"role": "user", "content": f"follow-up {i}?"},
        ]
    return msgs


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return (x.dtype, x.shape, x.stride()) == (y.dtype, y.shape, y.stride()) and (
        x.numpy().tobytes() == y.numpy().tobytes()
    )


def same_request(a, b) -> None:
    """Every field equal, every tensor bit for bit (also after the pickling Ray does)."""
    for x, y in ((a, b), (pickle.loads(pickle.dumps(a)), b)):
        assert replace(x, images=[], audios=[]) == replace(y, images=[], audios=[])
        assert len(x.images) == len(y.images) and len(x.audios) == len(y.audios)
        for i, j in zip(x.images, y.images):
            assert i.content_hash == j.content_hash and same_bits(i.tgt_sizes, j.tgt_sizes)
            assert all(same_bits(s, t) for s, t in zip(i.pixel_values, j.pixel_values, strict=True))
        for i, j in zip(x.audios, y.audios):
            assert i.content_hash == j.content_hash and same_bits(i.features, j.features)


@pytest.fixture
def decodes(monkeypatch) -> dict[str, int]:
    """Counts calls of the Processor's decoders (video, image, audio)."""
    counts = {"video": 0, "image": 0, "audio": 0}
    for kind in counts:
        name = f"decode_{kind}"
        real = getattr(processor_module, name)

        def counted(*args, _real=real, _kind=kind, **kwargs):
            counts[_kind] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(processor_module, name, counted)
    return counts


def test_followup_decodes_nothing_and_builds_the_same_request(decodes):
    cache = MediaCache(256 * MIB)
    cached, plain = proc(cache), proc()
    first = cached.build(conversation(), request_id="r")
    assert decodes == {"video": 1, "image": 1, "audio": 1}
    same_request(first, plain.build(conversation(), request_id="r"))
    for turns in (1, 2, 3):  # the same turn again, then follow-ups re-sending the media
        decodes.update(video=0, image=0, audio=0)
        req = cached.build(conversation(turns=turns), request_id="r")
        assert decodes == {"video": 0, "image": 0, "audio": 0}
        same_request(req, plain.build(conversation(turns=turns), request_id="r"))
    st = cache.stats()
    assert (st.hits, st.misses, st.entries) == (9, 3, 3)
    assert 0 < st.bytes == sum(value_bytes(v) for v, _ in cache._entries.values())


def test_merged_video_audio_keeps_one_clip_per_video():
    """merge_video_audio: the AudioParts of one video share one clip; a hit must keep that
    sharing (one clip per video), and the same video twice must stay two clips."""
    cache = MediaCache(256 * MIB)
    cached, plain = proc(cache, merge_video_audio=True), proc(merge_video_audio=True)
    msgs = [{"role": "user", "content": [{"type": "video", "data": VIDEO}] * 2 + ["twice?"]}]
    for _ in range(2):
        req = cached.build(msgs)
        assert len(req.audios) == 2
        same_request(req, plain.build(msgs))
    assert cache.stats().hits >= 2


def test_requests_never_share_tensors():
    cache = MediaCache(256 * MIB)
    cached, plain = proc(cache), proc()
    a = cached.build(conversation())
    b = cached.build(conversation())
    ptrs = lambda r: (
        {t.data_ptr() for i in r.images for t in i.pixel_values}
        | {c.features.data_ptr() for c in r.audios}
    )
    assert not ptrs(a) & ptrs(b)
    for req in (a, b):  # a request changing its inputs in place changes nobody else's
        for img in req.images:
            for t in img.pixel_values:
                t.fill_(7)
        for clip in req.audios:
            clip.features.zero_()
    same_request(cached.build(conversation()), plain.build(conversation()))


def test_a_store_in_the_background_does_not_hold_the_request(monkeypatch):
    """The miss returns what it built before its copy is stored; once stored, hits are
    copies of it, sharing no tensor with it or each other; a store that fails is logged and
    leaves nothing behind."""
    import pipeline.processing.media_cache as M

    cache = MediaCache(256 * MIB, store_in_background=True)
    gate, real_copy = threading.Event(), M.copy_value

    def held_copy(value):
        assert gate.wait(10)
        return real_copy(value)

    monkeypatch.setattr(M, "copy_value", held_copy)
    first = cache.get_or_build("k", lambda: [torch.arange(6.0)])  # returns, store held
    assert cache.stats().entries == 0 and cache.stats().misses == 1
    gate.set()
    cache.wait()
    assert cache.stats().entries == 1
    hit = cache.get_or_build("k", lambda: pytest.fail("a hit builds nothing"))
    assert torch.equal(hit[0], first[0]) and hit[0].data_ptr() != first[0].data_ptr()
    first[0].fill_(7)  # once stored, the request's own tensors are its own
    assert torch.equal(cache.get_or_build("k", list)[0], torch.arange(6.0))
    cache.get_or_build("bad", lambda: [object()])  # the copy refuses it, in the background
    cache.wait()
    assert cache.stats().entries == 1


def test_different_bytes_or_options_miss(decodes):
    cache = MediaCache(256 * MIB)
    cached = proc(cache)
    cached.build(conversation())
    decodes.update(video=0, image=0, audio=0)
    cached.build(conversation(VIDEO_2))  # other video bytes: only the video is decoded
    assert decodes == {"video": 1, "image": 0, "audio": 0}
    assert cache.stats().entries == 4

    # An image's slicing cap changes its pixels: another entry, the plain path's result.
    msgs = [{"role": "user", "content": [{"type": "image", "data": IMAGE}, "hi"]}]
    for n in (1, 2):
        decodes["image"] = 0
        req = cached.build(msgs, max_slice_nums=n)
        assert decodes["image"] == 1
        same_request(req, proc().build(msgs, max_slice_nums=n))

    # Processor-wide decoder inputs (a video's frame cap) are part of the key too.
    few = MediaLimits(max_video_frames=2)
    decodes["video"] = 0
    req = proc(cache, limits=few).build(conversation())
    assert decodes["video"] == 1 and len(req.images) == 2 + 1
    same_request(req, proc(limits=few).build(conversation()))


def test_options_applied_after_decoding_hit_and_stay_exact(decodes):
    """use_image_id and chunked audio shape the prompt, not the pixels or features: they
    share entries, and each request still equals the plain path with its own options."""
    cache = MediaCache(256 * MIB)
    proc(cache).build(conversation())
    no_ids = proc().build(conversation(), use_image_id=False)
    chunked = proc(chunked_audio=True).build(conversation())
    decodes.update(video=0, image=0, audio=0)
    same_request(proc(cache).build(conversation(), use_image_id=False), no_ids)
    same_request(proc(cache, chunked_audio=True).build(conversation()), chunked)
    assert decodes == {"video": 0, "image": 0, "audio": 0}


def test_failing_media_is_refused_every_time_and_not_cached(decodes):
    cache = MediaCache(256 * MIB)
    bad = VIDEO[: len(VIDEO) // 3]  # a truncated MP4
    msgs = [{"role": "user", "content": [{"type": "video", "data": bad}, "?"]}]
    errors = []
    for _ in range(2):
        with pytest.raises(MediaError) as e:
            proc(cache).build(msgs)
        errors.append((type(e.value), str(e.value)))
    assert errors[0] == errors[1] and decodes["video"] == 2
    assert cache.stats().entries == 0 and cache.stats().hits == 0


def test_request_limits_are_checked_on_hits():
    """max_images counts the request's frames and images whether they were decoded or not."""
    cache = MediaCache(256 * MIB)
    cached = proc(cache, limits=MediaLimits(max_images=4))  # the 3 s video: 3 frames
    one = [{"role": "user", "content": [{"type": "video", "data": VIDEO}]}]
    two = [{"role": "user", "content": [{"type": "video", "data": VIDEO}] * 2}]
    cached.build(one)
    for _ in range(2):
        with pytest.raises(TooManyFramesError):
            cached.build(two)
    assert cache.stats().hits == 4 and cache.stats().entries == 1


def test_lru_eviction_by_bytes():
    cache = MediaCache(3000)
    built: list[str] = []

    def value(name: str, n_bytes: int):
        def build():
            built.append(name)
            return [torch.zeros(n_bytes // 4)]

        return build

    for name in "abc":
        cache.get_or_build(name, value(name, 1000))
    assert cache.stats().bytes == 3000 and cache.stats().entries == 3
    cache.get_or_build("a", value("a", 1000))  # a is now the most recent
    cache.get_or_build("d", value("d", 1000))  # evicts b, the least recent
    assert list(cache._entries) == ["c", "a", "d"] and cache.stats().evictions == 1
    cache.get_or_build("e", value("e", 2000))  # evicts c and a
    assert list(cache._entries) == ["d", "e"] and cache.stats().bytes == 3000
    cache.get_or_build("big", value("big", 4000))  # larger than the whole cache: not kept
    assert "big" not in cache._entries and cache.stats().bytes == 3000
    built.clear()
    for name in ("d", "e", "b"):
        cache.get_or_build(name, value(name, 1000))
    assert built == ["b"]


def test_copy_value_clones_and_counts_shared_storage_once():
    shared = torch.arange(10.0)
    value = [shared, shared, torch.zeros(3, 4)[:, :2]]
    out = copy_value(value)
    assert out[0] is out[1] and out[0] is not shared and torch.equal(out[0], shared)
    assert out[0].data_ptr() != shared.data_ptr()
    assert value_bytes(value) == 40 + 48  # the view keeps its whole storage alive
    with pytest.raises(TypeError):
        copy_value([object()])


def test_concurrent_builds_are_safe():
    cache = MediaCache(256 * MIB)
    cached = proc(cache)
    expected = proc().build(conversation())
    start = threading.Barrier(2)

    def run(_):
        start.wait()
        return cached.build(conversation())

    for _ in range(2):  # both miss at once, then both hit at once
        with ThreadPoolExecutor(2) as pool:
            for req in pool.map(run, range(2)):
                same_request(req, expected)
    st = cache.stats()
    assert st.entries == 3 and st.hits + st.misses == 12 and st.hits >= 6

    small = MediaCache(5000)  # many threads, overlapping keys, constant eviction

    def churn(seed: int) -> None:
        for i in range(200):
            key = (seed * 7 + i) % 13
            got = small.get_or_build(key, lambda k=key: [torch.full((250,), float(k))])
            assert torch.equal(got[0], torch.full((250,), float(key)))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(churn, range(4)))
    st = small.stats()
    assert st.bytes == 1000 * st.entries <= 5000
    assert st.hits + st.misses == 800


def test_zero_bytes_turns_the_cache_off(decodes):
    cache = MediaCache(0)
    cached = proc(cache)
    for _ in range(2):
        same_request(cached.build(conversation()), proc().build(conversation()))
    assert decodes == {"video": 4, "image": 4, "audio": 4}
    st = cache.stats()
    assert (st.hits, st.misses, st.entries, st.bytes) == (0, 0, 0, 0)
    with pytest.raises(ValueError):
        MediaCache(-1)


def test_corrupt_image_error_unchanged_with_cache():
    msgs = [{"role": "user", "content": [MediaBytes("image", IMAGE[:200]), "?"]}]
    with pytest.raises(CorruptMediaError) as plain:
        proc().build(msgs)
    with pytest.raises(CorruptMediaError) as cached:
        proc(MediaCache(MIB)).build(msgs)
    assert str(plain.value) == str(cached.value)


# ---------------------------------------------------------------------------------------
# The ingress: settings, stats, metrics


def _body() -> dict:
    parts = [
        {"type": "video_url", "video_url": {"url": data_uri(VIDEO, "video/mp4")}},
        {"type": "text", "text": "what is shown?"},
    ]
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 4}


@pytest.mark.parametrize("size", [None, 0])
def test_ingress_stats_and_metrics_show_hits(size):
    from fakes import build_local_app

    cfg = {} if size is None else {"limits": {"media_cache_bytes": size}}
    ingress = build_local_app(cfg, light_source()).ingress

    async def main():
        turns = []
        for _ in range(3):  # each a follow-up once the turn before it was stored
            turns.append(await ingress.prepare(ingress.parse(_body())))
            ingress.media_cache.wait()
        return turns, await ingress.stats()

    turns, stats = asyncio.run(main())
    for t in turns[1:]:
        t.thinker_request.request_id = turns[0].thinker_request.request_id
        same_request(t.thinker_request, turns[0].thinker_request)
    st = stats["media_cache"]
    if size == 0:
        assert st == {
            "hits": 0,
            "misses": 0,
            "evictions": 0,
            "entries": 0,
            "bytes": 0,
            "capacity_bytes": 0,
        }
    else:
        assert st["capacity_bytes"] == 512 * MIB
        assert (st["hits"], st["misses"], st["entries"]) == (2, 1, 1) and st["bytes"] > 0
        assert ingress.metrics._ingress._counters == {"media_cache_hits": 2}


def test_setting_is_validated():
    from pydantic import ValidationError

    from deployments.config import AppConfig

    assert AppConfig().limits.media_cache_bytes == 512 * MIB
    with pytest.raises(ValidationError, match="media_cache_bytes"):
        AppConfig.model_validate({"limits": {"media_cache_bytes": -1}})

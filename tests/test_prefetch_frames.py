"""A request's media handed to the Thinker while the rest still decodes (a video's frames,
an audio part's clip): the Processor's `on_media` (the media exactly as the request holds
them, the request unchanged) and the ingress sending them to the Thinker's `prefetch`
(in-process app over fake engines)."""

from __future__ import annotations

import asyncio
import io
import threading

import numpy as np
import pytest
import soundfile as sf
import torch
from test_api import data_uri, light_source, user
from test_processing_prompt import ByteTokenizer
from test_processing_video import encode_clip, make_mp4

from deployments.wire import Done
from fakes import build_local_app
from pipeline.config import ThinkerConfig
from pipeline.handoff import AudioInput, ImageInput
from pipeline.processing import MediaBytes, Processor, processor as P, video as V


def _hold_back(monkeypatch, module, name: str) -> threading.Event:
    """`module.name` (an audio decoder) returns only once the event is set (or after 10 s)."""
    handed = threading.Event()
    decode = getattr(module, name)

    def after_frames(*a, **k):
        handed.wait(10)
        return decode(*a, **k)

    monkeypatch.setattr(module, name, after_frames)
    return handed


@pytest.fixture
def slow_audio(monkeypatch):
    """The audio track finishes only once the frames were handed over (or after 10 s), so
    the frames always come first, as with a real clip whose audio decodes longer."""
    return _hold_back(monkeypatch, V, "_decode_audio_track")


def _build(on_media=None, clip=None, extra=()):
    proc = Processor(ThinkerConfig(), ByteTokenizer())
    content = [MediaBytes("video", clip or make_mp4(3.5)), *extra, "Q?"]
    return proc.build([{"role": "user", "content": content}], speech_output=True,
                      on_media=on_media)


def test_on_frames_hands_over_the_request_frames_before_the_audio(slow_audio):
    got = []

    def on_frames(images):
        got.append((images, slow_audio.is_set()))
        slow_audio.set()

    req = _build(on_frames)
    plain = _build()
    assert len(got) == 1 and got[0][1] is False  # before the audio track was done
    images = got[0][0]
    assert len(images) == 4 and all(a is b for a, b in zip(images, req.images, strict=True))
    assert req.input_ids == plain.input_ids and req.image_bounds == plain.image_bounds
    for a, b in zip(req.images, plain.images, strict=True):
        assert a.content_hash == b.content_hash
        assert all(torch.equal(x, y) for x, y in zip(a.pixel_values, b.pixel_values, strict=True))
    assert [a.content_hash for a in req.audios] == [a.content_hash for a in plain.audios]


def test_on_frames_is_not_called_for_a_video_that_is_all_there_is(slow_audio):
    slow_audio.set()  # nothing is to be handed over: no reason to hold the audio back
    got = []
    req = _build(got.append, make_mp4(2.5, audio=False))
    assert not got and len(req.images) == 3 and not req.audios


def test_on_frames_while_another_media_part_decodes(monkeypatch):
    """The benchmark's shape: a video without an audio track, its audio as a part of its own
    (decoded side by side): the frames go as soon as they are decoded. The audio part, let
    go by the frames' handoff, may finish before the video's part is done: then its clip
    goes ahead too (the order of those two is the threads')."""
    handed = _hold_back(monkeypatch, P, "decode_audio")
    got = []

    def on_frames(items):
        got.append(items)
        handed.set()

    wav = io.BytesIO()
    sf.write(wav, np.zeros(16000, np.float32), 16000, format="WAV")
    req = _build(on_frames, make_mp4(2.5, audio=False), [MediaBytes("audio", wav.getvalue())])
    assert [a.content_hash for a in got[0]] == [a.content_hash for a in req.images]
    assert [a.content_hash for items in got[1:] for a in items] in (
        [], [a.content_hash for a in req.audios])
    assert len(req.images) == 3 and len(req.audios) == 1


def test_the_ingress_sends_a_video_frames_ahead(slow_audio):
    """The Thinker gets the turn's frames before its request (the same content hashes), and
    the turn completes."""
    clip = make_mp4(3.5)
    body = {"messages": user([{"type": "video_url",
                               "video_url": {"url": data_uri(clip, "video/mp4")}},
                              {"type": "text", "text": "What happens?"}]),
            "modalities": ["text", "audio"], "max_tokens": 8}
    cfg = {"capacity": 2}

    async def main():
        local = build_local_app(cfg, light_source())
        engine = local.thinker.engine
        opened = []
        real_open, real_prefetch = engine.open, engine.prefetch

        def take_frames(images):  # the frames reached the Thinker: the audio may finish now
            real_prefetch(images)
            slow_audio.set()

        def open_(rid, spec):
            opened.append((list(engine.prefetched), [im.content_hash for im in spec.images]))
            return real_open(rid, spec)

        engine.open, engine.prefetch = open_, take_frames
        evs = [ev async for ev in local.ingress.chat(body)]
        return evs, opened

    evs, opened = asyncio.run(main())
    assert isinstance(evs[-1], Done)
    (before, hashes), = opened
    assert len(hashes) == 4
    assert before == hashes


# --- frames handed over while later ones still decode ---------------------------------


def _record():
    calls = []

    def on_frames(picks, frames, timestamps, pending):
        calls.append((list(picks), list(frames), list(timestamps), pending))

    return calls, on_frames


@pytest.mark.parametrize("options", [{"g": "250"}, {"g": "10"}])  # one run / runs side by side
def test_decode_video_hands_frames_over_a_few_at_a_time(options):
    """Every frame exactly once, the very images returned, `handoff_frames` or more a call
    while later ones decode (pending), the rest last; the frames equal a decode without."""
    data = encode_clip(12.4, 5, options=options)
    calls, on_frames = _record()
    v = V.decode_video(data, on_frames=on_frames, handoff_frames=3)
    plain = V.decode_video(data)
    assert v.num_frames == plain.num_frames == 13 and not v.redecoded
    assert all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(v.frames, plain.frames, strict=True))
    picks = sorted(i for c in calls for i in c[0])
    assert picks == list(range(13)) and len(calls) >= 2
    for i, (ps, frames, ts, pending) in enumerate(calls):
        assert ps == sorted(ps) and ts == [v.timestamps[j] for j in ps]
        assert all(f is v.frames[j] for j, f in zip(ps, frames, strict=True))
        assert pending == (i < len(calls) - 1)  # no audio track: nothing pending at the end
        assert i == len(calls) - 1 or len(ps) >= 3


def test_frames_handed_from_a_decode_given_up_are_keyed_apart(monkeypatch):
    """The packets-only decode hands frames over, then finds a reason to decode in full: the
    request's frames are keyed apart from those handed over (they may differ), and the
    request is otherwise what a build without handing over makes."""
    data = encode_clip(12.4, 5, options={"g": "250"})
    real = V._decode_runs

    def given_up(*a, **k) -> None:  # hands its frames over as they decode, then gives up
        real(*a, **k)

    handed = []
    plain = _build(clip=data)
    monkeypatch.setattr(V, "_decode_runs", given_up)
    req = _build(handed.extend, data, [MediaBytes("audio", _wav())])
    ref = _build(clip=data, extra=[MediaBytes("audio", _wav())])
    assert handed and len(req.images) == 13
    assert not {im.content_hash for im in handed} & {im.content_hash for im in req.images}
    assert req.input_ids == ref.input_ids and req.image_bounds == ref.image_bounds
    for a, b in zip(req.images, plain.images, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a.pixel_values, b.pixel_values, strict=True))


def test_a_video_as_the_last_media_goes_ahead_while_it_still_decodes():
    """The benchmark's shape with a clip longer than a handoff: frames go ahead while later
    ones decode, though the audio part was done first; the request is unchanged."""
    data = encode_clip(12.4, 5, options={"g": "10"})
    got = []
    req = _build(got.append, data, [MediaBytes("audio", _wav())])
    plain = _build(clip=data, extra=[MediaBytes("audio", _wav())])
    frames = [items for items in got if isinstance(items[0], ImageInput)]
    assert frames and all(len(images) >= V.HANDOFF_FRAMES for images in frames)
    by_hash = {im.content_hash: im for im in req.images}
    assert all(im is by_hash[im.content_hash] for images in frames for im in images)
    assert [im.content_hash for im in req.images] == [im.content_hash for im in plain.images]
    assert req.input_ids == plain.input_ids


def _wav(seconds: float = 1.0) -> bytes:
    wav = io.BytesIO()
    sf.write(wav, np.zeros(int(16000 * seconds), np.float32), 16000, format="WAV")
    return wav.getvalue()


def test_frames_go_while_decoding_only_when_the_ingress_builds_nothing_else():
    """A few frames at a time while a video decodes costs the ingress's cores: only a build
    that starts alone does it; the frames of one that starts beside another go as before."""
    body = {"messages": user([{"type": "text", "text": "hi"}]), "max_tokens": 2}

    async def main():
        local = build_local_app({"capacity": 2}, light_source())
        ing = local.ingress
        seen, gate = [], threading.Event()

        def prepare(req, rid, on_frames=None, frames_while_decoding=True):
            seen.append(frames_while_decoding)
            gate.wait(10)
            raise ValueError("built")

        ing._prepare = prepare
        both = [asyncio.create_task(ing.prepare(ing.parse(body))) for _ in range(2)]
        while len(seen) < 2:
            await asyncio.sleep(0.01)
        gate.set()
        errors = await asyncio.gather(*both, return_exceptions=True)
        with pytest.raises(ValueError):
            await ing.prepare(ing.parse(body))  # alone again
        return seen, errors

    seen, errors = asyncio.run(main())
    assert seen == [True, False, True] and all(isinstance(e, ValueError) for e in errors)


def test_no_frames_while_decoding_when_asked_not_to():
    data = encode_clip(12.4, 5, options={"g": "10"})
    got = []
    proc = Processor(ThinkerConfig(), ByteTokenizer())
    content = [MediaBytes("video", data), MediaBytes("audio", _wav()), "Q?"]
    req = proc.build([{"role": "user", "content": content}], speech_output=True,
                     on_media=got.append, frames_while_decoding=False)
    frames = [items for items in got if isinstance(items[0], ImageInput)]
    assert len(req.images) == 13 and all(len(images) == 13 for images in frames)


def test_an_audio_part_goes_ahead_while_the_video_still_decodes(monkeypatch):
    """The benchmark's shape: the clip's audio as a part of its own decodes first: its clip
    goes ahead (the very object the request holds), once; an audio part that is the last to
    finish goes with the request only."""
    video = P.decode_video
    released = _hold_back(monkeypatch, P, "decode_video")  # done once the clip went
    got = []

    def on_media(items):
        got.append(items)
        released.set()

    req = _build(on_media, make_mp4(2.5, audio=False), [MediaBytes("audio", _wav())])
    clips = [items for items in got if isinstance(items[0], AudioInput)]
    assert clips == [[req.audios[0]]] and clips[0][0] is req.audios[0]
    monkeypatch.setattr(P, "decode_video", video)
    held = _hold_back(monkeypatch, P, "decode_audio")  # now the audio finishes last:
    part_done = P._MediaHandoff.part_done  # once the video's part is all done

    def video_done(self):
        part_done(self)
        held.set()

    monkeypatch.setattr(P._MediaHandoff, "part_done", video_done)
    got.clear()
    req = _build(got.append, make_mp4(2.5, audio=False), [MediaBytes("audio", _wav())])
    assert got and all(isinstance(m, ImageInput) for items in got for m in items)

"""A video's frames handed to the Thinker while its audio track still decodes: the Processor's
`on_frames` (the frames exactly as the request holds them, the request unchanged) and the
ingress sending them to the Thinker's `prefetch` (in-process app over fake engines)."""

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
from test_processing_video import make_mp4

from deployments.schemas import Done
from deployments.testing import build_local_app
from pipeline.config import ThinkerConfig
from pipeline.processing import MediaBytes, Processor
from pipeline.processing import processor as P
from pipeline.processing import video as V


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


def _build(on_frames=None, clip=None, extra=()):
    proc = Processor(ThinkerConfig(), ByteTokenizer())
    content = [MediaBytes("video", clip or make_mp4(3.5)), *extra, "Q?"]
    return proc.build([{"role": "user", "content": content}], speech_output=True,
                      on_frames=on_frames)


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
    (decoded side by side): the frames go as soon as they are decoded."""
    handed = _hold_back(monkeypatch, P, "decode_audio")
    got = []

    def on_frames(images):
        got.append(images)
        handed.set()

    wav = io.BytesIO()
    sf.write(wav, np.zeros(16000, np.float32), 16000, format="WAV")
    req = _build(on_frames, make_mp4(2.5, audio=False), [MediaBytes("audio", wav.getvalue())])
    assert len(got) == 1 and [a.content_hash for a in got[0]] == [
        a.content_hash for a in req.images]
    assert len(req.images) == 3 and len(req.audios) == 1


@pytest.mark.parametrize("prefetch", [True, False])
def test_the_ingress_sends_a_video_frames_ahead(slow_audio, prefetch):
    """With `ingress.prefetch_frames` the Thinker gets the turn's frames before its request
    (the same content hashes), and the turn completes as without."""
    clip = make_mp4(3.5)
    body = {"messages": user([{"type": "video_url",
                               "video_url": {"url": data_uri(clip, "video/mp4")}},
                              {"type": "text", "text": "What happens?"}]),
            "modalities": ["text", "audio"], "max_tokens": 8}
    cfg = {"active_stream_window": 2, "ingress": {"prefetch_frames": prefetch}}

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
        if not prefetch:
            slow_audio.set()
        evs = [ev async for ev in local.ingress.chat(body)]
        return evs, opened

    evs, opened = asyncio.run(main())
    assert isinstance(evs[-1], Done)
    (before, hashes), = opened
    assert len(hashes) == 4
    assert before == (hashes if prefetch else [])

"""The official `openai` client against the running Ray Serve app (tests/apps.py, real
engines on the tiny default): chat with text and with audio out in every format, sync and
async, streamed and not; models.list / models.retrieve; the voices endpoints (refused on
the tiny default, which has no voice front end; the whole round trip on an app whose
Code2Wav is the fake engine, which accepts voices)."""

from __future__ import annotations

import asyncio
import base64
import io
import tempfile

import av
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("ray.serve")

import apps
from ray import serve
from test_api import wav_bytes

from deployments.app import build_omni_app
from fakes import FakeCode2WavEngine, FakeTalkerEngine, FakeThinkerEngine

APP = apps.APP
CODES = 30  # fixed-length speech: 3 silence codes + 30 codes of 960 samples each, after
# 160 ms of zeros (minicpmo-utils 1.0.7's first chunk)
SAMPLES = (3 + CODES) * 960 + 3840


def decoded_samples(data: bytes, fmt: str) -> tuple[int, int]:
    """(samples, rate) of encoded audio bytes (pcm16: raw 24 kHz int16)."""
    if fmt == "pcm16":
        return len(data) // 2, 24000
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.audio[0]
        n = sum(f.samples for f in c.decode(stream))
        return n, stream.codec_context.sample_rate


def speech_kwargs(fmt: str, **extra) -> dict:
    return dict(model=APP, max_tokens=6, messages=[{"role": "user", "content": "Hi"}],
                modalities=["text", "audio"], audio={"format": fmt, "voice": "alloy"},
                extra_body={"omniray": {"fixed_speech_codes": CODES}, **extra})


def check_duration(data: bytes, fmt: str) -> None:
    n, rate = decoded_samples(data, fmt)
    seconds = n / rate
    # Lossy codecs add priming / padding (mp3 ~0.05 s, aac ~0.09 s); none loses audio.
    assert SAMPLES / 24000 - 0.01 <= seconds <= SAMPLES / 24000 + 0.15, (fmt, seconds)


@pytest.fixture(scope="module")
def client(serve_app):
    return openai.OpenAI(base_url=f"{serve_app}/v1", api_key="unused", max_retries=0)


def test_models_list_and_retrieve(client):
    assert [m.id for m in client.models.list().data] == [APP, "openbmb/MiniCPM-o-4_5"]
    assert client.models.retrieve(APP).id == APP
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_text_chat_sync_stream_and_not(client):
    out = client.chat.completions.create(model=APP, max_tokens=6,
                                         messages=[{"role": "developer", "content": "Be brief."},
                                                   {"role": "user", "content": "Hi"}])
    assert out.choices[0].message.content and out.usage.completion_tokens > 0
    text = [c.choices[0].delta.content for c in client.chat.completions.create(
        model=APP, max_tokens=6, stream=True, messages=[{"role": "user", "content": "Hi"}])
        if c.choices and c.choices[0].delta.content]
    assert "".join(text)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=APP, messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.chat.completions.create(model=APP, max_tokens=4, messages=[
            {"role": "user", "content": "Hi"}], response_format={"type": "json_object"})


@pytest.mark.parametrize("fmt", ["wav", "pcm16", "mp3", "opus", "aac", "flac"])
def test_streamed_speech_in_every_format(client, fmt):
    """OpenAI's streamed audio: delta.audio pieces of one id; the transcript is the text;
    the pieces joined decode to all of the audio (wav: each piece is a file of its own)."""
    pieces, transcript, expires = [], [], None
    for chunk in client.chat.completions.create(stream=True, **speech_kwargs(fmt)):
        if not chunk.choices:
            continue
        audio = chunk.choices[0].delta.audio
        if audio is None:
            continue
        if audio.data:
            pieces.append(base64.b64decode(audio.data))
        if audio.transcript:
            transcript.append(audio.transcript)
        expires = audio.expires_at or expires
    assert pieces and "".join(transcript) and expires
    if fmt == "wav":
        total = sum(decoded_samples(p, fmt)[0] for p in pieces)
        assert total == SAMPLES
    else:
        check_duration(b"".join(pieces), fmt)


@pytest.mark.parametrize("fmt", ["wav", "mp3"])
def test_non_streamed_speech(client, fmt):
    out = client.chat.completions.create(**speech_kwargs(fmt))
    audio = out.choices[0].message.audio
    assert audio.id and audio.transcript == out.choices[0].message.content
    check_duration(base64.b64decode(audio.data), fmt)


def test_async_client_streamed_and_not(serve_app):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{serve_app}/v1", api_key="unused",
                                     max_retries=0)
        stream = await aclient.chat.completions.create(stream=True, **speech_kwargs("opus"))
        data = b"".join([base64.b64decode(c.choices[0].delta.audio.data) async for c in stream
                         if c.choices and c.choices[0].delta.audio
                         and c.choices[0].delta.audio.data])
        whole = await aclient.chat.completions.create(**speech_kwargs("flac"))
        models = await aclient.models.list()
        await aclient.close()
        return data, whole, models

    data, whole, models = asyncio.run(main())
    check_duration(data, "opus")
    check_duration(base64.b64decode(whole.choices[0].message.audio.data), "flac")
    assert models.data[0].id == APP


def test_voices_refused_without_a_voice_front_end(client):
    with pytest.raises(openai.BadRequestError, match="voice cloning is not available"):
        client.audio.voices.create(name="narrator", consent="cons_1",
                                   audio_sample=("v.wav", wav_bytes(1.0), "audio/wav"))
    with pytest.raises(openai.BadRequestError, match="voice cloning is not available"):
        client.chat.completions.create(
            model=APP, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
            modalities=["text", "audio"], audio={"format": "wav", "voice": "narrator"})


@pytest.fixture(scope="module")
def fake_voice_app(ray_http):
    """The app over fake engines (their Code2Wav accepts reference voices)."""
    cfg = {"voices_dir": tempfile.mkdtemp(prefix="omniray-fake-voices-"),
           "capacity": 4}
    serve.run(build_omni_app(cfg, thinker_engine_cls=FakeThinkerEngine,
                             talker_engine_cls=FakeTalkerEngine,
                             code2wav_engine_cls=FakeCode2WavEngine, use_gpu=False),
              name="fakevoices", route_prefix="/fakevoices")
    yield f"{ray_http}/fakevoices"
    serve.delete("fakevoices")


def test_voices_round_trip(fake_voice_app):
    import requests

    client = openai.OpenAI(base_url=f"{fake_voice_app}/v1", api_key="unused", max_retries=0)
    voice = client.audio.voices.create(name="narrator", consent="cons_1",
                                       audio_sample=("v.wav", wav_bytes(1.0), "audio/wav"))
    assert voice.id.startswith("voice_") and voice.name == "narrator"
    assert voice.object == "audio.voice" and voice.type == "audio_sample"
    listed = requests.get(f"{fake_voice_app}/v1/audio/voices", timeout=30).json()
    assert [v["id"] for v in listed["data"]] == [voice.id]
    for key in ("narrator", {"id": voice.id}):
        out = client.chat.completions.create(
            model="omniray", max_tokens=6, messages=[{"role": "user", "content": "Hi"}],
            modalities=["text", "audio"], audio={"format": "wav", "voice": key})
        assert out.choices[0].message.audio.data
    with pytest.raises(openai.ConflictError):
        client.audio.voices.create(name="narrator", consent="c",
                                   audio_sample=("v.wav", wav_bytes(1.0), "audio/wav"))
    deleted = client.audio.voices.delete(voice.id)
    assert deleted.deleted and deleted.id == voice.id
    with pytest.raises(openai.NotFoundError):
        client.audio.voices.delete(voice.id)
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.chat.completions.create(
            model="omniray", max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
            modalities=["text", "audio"], audio={"format": "wav", "voice": "narrator"})

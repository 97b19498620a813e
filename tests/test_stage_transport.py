"""AppConfig.stage_transport, in-process (no Ray): which transport each of a turn's calls
asks Serve for. With grpc, every call of a turn (the Thinker's generate, the speech opens,
the hops Thinker -> Talker -> Code2Wav, resumes and aborts) goes `_by_reference=False`
(Serve's gRPC data plane) unless its arrays are over `GRPC_MAX_ARG_BYTES` (then an actor
call: the object store, no gRPC message limit); with ray, every call is an actor call. The
same turns come out either way."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_api import data_uri, light_source, png_bytes, user

import deployments.wire as wire
from deployments.config import AppConfig
from deployments.wire import Done, via
from fakes import build_local_app
from pipeline.handoff import AudioInput, ImageInput, ThinkerRequest


@pytest.fixture(scope="module")
def source():
    return light_source()


class Recording:
    """Wraps a handle; logs (method, by_reference) of every call made through it."""

    def __init__(self, inner, log: list, by_reference: bool = True):
        self.inner, self.log, self.by_reference = inner, log, by_reference

    def options(self, _by_reference: bool | None = None, **kw):
        by_ref = self.by_reference if _by_reference is None else _by_reference
        return Recording(self.inner.options(**kw), self.log, by_ref)

    def __getattr__(self, name: str):
        target = getattr(self.inner, name)
        outer = self

        class _Method:
            def remote(self, *a, **k):
                outer.log.append((name, outer.by_reference))
                return target.remote(*a, **k)

        return _Method()


SPEECH = {"messages": user("hi"), "modalities": ["text", "audio"], "max_tokens": 24}
IMAGE = {
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_uri(png_bytes(), "image/png")}},
                {"type": "text", "text": "what is it?"},
            ],
        }
    ],
    "modalities": ["text", "audio"],
    "max_tokens": 24,
}


def run_turns(source, transport: str, bodies: list[dict]) -> tuple[list, list]:
    """The turns' terminal events, and every call they made: (method, by_reference)."""

    async def main():
        local = build_local_app({"stage_transport": transport}, source)
        log: list = []
        stages = local.ingress.groups[0].stages
        for name in ("thinker", "talker", "code2wav"):
            setattr(stages, name, Recording(getattr(stages, name), log))
        local.thinker.talker = Recording(local.thinker.talker, log)
        local.talker.code2wav = Recording(local.talker.code2wav, log)
        ends = []
        for body in bodies:
            ends.append([ev async for ev in local.ingress.chat(body)][-1])
        await asyncio.sleep(0.2)  # fire-and-forget resumes and aborts land
        return ends, log

    return asyncio.run(main())


def test_grpc_takes_every_call_of_a_turn_and_ray_none(source):
    ends, log = run_turns(source, "grpc", [SPEECH])
    assert isinstance(ends[0], Done) and ends[0].audio_seconds > 0, ends
    methods = {m for m, _ in log}
    assert {"generate", "session", "stream", "feed", "push"} <= methods, log
    assert all(by_ref is False for _, by_ref in log), log

    ends, log = run_turns(source, "ray", [SPEECH])
    assert isinstance(ends[0], Done) and ends[0].audio_seconds > 0, ends
    assert {"generate", "session", "stream", "feed", "push"} <= {m for m, _ in log}, log
    assert all(by_ref is True for _, by_ref in log), log


def test_calls_over_the_grpc_size_go_as_actor_calls(source, monkeypatch):
    monkeypatch.setattr(wire, "GRPC_MAX_ARG_BYTES", 1024)  # the image's pixels are more
    ends, log = run_turns(source, "grpc", [IMAGE, SPEECH])
    assert all(isinstance(e, Done) for e in ends), ends
    generates = [by_ref for m, by_ref in log if m == "generate"]
    assert generates == [True, False], log  # the image turn's request, then the text turn's
    assert all(by_ref is False for m, by_ref in log if m in ("session", "stream", "push")), log


def test_via_and_the_bytes_it_is_told():
    log: list = []
    h = Recording(type("H", (), {"options": lambda self, **k: self, "push": None})(), log)
    assert via(h, True).by_reference is False
    assert via(h, True, wire.GRPC_MAX_ARG_BYTES).by_reference is False
    assert via(h, True, wire.GRPC_MAX_ARG_BYTES + 1) is h
    assert via(h, False) is h

    image = ImageInput([torch.zeros(3, 14, 28, dtype=torch.uint8)] * 2, torch.ones(2, 2), "i")
    audio = AudioInput(torch.zeros(80, 100), "a")
    req = ThinkerRequest("r", [1, 2, 3], images=[image], audios=[audio])
    assert req.media_bytes == 2 * 3 * 14 * 28 + 80 * 100 * 4
    assert ThinkerRequest("r", [1]).media_bytes == 0


def test_the_transport_is_checked():
    assert AppConfig().stage_transport == "grpc"
    assert AppConfig.model_validate({"stage_transport": "ray"}).stage_transport == "ray"
    with pytest.raises(ValueError, match="stage_transport"):
        AppConfig.model_validate({"stage_transport": "tcp"})

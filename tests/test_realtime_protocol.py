"""The Realtime protocol layer against the openai package's own types: client events in the
GA and beta spellings (built as the SDK's `*Param` shapes and put on the wire the way its
`connection.send` does), refusals with their codes, and every server event validated as the
SDK's GA and beta server-event unions."""

from __future__ import annotations

import base64
import json
from dataclasses import replace

import pytest
from openai._models import construct_type_unchecked
from openai._utils import maybe_transform
from openai.types import realtime as ga
from openai.types.beta import realtime as beta
from openai.types.beta.realtime import RealtimeClientEventParam as BetaClientEventParam
from openai.types.beta.realtime.session_update_event_param import (
    SessionUpdateEventParam as BetaSessionUpdateParam,
)
from openai.types.realtime import (
    ConversationItemCreateEventParam,
    ResponseCreateEventParam,
    SessionUpdateEventParam,
)
from openai.types.realtime import RealtimeClientEventParam as GAClientEventParam
from pydantic import TypeAdapter, ValidationError

from deployments.realtime import protocol as rt

GA_CLIENT = TypeAdapter(ga.RealtimeClientEvent)
BETA_CLIENT = TypeAdapter(beta.RealtimeClientEvent)
GA_SERVER = TypeAdapter(ga.RealtimeServerEvent)
BETA_SERVER = TypeAdapter(beta.RealtimeServerEvent)
MAX = 1 << 20
PCM = bytes(range(256)) * 4  # 1024 bytes: 512 samples
PCM_B64 = base64.b64encode(PCM).decode()


def wire(event: dict, *, beta_api: bool = False) -> str:
    """`event` as the SDK sends a dict (`connection.session.update(...)` and friends), after
    checking that it is a valid client event of that API."""
    (BETA_CLIENT if beta_api else GA_CLIENT).validate_python(event)
    param = BetaClientEventParam if beta_api else GAClientEventParam
    return json.dumps(maybe_transform(event, param))


def parse(event: dict | str, *, beta_api: bool = False) -> rt.ClientEvent:
    text = event if isinstance(event, str) else wire(event, beta_api=beta_api)
    return rt.parse_client_event(text, max_bytes=MAX)


def refused(event: dict | str | bytes) -> rt.ProtocolError:
    text = event if isinstance(event, str | bytes) else json.dumps(event)
    with pytest.raises(rt.ProtocolError) as info:
        ev = rt.parse_client_event(text, max_bytes=MAX)
        if isinstance(ev, rt.SessionUpdate):
            rt.apply_session_update(rt.SessionConfig(), ev.session)
        if isinstance(ev, rt.ResponseCreate):
            rt.apply_session_update(rt.SessionConfig(), ev.response.patch)
    return info.value


# ---------------------------------------------------------------------------------------
# Client events, both spellings


GA_SESSION: SessionUpdateEventParam = {
    "type": "session.update",
    "event_id": "evt_1",
    "session": {
        "type": "realtime",
        "instructions": "Be brief.",
        "output_modalities": ["audio"],
        "max_output_tokens": 256,
        "audio": {
            "input": {
                "format": {"type": "audio/pcm", "rate": 24000},
                "turn_detection": {
                    "type": "server_vad",
                    "threshold": 0.6,
                    "prefix_padding_ms": 200,
                    "silence_duration_ms": 700,
                    "create_response": False,
                    "interrupt_response": True,
                },
                "noise_reduction": {"type": "near_field"},
                "transcription": {"model": "whisper-1"},
            },
            "output": {"format": {"type": "audio/pcm"}, "voice": "my_voice", "speed": 1.1},
        },
        "tools": [],
        "tool_choice": "auto",
        "tracing": "auto",
    },
}
BETA_SESSION: BetaSessionUpdateParam = {
    "type": "session.update",
    "event_id": "evt_1",
    "session": {
        "instructions": "Be brief.",
        "modalities": ["text", "audio"],
        "max_response_output_tokens": 256,
        "input_audio_format": "pcm16",
        "output_audio_format": "pcm16",
        "turn_detection": {
            "type": "server_vad",
            "threshold": 0.6,
            "prefix_padding_ms": 200,
            "silence_duration_ms": 700,
            "create_response": False,
            "interrupt_response": True,
        },
        "voice": "my_voice",
        "input_audio_transcription": {"model": "whisper-1"},
        "input_audio_noise_reduction": {"type": "near_field"},
        "tools": [],
        "tool_choice": "auto",
        "speed": 1.1,
    },
}
EXPECTED = rt.SessionConfig(
    instructions="Be brief.",
    output_modalities=("audio",),
    turn_detection=rt.TurnDetection(0.6, 200, 700, create_response=False),
    voice="my_voice",
    max_output_tokens=256,
)


def test_session_update_ga_and_beta_give_the_same_config():
    ga_ev, beta_ev = parse(GA_SESSION), parse(BETA_SESSION, beta_api=True)
    assert isinstance(ga_ev, rt.SessionUpdate) and isinstance(beta_ev, rt.SessionUpdate)
    assert ga_ev.event_id == beta_ev.event_id == "evt_1"
    for ev in (ga_ev, beta_ev):
        assert rt.apply_session_update(rt.SessionConfig(), ev.session) == EXPECTED


def test_session_update_only_changes_what_it_names():
    cfg = rt.apply_session_update(rt.SessionConfig(), parse(GA_SESSION).session)
    ev = parse({"type": "session.update", "session": {"type": "realtime", "instructions": "x"}})
    assert rt.apply_session_update(cfg, ev.session) == replace(EXPECTED, instructions="x")
    off = parse({"type": "session.update", "session": {"turn_detection": None}}, beta_api=True)
    assert rt.apply_session_update(cfg, off.session).turn_detection is None


def test_session_update_extensions_and_builtin_voices():
    ev = parse(
        json.dumps(
            {
                "type": "session.update",
                "session": {
                    "type": "realtime",
                    "audio": {
                        "input": {"format": {"type": "audio/pcm", "rate": 16000}},
                        "output": {"voice": "alloy"},
                    },
                    "temperature": 0.7,
                    "max_output_tokens": "inf",
                    "omniray": {"ref_audio": "data:audio/wav;base64,AAAA"},
                },
            }
        )
    )
    cfg = rt.apply_session_update(rt.SessionConfig(voice="old"), ev.session)
    assert cfg.input_audio_rate == 16000
    assert cfg.voice is None  # a built-in name: the checkpoint's own voice
    assert cfg.ref_audio == "data:audio/wav;base64,AAAA"
    assert (cfg.temperature, cfg.max_output_tokens) == (0.7, None)
    # beta: "pcm16" with the extension's rate; GA custom voice objects name a stored voice
    ev = parse(
        json.dumps(
            {
                "type": "session.update",
                "session": {"input_audio_format": "pcm16", "omniray": {"input_audio_rate": 16000}},
            }
        )
    )
    assert rt.apply_session_update(rt.SessionConfig(), ev.session).input_audio_rate == 16000
    ev = parse(
        {
            "type": "session.update",
            "session": {"type": "realtime", "audio": {"output": {"voice": {"id": "voice_1"}}}},
        }
    )
    assert rt.apply_session_update(rt.SessionConfig(), ev.session).voice == "voice_1"


@pytest.mark.parametrize("beta_api", [False, True])
@pytest.mark.parametrize(
    "cfg",
    [
        rt.SessionConfig(),
        EXPECTED,
        rt.SessionConfig(output_modalities=("text",), turn_detection=None, temperature=1.2),
        rt.SessionConfig(input_audio_rate=16000, ref_audio="v", max_output_tokens=9),
    ],
)
def test_session_object_sent_back_gives_the_same_config(cfg, beta_api):
    obj = rt.session_object("sess_1", cfg, beta=beta_api)
    ev = parse(json.dumps({"type": "session.update", "session": obj}))
    got = rt.apply_session_update(rt.SessionConfig(ref_audio=cfg.ref_audio), ev.session)
    assert got == cfg


def test_audio_buffer_events():
    for beta_api in (False, True):
        ev = parse({"type": "input_audio_buffer.append", "audio": PCM_B64}, beta_api=beta_api)
        assert ev == rt.AudioAppend(PCM)
        ev = parse({"type": "input_audio_buffer.commit", "event_id": "e"}, beta_api=beta_api)
        assert ev == rt.AudioCommit("e")
        assert parse({"type": "input_audio_buffer.clear"}, beta_api=beta_api) == rt.AudioClear()


GA_ITEMS: list[ConversationItemCreateEventParam] = [
    {
        "type": "conversation.item.create",
        "previous_item_id": "item_prev",
        "item": {
            "id": "item_u",
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "hi"},
                {"type": "input_audio", "audio": PCM_B64},
            ],
        },
    },
    {
        "type": "conversation.item.create",
        "item": {
            "type": "message",
            "role": "assistant",
            "content": [
                {"type": "output_text", "text": "hello"},
                {"type": "output_audio", "transcript": "hello there"},
            ],
        },
    },
    {
        "type": "conversation.item.create",
        "item": {
            "type": "message",
            "role": "system",
            "content": [{"type": "input_text", "text": "s"}],
        },
    },
]


def _beta_item_event(ev: dict) -> dict:
    names = {"output_text": "text", "output_audio": "audio"}
    item = ev["item"]
    content = [{**c, "type": names.get(c["type"], c["type"])} for c in item["content"]]
    return {**ev, "item": {**item, "content": content}}


@pytest.mark.parametrize("index", range(len(GA_ITEMS)))
def test_item_create_ga_and_beta(index):
    ga_ev = parse(GA_ITEMS[index])
    beta_ev = parse(_beta_item_event(GA_ITEMS[index]), beta_api=True)
    assert isinstance(ga_ev, rt.ItemCreate)
    if "id" not in GA_ITEMS[index]["item"]:  # generated ids differ
        assert ga_ev.item.id.startswith("item_") and len(ga_ev.item.id) == 26
        beta_ev = rt.ItemCreate(replace(beta_ev.item, id=ga_ev.item.id), beta_ev.previous_item_id)
    assert ga_ev == beta_ev
    if index == 0:
        assert ga_ev.previous_item_id == "item_prev"
        assert ga_ev.item.content == (
            rt.ContentPart("input_text", text="hi"),
            rt.ContentPart("input_audio", audio=PCM),
        )
    if index == 1:
        assert [p.type for p in ga_ev.item.content] == ["output_text", "output_audio"]
        assert ga_ev.item.content[1].transcript == "hello there"


def test_truncate_delete_cancel():
    for beta_api in (False, True):
        ev = parse(
            {
                "type": "conversation.item.truncate",
                "item_id": "item_a",
                "content_index": 0,
                "audio_end_ms": 1500,
            },
            beta_api=beta_api,
        )
        assert ev == rt.ItemTruncate("item_a", 0, 1500)
        ev = parse({"type": "conversation.item.delete", "item_id": "item_a"}, beta_api=beta_api)
        assert ev == rt.ItemDelete("item_a")
        ev = parse({"type": "response.cancel", "response_id": "resp_a"}, beta_api=beta_api)
        assert ev == rt.ResponseCancel("resp_a")
        assert parse({"type": "response.cancel"}, beta_api=beta_api) == rt.ResponseCancel()


def test_response_create_ga_and_beta_overrides():
    ga_ev: ResponseCreateEventParam = {
        "type": "response.create",
        "response": {
            "instructions": "Say it in French.",
            "output_modalities": ["text"],
            "max_output_tokens": 64,
            "metadata": {"topic": "greeting"},
            "audio": {"output": {"voice": "v2", "format": {"type": "audio/pcm", "rate": 24000}}},
            "conversation": "auto",
            "tool_choice": "none",
        },
    }
    beta_ev = {
        "type": "response.create",
        "response": {
            "instructions": "Say it in French.",
            "modalities": ["text"],
            "max_response_output_tokens": 64,
            "metadata": {"topic": "greeting"},
            "voice": "v2",
            "output_audio_format": "pcm16",
            "temperature": 0.9,
        },
    }
    session = rt.SessionConfig(temperature=0.9, instructions="base")
    want = replace(
        session,
        instructions="Say it in French.",
        output_modalities=("text",),
        max_output_tokens=64,
        voice="v2",
    )
    for ev in (parse(ga_ev), parse(beta_ev, beta_api=True)):
        assert isinstance(ev, rt.ResponseCreate)
        assert dict(ev.response.metadata) == {"topic": "greeting"}
        assert rt.apply_session_update(session, ev.response.patch) == want
    plain = parse({"type": "response.create"})
    assert rt.apply_session_update(session, plain.response.patch) == session


# ---------------------------------------------------------------------------------------
# Refusals


def test_event_level_refusals():
    assert refused("{not json").code == "invalid_event"
    assert refused(b"\xff\xfe").code == "invalid_event"
    assert refused("[1, 2]").code == "invalid_event"
    assert refused('"text"').code == "invalid_event"
    assert refused('{"type": "response.create", "x": NaN}').code == "invalid_event"
    assert refused("[" * 100_000 + "]" * 100_000).code == "invalid_event"
    assert refused({"event_id": "e"}).code == "invalid_event"
    assert refused({"type": 3}).code == "invalid_event"
    e = refused({"type": "response.explode", "event_id": "e9"})
    assert (e.code, e.event_id) == ("unknown_event", "e9") and "response.explode" in e.message
    assert refused({"type": "conversation.item.retrieve", "item_id": "a"}).code == "unsupported"
    e = refused({"type": "input_audio_buffer.commit", "event_id": 5})
    assert (e.code, e.param) == ("invalid_value", "event_id")
    e = refused({"type": "input_audio_buffer.commit", "extra": 1})
    assert (e.code, e.param) == ("invalid_value", "extra")


def test_size_bound_comes_first():
    big = json.dumps({"type": "input_audio_buffer.append", "audio": "A" * 200})
    for text in (big, big.encode(), "é" * 60):  # 60 characters, 120 bytes
        with pytest.raises(rt.ProtocolError) as info:
            rt.parse_client_event(text, max_bytes=100)
        assert info.value.code == "payload_too_large"
    with pytest.raises(rt.ProtocolError) as info:  # not JSON, but too large is what it is told
        rt.parse_client_event("x" * 101, max_bytes=100)
    assert info.value.code == "payload_too_large"


@pytest.mark.parametrize("audio", ["not base64!", "QUJD", 12, "é"])
def test_bad_audio(audio):
    e = refused({"type": "input_audio_buffer.append", "audio": audio, "event_id": "a1"})
    assert (e.code, e.param, e.event_id) == ("invalid_value", "audio", "a1")


def _session(**fields) -> dict:
    return {"type": "session.update", "event_id": "s1", "session": fields}


@pytest.mark.parametrize(
    ("session", "code", "param"),
    [
        ({"type": "transcription"}, "unsupported", "session.type"),
        ({"type": "chat"}, "invalid_value", "session.type"),
        ({"colour": "red"}, "invalid_value", "session.colour"),
        ({"audio": {"input": {"echo": 1}}}, "invalid_value", "session.audio.input.echo"),
        ({"omniray": {"speed": 2}}, "invalid_value", "session.omniray.speed"),
        (
            {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 8000}}}},
            "invalid_value",
            "session.audio.input.format.rate",
        ),
        (
            {"audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}},
            "invalid_value",
            "session.audio.output.format.rate",
        ),
        (
            {"audio": {"input": {"format": {"type": "audio/pcmu"}}}},
            "unsupported",
            "session.audio.input.format.type",
        ),
        ({"input_audio_format": "g711_ulaw"}, "unsupported", "session.input_audio_format"),
        ({"input_audio_format": "mp3"}, "invalid_value", "session.input_audio_format"),
        (
            {"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}},
            "unsupported",
            "session.audio.input.turn_detection.type",
        ),
        (
            {"turn_detection": {"type": "server_vad", "threshold": 1.5}},
            "invalid_value",
            "session.turn_detection.threshold",
        ),
        (
            {"turn_detection": {"prefix_padding_ms": 10**9}},
            "invalid_value",
            "session.turn_detection.prefix_padding_ms",
        ),
        (
            {"turn_detection": {"create_response": "yes"}},
            "invalid_value",
            "session.turn_detection.create_response",
        ),
        ({"output_modalities": []}, "invalid_value", "session.output_modalities"),
        ({"modalities": ["video"]}, "invalid_value", "session.modalities"),
        ({"temperature": 2.5}, "invalid_value", "session.temperature"),
        ({"temperature": True}, "invalid_value", "session.temperature"),
        ({"max_output_tokens": 0}, "invalid_value", "session.max_output_tokens"),
        (
            {"max_response_output_tokens": "all"},
            "invalid_value",
            "session.max_response_output_tokens",
        ),
        ({"voice": ""}, "invalid_value", "session.voice"),
        ({"instructions": 5}, "invalid_value", "session.instructions"),
        ({"omniray": {"ref_audio": 5}}, "invalid_value", "session.omniray.ref_audio"),
        (
            {"omniray": {"input_audio_rate": 44100}},
            "invalid_value",
            "session.omniray.input_audio_rate",
        ),
        (
            {
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}},
                "omniray": {"input_audio_rate": 16000},
            },
            "invalid_value",
            "session.omniray.input_audio_rate",
        ),
        (
            {"modalities": ["text"], "output_modalities": ["text"]},
            "invalid_value",
            "session.output_modalities",
        ),
        ({"audio": 3}, "invalid_value", "session.audio"),
    ],
)
def test_session_update_refusals(session, code, param):
    e = refused(_session(**session))
    assert (e.code, e.param) == (code, param), e.message
    assert param in e.message


def test_missing_session_and_other_field_refusals():
    assert refused({"type": "session.update"}).param == "session"
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}

    def item_error(**changes) -> rt.ProtocolError:
        return refused({"type": "conversation.item.create", "item": {**item, **changes}})

    e = item_error(type="function_call", call_id="c", name="f", arguments="{}")
    assert (e.code, e.param) == ("unsupported", "item.type")
    e = item_error(content=[{"type": "input_image", "image_url": "data:"}])
    assert (e.code, e.param) == ("unsupported", "item.content[0].type")
    e = item_error(content=[{"type": "output_text", "text": "x"}])  # a user part it is not
    assert (e.code, e.param) == ("invalid_value", "item.content[0].type")
    e = item_error(content=[{"type": "input_audio", "audio": "***"}])
    assert (e.code, e.param) == ("invalid_value", "item.content[0].audio")
    e = item_error(content=[{"type": "input_text"}])
    assert (e.code, e.param) == ("invalid_value", "item.content[0].text")
    assert item_error(role="tool").param == "item.role"
    assert item_error(id="x" * 100).param == "item.id"
    assert item_error(colour=1).param == "item.colour"
    e = refused(
        {
            "type": "conversation.item.truncate",
            "item_id": "a",
            "content_index": -1,
            "audio_end_ms": 0,
        }
    )
    assert e.param == "content_index"
    e = refused({"type": "conversation.item.truncate", "item_id": "a", "content_index": 0})
    assert e.param == "audio_end_ms"
    assert refused({"type": "conversation.item.delete"}).param == "item_id"
    e = refused({"type": "response.create", "response": {"conversation": "none"}})
    assert (e.code, e.param) == ("unsupported", "response.conversation")
    e = refused({"type": "response.create", "response": {"input": [item]}})
    assert (e.code, e.param) == ("unsupported", "response.input")
    e = refused({"type": "response.create", "response": {"metadata": {"k": 1}}})
    assert e.param == "response.metadata"
    e = refused({"type": "response.create", "response": {"temperature": -1}})
    assert e.param == "response.temperature"
    e = refused({"type": "response.create", "response": {"turn_detection": None}})
    assert e.param == "response.turn_detection"  # a session setting, not a response's


# ---------------------------------------------------------------------------------------
# Server events


def _check(ev: dict, ga_class: type, beta_class: type | None) -> None:
    """`ev` is the GA event `ga_class`; its beta form is `beta_class` (None: not sent)."""
    assert ev["event_id"].startswith("event_")
    assert type(GA_SERVER.validate_python(ev)) is ga_class
    b = rt.to_beta(ev)
    if beta_class is None:
        assert b is None
    else:
        assert type(BETA_SERVER.validate_python(b)) is beta_class
    json.dumps(ev)  # plain JSON values only


USER = rt.Item("item_u", "user", (rt.ContentPart("input_audio", audio=PCM, transcript=None),))
REPLY = rt.Item(
    "item_a",
    "assistant",
    (rt.ContentPart("output_audio", transcript="Hello!"), rt.ContentPart("output_text", text="")),
)


def test_session_events_validate():
    for cfg in (rt.SessionConfig(), EXPECTED, rt.SessionConfig(turn_detection=None, voice="v")):
        _check(rt.session_created("sess_1", cfg), ga.SessionCreatedEvent, beta.SessionCreatedEvent)
        _check(rt.session_updated("sess_1", cfg), ga.SessionUpdatedEvent, beta.SessionUpdatedEvent)
    m = GA_SERVER.validate_python(rt.session_created("sess_1", EXPECTED))
    assert m.session.audio.input.turn_detection.silence_duration_ms == 700
    assert m.session.audio.output.voice == "my_voice" and m.session.max_output_tokens == 256
    b = BETA_SERVER.validate_python(rt.to_beta(rt.session_created("sess_1", EXPECTED)))
    assert b.session.modalities == ["text", "audio"] and b.session.voice == "my_voice"
    assert b.session.max_response_output_tokens == 256 and b.session.input_audio_format == "pcm16"


def test_a_16k_session_breaks_only_the_ga_rate_literal():
    # The GA schema pins rate to 24000; 16 kHz is omniray's extension. The SDK builds server
    # events without validating them, so its clients read the rate as sent.
    obj = rt.session_object("sess_1", rt.SessionConfig(input_audio_rate=16000))
    with pytest.raises(ValidationError) as info:
        TypeAdapter(ga.RealtimeSessionCreateRequest).validate_python(obj)
    locs = {err["loc"] for err in info.value.errors()}
    # (the format union is tried member by member: the pcmu / pcma members fail on `type`)
    assert all(loc[:3] == ("audio", "input", "format") for loc in locs)
    assert [loc for loc in locs if loc[3] == "AudioPCM"] == [
        ("audio", "input", "format", "AudioPCM", "rate")
    ]
    ev = construct_type_unchecked(
        value=rt.session_updated("s", rt.SessionConfig(input_audio_rate=16000)),
        type_=ga.RealtimeServerEvent,
    )
    assert ev.session.audio.input.format.rate == 16000
    b = BETA_SERVER.validate_python(
        rt.to_beta(rt.session_updated("s", rt.SessionConfig(input_audio_rate=16000)))
    )
    assert b.session.omniray == {"has_ref_audio": False, "input_audio_rate": 16000}


def test_error_events_validate():
    ev = rt.error("invalid_value", "bad", "session.temperature", "evt_3")
    _check(ev, ga.RealtimeErrorEvent, beta.ErrorEvent)
    m = GA_SERVER.validate_python(ev)
    assert (m.error.code, m.error.param, m.error.event_id) == (
        "invalid_value",
        "session.temperature",
        "evt_3",
    )
    e = refused({"type": "nope", "event_id": "evt_4"})
    m = GA_SERVER.validate_python(rt.protocol_error(e))
    assert (m.error.code, m.error.event_id, m.error.type) == (
        "unknown_event",
        "evt_4",
        "invalid_request_error",
    )


def test_input_audio_buffer_and_item_events_validate():
    _check(
        rt.input_audio_buffer_speech_started(120, "item_u"),
        ga.InputAudioBufferSpeechStartedEvent,
        beta.InputAudioBufferSpeechStartedEvent,
    )
    _check(
        rt.input_audio_buffer_speech_stopped(900, "item_u"),
        ga.InputAudioBufferSpeechStoppedEvent,
        beta.InputAudioBufferSpeechStoppedEvent,
    )
    _check(
        rt.input_audio_buffer_committed("item_u", None),
        ga.InputAudioBufferCommittedEvent,
        beta.InputAudioBufferCommittedEvent,
    )
    _check(
        rt.input_audio_buffer_committed("item_u", "item_p"),
        ga.InputAudioBufferCommittedEvent,
        beta.InputAudioBufferCommittedEvent,
    )
    _check(
        rt.input_audio_buffer_cleared(),
        ga.InputAudioBufferClearedEvent,
        beta.InputAudioBufferClearedEvent,
    )
    for item in (USER, REPLY):
        _check(
            rt.conversation_item_added(item, "item_p"),
            ga.ConversationItemAdded,
            beta.ConversationItemCreatedEvent,
        )
        _check(rt.conversation_item_done(item, None), ga.ConversationItemDone, None)
    _check(
        rt.conversation_item_truncated("item_a", 0, 640),
        ga.ConversationItemTruncatedEvent,
        beta.ConversationItemTruncatedEvent,
    )
    _check(
        rt.conversation_item_deleted("item_a"),
        ga.ConversationItemDeletedEvent,
        beta.ConversationItemDeletedEvent,
    )
    m = GA_SERVER.validate_python(rt.conversation_item_added(REPLY, None, "in_progress"))
    assert [c.type for c in m.item.content] == ["output_audio", "output_text"]
    assert m.item.status == "in_progress" and m.item.content[0].transcript == "Hello!"
    b = BETA_SERVER.validate_python(rt.to_beta(rt.conversation_item_added(REPLY, None)))
    assert [c.type for c in b.item.content] == ["audio", "text"]
    m = GA_SERVER.validate_python(rt.conversation_item_added(USER, None))
    assert m.item.content[0].type == "input_audio" and m.item.content[0].audio is None


def test_parsed_item_renders_as_created():
    ev = parse(GA_ITEMS[0])
    m = GA_SERVER.validate_python(rt.conversation_item_added(ev.item, ev.previous_item_id))
    assert m.item.id == "item_u" and m.previous_item_id == "item_prev"
    assert [c.type for c in m.item.content] == ["input_text", "input_audio"]


def test_response_content_events_validate():
    args = ("resp_1", "item_a", 0, 0)
    audio = REPLY.content[0]
    pairs = [
        (
            rt.response_content_part_added(*args, rt.ContentPart("output_audio", transcript="")),
            ga.ResponseContentPartAddedEvent,
            beta.ResponseContentPartAddedEvent,
        ),
        (
            rt.response_content_part_done(*args, audio),
            ga.ResponseContentPartDoneEvent,
            beta.ResponseContentPartDoneEvent,
        ),
        (
            rt.response_content_part_done(*args, rt.ContentPart("output_text", text="hi")),
            ga.ResponseContentPartDoneEvent,
            beta.ResponseContentPartDoneEvent,
        ),
        (
            rt.response_output_audio_delta(*args, PCM_B64),
            ga.ResponseAudioDeltaEvent,
            beta.ResponseAudioDeltaEvent,
        ),
        (
            rt.response_output_audio_done(*args),
            ga.ResponseAudioDoneEvent,
            beta.ResponseAudioDoneEvent,
        ),
        (
            rt.response_output_audio_transcript_delta(*args, "Hel"),
            ga.ResponseAudioTranscriptDeltaEvent,
            beta.ResponseAudioTranscriptDeltaEvent,
        ),
        (
            rt.response_output_audio_transcript_done(*args, "Hello!"),
            ga.ResponseAudioTranscriptDoneEvent,
            beta.ResponseAudioTranscriptDoneEvent,
        ),
        (
            rt.response_output_text_delta(*args, "Hel"),
            ga.ResponseTextDeltaEvent,
            beta.ResponseTextDeltaEvent,
        ),
        (
            rt.response_output_text_done(*args, "Hello!"),
            ga.ResponseTextDoneEvent,
            beta.ResponseTextDoneEvent,
        ),
        (
            rt.response_output_item_added("resp_1", 0, rt.Item("item_a", "assistant")),
            ga.ResponseOutputItemAddedEvent,
            beta.ResponseOutputItemAddedEvent,
        ),
        (
            rt.response_output_item_done("resp_1", 0, REPLY),
            ga.ResponseOutputItemDoneEvent,
            beta.ResponseOutputItemDoneEvent,
        ),
    ]
    for ev, ga_class, beta_class in pairs:
        _check(ev, ga_class, beta_class)
    m = GA_SERVER.validate_python(rt.response_output_audio_transcript_done(*args, "Hello!"))
    assert (m.transcript, m.response_id, m.item_id) == ("Hello!", "resp_1", "item_a")
    assert rt.to_beta(rt.response_output_audio_delta(*args, "AA"))["delta"] == "AA"
    with pytest.raises(ValueError):
        rt.response_content_part_added(*args, rt.ContentPart("input_text", text=""))


CFG = rt.SessionConfig(voice="v", max_output_tokens=100, temperature=0.8)
RESPONSES = [
    rt.Response("resp_1", CFG),
    rt.Response(
        "resp_1",
        CFG,
        "completed",
        (REPLY,),
        usage=rt.Usage(40, 12, cached_tokens=30),
        metadata={"k": "v"},
    ),
    rt.Response(
        "resp_1", CFG, "cancelled", (REPLY,), reason="turn_detected", usage=rt.Usage(40, 3)
    ),
    rt.Response("resp_1", CFG, "cancelled", reason="client_cancelled"),
    rt.Response(
        "resp_1",
        replace(CFG, output_modalities=("text",)),
        "incomplete",
        (rt.Item("item_t", "assistant", (rt.ContentPart("output_text", text="ab"),)),),
        reason="max_output_tokens",
        usage=rt.Usage(5, 100),
    ),
    rt.Response(
        "resp_1", CFG, "failed", error=rt.ResponseError("stage_failed", "the Talker stopped")
    ),
]


@pytest.mark.parametrize("resp", RESPONSES, ids=lambda r: f"{r.status}-{r.reason}")
def test_response_events_validate(resp):
    for build, ga_class, beta_class in (
        (rt.response_created, ga.ResponseCreatedEvent, beta.ResponseCreatedEvent),
        (rt.response_done, ga.ResponseDoneEvent, beta.ResponseDoneEvent),
    ):
        ev = build(resp)
        _check(ev, ga_class, beta_class)
        for m in (GA_SERVER.validate_python(ev), BETA_SERVER.validate_python(rt.to_beta(ev))):
            r = m.response
            assert (r.id, r.status, r.max_output_tokens) == ("resp_1", resp.status, 100)
            assert len(r.output) == len(resp.output)
            want_item = {"completed": "completed", "in_progress": "in_progress"}.get(
                resp.status, "incomplete"
            )
            assert all(item.status == want_item for item in r.output)
            if resp.reason is not None:
                assert (r.status_details.type, r.status_details.reason) == (
                    resp.status,
                    resp.reason,
                )
            elif resp.error is not None:
                assert r.status_details.error.code == "stage_failed"
            else:
                assert r.status_details is None
            if resp.usage is not None:
                u = resp.usage
                assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
                    u.input_tokens,
                    u.output_tokens,
                    u.input_tokens + u.output_tokens,
                )
                assert r.usage.input_token_details.cached_tokens == u.cached_tokens
    b = BETA_SERVER.validate_python(rt.to_beta(rt.response_done(resp))).response
    assert (b.voice, b.temperature, b.output_audio_format) == ("v", 0.8, "pcm16")
    assert b.modalities == (
        ["text", "audio"] if "audio" in resp.config.output_modalities else ["text"]
    )


def test_response_status_rules():
    with pytest.raises(ValueError):
        rt.Response("r", CFG, "cancelled")  # no reason
    with pytest.raises(ValueError):
        rt.Response("r", CFG, "cancelled", reason="max_output_tokens")
    with pytest.raises(ValueError):
        rt.Response("r", CFG, "completed", reason="turn_detected")
    with pytest.raises(ValueError):
        rt.Response("r", CFG, "failed")  # no error
    with pytest.raises(ValueError):
        rt.Response("r", CFG, "completed", error=rt.ResponseError("x", "y"))


def test_to_beta_refuses_unknown_events_and_does_not_mutate():
    ev = rt.conversation_item_added(REPLY, None)
    before = json.dumps(ev)
    rt.to_beta(ev)
    assert json.dumps(ev) == before
    with pytest.raises(ValueError):
        rt.to_beta({"type": "rate_limits.updated", "event_id": "e"})


def test_new_ids_look_like_the_apis():
    ids = {rt.new_id("event") for _ in range(100)}
    assert len(ids) == 100
    assert all(i.startswith("event_") and i[6:].isalnum() and len(i) == 27 for i in ids)

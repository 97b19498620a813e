"""vLLM-Omni's clients against the ingress, in-process (no Ray): the four servers over fake
engines (tests/fakes.py) with the real Processor, HTTP through Starlette's TestClient.

The requests are written from vLLM-Omni's documented API (its online-serving examples and
`vllm bench serve --omni`, as summarised in docs/api.md "vLLM-Omni clients"): the
checkpoint's own model name, `sampling_params_list` as [Thinker, Talker, Code2Wav] (top
level, or nested in `extra_body`), `modalities` null or without OpenAI's `audio` object,
`chat_template_kwargs`; the replies are read as its clients read them (`modality` and
`delta.content`, `message.audio` + `audio_metadata`).
"""

from __future__ import annotations

import base64
import io
import wave

import numpy as np
import pytest
from starlette.testclient import TestClient
from test_api import data_uri, light_source, png_bytes, sse_events, wav_bytes
from test_processing_video import make_mp4

from deployments.config import OFFICIAL_MODEL_NAME, AppConfig, checkpoint_model_name
from deployments.ingress.schemas import THINKER_STOP_IDS
from fakes import FakeTalkerEngine, FakeThinkerEngine, build_local_app
from pipeline.handoff import SamplingParams

URL = "/v1/chat/completions"


class RecordingThinker(FakeThinkerEngine):
    """The fake Thinker, keeping each request it was given."""

    seen: dict = {}

    def open(self, rid, spec):
        RecordingThinker.seen[rid] = spec
        super().open(rid, spec)


class RecordingTalker(FakeTalkerEngine):
    """The fake Talker, keeping each stream's spec (its seed)."""

    seen: dict = {}

    def open(self, rid, spec=None):
        RecordingTalker.seen[rid] = spec
        super().open(rid, spec)


@pytest.fixture(scope="module")
def source():
    return light_source()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-omni-media")
    (d / "clip.wav").write_bytes(wav_bytes(0.6))
    return d


@pytest.fixture(scope="module")
def client(source, media_dir):
    cfg = {"capacity": 2, "allowed_local_media_path": str(media_dir),
           "limits": {"max_images": 8, "max_tokens": 64},
           "code2wav": {"engine": {"step_delay_s": 0.002}}}
    local = build_local_app(cfg, source, thinker_engine_cls=RecordingThinker,
                            talker_engine_cls=RecordingTalker)
    with TestClient(local.ingress.__serve_build_asgi_app__()) as c:
        yield c


def stage_list(talker, *, seed: int = 42, **thinker) -> list[dict]:
    """vLLM-Omni's three entries as its examples write them, the Talker's at the served
    Talker's own sampler values (the only ones it takes per request, besides the seed)."""
    return [
        {"temperature": 0.4, "top_p": 0.9, "top_k": -1, "max_tokens": 4, "seed": seed,
         "repetition_penalty": 1.05, "stop_token_ids": [151645], **thinker},
        {"temperature": talker.temperature, "top_p": talker.top_p, "top_k": talker.top_k,
         "repetition_penalty": talker.repetition_penalty, "max_tokens": 4096,
         "seed": seed + 1, "detokenize": False, "stop_token_ids": [talker.eos_code]},
        {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 65536, "seed": seed,
         "detokenize": True, "repetition_penalty": 1.1},
    ]


def read_vllm_omni_stream(events: list) -> tuple[str, list[np.ndarray], list]:
    """What vLLM-Omni's streaming readers take: text from `modality == "text"` chunks'
    delta.content, one WAV file per `modality == "audio"` chunk's delta.content."""
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c.get("modality") in ("text", "audio") for c in chunks)
    assert not any("audio" in c["choices"][0]["delta"] for c in chunks if c["choices"])
    text, pcm = [], []
    for c in chunks:
        if not c["choices"]:
            continue
        content = c["choices"][0]["delta"].get("content")
        if c["modality"] == "text" and content:
            text.append(content)
        elif c["modality"] == "audio":
            with wave.open(io.BytesIO(base64.b64decode(content))) as w:
                assert w.getframerate() == 24000 and w.getnchannels() == 1
                frames = w.readframes(w.getnframes())
            pcm.append(np.frombuffer(frames, "<i2"))
            meta = c["choices"][0]["audio_metadata"]
            assert meta["sample_rate_hz"] == 24000 and meta["frame_count"] == len(pcm[-1])
    return "".join(text), pcm, chunks


# ---------------------------------------------------------------------------------------
# Served names


def test_models_lists_the_configured_and_the_checkpoint_name(client):
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids == ["omniray", OFFICIAL_MODEL_NAME]
    card = client.get(f"/v1/models/{OFFICIAL_MODEL_NAME}").json()
    assert card["id"] == OFFICIAL_MODEL_NAME and card["root"] == OFFICIAL_MODEL_NAME
    r = client.get("/v1/models/Qwen/Qwen3-Omni-30B-A3B-Instruct")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.post(URL, json={"model": "Qwen/Qwen3-Omni-30B-A3B-Instruct", "max_tokens": 2,
                               "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert OFFICIAL_MODEL_NAME in r.json()["error"]["message"]
    r = client.post(URL, json={"model": OFFICIAL_MODEL_NAME, "max_tokens": 2,
                               "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["model"] == OFFICIAL_MODEL_NAME


def test_checkpoint_model_name_rules(tmp_path):
    assert checkpoint_model_name(None, {}) == OFFICIAL_MODEL_NAME
    assert checkpoint_model_name("random-full", {}) == OFFICIAL_MODEL_NAME
    snap = tmp_path / "hub" / "models--someorg--MiniCPM-o-4_5-ft" / "snapshots" / "abc123"
    assert checkpoint_model_name(str(snap), {}) == "someorg/MiniCPM-o-4_5-ft"
    folder = str(tmp_path / "ckpt")
    assert checkpoint_model_name(folder, {"_name_or_path": "org/tuned"}) == "org/tuned"
    # a local path in config.json is not a name to serve (nor to show)
    assert checkpoint_model_name(folder, {"_name_or_path": str(tmp_path)}) == OFFICIAL_MODEL_NAME
    assert AppConfig(name=OFFICIAL_MODEL_NAME).served_model_names() == [OFFICIAL_MODEL_NAME]
    assert AppConfig(name="m", model=folder).served_model_names(
        {"_name_or_path": "org/tuned"}) == ["m", "org/tuned"]


def test_thinker_stop_ids_match_the_engine_default():
    assert THINKER_STOP_IDS == set(SamplingParams().stop_ids)


# ---------------------------------------------------------------------------------------
# Streamed: the bench's request and the examples' media


def _media(kind: str, media_dir) -> list[dict]:
    wav = wav_bytes(0.6)
    parts = {
        "text": [],
        "image": [{"type": "image_url", "image_url": {"url": data_uri(png_bytes(), "image/png")}}],
        "audio": [{"type": "audio_url", "audio_url": {"url": f"file://{media_dir}/clip.wav"}},
                  {"type": "input_audio", "input_audio": {
                      "data": base64.b64encode(wav).decode(), "format": "wav"}}],
        "video": [{"type": "video_url", "video_url": {
            "url": data_uri(make_mp4(1.0, size=(32, 24)), "video/mp4")}}],
    }[kind]
    return [*parts, {"type": "text", "text": "What is in it?"}]


@pytest.mark.parametrize("kind", ["text", "image", "audio", "video"])
def test_bench_request_streams_vllm_omni_shape(client, media_dir, kind):
    """`vllm bench serve --omni`'s request: modalities without OpenAI's `audio` object,
    temperature 0, max_tokens, usage options; no omniray field."""
    body = {"model": OFFICIAL_MODEL_NAME, "stream": True, "temperature": 0.0, "max_tokens": 6,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "modalities": ["text", "audio"],
            "messages": [{"role": "user", "content": _media(kind, media_dir)}]}
    with client.stream("POST", URL, json=body) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    text, pcm, chunks = read_vllm_omni_stream(events)
    assert text == "Hello there! This reply comes from "
    assert pcm and sum(map(len, pcm)) > 0
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert {c["model"] for c in chunks} == {OFFICIAL_MODEL_NAME}
    # continuous_usage_stats: every chunk from the first text on carries the running usage
    first = next(i for i, c in enumerate(chunks) if c.get("modality") == "text")
    running = [c["usage"]["completion_tokens"] for c in chunks[first:]]
    assert running == sorted(running) and running[-1] == 6 and running[0] >= 1, running
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + n
               and c["usage"]["prompt_tokens"] > 0 for c, n in zip(chunks[first:], running))


def test_usage_comes_once_without_continuous_usage_stats(client):
    body = {"model": OFFICIAL_MODEL_NAME, "stream": True, "max_tokens": 4,
            "stream_options": {"include_usage": True}, "modalities": ["text", "audio"],
            "messages": [{"role": "user", "content": "Hi."}]}
    with client.stream("POST", URL, json=body) as r:
        _, _, chunks = read_vllm_omni_stream(sse_events(r.iter_lines()))
    assert [c for c in chunks if "usage" in c] == chunks[-1:]


def test_bench_text_only_run_is_tagged_text(client):
    """The Daily-Omni text arm (`--extra-body '{"modalities": ["text"], "chat_template_kwargs":
    {"enable_thinking": false}}'`): its reader counts only `modality == "text"` chunks."""
    body = {"model": OFFICIAL_MODEL_NAME, "stream": True, "temperature": 0.0, "max_tokens": 3,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "modalities": ["text"], "chat_template_kwargs": {"enable_thinking": False},
            "messages": [{"role": "user", "content": "Answer with one letter."}]}
    with client.stream("POST", URL, json=body) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    text, pcm, chunks = read_vllm_omni_stream(events)
    assert text == "Hello there! This " and not pcm
    assert {c["modality"] for c in chunks} == {"text"}


def test_sampling_params_list_drives_each_stage(client, source):
    """Entry 0 wins over the top-level fields for the Thinker, entry 1's seed seeds the
    Talker; `modalities` null means text and audio, and the stream is vLLM-Omni's."""
    RecordingThinker.seen.clear()
    RecordingTalker.seen.clear()
    body = {"model": OFFICIAL_MODEL_NAME, "stream": True, "modalities": None,
            "max_tokens": 20, "temperature": 1.5, "seed": 1,
            "sampling_params_list": stage_list(source.config.talker, seed=42),
            "chat_template_kwargs": {"use_tts_template": True},
            "messages": [{"role": "user", "content": "Say hi."}]}
    with client.stream("POST", URL, json=body) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    text, pcm, chunks = read_vllm_omni_stream(events)
    assert text == "Hello there! This reply " and pcm
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    [spec] = RecordingThinker.seen.values()
    s = spec.sampling
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.seed, s.max_tokens) == (
        0.4, 0.9, 0, 1.05, 42, 4)
    [talker_spec] = RecordingTalker.seen.values()
    assert talker_spec.seed == 43

    # Without a Talker entry, the Thinker's seed seeds the Talker too (one request seed).
    RecordingTalker.seen.clear()
    body["sampling_params_list"] = stage_list(source.config.talker, seed=7)[:1]
    with client.stream("POST", URL, json=body) as r:
        assert r.status_code == 200
        r.read()
    assert [t.seed for t in RecordingTalker.seen.values()] == [7]


def test_explicit_stream_format_wins_over_the_dialect(client, source):
    body = {"stream": True, "modalities": ["text", "audio"], "max_tokens": 3,
            "sampling_params_list": stage_list(source.config.talker)[:1],
            "omniray": {"stream_format": "openai"},
            "messages": [{"role": "user", "content": "hi"}]}
    with client.stream("POST", URL, json=body) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and not any("modality" in e for e in events[:-1])
    assert any("audio" in c["choices"][0]["delta"] for c in events[:-1] if c["choices"])


# ---------------------------------------------------------------------------------------
# Non-streamed: the OpenAI SDK with vLLM-Omni's extras in extra_body


def test_non_stream_with_extra_body_stage_list(client, source):
    """The examples' `client.chat.completions.create(..., modalities=None,
    extra_body={"sampling_params_list": [...]})` (the SDK merges extra_body into the body;
    a client that nests it verbatim is read the same)."""
    body = {"model": OFFICIAL_MODEL_NAME, "modalities": None,
            "extra_body": {"sampling_params_list": stage_list(source.config.talker)},
            "messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                         {"role": "user", "content": _media("image", None)}]}
    r = client.post(URL, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == OFFICIAL_MODEL_NAME and len(out["choices"]) == 1
    choice = out["choices"][0]
    assert choice["message"]["content"] == "Hello there! This reply "
    assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 4
    with wave.open(io.BytesIO(base64.b64decode(choice["message"]["audio"]["data"]))) as w:
        assert w.getframerate() == 24000 and w.getnframes() > 0
        assert choice["audio_metadata"] == {"format": "wav", "sample_rate_hz": 24000,
                                            "frame_count": w.getnframes(), "channels": 1}


def test_enable_thinking_drops_the_empty_think_block(client, source):
    tokens = source.config.thinker.tokens
    prompts = {}
    for thinking in (False, True):
        RecordingThinker.seen.clear()
        r = client.post(URL, json={"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                                   "chat_template_kwargs": {"enable_thinking": thinking,
                                                            "use_tts_template": True}})
        assert r.status_code == 200, r.text
        [spec] = RecordingThinker.seen.values()
        prompts[thinking] = list(spec.input_ids)
    assert prompts[False][-1] == prompts[True][-1] == tokens.tts_bos
    assert tokens.think in prompts[False] and tokens.think not in prompts[True]
    assert prompts[False][:len(prompts[True]) - 1] == prompts[True][:-1]


# ---------------------------------------------------------------------------------------
# Refusals


def _bad(source, stage: int, **entry) -> list:
    entries = stage_list(source.config.talker)
    entries[stage] = {**entries[stage], **entry}
    return entries


BAD = [
    ("thinker_min_p", lambda s: {"sampling_params_list": _bad(s, 0, min_p=0.1)},
     "sampling_params_list.0.min_p"),
    ("thinker_unknown_key", lambda s: {"sampling_params_list": _bad(s, 0, best_of=2)},
     "sampling_params_list.0.best_of"),
    ("thinker_temperature_range", lambda s: {"sampling_params_list": _bad(s, 0, temperature=5)},
     "sampling_params_list.0.temperature"),
    ("thinker_stop_sequences", lambda s: {"sampling_params_list": _bad(s, 0, stop=["\n"])},
     "sampling_params_list.0.stop"),
    ("thinker_other_stop_id", lambda s: {"sampling_params_list": _bad(s, 0, stop_token_ids=[7])},
     "sampling_params_list.0.stop_token_ids"),
    ("thinker_seed_negative", lambda s: {"sampling_params_list": _bad(s, 0, seed=-1)},
     "sampling_params_list.0.seed"),
    ("talker_other_temperature", lambda s: {"sampling_params_list": _bad(s, 1, temperature=0.3)},
     "sampling_params_list.1.temperature"),
    ("talker_other_top_k", lambda s: {"sampling_params_list": _bad(s, 1, top_k=50)},
     "sampling_params_list.1.top_k"),
    ("talker_short_cap", lambda s: {"sampling_params_list": _bad(s, 1, max_tokens=5)},
     "sampling_params_list.1.max_tokens"),
    ("talker_ignore_eos", lambda s: {"sampling_params_list": _bad(s, 1, ignore_eos=True)},
     "sampling_params_list.1.ignore_eos"),
    ("talker_other_stop_id", lambda s: {"sampling_params_list": _bad(s, 1, stop_token_ids=[2150])},
     "sampling_params_list.1.stop_token_ids"),
    ("code2wav_unknown_key", lambda s: {"sampling_params_list": _bad(s, 2, guidance=3.0)},
     "sampling_params_list.2.guidance"),
    ("four_entries", lambda s: {"sampling_params_list": stage_list(s.config.talker) + [{}]},
     "sampling_params_list"),
    ("entry_not_object", lambda s: {"sampling_params_list": ["greedy"]},
     "sampling_params_list.0"),
    ("use_tts_template_false", lambda s: {"chat_template_kwargs": {"use_tts_template": False}},
     "chat_template_kwargs.use_tts_template"),
    ("enable_thinking_not_bool", lambda s: {"chat_template_kwargs": {"enable_thinking": "yes"}},
     "chat_template_kwargs.enable_thinking"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_vllm_omni_fields_are_400_naming_the_field(client, source, case):
    _, extra, param = case
    body = {"stream": True, "modalities": ["text", "audio"], "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}], **extra(source)}
    r = client.post(URL, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err

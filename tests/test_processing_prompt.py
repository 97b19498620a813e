"""Prompt building (template + Processor): ids vs a whole-string rendering, bounds, errors."""

from __future__ import annotations

import io
import math
import re

import numpy as np
import pytest
import soundfile as sf
from PIL import Image
from test_processing_video import make_mp4  # tests/ is on sys.path (rootdir-less prepend)

from pipeline.config import SpecialTokens, ThinkerConfig
from pipeline.handoff import SamplingParams
from pipeline.processing import (
    InvalidMessageError,
    MediaBytes,
    MediaLimits,
    MediaTooLargeError,
    Processor,
    PromptTooLongError,
    TooManyFramesError,
)
from pipeline.processing.errors import CorruptMediaError, EmptyMediaError

TOK = SpecialTokens()
TEXT_OF = SpecialTokens.text_of()
ID_OF = {TEXT_OF[k]: getattr(TOK, k) for k in TEXT_OF}


class ByteTokenizer:
    """Fake byte-level tokenizer: one id per UTF-8 byte (ids 0..255), no special tokens."""

    def encode(self, text: str, *, special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def count(self, text: str, limit: int, *, special_tokens: bool = True) -> int:
        return len(self.encode(text))


def tokenize_whole(s: str) -> list[int]:
    """How the reference tokenizes a rendered prompt string: special tokens split first."""
    pattern = "(" + "|".join(re.escape(t) for t in sorted(ID_OF, key=len, reverse=True)) + ")"
    ids: list[int] = []
    for piece in re.split(pattern, s):
        ids += [ID_OF[piece]] if piece in ID_OF else list(piece.encode("utf-8"))
    return ids


THINK_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
# The generation prompt of the reference's streamed decode (`streaming_generate`'s
# `bos_input` with use_tts_template=True): <|tts_bos|> with or without speech output.
GEN = THINK_OFF + "<|tts_bos|>"
UNK64 = "<unk>" * 64


def _png(w, h) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(w).integers(0, 256, (h, w, 3), np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _wav(seconds: float) -> bytes:
    buf = io.BytesIO()
    x = 0.2 * np.sin(2 * np.pi * 330 * np.arange(int(seconds * 16000)) / 16000)
    sf.write(buf, x.astype(np.float32), 16000, format="WAV")
    return buf.getvalue()


def proc(**limits) -> Processor:
    return Processor(ThinkerConfig(), ByteTokenizer(), MediaLimits(**limits))


def _check_bounds(req):
    for s, e in req.image_bounds:
        assert req.input_ids[s - 1] in (TOK.image, TOK.slice)
        assert req.input_ids[e] in (TOK.image_end, TOK.slice_end)
        assert e - s == 64 and set(req.input_ids[s:e]) == {TOK.unk}
    for (s, e), (clip, first, n) in zip(req.audio_bounds, req.audio_segments, strict=True):
        assert req.input_ids[s - 1] == TOK.audio_start and req.input_ids[e] == TOK.audio_end
        assert e - s == n and set(req.input_ids[s:e]) == {TOK.unk}
        assert 0 <= clip < len(req.audios)
    n_unk = sum(1 for t in req.input_ids if t == TOK.unk)
    assert n_unk == 64 * len(req.image_bounds) + sum(n for _, _, n in req.audio_segments)
    assert len(req.image_bounds) == sum(im.num_slices for im in req.images)


def test_text_only():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    req = proc().build(msgs, request_id="r1", sampling=SamplingParams(max_tokens=7))
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n" + GEN
    )
    assert req.input_ids == tokenize_whole(expected)
    assert req.request_id == "r1" and req.sampling.max_tokens == 7
    assert not req.return_hidden and req.images == [] and req.audios == []


def test_speech_output_and_thinking():
    req = proc().build([{"role": "user", "content": "Hi"}], speech_output=True)
    assert req.input_ids[-1] == TOK.tts_bos and req.return_hidden
    assert req.input_ids == tokenize_whole("<|im_start|>user\nHi<|im_end|>\n" + GEN)
    req = proc().build([{"role": "user", "content": "Hi"}], enable_thinking=True)
    assert req.input_ids == tokenize_whole(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<|tts_bos|>"
    )


def test_history_assistant_drops_reasoning():
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nB"},
        {"role": "user", "content": "c"},
    ]
    req = proc().build(msgs)
    expected = (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nB<|im_end|>\n"
        "<|im_start|>user\nc<|im_end|>\n" + GEN
    )
    assert req.input_ids == tokenize_whole(expected)


def test_sliced_image_layout():
    data = _png(1344, 896)  # 3x2 grid
    msgs = [{"role": "user", "content": [MediaBytes("image", data), "What is this?"]}]
    req = proc().build(msgs)
    row = ("<slice>" + UNK64 + "</slice>") * 3
    expected = (
        "<|im_start|>user\n<image_id>0</image_id><image>"
        + UNK64
        + "</image>"
        + row
        + "\n"
        + row
        + "\nWhat is this?<|im_end|>\n"
        + GEN
    )
    assert req.input_ids == tokenize_whole(expected)
    assert len(req.images) == 1 and req.images[0].num_slices == 7
    assert req.images[0].tgt_sizes.tolist() == [[26, 39]] + [[32, 32]] * 6
    _check_bounds(req)


def test_two_images_ids_and_hash():
    data = _png(300, 200)
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image", "data": data},
                {"type": "image", "data": data, "max_slice_nums": 1},
                {"type": "text", "text": "compare"},
            ],
        }
    ]
    req = proc().build(msgs)
    text = (
        "<|im_start|>user\n"
        + "\n".join(f"<image_id>{k}</image_id><image>{UNK64}</image>" for k in range(2))
        + "\ncompare"
    )
    assert req.input_ids == tokenize_whole(text + "<|im_end|>\n" + GEN)
    h0, h1 = (im.content_hash for im in req.images)
    assert h0 != h1 and len(h0) == 64  # same bytes, different slicing option
    assert proc().build(msgs).images[0].content_hash == h0


@pytest.mark.parametrize("chunked", [False, True])
def test_audio_layout(chunked):
    msgs = [{"role": "user", "content": [MediaBytes("audio", _wav(2.5)), "Transcribe."]}]
    p = Processor(ThinkerConfig(), ByteTokenizer(), chunked_audio=chunked)
    req = p.build(msgs)
    groups = [10, 10, 5] if chunked else [25]
    ph = "".join("<|audio_start|>" + "<unk>" * n + "<|audio_end|>" for n in groups)
    sep = "" if chunked else "\n"  # chunked = the reference's stream_input: parts joined by ""
    expected = f"<|im_start|>user\n{ph}{sep}Transcribe.<|im_end|>\n" + GEN
    assert req.input_ids == tokenize_whole(expected)
    assert len(req.audios) == 1 and req.audios[0].num_frames == 250
    assert req.audio_segments == [(0, sum(groups[:i]), n) for i, n in enumerate(groups)]
    _check_bounds(req)


def _reference_audio_placeholder(num_samples: int, stream_input: bool) -> str:
    """MiniCPMOProcessor.get_audio_placeholder restated (16 kHz, hop 160, pool 5, 1 s chunks
    of 10 tokens when stream_input)."""
    n = ((math.ceil(num_samples / 160) - 1) // 2 + 1 - 5) // 5 + 1
    groups = [min(10, n - k) for k in range(0, n, 10)] if stream_input else [n]
    return "".join("<|audio_start|>" + "<unk>" * g + "<|audio_end|>" for g in groups)


def _reference_chat_prompt(
    msgs: list[tuple[str, list[str]]], *, omni_mode: bool, stream_input: bool, tts: bool
) -> str:
    """MiniCPMO.chat() restated on content items already expanded to their placeholder
    strings: every message's items joined with "" when omni_mode or stream_input, else
    with "\n"; then the ChatML chat template with thinking off."""
    joiner = "" if omni_mode or stream_input else "\n"
    out = "".join(f"<|im_start|>{role}\n{joiner.join(items)}<|im_end|>\n" for role, items in msgs)
    return out + THINK_OFF + ("<|tts_bos|>" if tts else "")


@pytest.mark.parametrize("with_video", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_content_joiner_matches_reference_chat(chunked, with_video):
    """A history turn with audio + text, then a video + audio + text turn: omniray's chunked
    audio is the reference's stream_input, a video makes the call omni_mode."""
    first, clip = _wav(1.5), _wav(2.5)
    last = [MediaBytes("video", make_mp4(2.5))] * with_video + [MediaBytes("audio", clip), "Q?"]
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [MediaBytes("audio", first), "first"]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": last},
    ]
    p = Processor(ThinkerConfig(), ByteTokenizer(), chunked_audio=chunked)
    req = p.build(msgs, speech_output=True)
    # The video as the reference's omni_mode callers pass it: frame i, then second i's audio.
    frame = "<image>" + UNK64 + "</image>"
    video = [frame + _reference_audio_placeholder(n, chunked) for n in (16000, 16000, 8000)]
    ref = _reference_chat_prompt(
        [
            ("system", ["Be brief."]),
            ("user", [_reference_audio_placeholder(24000, chunked), "first"]),
            ("assistant", ["ok"]),
            ("user", video * with_video + [_reference_audio_placeholder(40000, chunked), "Q?"]),
        ],
        omni_mode=with_video,
        stream_input=chunked,
        tts=True,
    )
    assert req.input_ids == tokenize_whole(ref)
    _check_bounds(req)


def test_video_omni_packing_order():
    msgs = [{"role": "user", "content": [MediaBytes("video", make_mp4(2.5)), "Q?"]}]
    req = proc().build(msgs, speech_output=True)
    # frame i then audio i, no separators inside the omni block nor before the text
    sec = lambda n: "<image>" + UNK64 + "</image><|audio_start|>" + "<unk>" * n + "<|audio_end|>"
    expected = "<|im_start|>user\n" + sec(10) + sec(10) + sec(5) + "Q?<|im_end|>\n" + GEN
    assert req.input_ids == tokenize_whole(expected)
    assert len(req.images) == 3 and all(im.num_slices == 1 for im in req.images)
    assert len(req.audios) == 3 and req.audio_segments == [(0, 0, 10), (1, 0, 10), (2, 0, 5)]
    # bounds alternate in prompt order: image 0 < audio 0 < image 1 < audio 1 ...
    order = sorted(
        [(s, "i") for s, _ in req.image_bounds] + [(s, "a") for s, _ in req.audio_bounds]
    )
    assert "".join(k for _, k in order) == "iaiaia"
    _check_bounds(req)


def test_video_merged_audio_segments():
    p = Processor(ThinkerConfig(), ByteTokenizer(), merge_video_audio=True)
    req = p.build([{"role": "user", "content": [MediaBytes("video", make_mp4(2.5))]}])
    assert len(req.audios) == 1
    assert req.audio_segments == [(0, 0, 10), (0, 10, 10), (0, 20, 5)]
    _check_bounds(req)


def test_errors_have_messages():
    with pytest.raises(PromptTooLongError, match=r"over the limit of 10 tokens") as e:
        proc(max_prompt_tokens=10).build([{"role": "user", "content": "a long enough prompt"}])
    assert e.value.http_status == 413
    img = _png(64, 64)
    with pytest.raises(TooManyFramesError, match=r"3 images \+ video frames, over the limit of 2"):
        proc(max_images=2).build([{"role": "user", "content": [MediaBytes("image", img)] * 3}])
    with pytest.raises(TooManyFramesError):
        proc(max_images=2).build(
            [{"role": "user", "content": [MediaBytes("video", make_mp4(3.0))]}]
        )
    with pytest.raises(
        MediaTooLargeError, match=r"image is \d+ bytes, over the limit of 100 bytes"
    ):
        proc(max_media_bytes=100).build([{"role": "user", "content": [MediaBytes("image", img)]}])
    with pytest.raises(MediaTooLargeError, match="over the limit of 1 s"):
        proc(max_audio_seconds=1).build(
            [{"role": "user", "content": [MediaBytes("audio", _wav(2))]}]
        )
    with pytest.raises(CorruptMediaError):
        proc().build([{"role": "user", "content": [MediaBytes("image", img[:100])]}])
    with pytest.raises(EmptyMediaError):
        proc().build([{"role": "user", "content": [MediaBytes("audio", b"")]}])
    with pytest.raises(InvalidMessageError, match="role 'tool'"):
        proc().build([{"role": "tool", "content": "x"}])
    with pytest.raises(InvalidMessageError, match="type 'image_url'"):
        proc().build([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])
    with pytest.raises(InvalidMessageError):
        MediaBytes("pdf", b"x")
    with pytest.raises(InvalidMessageError, match="max_slice_nums"):
        proc().build([{"role": "user", "content": [MediaBytes("image", img, max_slice_nums=20)]}])
    for err in (PromptTooLongError, TooManyFramesError, CorruptMediaError):
        assert issubclass(err, ValueError)


def test_interleaved_image_audio_parts_daily_omni_options():
    """The bench's minicpm-interleave mode: image_url / audio_url pairs with
    mm_processor_kwargs max_slice_nums=1, use_image_id=False."""
    frame, sec = _png(1344, 896), _wav(1.0)
    content = [MediaBytes("image", frame), MediaBytes("audio", sec)] * 2 + ["Q"]
    req = proc().build([{"role": "user", "content": content}], max_slice_nums=1, use_image_id=False)
    pair = "<image>" + UNK64 + "</image>\n<|audio_start|>" + "<unk>" * 10 + "<|audio_end|>"
    expected = "<|im_start|>user\n" + pair + "\n" + pair + "\nQ<|im_end|>\n" + GEN
    assert req.input_ids == tokenize_whole(expected)
    assert [im.num_slices for im in req.images] == [1, 1]
    _check_bounds(req)


def test_parallel_part_decoding_equals_in_order():
    content = [
        MediaBytes("video", make_mp4(2.5)),
        MediaBytes("image", _png(300, 200)),
        MediaBytes("audio", _wav(1.5)),
        "and a question",
    ]
    msgs = [{"role": "user", "content": content}]
    one = Processor(ThinkerConfig(), ByteTokenizer(), decode_workers=1).build(msgs)
    many = Processor(ThinkerConfig(), ByteTokenizer(), decode_workers=4).build(msgs)
    assert one.input_ids == many.input_ids and one.image_bounds == many.image_bounds
    assert one.audio_segments == many.audio_segments
    for a, b in zip(one.images, many.images):
        assert all(x.equal(y) for x, y in zip(a.pixel_values, b.pixel_values))
    for a, b in zip(one.audios, many.audios):
        assert a.features.equal(b.features)
    # the first bad part (in message order) is the error reported, whatever finishes first
    bad = [
        MediaBytes("image", _png(64, 64)),
        MediaBytes("audio", b""),
        MediaBytes("video", b"not a video"),
    ]
    with pytest.raises(EmptyMediaError):
        Processor(ThinkerConfig(), ByteTokenizer(), decode_workers=4).build(
            [{"role": "user", "content": bad}]
        )


# ---------------------------------------------------------------------------------------
# The streamed chat's generation prompt and its bans (MiniCPMO.streaming_generate driving
# ChunkPrefillChunkGenerate.chunk_generate, as the demo's chat server calls them)


def _reference_streamed_prompt(user_items: list[str], think: bool = False) -> str:
    """streaming_prefill of one user message, then streaming_generate's `bos_input`:
    "<|im_start|>user\\n" + content (left open), then "<|im_end|>\\n<|im_start|>assistant\\n"
    + the think block (thinking off) + "<|tts_bos|>" (use_tts_template=True, the default,
    which the demo's chat passes whether it generates audio or not). Content items are
    joined with "\\n", chat()'s joiner outside omni / stream-input mode."""
    prefill = "<|im_start|>user\n" + "\n".join(user_items)
    bos = "<|im_end|>\n<|im_start|>assistant\n" + ("" if think else "<think>\n\n</think>\n\n")
    return prefill + bos + "<|tts_bos|>"


@pytest.mark.parametrize("audio_in", [False, True])
def test_streamed_prompt_is_the_same_for_text_and_speech_output(audio_in):
    content = [MediaBytes("audio", _wav(1.5)), "What did I say?"] if audio_in else ["Hi"]
    msgs = [{"role": "user", "content": content}]
    items = [_reference_audio_placeholder(24000, False), "What did I say?"] if audio_in else ["Hi"]
    for think in (False, True):
        ref = tokenize_whole(_reference_streamed_prompt(items, think))
        text = proc().build(msgs, enable_thinking=think)
        speech = proc().build(msgs, speech_output=True, enable_thinking=think)
        assert text.input_ids == speech.input_ids == ref
        assert text.input_ids[-1] == TOK.tts_bos
        assert not text.return_hidden and speech.return_hidden


# The reference's list (`ChunkPrefillChunkGenerate.__init__`, MiniCPM-o 4.5 utils.py).
REFERENCE_FORBIDDEN = [":", "：", "；", "#", "“", "”", "‘", "’", "@", "*", "【", "】", "「", "」",
                       "(", ")", "（", "）", "[", "]", "&", "/", "$"]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The embedded default's tokenizer files, with `bad_token_ids` in tokenizer_config.json
    as the release has them (a few of its ids, and a repeat of a punctuation id)."""
    import json

    from pipeline.checkpoint import write_tokenizer

    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path, vocab_size=151748)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["bad_token_ids"] = [7, 8, 94, 95, 198, 151560]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_speech_output_bans_what_the_reference_bans(tokenizer_dir):
    transformers = pytest.importorskip("transformers")
    from pipeline.processing.template import SPOKEN_FORBIDDEN_TOKENS
    from pipeline.tokenizer import TextTokenizer

    assert list(SPOKEN_FORBIDDEN_TOKENS) == REFERENCE_FORBIDDEN
    tok = TextTokenizer.from_dir(tokenizer_dir)
    assert tok.bad_token_ids == (7, 8, 94, 95, 198, 151560)
    # The reference: tokenizer.convert_tokens_to_ids on each string (<unk> when it is not a
    # vocabulary string), then `extend(tokenizer.bad_token_ids)`.
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_dir / "tokenizer.json"), unk_token="<unk>"
    )
    want = set(hf.convert_tokens_to_ids(REFERENCE_FORBIDDEN)) | set(tok.bad_token_ids)
    assert TOK.unk in want and {25, 7, 8} <= want  # ':' '(' ')' are byte-level vocab strings
    p = Processor(ThinkerConfig(), tok)
    msgs = [{"role": "user", "content": "Hi"}]
    speech = p.build(msgs, speech_output=True, sampling=SamplingParams(banned_ids=(5, 3)))
    assert speech.sampling.banned_ids == tuple(sorted(want | {3, 5}))  # the caller's kept too
    # Text-only output: no bans (the demo's chat: suppress_forbidden_tokens=generate_audio).
    assert p.build(msgs).sampling.banned_ids == ()
    assert p.build(msgs, sampling=SamplingParams(banned_ids=(9,))).sampling.banned_ids == (9,)


def test_banned_ids_are_validated_and_normalized():
    assert SamplingParams(banned_ids=(9, 2, 9, 4)).banned_ids == (2, 4, 9)
    for bad in ((-1,), (1.5,), ("3",)):
        with pytest.raises(ValueError, match="banned_ids"):
            SamplingParams(banned_ids=bad)

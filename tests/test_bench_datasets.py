"""Daily-Omni loader, request packing and answer parsing on a small generated sample in the
published layout; the synthetic set's determinism and shape."""

from __future__ import annotations

import base64
import io
import json

import av
import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from bench.datasets import (
    build_prompt,
    extract_choice_letter,
    is_correct,
    item_messages,
    load_daily_omni,
    make_specs,
    make_synthetic_daily_omni,
    media_paths,
    write_synthetic_audio,
    write_synthetic_video,
)
from bench.metrics import wav_frames


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    """Three qa.json items in the published layout; the third clip's media are missing."""
    root = tmp_path_factory.mktemp("daily_omni")
    vdir = root / "Videos"
    qa = [
        {"Question": "What sound plays when the door opens?",
         "Choice": ["A. A bell", "B. A dog barking", "C. Music", "D. Silence"],
         "Answer": "b", "video_id": "vidA", "Type": "AV Event Alignment",
         "video_duration": "30s", "video_category": "home"},
        {"Question": "What happens after the clap?",
         "Choice": ["The light turns on", "Nothing", "A car passes", "Rain starts"],
         "Answer": "C", "video_id": "vidB", "Type": "Event Sequence",
         "video_duration": "60s", "video_category": "street"},
        {"Question": "Missing media", "Choice": ["A. x", "B. y", "C. z", "D. w"],
         "Answer": "A", "video_id": "vidMissing", "Type": "Reasoning",
         "video_duration": "30s", "video_category": "x"},
    ]
    for vid, secs in (("vidA", 3.0), ("vidB", 2.0)):
        v, a = media_paths(vdir, vid)
        v.parent.mkdir(parents=True)
        write_synthetic_video(v, secs, (48, 32), fps=4, seed=1)
        write_synthetic_audio(a, secs, 16000, seed=1)
    (root / "qa.json").write_text(json.dumps(qa))
    return root


def test_loader_reads_published_layout(sample):
    items = load_daily_omni(sample)
    assert [it.video_id for it in items] == ["vidA", "vidB"], "item without media must be skipped"
    a = items[0]
    assert a.video_path == sample / "Videos" / "vidA" / "vidA_video.mp4"
    assert a.audio_path == sample / "Videos" / "vidA" / "vidA_audio.wav"
    assert a.answer == "B", "answers are normalised to upper case"
    assert a.choices[1] == "B. A dog barking"
    assert a.meta == {"video_id": "vidA", "type": "AV Event Alignment", "category": "home",
                      "duration": "30s"}
    assert [it.video_id for it in load_daily_omni(sample, durations=("60s",))] == ["vidB"]
    assert len(load_daily_omni(sample, limit=1)) == 1
    assert len(load_daily_omni(sample, require_media=False)) == 3


def test_prompt_letters_choices_once(sample):
    a, b = load_daily_omni(sample)
    pa, pb = build_prompt(a.question, a.choices), build_prompt(b.question, b.choices)
    assert "Question: What sound plays when the door opens?" in pa
    assert "\nA. A bell\nB. A dog barking\nC. Music\nD. Silence\n" in pa, pa
    assert "A. A. " not in pa
    # unlettered choices get letters
    assert "\nA. The light turns on\nB. Nothing\nC. A car passes\nD. Rain starts\n" in pb, pb
    assert "capital letter" in pa and "A, B, C, or D" in pa


def test_video_pack_sends_whole_files_as_data_uris(sample):
    a = load_daily_omni(sample)[0]
    msgs = item_messages(a, pack="video")
    assert len(msgs) == 1 and msgs[0]["role"] == "user"
    parts = msgs[0]["content"]
    assert [p["type"] for p in parts] == ["video_url", "input_audio", "text"]
    url = parts[0]["video_url"]["url"]
    assert url.startswith("data:video/mp4;base64,")
    assert base64.b64decode(url.split(",", 1)[1]) == a.video_path.read_bytes()
    assert parts[1]["input_audio"]["format"] == "wav"
    assert base64.b64decode(parts[1]["input_audio"]["data"]) == a.audio_path.read_bytes()
    alt = item_messages(a, pack="video", audio_style="audio_url", input_mode="audio")
    assert [p["type"] for p in alt[0]["content"]] == ["audio_url", "text"]
    assert alt[0]["content"][0]["audio_url"]["url"].startswith("data:audio/wav;base64,")
    vis = item_messages(a, pack="video", input_mode="visual")
    assert [p["type"] for p in vis[0]["content"]] == ["video_url", "text"]
    for pack in ("video", "interleave"):
        txt = item_messages(a, pack=pack, input_mode="text")[0]["content"]
        assert [p["type"] for p in txt] == ["text"] and a.question in txt[0]["text"]
    files = item_messages(a, pack="video", transport="file")[0]["content"]
    assert [p["type"] for p in files] == ["video_url", "audio_url", "text"]
    assert files[0]["video_url"]["url"] == a.video_path.resolve().as_uri()
    assert files[1]["audio_url"]["url"].startswith("file:///")


def test_interleave_pack_one_frame_and_one_second_of_audio_per_second(sample):
    a = load_daily_omni(sample)[0]  # 3 s clip at 4 fps
    parts = item_messages(a, pack="interleave")[0]["content"]
    types = [p["type"] for p in parts]
    assert types == ["image_url", "input_audio"] * 3 + ["text"], types
    for p in parts[0:6:2]:
        raw = base64.b64decode(p["image_url"]["url"].split(",", 1)[1])
        assert Image.open(io.BytesIO(raw)).size == (48, 32)
    for p in parts[1:6:2]:
        frames, sr = wav_frames(base64.b64decode(p["input_audio"]["data"]))
        assert (frames, sr) == (16000, 16000)
    capped = item_messages(a, pack="interleave", max_pairs=2)[0]["content"]
    assert [p["type"] for p in capped] == ["image_url", "input_audio"] * 2 + ["text"]


def test_track_pack_sends_one_mp4_with_the_wav_as_its_audio_track(sample):
    """The server decodes the muxed clip to the same frames as the clip alone, and its
    audio track to the wav's length and loudness (AAC in between: not the same samples)."""
    from pipeline.processing.video import decode_video

    a = load_daily_omni(sample)[0]
    parts = item_messages(a, pack="track")[0]["content"]
    assert [p["type"] for p in parts] == ["video_url", "text"]
    data = base64.b64decode(parts[0]["video_url"]["url"].split(",", 1)[1])
    muxed, plain = decode_video(data), decode_video(a.video_path.read_bytes())
    assert muxed.timestamps == plain.timestamps and plain.audio_segments is None
    assert all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(muxed.frames, plain.frames, strict=True))
    wav, sr = sf.read(a.audio_path, dtype="float32", always_2d=True)
    wav = wav.mean(axis=1)
    got = np.concatenate(muxed.audio_segments)
    assert sr == 16000 and abs(len(got) - len(wav)) <= 1600, (len(got), len(wav))
    ratio = np.sqrt(np.mean(np.square(got)) / np.mean(np.square(wav)))  # loudness
    assert 0.8 < ratio < 1.25, ratio
    files = item_messages(a, pack="track", transport="file")[0]["content"]
    track = a.video_path.with_name(f"{a.video_id}_track.mp4")
    assert files[0]["video_url"]["url"] == track.resolve().as_uri()
    with pytest.raises(ValueError, match="input_mode all"):
        item_messages(a, pack="track", input_mode="audio")


def test_make_specs_carries_answer_and_labels(sample):
    specs = make_specs(load_daily_omni(sample))
    assert [s.answer for s in specs] == ["B", "C"]
    assert specs[1].meta["duration"] == "60s" and specs[0].item_id.startswith("vidA")


@pytest.mark.parametrize(
    "text, letter",
    [
        ("B", "B"),
        ("B.", "B"),
        ("  C) a car passes", "C"),
        ("D\n", "D"),
        ("assistant\nA", "A"),
        ("system\nYou are ...\nuser\n...\nassistant\n  c", None),  # lower case is not a choice
        ("The answer is D.", "D"),
        ("I think (B) is right", "B"),
        ("Answer: A, not B", "A"),
        ("答案是B", "B"),
        ("选项C正确", "C"),
        ("An apple falls", None),
        ("Because the dog barks", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_choice_letter(text, letter):
    assert extract_choice_letter(text) == letter


def test_is_correct_needs_exact_letter():
    assert is_correct("B", "b")
    assert is_correct("assistant\nB. A dog", "B")
    assert not is_correct("A", "B")
    assert not is_correct("no idea", "B")


def test_synthetic_set_is_deterministic_and_in_layout(tmp_path):
    r1 = make_synthetic_daily_omni(tmp_path / "s1", num_videos=3, durations=(2, 3), seed=7,
                                   size=(33, 24), fps=3, sample_rate=8000)
    r2 = make_synthetic_daily_omni(tmp_path / "s2", num_videos=3, durations=(2, 3), seed=7,
                                   size=(33, 24), fps=3, sample_rate=8000, workers=2)
    qa1 = json.loads((r1 / "qa.json").read_text())
    assert qa1 == json.loads((r2 / "qa.json").read_text())
    assert [q["video_duration"] for q in qa1] == ["2s", "3s", "2s"]
    assert all(q["Answer"] in "ABCD" and len(q["Choice"]) == 4 for q in qa1)
    items = load_daily_omni(r1)
    assert len(items) == 3
    for it, secs in zip(items, (2, 3, 2)):
        other = r2 / "Videos" / it.video_id / it.audio_path.name
        assert it.audio_path.read_bytes() == other.read_bytes(), "audio must follow the seed"
        audio, sr = sf.read(str(it.audio_path))
        assert sr == 8000 and len(audio) == secs * 8000
        with av.open(str(it.video_path)) as c:
            frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
        assert len(frames) == secs * 3
        assert frames[0].shape == (24, 32, 3), "odd width rounded down to even"
        assert float(np.std(frames[0])) > 1.0, "frames are not blank"
    # a different seed gives different audio
    r3 = make_synthetic_daily_omni(tmp_path / "s3", num_videos=1, durations=(2,), seed=8,
                                   size=(32, 24), fps=3, sample_rate=8000)
    it3 = load_daily_omni(r3)[0]
    assert it3.audio_path.read_bytes() != items[0].audio_path.read_bytes()

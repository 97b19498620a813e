"""Duplex parity against the official reference's golden outputs.

The goldens in tests/duplex_golden/ were written by tests/duplex_golden/make_golden.py from
`MiniCPMODuplex` of OpenBMB/minicpm-o-4_5-pytorch-simple-demo at commit REFERENCE_COMMIT
(MiniCPMO45/modeling_minicpmo.py), run on CPU in float32 on the duplex test checkpoint
(tests/_duplex_ckpt.py) with the scripted inputs of tests/_duplex_inputs.py; FORMAT.md there
describes the files. CI cannot import the reference (not on PyPI): it compares against them.

First part (dref): the goldens' own consistency: they match the scripts and the committed
checkpoint patch, and the scripted events occur (listen and speak units, turn ends, window
slides). Omniray's unit-by-unit comparison follows in its own section.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from tests import _duplex_ckpt as dc
from tests import _duplex_inputs as di

REFERENCE_COMMIT = "c7e16605c3ae9623a0caee5845bd0183b1d6d5b3"
GOLDEN = Path(__file__).resolve().parent / "duplex_golden"

UNIT, UNIT_END, LISTEN, SPEAK = 151683, 151684, 151705, 151706
IMAGE, IMAGE_END = 151669, 151670
TTS_BOS, TURN_EOS, CHUNK_EOS, CHUNK_TTS_EOS = 151703, 151717, 151718, 151721
NUM_AUDIO_CODES = 6561  # the Talker's codes; 6561 is its end token (never returned)
SILENCE_CODE = 4218  # the reference's Token2Wav buffer starts each turn with three


@lru_cache(maxsize=None)
def golden(name: str) -> tuple[dict, dict]:
    """(json record, npz arrays) of one golden session."""
    record = json.loads((GOLDEN / f"{name}.json").read_text())
    with np.load(GOLDEN / f"{name}.npz") as z:
        arrays = {k: z[k] for k in z.files}
    return record, arrays


SESSION_NAMES = [s.name for s in di.SESSIONS]


# =======================================================================================
# dref: the goldens' own consistency (omniray's comparison goes in the section below)


def test_golden_files_are_small_and_complete():
    names = {p.name for p in GOLDEN.iterdir()}
    for s in SESSION_NAMES:
        assert {f"{s}.json", f"{s}.npz"} <= names
    total = sum(p.stat().st_size for p in GOLDEN.iterdir()
                if p.suffix in (".json", ".npz"))
    assert total < 3 * 1024 * 1024


@pytest.mark.parametrize("name", SESSION_NAMES)
def test_golden_matches_its_script_commit_and_patch(name):
    record, _ = golden(name)
    script = di.session(name)
    assert record["demo_commit"] == REFERENCE_COMMIT
    assert record["patch_digest"] == dc.patch_digest(dc.load_patch())
    assert record["decode_mode"] == script.decode_mode
    assert record["seed"] == script.seed
    assert record["pattern"] == script.pattern
    assert record["frames"] == script.frames
    assert tuple(record["frame_size"]) == script.frame_size
    assert record["duplex_kwargs"] == script.duplex_kwargs
    assert record["generate_audio"] == script.generate_audio
    assert record["n_timesteps"] == script.n_timesteps
    assert (record["prefix"], record["suffix"]) == (di.PREFIX, di.SUFFIX)
    assert len(record["units"]) == len(script.pattern) >= 12


@pytest.mark.parametrize("name", SESSION_NAMES)
def test_golden_has_the_scripted_events(name):
    """Listen and speak units, a turn end, a window slide, Talker codes and PCM."""
    record, _ = golden(name)
    units = record["units"]
    listens = [u for u in units if u["is_listen"]]
    speaks = [u for u in units if not u["is_listen"]]
    assert listens and speaks
    assert any(u["end_of_turn"] for u in speaks)
    assert units[-1]["slides"] >= 1
    if record["duplex_kwargs"]["sliding_window_mode"] == "context":
        assert units[-1]["previous_text"] and units[-1]["previous_token_ids"]
    else:
        slid = [i for i in range(1, len(units)) if units[i]["slides"] > units[i - 1]["slides"]]
        assert all(units[i]["position_offset"] > units[i - 1]["position_offset"] for i in slid)
    if record["generate_audio"]:
        assert all(u["talker_called"] and u["codes"] for u in speaks)
    else:
        assert not any(u["talker_called"] for u in units)
    if record["decode_mode"] == "greedy":
        # the test checkpoint's behaviour: loud units speak, quiet ones listen or end a turn
        for u in units:
            if u["kind"] == "L":
                assert not u["is_listen"] and u["generated"][0] == SPEAK
            elif u["is_listen"]:
                assert u["generated"] == [LISTEN, UNIT_END]
            else:
                assert u["generated"] == [TTS_BOS, TURN_EOS, CHUNK_TTS_EOS, UNIT_END]
                assert u["end_of_turn"]


@pytest.mark.parametrize("name", SESSION_NAMES)
def test_golden_units_are_consistent(name):
    record, arrays = golden(name)
    script = di.session(name)
    units = record["units"]
    window = record["duplex_kwargs"]["sliding_window_mode"]
    tts_pos, buffer = 0, [SILENCE_CODE] * 3 if record["generate_audio"] else []
    all_generated, fed = [], {}
    cache, offset, slides = record["prepare_cache_len"], 0, 0
    for u in units:
        gen = u["generated"]
        all_generated += gen
        assert gen[-1] == UNIT_END and UNIT_END not in gen[:-1]
        # prefill: <unit>, the frame (omni), the unit's audio embeddings
        pre = u["prefill"]
        assert pre[0] == UNIT and pre[-1][0] == "audio" and pre[-1][1] > 0
        if script.frames:
            assert pre[1] == IMAGE and pre[2] == ["img", 64] and pre[3] == IMAGE_END
        else:
            assert len(pre) == 2
        # every prefill row and every generated id is fed to the LLM
        fed[u["index"]] = sum(x[1] if isinstance(x, list) else 1 for x in pre) + len(gen)
        if u["slides"] == slides:
            assert u["cache_len"] == cache + fed[u["index"]]
        elif window == "basic":  # drops whole units and moves the RoPE offset by as many
            assert u["cache_len"] == cache + fed[u["index"]] - (u["position_offset"] - offset)
        else:  # context: [prefix][previous: ...][suffix][kept units], RoPE offset unchanged
            suffix = record["system_preserve_len"] - u["preserve_prefix_len"]
            kept = u["unit_history"]
            assert len(kept) == record["duplex_kwargs"]["context_max_units"]
            assert kept == list(range(u["index"] - len(kept) + 1, u["index"] + 1))
            assert u["cache_len"] == (u["preserve_prefix_len"] + u["previous_content_len"]
                                      + suffix + sum(fed[k] for k in kept))
            assert len(u["previous_token_ids"]) == u["previous_content_len"]
            assert u["position_offset"] == 0
        cache, offset, slides = u["cache_len"], u["position_offset"], u["slides"]
        # terminators: a unit ends at a chunk terminator (or the forced <|chunk_eos|>)
        assert gen[-2] in (LISTEN, CHUNK_EOS, CHUNK_TTS_EOS)
        assert len(gen) <= 21  # max_new_speak_tokens_per_chunk 20, then </unit>
        # Talker input: this unit's ids after its first step, in order
        assert u["spoken_ids"] == ([] if u["is_listen"] else gen[1:-2])
        if u["spoken_ids"]:
            hidden = arrays[f"spoken_hidden_{u['index']}"]
            assert hidden.shape == (len(u["spoken_ids"]), 128) and hidden.dtype == np.float32
            assert np.isfinite(hidden).all()
            assert len({h.tobytes() for h in hidden}) == len(hidden)  # one per step
        # codes and PCM
        assert all(0 <= c < NUM_AUDIO_CODES for c in u["codes"])
        assert (u["codes"] == []) == (u["is_listen"] or not record["generate_audio"])
        pcm = arrays.get(f"pcm_{u['index']}")
        assert (pcm is None) == (u["pcm"] is None)
        assert (pcm is None) == (not u["is_listen"] and not record["generate_audio"])
        if pcm is not None:
            assert pcm.dtype == np.int16 and len(pcm) == u["pcm"]
            if u["is_listen"]:
                assert len(pcm) == 24000 and not pcm.any()  # the reference's 1 s of silence
            else:
                assert pcm.any() and len(pcm) >= 24000  # left-padded to 1 s but the last
        if u["end_of_turn"]:
            assert u["tts_text_start_pos"] == 0
        # the Talker's chunk call and the Token2Wav windows it fed
        call, windows = u["talker_call"], u["token2wav_calls"]
        if u["talker_called"]:
            assert call["condition_len"] == len(u["spoken_ids"]) + 1  # + audio_bos
            assert call["text_start_pos"] == tts_pos and call["max_new_token"] == 26
            assert call["min_new_tokens"] == (0 if tts_pos == 0 or u["end_of_turn"] else 26)
            stream, at = buffer + u["codes"], 0
            for k, (tokens, last, _) in enumerate(windows):
                assert tokens == stream[at:at + len(tokens)]
                assert last == (u["end_of_turn"] and k == len(windows) - 1)
                at = len(stream) if last else at + min(25, len(tokens) - 3)
            buffer = [SILENCE_CODE] * 3 if u["end_of_turn"] else stream[at:]
            samples = sum(w[2] for w in windows)
            assert len(pcm) == (samples if u["end_of_turn"] else max(24000, samples))
        else:
            assert call is None and windows == []
        assert u["token2wav_buffer"] == buffer
        tts_pos = u["tts_text_start_pos"]
        # the global RNG: only sampling draws, two per sampled step at most
        if record["decode_mode"] == "greedy":
            assert u["rng_draws"] == 0
        else:
            assert 1 <= u["rng_draws"] <= 2 * (len(gen) - 1)
    assert record["total_ids"] == all_generated


@pytest.mark.parametrize("name", SESSION_NAMES)
def test_omniray_tokenizer_agrees_with_the_goldens(name):
    """The system prompt's ids and every unit's text, through omniray's tokenizer of the test
    checkpoint, are the reference's (its MiniCPMOTokenizerFast over the same tokenizer.json)."""
    from pipeline.tokenizer import TextTokenizer

    record, _ = golden(name)
    tok = TextTokenizer.from_dir(dc.duplex_test_checkpoint())
    assert tok.encode(record["prefix"]) == record["prefix_ids"]
    assert tok.encode(record["suffix"]) == record["suffix_ids"]
    ref_rows = record["prepare_cache_len"] - len(record["prefix_ids"]) - len(record["suffix_ids"])
    assert ref_rows == 10  # HT_ref_audio.wav: 1 s, 10 audio rows
    for u in record["units"]:
        assert tok.decode(u["spoken_ids"], skip_special_tokens=True) == u["text"]


def test_scripted_inputs_are_deterministic_and_distinct():
    for script in di.SESSIONS:
        a, b = di.session_inputs(script), di.session_inputs(script)
        assert len(a) == len(script.pattern)
        for (x, fx), (y, fy) in zip(a, b):
            assert x.dtype == np.float32 and x.shape == (di.UNIT_SAMPLES,)
            assert np.array_equal(x, y)
            if script.frames:
                assert fx[0].size == script.frame_size
                assert np.array_equal(np.asarray(fx[0]), np.asarray(fy[0]))
            else:
                assert fx is None
        loud = [x for (x, _), k in zip(a, script.pattern) if k == "L"]
        quiet = [x for (x, _), k in zip(a, script.pattern) if k == "q"]
        assert min(np.abs(x).max() for x in loud) > 100 * max(np.abs(x).max() for x in quiet)
    with pytest.raises(ValueError):
        di.unit_audio("x", 0)


def test_test_checkpoint_is_the_tiny_default_plus_the_patch(tiny_checkpoint):
    """The test checkpoint loads with omniray's strict checkpoint reader; only the patched
    rows / columns / tensors differ from the tiny default, and they hold the patch (rounded
    to the stored dtype)."""
    import torch

    from pipeline.checkpoint import Checkpoint

    patch = dc.load_patch()
    path = dc.duplex_test_checkpoint()
    test, base = Checkpoint(path), Checkpoint(tiny_checkpoint)
    assert test.config == base.config
    for name, entry in patch.items():
        got, was = test.get(name, "cpu", torch.float32), base.get(name, "cpu", torch.float32)
        dtype = test.get(name).dtype  # as stored (the tiny default: bfloat16)
        changed = torch.zeros_like(got, dtype=torch.bool)
        if entry["full"] is not None:
            want = torch.as_tensor(entry["full"]).to(dtype).float()
            assert torch.equal(got, want)
            continue
        for i, vec in entry["rows"].items():
            assert torch.equal(got[i], torch.as_tensor(vec).to(dtype).float())
            changed[i] = True
        for j, vec in entry["cols"].items():
            assert torch.equal(got[:, j], torch.as_tensor(vec).to(dtype).float())
            changed[:, j] = True
        assert torch.equal(got[~changed], was[~changed])
    untouched = "llm.model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(test.get(untouched, "cpu", torch.float32),
                       base.get(untouched, "cpu", torch.float32))
    with pytest.raises(KeyError):
        dc.write_patched_checkpoint(tiny_checkpoint, path.parent / "never",
                                    {"no.such.tensor": {"full": np.zeros(1)}})


# =======================================================================================
# omniray against the goldens (dthk)

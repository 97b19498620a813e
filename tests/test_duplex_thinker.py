"""The duplex Thinker side and the session (pipeline/duplex): behaviour on the tiny default.

Unit-by-unit parity with the reference `MiniCPMODuplex` is checked against the committed
golden files (tests/duplex_golden, see test_duplex_parity.py and the parity section at the
end of this file); the tests here check what holds without the reference: forced
decisions, what reaches the speech side, seeded repeatability and session isolation, the
sliding window's RoPE realignment, the streaming mel's stable frames, and bad input.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.duplex.audio_stream import StreamingMel, log_mel_frames
from pipeline.duplex.config import DuplexConfig
from pipeline.duplex.kv import SessionKV, standalone_pages
from pipeline.duplex.session import DuplexSession
from pipeline.duplex.thinker import DuplexThinker
from pipeline.processing.audio import HOP_LENGTH, N_FFT, _stft_constants
from pipeline.thinker.model import ThinkerModel
from pipeline.tokenizer import TextTokenizer

PREFIX, SUFFIX = "You are a helpful assistant.", "<|im_end|>\n"


@pytest.fixture(scope="module")
def parts(tiny_source):
    model = ThinkerModel.load(tiny_source, device="cpu", dtype=torch.float32)
    return model, TextTokenizer.from_dir(tiny_source.tokenizer_dir)


def make(parts, seed=0, **kw) -> DuplexThinker:
    kw.setdefault("max_new_speak_tokens_per_chunk", 6)
    model, tok = parts
    return DuplexThinker(model, tok, DuplexConfig(**kw), seed=seed)


def audio_units(n, seed=0, seconds=1.0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(int(16000 * seconds)) * 0.05).astype(np.float32) for _ in range(n)]


def frame(seed, w=40, h=30):
    return np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)


# ---------------------------------------------------------------------------------------
# Decisions and what a unit holds


def test_forced_listen_and_speak(parts):
    th = make(parts, decode_mode="greedy")
    t = th.tokens
    s = DuplexSession(th)
    s.prepare(PREFIX, SUFFIX)
    a = audio_units(3)
    listen = s.unit(a[0], force="listen")
    assert listen.is_listen and not listen.end_of_turn
    assert listen.token_ids == [t.listen, t.unit_end]
    assert listen.codes == [] and listen.pcm is None and listen.text == ""
    assert listen.prefill == [t.unit, ("audio", 10)]

    before = th.context_length
    speak = th.prefill_unit(a[1]) and th.generate_unit(force="speak")
    assert not speak.is_listen
    assert speak.token_ids[0] == t.speak and speak.token_ids[-1] == t.unit_end
    # every token after the decision up to the terminator is spoken, with its hidden row
    body = speak.token_ids[1:-1]
    if body and body[-1] in (t.chunk_eos, t.chunk_tts_eos, t.listen):
        body = body[:-1]
    assert [i for i, _ in speak.spoken] == body
    assert all(h.shape == (th.model.cfg.llm.hidden_size,) for _, h in speak.spoken)
    assert speak.text == th.tokenizer.decode(body, skip_special_tokens=True)
    # the KV grew by <unit>, the audio rows and every fed token
    assert th.context_length == before + 1 + 10 + len(speak.token_ids)


def test_max_tokens_end_the_chunk_with_chunk_eos(parts):
    th = make(parts, decode_mode="greedy", max_new_speak_tokens_per_chunk=4)
    t = th.tokens
    th.prepare(PREFIX, SUFFIX)
    th.prefill_unit(audio_units(1)[0])
    u = th.generate_unit(force="speak")
    assert u.token_ids[0] == t.speak and u.token_ids[-1] == t.unit_end
    if u.token_ids[-2] == t.chunk_eos and len(u.token_ids) == 5:
        # decision + 2 tokens, then the reference's forced <|chunk_eos|> at the last step
        assert len(u.spoken) == 2
    else:  # the model ended the chunk itself before the cap
        assert u.token_ids[-2] in th.chunk_terminators and len(u.token_ids) < 5


def test_force_listen_count_then_model_decides(parts):
    th = make(parts, decode_mode="greedy", force_listen_count=2)
    t = th.tokens
    th.prepare(PREFIX, SUFFIX)
    out = []
    for a in audio_units(3):
        th.prefill_unit(a)
        out.append(th.generate_unit())
    assert [u.token_ids for u in out[:2]] == [[t.listen, t.unit_end]] * 2
    assert th.generate_count == 3


def test_no_input_gives_a_listen_without_touching_the_context(parts):
    th = make(parts)
    th.prepare(PREFIX, SUFFIX)
    n = th.context_length
    assert th.prefill_unit(None) is False
    assert th.prefill_unit(np.zeros(0, np.float32), []) is False
    u = th.generate_unit()
    assert u.is_listen and u.token_ids == [] and th.context_length == n
    assert th.generate_count == 0  # the reference does not count it towards force_listen


def test_a_turn_in_progress_may_not_listen(parts):
    """After a speak unit the turn is open: a decoded <|listen|> becomes <|tts_bos|>."""
    th = make(parts, decode_mode="greedy", listen_prob_scale=1.0)
    t = th.tokens
    th.prepare(PREFIX, SUFFIX)
    a = audio_units(2)
    th.prefill_unit(a[0])
    first = th.generate_unit(force="speak")
    assert not th.current_turn_ended or first.end_of_turn
    th.prefill_unit(a[1])
    # make <|listen|> the model's choice: the decoder sees pending logits that favour it
    th.pending_logits = torch.full_like(th.pending_logits, -1e4)
    th.pending_logits[0, t.listen] = 1e4
    turn_open = not th.current_turn_ended
    u = th.generate_unit()
    assert u.token_ids[0] == (t.tts_bos if turn_open else t.listen)


# ---------------------------------------------------------------------------------------
# The session and the speech side


@dataclass
class _Chunk:
    codes: list[int]
    pcm: np.ndarray


class StandInSpeech:
    """Records what the session hands the speech side; answers one code per spoken row."""

    def __init__(self, log):
        self.log, self.calls = log, []
        self.generator = torch.Generator()

    def prepare(self, prompt_wav):
        self.log.append(("speech.prepare", prompt_wav))

    def close(self):
        self.log.append(("speech.close",))

    def speak(self, spoken, end_of_turn):
        self.calls.append(([i for i, _ in spoken], [h.clone() for _, h in spoken], end_of_turn))
        return _Chunk(list(range(len(spoken))), np.zeros(240 * len(spoken), np.float32))


def test_session_hands_speak_units_to_the_speech_side(parts):
    log = []
    th = make(parts, decode_mode="greedy")
    orig = th.prepare
    th.prepare = lambda *a, **k: (log.append(("thinker.prepare",)), orig(*a, **k))[1]
    speech = StandInSpeech(log)
    s = DuplexSession(th, speech)
    assert speech.generator is th.generator  # one RNG per session, as the reference's
    s.prepare(PREFIX, SUFFIX, prompt_wav="voice.wav")
    assert log == [("speech.prepare", "voice.wav"), ("thinker.prepare",)]
    forces = ["listen", "speak", None, "listen", "speak"]
    results = [s.unit(a, force=f) for a, f in zip(audio_units(5), forces)]
    speak_units = [r for r in results if not r.is_listen]
    assert len(speech.calls) == len(speak_units) >= 2
    for r, (ids, hidden, eot) in zip(speak_units, speech.calls):
        assert eot == r.end_of_turn
        assert r.codes == list(range(len(ids))) and r.pcm.shape == (240 * len(ids),)
        assert all(h.shape == (th.model.cfg.llm.hidden_size,) for h in hidden)
    for r in results:
        if r.is_listen:
            assert r.codes == [] and r.pcm is None


def test_close_frees_the_session_state(parts):
    log = []
    s = DuplexSession(make(parts, decode_mode="greedy"), StandInSpeech(log))
    s.prepare(PREFIX, SUFFIX)
    s.unit(audio_units(1)[0], force="speak")
    th = s.thinker
    pool = th.pages.blocks
    held, free = len(th.kv.table), pool.num_free
    assert held > 0 and th.audio_encoder.k is not None
    s.close()
    # every block of the session back in the model's pool
    assert th.kv.table == [] and th.context_length == 0 and pool.num_free == free + held
    assert th.audio_encoder.k is None and th.pending_logits is None and th.units == []
    assert log[-1] == ("speech.close",)


def test_session_without_speech_is_text_only(parts):
    s = DuplexSession(make(parts, decode_mode="greedy"), None)
    s.prepare(PREFIX, SUFFIX)
    r = s.unit(audio_units(1)[0], force="speak")
    assert not r.is_listen and r.codes == [] and r.pcm is None
    assert r.text == s.thinker.tokenizer.decode(
        [i for i in r.token_ids[1:] if i not in s.thinker.chunk_terminators
         and i != s.thinker.tokens.unit_end], skip_special_tokens=True)


def test_seeded_sampling_repeats_and_sessions_are_isolated(parts):
    a, f = audio_units(3), [frame(i) for i in range(3)]

    def run(th, units):
        return [(th.prefill_unit(x, None if y is None else [y]), th.generate_unit().token_ids)[1]
                for x, y in units]

    alone = make(parts, seed=7)
    alone.prepare(PREFIX, SUFFIX)
    ref = run(alone, zip(a, f))
    again = make(parts, seed=7)
    again.prepare(PREFIX, SUFFIX)
    other = make(parts, seed=8)
    other.prepare("Another prompt.", SUFFIX)
    mixed = []
    for x, y, z in zip(a, f, audio_units(3, seed=5)):  # interleaved with another session
        mixed += run(again, [(x, y)])
        run(other, [(z, None)])
    assert mixed == ref
    assert sum(len(ids) for ids in ref) > 3 * 2  # sampling produced speech tokens


# ---------------------------------------------------------------------------------------
# Sliding window


def test_dropping_a_span_realigns_the_rest_as_if_never_there(parts):
    """Layer 0's keys depend only on a token and its position: after dropping a middle
    span, the kept suffix's keys equal those of a context that never held the span."""
    model, _ = parts
    emb = model.llm.embed(torch.arange(1000, 1015))
    a, b, c = emb[:3], emb[3:8], emb[8:]
    kv = SessionKV(standalone_pages(model.llm))
    kv.forward(torch.cat([a, b, c]))
    kv.drop(3, 5)
    fresh = SessionKV(standalone_pages(model.llm))
    fresh.forward(torch.cat([a, c]))
    assert kv.length == fresh.length == 10
    got, want = kv.snapshot()[0][0], fresh.snapshot()[0][0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_basic_window_slides_and_keeps_the_system_prompt(parts):
    th = make(parts, decode_mode="greedy", sliding_window_mode="basic",
              basic_window_high_tokens=60, basic_window_low_tokens=40)
    th.prepare(PREFIX, SUFFIX)
    keep = th.preserve
    system_k = [kv[0, :keep] for kv in th.kv.snapshot()]
    lengths = []
    for i, a in enumerate(audio_units(6)):
        th.prefill_unit(a)
        th.generate_unit(force="speak" if i % 2 else None)
        lengths.append(th.context_length)
        assert th.context_length <= 60
        assert th.context_length == keep + sum(u.length for u in th.units)
    assert th.slides >= 1
    for before, kv in zip(system_k, th.kv.snapshot(), strict=True):
        assert torch.equal(before, kv[0, :keep])


def test_context_window_carries_dropped_speech_into_the_previous_text(parts):
    th = make(parts, decode_mode="greedy", sliding_window_mode="context",
              context_max_units=2, context_previous_max_tokens=8)
    th.prepare(PREFIX, SUFFIX)
    prefix_len, suffix = th.ctx_prefix, th.ctx_suffix
    assert prefix_len + len(suffix) == th.preserve and suffix == th.tokenizer.encode(SUFFIX)
    spoken = []
    for i, a in enumerate(audio_units(5)):
        th.prefill_unit(a)
        u = th.generate_unit(force="listen" if i == 1 else "speak")
        spoken.append([] if u.is_listen else [x for x, _ in u.spoken if x not in th.special_ids])
        assert len(th.units) <= 2
        assert th.context_length == th.preserve + sum(x.length for x in th.units)
    marker = th.tokenizer.encode("\n\nprevious: ")
    # units 0-2 left the context: the newest 8 of their spoken tokens follow the marker
    assert th.ctx_previous == marker + [x for ids in spoken[:3] for x in ids][-8:]
    assert th.preserve == prefix_len + len(th.ctx_previous) + len(suffix)
    # the system part was recomputed: prefix, previous and suffix as if prefilled afresh
    fresh = SessionKV(th.pages)
    fresh.forward(th._embed(th.tokenizer.encode(PREFIX) + th.ctx_previous + suffix))
    for got, want in zip(th.kv.snapshot(), fresh.snapshot(), strict=True):
        torch.testing.assert_close(got[:, : th.preserve], want[:, : th.preserve],
                                   rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# Streaming audio


def test_streaming_mel_stable_frames_do_not_change_with_more_audio():
    mel = StreamingMel(1000, 1035, 20)
    a = audio_units(3, seed=3)
    first = mel.push(np.concatenate([np.zeros(480, np.float32), a[0]])[:16480])
    second = mel.push(a[1])
    third = mel.push(a[2])
    assert [first.shape[1], second.shape[1], third.shape[1]] == [102, 104, 104]
    # the redundant frames either side of a boundary are the neighbour's core frames
    torch.testing.assert_close(second[:, :4], first[:, 98:102], rtol=0, atol=1e-5)
    torch.testing.assert_close(third[:, :4], second[:, 100:104], rtol=0, atol=1e-5)


def plain_log_spec(buffer):
    """The reference's features over the whole buffer (a centered STFT, its last frame
    dropped), before the floor: the plain path `StreamingMel.log_spec` keeps frames of."""
    window, fb = _stft_constants()
    stft = torch.stft(torch.from_numpy(buffer)[None], N_FFT, HOP_LENGTH, window=window,
                      return_complex=True)
    return torch.clamp(fb.T @ (stft[..., :-1].abs() ** 2), min=1e-10).log10()[0]


class PlainMel(StreamingMel):
    def log_spec(self):
        return plain_log_spec(self.buffer)


@pytest.mark.parametrize("n", [400, 401, 16000, 16480 + 77, 16000 * 30])
def test_log_mel_frames_are_the_whole_buffers_frames(n):
    x = (np.random.default_rng(n).standard_normal(n) * 0.1).astype(np.float32)
    whole = plain_log_spec(x)
    total = whole.shape[1]
    assert total == n // HOP_LENGTH
    # the front (reflect-padded), the middle, the tail (reflect-padded at the end), all
    for lo, hi in {(0, 1), (0, min(3, total)), (1, total), (total // 2, total),
                   (max(0, total - 2), total), (0, total)}:
        got = log_mel_frames(x, lo, hi)
        assert got.shape == (80, hi - lo)
        # the FFTs are the same bits; the filter bank's matmul by other column counts
        # moves a sum by an ulp
        torch.testing.assert_close(got, whole[:, lo:hi], rtol=0, atol=1e-6)


def test_streaming_mel_keeps_frames_as_the_whole_buffer_computes_them():
    """Units through the kept frames equal the plain path (the whole buffer featurized at
    every unit) over 45 s: the fixed floor, the floor relative to the max from 5 s, a loud
    second that sets the max and leaves it when the 30 s buffer slides."""
    fast, plain = StreamingMel(1000, 1035, 20), PlainMel(1000, 1035, 20)
    rng = np.random.default_rng(7)
    worst = 0.0
    for i in range(45):
        x = (rng.standard_normal(fast.chunk_size()) * (1.0 if i == 6 else 0.05))
        x = x.astype(np.float32)
        got, want = fast.push(x), plain.push(x)
        assert got.shape == want.shape and got.shape[1] in (102, 104)
        assert fast.base == plain.base and len(fast.buffer) == len(plain.buffer)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        worst = max(worst, (got - want).abs().max().item())
        # what is kept is the buffer's stable frames, no more
        assert fast._stable.shape[1] == (len(fast.buffer) - N_FFT // 2) // HOP_LENGTH + 1
    assert fast.base > 0  # the buffer slid
    assert worst <= 1e-6


def test_audio_of_a_unit_short_of_a_chunk_waits(parts):
    th = make(parts, decode_mode="greedy")
    th.prepare(PREFIX, SUFFIX)
    assert th.prefill_unit(audio_units(1)[0]) is True  # the first unit is padded to 1.035 s
    th.generate_unit()
    assert th.prefill_unit(audio_units(1, seconds=0.5)[0]) is False
    assert th.generate_unit().token_ids == []
    assert th.prefill_unit(audio_units(1, seconds=0.5)[0]) is True


# ---------------------------------------------------------------------------------------
# Bad input


def test_bad_input_is_refused_before_any_state_changes(parts):
    th = make(parts)
    th.prepare(PREFIX, SUFFIX)
    n = th.context_length
    with pytest.raises(ValueError, match="1-D"):
        th.prefill_unit(np.zeros((2, 16000), np.float32))
    with pytest.raises(ValueError, match="NaN"):
        th.prefill_unit(np.full(16000, np.nan, np.float32))
    with pytest.raises(ValueError, match="frame"):
        th.prefill_unit(None, ["not an image"])
    with pytest.raises(ValueError, match="max_slice_nums"):
        th.prefill_unit(None, [frame(0)], [1, 2])
    with pytest.raises(ValueError, match="max_slice_nums"):
        th.prefill_unit(None, [frame(0)], 0)
    with pytest.raises(ValueError, match="force"):
        th.generate_unit(force="shout")
    with pytest.raises(ValueError, match="ref_audio"):
        th.prepare(PREFIX, SUFFIX, np.zeros((2, 10), np.float32))
    assert th.context_length == n and th.pending_logits is None


def test_prepared_frames_stand_for_their_frames(parts):
    """A unit's frames sliced beforehand (`prepare_frames`, a future of them too) prefill
    as the frames do; sliced at another max_slice_nums they are refused."""
    from concurrent.futures import Future

    from pipeline.duplex.thinker import prepare_frames

    a, b = make(parts), make(parts)
    for th in (a, b):
        th.prepare(PREFIX, SUFFIX)
    frames = [frame(1), frame(2)]
    prepared = prepare_frames(a.model.cfg.slicing, frames, 2)
    fut: Future = Future()
    fut.set_result(prepared)
    # a future of them, then as they are, against the frames themselves (plans only)
    for got, want in ((a.plan_prefill(None, fut, 2), b.plan_prefill(None, frames, 2)),
                      (a.plan_prefill(None, prepared, 2), b.plan_prefill(None, frames, 2))):
        assert got.schema == want.schema and torch.equal(got.rows, want.rows)
    with pytest.raises(ValueError, match="max_slice_nums"):
        a.plan_prefill(None, prepared, 1)


@pytest.mark.parametrize("kw, match", [
    ({"sliding_window_mode": "context", "context_max_units": 0}, "context window"),
    ({"sliding_window_mode": "sideways"}, "sliding_window_mode"),
    ({"decode_mode": "beam"}, "decode_mode"),
    ({"max_new_speak_tokens_per_chunk": 0}, "max_new_speak_tokens_per_chunk"),
    ({"temperature": 0.0}, "temperature"),
    ({"sample_rate": 24000}, "16 kHz"),
    ({"sliding_window_mode": "basic", "basic_window_high_tokens": 10,
      "basic_window_low_tokens": 20}, "basic window"),
])
def test_config_refuses_what_it_cannot_run(kw, match):
    with pytest.raises(ValueError, match=match):
        DuplexConfig(**kw)


# ---------------------------------------------------------------------------------------
# Parity with the reference: the committed goldens of tests/duplex_golden
#
# Written by tests/duplex_golden/make_golden.py (the official demo's MiniCPMODuplex, its
# commit named in each json as `demo_commit`, on the duplex test checkpoint of
# tests/_duplex_ckpt.py, CPU float32), one fresh reference object per session, inputs from
# tests/_duplex_inputs.py. Here: the Thinker side alone, unit by unit; the speech side and
# the whole session are compared in test_duplex_parity.py.

GOLDEN = Path(__file__).resolve().parent / "duplex_golden"
GOLDEN_SESSIONS = ("audio_greedy", "audio_sampling", "omni_greedy", "text_context_greedy")


def _golden(name):
    path = GOLDEN / f"{name}.json"
    if not path.is_file():
        pytest.skip(f"{path} not committed")
    record = json.loads(path.read_text())
    arrays = np.load(GOLDEN / f"{name}.npz")
    return record, arrays


def _schema(prefill):
    return [list(x) if isinstance(x, tuple) else x for x in prefill]


@pytest.fixture(scope="module")
def duplex_ckpt():
    if not GOLDEN.is_dir():
        pytest.skip("tests/duplex_golden not committed")
    from tests._duplex_ckpt import duplex_test_checkpoint

    return duplex_test_checkpoint()


@pytest.mark.parametrize("name", GOLDEN_SESSIONS)
def test_thinker_matches_the_reference_unit_by_unit(name, duplex_ckpt):
    from tests import _duplex_inputs as di

    record, arrays = _golden(name)
    script = di.session(name)
    cfg = DuplexConfig(decode_mode=record["decode_mode"], **record["duplex_kwargs"])
    # the reference seeds the global RNG right before prepare; the session's generator
    # takes the same seed and its draws come in the same order
    th = DuplexThinker.from_checkpoint(duplex_ckpt, cfg, seed=record["seed"])
    th.prepare(record["prefix"], record["suffix"], di.ref_audio(duplex_ckpt))
    assert th.context_length == record["prepare_cache_len"]
    assert th.preserve == record["system_preserve_len"]
    seen = set()
    for unit, (audio, frames) in zip(record["units"], di.session_inputs(script), strict=True):
        i = unit["index"]
        draws = th.decoder.draws
        assert th.prefill_unit(audio, frames) is True
        u = th.generate_unit()
        where = f"{name} unit {i}"
        assert _schema(u.prefill) == unit["prefill"], where
        assert u.token_ids == unit["generated"], where
        assert (u.is_listen, u.end_of_turn, u.text) == (
            unit["is_listen"], unit["end_of_turn"], unit["text"]), where
        assert [x for x, _ in u.spoken] == unit["spoken_ids"], where
        assert th.context_length == unit["cache_len"], where
        assert th.slides == unit["slides"], where
        if "dropped_units" in unit:
            assert th.dropped_units == unit["dropped_units"], where
        if "rng_draws" in unit:
            assert th.decoder.draws - draws == unit["rng_draws"], where
        if "previous_token_ids" in unit:  # the context window's system part
            assert th.ctx_previous == unit["previous_token_ids"], where
            assert th.ctx_previous_len == unit["previous_content_len"], where
            assert th.ctx_prefix == unit["preserve_prefix_len"], where
        if u.spoken:
            want = torch.from_numpy(arrays[f"spoken_hidden_{i}"])
            got = torch.stack([h for _, h in u.spoken])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=where)
        seen.add("listen" if u.is_listen else "turn_end" if u.end_of_turn else "speak")
    assert record["total_ids"][-len(u.token_ids):] == u.token_ids
    # the session covers what the parity claim is about
    assert {"listen", "speak", "turn_end"} <= seen and th.slides >= 1


# One session end to end (listen, speak, two turn ends, window slides, frames): each side is
# compared on every golden session above and in test_duplex_speech.py; this checks the
# composition (Token2Wav on CPU makes a session end to end cost ~15 s).
@pytest.mark.parametrize("name", ["omni_greedy"])
def test_session_with_speech_matches_the_reference(name, duplex_ckpt):
    """The whole session (this Thinker + pipeline/duplex/speech.py) against the goldens:
    decisions, tokens, the Talker's codes and the PCM of every speak unit (the reference's
    Talker takes the argmax code in the golden run: the speech side's `greedy`)."""
    speech_mod = pytest.importorskip("pipeline.duplex.speech")
    from tests import _duplex_inputs as di
    from tests._duplex_ckpt import vocoder_noise_table

    record, arrays = _golden(name)
    cfg = DuplexConfig(decode_mode=record["decode_mode"], **record["duplex_kwargs"])
    th = DuplexThinker.from_checkpoint(duplex_ckpt, cfg, seed=record["seed"])
    speech = speech_mod.DuplexSpeech.from_checkpoint(duplex_ckpt, cfg, seed=record["seed"],
                                                     greedy=True)
    speech.models.vocoder.noise_table = vocoder_noise_table()  # the golden run's fixed table
    s = DuplexSession(th, speech)
    s.prepare(record["prefix"], record["suffix"], di.ref_audio(duplex_ckpt), None)
    for unit, (audio, frames) in zip(record["units"], di.session_inputs(di.session(name)),
                                     strict=True):
        i, where = unit["index"], f"{name} unit {unit['index']}"
        r = s.unit(audio, frames)
        assert r.token_ids == unit["generated"], where
        assert (r.is_listen, r.end_of_turn) == (unit["is_listen"], unit["end_of_turn"]), where
        assert r.codes == unit["codes"], where
        if r.is_listen:
            # the reference hands out a second of silence on a listen unit; here: no audio
            assert r.pcm is None and not np.any(arrays[f"pcm_{i}"]), where
        else:
            want = arrays[f"pcm_{i}"].astype(np.float32) / 32768.0
            assert r.pcm.shape == want.shape, where
            np.testing.assert_allclose(r.pcm, want, rtol=0, atol=1e-3, err_msg=where)

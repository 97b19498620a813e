"""DuplexSpeech (pipeline/duplex/speech.py) against the reference, CPU fp32, the tiny default.

* The Talker: `MiniCPMTTS.generate_chunk` as `MiniCPMODuplex.streaming_generate` drives it,
  restated plainly here (`PlainChunkTalker`: no KV, every draw recomputes the turn's whole
  sequence from position 0 with tests/_talker_ref.py's forward), seeded sampling and argmax,
  with the EOS row of the head scaled up so that chunks end early and the min-token masks
  matter.
* Token2Wav: minicpmo-utils 1.0.7's own Token2wav (tests/_code2wav_ref.py; skipped when it is
  not installed) driven as the demo's `_generate_waveform_from_tokens` does (`demo_waveform`),
  unit by unit over several turns, force-flushed turn starts of every size included.
* The whole speech side against the golden reference session (tests/duplex_golden/, written by
  the duplex reference script from the demo's MiniCPMODuplex), where present.
The demo (OpenBMB/minicpm-o-4_5-pytorch-simple-demo @ c7e16605) is not on PyPI; the restated
pieces follow its MiniCPMO45/modeling_minicpmo.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.code2wav.assets import load_code2wav
from pipeline.duplex.speech import (
    CHUNK_DRAWS,
    DuplexSpeech,
    SpeechModels,
    as_reference_pcm,
)
from pipeline.talker.model import TalkerKVCache
from tests._talker_ref import PlainTalker

LSB = 1 / 32768  # the reference's PCM goes through int16


@pytest.fixture(scope="module")
def models(tiny_checkpoint) -> SpeechModels:
    return SpeechModels.from_checkpoint(tiny_checkpoint)


def _spoken(g: torch.Generator, n: int, width: int) -> list[tuple[int, torch.Tensor]]:
    ids = torch.randint(0, 151000, (n,), generator=g).tolist()
    return [(i, torch.randn(width, generator=g)) for i in ids]


# -- the Talker ---------------------------------------------------------------------------


class PlainChunkTalker:
    """generate_chunk + the per-turn state streaming_generate keeps, computed plainly."""

    def __init__(self, model, seed: int, greedy: bool, temperature=0.8, penalty=1.05):
        self.model, self.plain = model, PlainTalker(model)
        self.generator = torch.Generator().manual_seed(seed)
        self.greedy, self.temperature, self.penalty = greedy, torch.tensor([[temperature]]), penalty
        self.eos = model.cfg.num_audio_tokens - 1
        self.turn: list[torch.Tensor] = []  # the turn's input rows so far (its past KV)

    def condition(self, spoken) -> torch.Tensor:
        """_convert_results_to_tts_input."""
        m = self.model
        bos = m.emb_text(torch.tensor([m.cfg.audio_bos_token_id]))
        if not spoken:
            return bos
        ids = torch.tensor([i for i, _ in spoken])
        hidden = m.projector_semantic(torch.stack([h for _, h in spoken]))
        return torch.cat([m.emb_text(ids) + F.normalize(hidden, p=2, dim=-1), bos])

    def _logits(self) -> torch.Tensor:
        rows = torch.cat(self.turn)
        cache = TalkerKVCache(self.model.cfg, 1, rows.shape[0], torch.float32, torch.device("cpu"))
        return self.plain.prefill(cache, 0, rows)[None]  # (1, V)

    def chunk(self, spoken, end_of_turn: bool) -> list[int]:
        min_new = 0 if end_of_turn or not self.turn else CHUNK_DRAWS
        self.turn.append(self.condition(spoken))
        new: list[int] = []
        for t in range(CHUNK_DRAWS):
            if t > 0:
                self.turn.append(self.model.emb_code[0](torch.tensor([new[t - 1]])))
            logits = self._logits() / self.temperature
            if t > 0:  # CustomRepetitionPenaltyLogitsProcessorRepeat over new_tokens[:t]
                freq = F.one_hot(torch.tensor([new[-16:]]), logits.shape[1]).sum(1)
                alpha = torch.pow(self.penalty, freq)
                logits = torch.where(logits < 0, logits * alpha, logits / alpha)
            if t < min_new:
                logits[:, self.eos] = -torch.inf
            scores = F.softmax(logits, dim=-1)
            code = (scores.argmax(-1) if self.greedy
                    else torch.multinomial(scores, 1, generator=self.generator)).item()
            if code == self.eos:
                break
            new.append(code)
        if end_of_turn:
            self.turn = []
        return new[:t]


@pytest.fixture
def eos_prone(models):
    """The Talker's EOS logit scaled up (its weight-norm gain), so chunks end early."""
    head = models.talker.model.head_code[0]
    gain = head.parametrizations["weight"].original0
    eos = models.talker.model.cfg.eos_code
    saved = gain[eos].clone()
    with torch.no_grad():
        gain[eos] *= 60.0
    head.materialize()
    yield
    with torch.no_grad():
        gain[eos] = saved
    head.materialize()


# units: (spoken rows, end_of_turn); turn starts (min 0, force flush), empty units, a long turn
SCRIPT = [(8, False), (20, False), (19, False), (0, True), (15, False), (3, True), (0, False),
          (20, False), (20, False), (20, False), (20, False), (20, False), (20, False),
          (20, False), (2, True)]


@pytest.mark.parametrize("greedy", [True, False], ids=["argmax", "sampled"])
def test_talker_chunks_match_plain_generate_chunk(models, eos_prone, greedy):
    width = models.talker.model.cfg.llm_dim
    speech = DuplexSpeech(models, seed=11, greedy=greedy)
    speech.prepare(None)
    plain = PlainChunkTalker(models.talker.model, seed=11, greedy=greedy)
    g = torch.Generator().manual_seed(0)
    lengths, capacity = [], 0
    with torch.inference_mode():
        for u, (n, eot) in enumerate(SCRIPT):
            spoken = _spoken(g, n, width)
            want = plain.chunk(spoken, eot)
            got = speech.speak(spoken, eot).codes
            assert got == want, f"unit {u}: {got} != {want}"
            lengths.append(len(got))
            assert speech.talker.length == sum(r.shape[0] for r in plain.turn)
            capacity = max(capacity, speech.talker.cache.max_len if speech.talker.cache else 0)
    # the script reaches every kind of chunk end: EOS at the first draw, early EOS, 25 codes
    assert 0 in lengths and 25 in lengths and any(0 < k < 25 for k in lengths), lengths
    assert capacity > 256 and speech.talker.cache is None  # grown in the long turn; freed


def test_talker_context_restarts_at_its_bound(models):
    """A turn that would pass max_position_embeddings restarts the Talker's context at
    position 0 (the reference would run past its trained positions), keeping Token2Wav's."""
    speech = DuplexSpeech(models, seed=1, greedy=True)
    speech.prepare(None)
    speech.talker.limit = 120
    g = torch.Generator().manual_seed(1)
    width = models.talker.model.cfg.llm_dim
    with torch.inference_mode():
        for _ in range(2):
            speech.speak(_spoken(g, 20, width), False)
            assert speech.talker.length <= 120
        before = speech.talker.length
        chunk = speech.speak(_spoken(g, 20, width), False)
    assert speech.talker.length < before and len(chunk.codes) == 25
    assert chunk.pcm.shape == (24000,)  # Token2Wav went on: a full chunk, no turn start


# -- Token2Wav ----------------------------------------------------------------------------


def demo_waveform(t2w, buffer: list[int], codes: list[int], last: bool, force_flush: bool,
                  terminators: tuple[int, ...] = ()):
    """MiniCPMODuplex._generate_waveform_from_tokens over the package's Token2wav.stream
    (pre_lookahead 3): returns (float PCM or None, the new buffer)."""
    buffer = buffer + codes
    out = []
    if force_flush or any(c in terminators for c in codes):
        while len(buffer) >= 3 + 5:
            n = min(25 + 3, len(buffer))
            out.append(t2w.stream(buffer[:n]))
            buffer = buffer[min(25, n - 3):]
    else:
        while len(buffer) >= 28:
            out.append(t2w.stream(buffer[:28]))
            buffer = buffer[25:]
    if last and buffer:
        out.append(t2w.stream(buffer, last_chunk=True))
        buffer = []
    if not out or not b"".join(out):
        return None, buffer
    pcm = np.frombuffer(b"".join(out), dtype="<i2").astype(np.float32) / 32768.0
    if not last and len(pcm) < 24000:
        pcm = np.pad(pcm, (24000 - len(pcm), 0))
    return pcm, buffer


# the flow's noise and the vocoder's noise table, seeded draws both sides get
NOISE = torch.randn(1, 80, 30000, generator=torch.Generator().manual_seed(0))
NOISE_TABLE = torch.rand(24000 * 30, 9, generator=torch.Generator().manual_seed(1))


def _same_noise(models: SpeechModels) -> None:
    models.flow.decoder.rand_noise.copy_(NOISE)
    models.vocoder.noise_table = NOISE_TABLE


@pytest.fixture(scope="module")
def mu7_token2wav(tiny_checkpoint, models):
    """The package's Token2wav on the checkpoint's token2wav files, its flow noise and
    vocoder noise table set to the seeded draws our models get too: (the package, a
    `Token2wav(float16=False, n_timesteps=10)` and a maker of it in other modes)."""
    from tests._code2wav_ref import build_reference_flow, load_reference_mu7

    mu7 = load_reference_mu7()
    if mu7 is None:
        pytest.skip("minicpmo-utils 1.0.7 not installed (see tests/_code2wav_ref.py)")
    import tests.test_code2wav_reference as t2w_tests

    t2w_tests.MU7 = mu7
    folder = tiny_checkpoint / "assets" / "token2wav"
    _, vocoder, cfg = load_code2wav(tiny_checkpoint)
    ref_voc = t2w_tests._reference_vocoder(vocoder.cfg)
    ref_voc.load_state_dict(torch.load(folder / "hift.pt", weights_only=True), strict=True)
    ref_flow = build_reference_flow(mu7, cfg)
    ref_flow.load_state_dict(torch.load(folder / "flow.pt", weights_only=True), strict=True)
    t2w_tests._resize_dit_buffers(ref_flow.eval(), cfg)
    ref_flow.decoder.rand_noise.copy_(NOISE)
    ref_voc.m_source.l_sin_gen.sine_waves = NOISE_TABLE[None]
    _same_noise(models)
    ref_voc = ref_voc.float().eval()

    def make(**mode):
        return t2w_tests._token2wav(ref_flow, ref_voc, **mode)

    yield mu7, make(), make
    models.vocoder.noise_table = None


# Units of five turns: 25-code units, turn starts of 10, 3 (nothing to decode yet), 0 and 20
# codes (force-flushed windows shorter than 28), end_of_turn units of 0..25 codes.
DEMO_PLAN = [(10, False), (25, False), (4, True), (3, False), (25, False), (2, True),
             (0, False), (25, True), (5, True), (20, False), (25, True)]


def _against_demo(models: SpeechModels, mu7, t2w) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each DEMO_PLAN unit's PCM from a session over `models` and from the demo's
    `_generate_waveform_from_tokens` over `t2w` (got, want); the caches restart from the
    voice's template at every turn, the codes still to decode equal the demo's."""
    voice = models.voices.default()
    # a half flow on CPU (no autocast there) takes its x-vector and prompt mel in fp16
    dtype = torch.float16 if t2w.float16 else torch.float32
    t2w.cache["voice"] = (voice.prompt_tokens.int(), None, voice.spk_emb.to(dtype),
                          voice.prompt_mel.to(dtype), None)
    speech = DuplexSpeech(models, seed=0)
    speech.prepare(voice)
    g = torch.Generator().manual_seed(3)
    turn_start, out = True, []
    with mu7.active():  # prepare's _init_token2wav_cache: the voice's caches, kept as a base
        base = copy.deepcopy(t2w.set_stream_cache("voice"))
    buffer = [4218] * 3
    for u, (n, eot) in enumerate(DEMO_PLAN):
        codes = torch.randint(0, 6561, (n,), generator=g).tolist()
        with mu7.active(), torch._dynamo.config.patch(disable=True):
            want, buffer = demo_waveform(t2w, buffer, codes, eot, turn_start)
            if eot:  # _reset_token2wav_for_new_turn: clones of the base, 3 x silence
                t2w.stream_cache, t2w.hift_cache_dict = copy.deepcopy(base)
                buffer = [4218] * 3
        with torch.inference_mode():
            got = speech._token2wav(codes, last=eot, force_flush=turn_start)
            if eot:
                speech._new_turn()
        want = np.zeros(0, np.float32) if want is None else want
        assert got.dtype == np.float32 and got.shape == want.shape, f"unit {u}"
        assert speech.buffer == buffer
        out.append((got, want))
        turn_start = eot
    speech.close()
    return out


def test_token2wav_matches_the_demo_over_minicpmo_utils(models, mu7_token2wav):
    """Unit by unit over DEMO_PLAN's five turns, within 2 LSB of the demo's PCM."""
    mu7, t2w, _ = mu7_token2wav
    units = _against_demo(models, mu7, t2w)
    for u, (got, want) in enumerate(units):
        diff = float(np.abs(got - want).max()) if want.size else 0.0
        assert diff <= 2 * LSB, f"unit {u}: max abs diff {diff:.3g}"
    sizes = [got.size for got, _ in units]
    assert 0 in sizes and 24000 in sizes and max(sizes) > 24000  # silence, full, end-of-turn


def _snr_db(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(10 * np.log10((b**2).sum() / max(((a - b) ** 2).sum(), 1e-300)))


@pytest.mark.filterwarnings("ignore:.*Disabling autocast")  # the package's CUDA autocast, on CPU
def test_float16_token2wav_matches_the_demo_in_its_float16_mode(tiny_checkpoint,
                                                                   mu7_token2wav):
    """`duplex.token2wav_precision: fp16` is the demo's `enable_float16` (its
    Token2wav(float16=True)), at the served 5 Euler steps: over DEMO_PLAN the session's PCM
    is closer to the demo's in that mode (fp16 rounding of other summation orders) than the
    demo's fp16 is to its fp32, and as far from the fp32 demo as that (it runs in fp16).
    The engine's fp16 mode on CUDA: tests/test_code2wav_reference.py."""
    mu7, _, make = mu7_token2wav
    half = SpeechModels.from_checkpoint(tiny_checkpoint, precision="fp16", n_timesteps=5)
    assert half.flow.decoder.rand_noise.dtype == torch.float16
    _same_noise(half)
    units = _against_demo(half, mu7, make(float16=True, n_timesteps=5))
    got = np.concatenate([g for g, _ in units])
    want = np.concatenate([w for _, w in units])
    fp32 = np.concatenate([w for _, w in _against_demo(half, mu7, make(n_timesteps=5))])
    snr, snr_fp32, ours_fp32 = _snr_db(got, want), _snr_db(want, fp32), _snr_db(got, fp32)
    print(f"duplex fp16 vs demo fp16 {snr:.1f} dB; demo fp16 vs fp32 {snr_fp32:.1f} dB; "
          f"duplex fp16 vs demo fp32 {ours_fp32:.1f} dB")
    assert snr >= snr_fp32 + 3 and ours_fp32 <= snr_fp32 + 3


def test_pcm_is_the_references_int16_round_trip():
    x = np.array([-1.5, -1.0, -0.5, -1e-5, 0.0, 1e-5, 0.5, 0.99999, 1.0, 2.0], np.float32)
    got = as_reference_pcm(x)
    want = (np.clip(x, -1, 1) * 32767.0).astype("<i2").astype(np.float32) / 32768.0
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert got[0] == -32767 / 32768 and got[-1] == 32767 / 32768


# -- the session ----------------------------------------------------------------------------


def _session(models, seed: int, units) -> list:
    speech = DuplexSpeech(models, seed=seed)
    speech.prepare(None)
    g = torch.Generator().manual_seed(5)
    width = models.talker.model.cfg.llm_dim
    return [speech.speak(_spoken(g, n, width), eot) for n, eot in units]


def test_sessions_are_isolated_and_prepare_resets(models):
    """The same seed gives the same codes and PCM in a fresh session; prepare() mid-turn
    starts over (Talker KV, Token2Wav caches and buffer) like a fresh session; another seed
    draws other codes."""
    units = [(12, False), (20, False), (6, True), (9, False)]
    a = _session(models, 7, units)
    speech = DuplexSpeech(models, seed=7)
    speech.prepare(None)
    g = torch.Generator().manual_seed(9)
    speech.speak(_spoken(g, 20, models.talker.model.cfg.llm_dim), False)  # a turn left open
    speech.generator.manual_seed(7)
    speech.prepare(None)
    assert speech.talker.length == 0 and speech.buffer == [4218] * 3
    g = torch.Generator().manual_seed(5)
    b = [speech.speak(_spoken(g, n, models.talker.model.cfg.llm_dim), eot) for n, eot in units]
    for u, (x, y) in enumerate(zip(a, b)):
        assert x.codes == y.codes and np.array_equal(x.pcm, y.pcm), f"unit {u}"
    c = _session(models, 8, units)
    assert [x.codes for x in a] != [x.codes for x in c]
    # turn ends reset the Talker: the next unit is a turn start again (force-flushed)
    assert a[-1].pcm.shape == (24000,) and a[2].pcm.size > 0


def test_bad_input_and_misuse(models):
    speech = DuplexSpeech(models, seed=0)
    with pytest.raises(RuntimeError, match="before prepare"):
        speech.speak([], False)
    speech.prepare(None)
    with pytest.raises(ValueError, match="128 wide"):
        speech.speak([(5, torch.zeros(64))], False)
    assert speech.talker.length == 0  # nothing ran
    with pytest.raises(ValueError, match="non-empty and finite"):
        speech.prepare(np.zeros(0, np.float32))
    with pytest.raises((FileNotFoundError, RuntimeError), match="onnx"):
        speech.prepare(np.zeros(16000, np.float32))  # the tiny default has no front ends
    with pytest.raises(ValueError, match="temperature"):
        DuplexSpeech(models, temperature=0.0)
    chunk = speech.speak([], False)  # an empty unit is the audio_bos row alone
    assert speech.talker.length == 1 + len(chunk.codes)
    speech.close()
    with pytest.raises(RuntimeError, match="before prepare"):
        speech.speak([], True)


# -- the golden reference sessions ---------------------------------------------------------

GOLDEN = Path(__file__).resolve().parent / "duplex_golden"
# omni_greedy differs only in the hidden rows; audio_greedy_5steps is audio_greedy with
# Token2wav at 5 Euler steps (the reference's duplex mode)
SESSIONS = ("audio_greedy", "audio_sampling", "audio_greedy_5steps")


@pytest.fixture(scope="module")
def golden_models():
    """The speech side of the duplex test checkpoint at a number of Euler steps, with the
    golden run's fixed noise (loaded once per step count)."""
    if not (GOLDEN / "FORMAT.md").is_file():
        pytest.skip("tests/duplex_golden/ not present")
    from tests._duplex_ckpt import duplex_test_checkpoint, flow_noise, vocoder_noise_table

    loaded: dict[int, SpeechModels] = {}

    def at(n_timesteps: int) -> SpeechModels:
        if n_timesteps not in loaded:
            models = SpeechModels.from_checkpoint(duplex_test_checkpoint(),
                                                  n_timesteps=n_timesteps)
            assert torch.equal(models.flow.decoder.rand_noise, flow_noise())  # omniray's draw
            models.vocoder.noise_table = vocoder_noise_table()
            loaded[n_timesteps] = models
        return loaded[n_timesteps]

    return at


@pytest.mark.parametrize("name", SESSIONS)
def test_speech_matches_the_golden_sessions(golden_models, name):
    """Every speak unit of the reference session (tests/duplex_golden/FORMAT.md): its Talker
    inputs (the spoken ids and the Thinker's hidden states the reference recorded) -> the same
    codes, the same PCM (within int16 rounding of fp32 summation orders), the same Talker
    position and Token2wav buffer after the unit; the Talker is argmax in the golden run."""
    meta = json.loads((GOLDEN / f"{name}.json").read_text())
    arrays = np.load(GOLDEN / f"{name}.npz")
    speech = DuplexSpeech(golden_models(meta["n_timesteps"]), seed=meta["seed"], greedy=True)
    speech.prepare(None)  # the checkpoint's default voice, the golden run's prompt
    spoken_units = turn_ends = 0
    for u in meta["units"]:
        if not u["talker_called"]:
            assert u["is_listen"] and not u["codes"], f"unit {u['index']}"
            continue
        i = u["index"]
        hidden = torch.from_numpy(arrays[f"spoken_hidden_{i}"]) if u["spoken_ids"] else []
        spoken = list(zip(u["spoken_ids"], hidden))
        with torch.inference_mode():
            chunk = speech.speak(spoken, u["end_of_turn"])
        assert chunk.codes == u["codes"], f"unit {i}: codes"
        want = arrays[f"pcm_{i}"].astype(np.float32) / 32768.0 if u["pcm"] is not None else (
            np.zeros(0, np.float32))
        assert chunk.pcm.shape == want.shape, f"unit {i}: {chunk.pcm.shape} vs {want.shape}"
        diff = float(np.abs(chunk.pcm - want).max()) if want.size else 0.0
        assert diff <= 2 * LSB, f"unit {i}: PCM max abs diff {diff:.3g}"
        assert speech.talker.length == u["tts_text_start_pos"], f"unit {i}: text_start_pos"
        assert speech.buffer == u["token2wav_buffer"], f"unit {i}: Token2wav buffer"
        spoken_units += 1
        turn_ends += u["end_of_turn"]
    assert spoken_units >= 4 and turn_ends >= 1  # the session spoke and ended a turn

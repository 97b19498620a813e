"""The speak units of many duplex sessions drawn in lockstep (pipeline/duplex/speech.py
`speak_batch`, one Talker decode a step over every drawing session's row of the shared
TalkerPool) equal each session speaking alone, and the pool's rows come back.

The tiny default's Talker with its EOS row scaled up (as tests/test_duplex_speech.py does),
so that chunks end at EOS at different draws: in the same units one session ends its turn,
one draws EOS early at a turn start, one runs all 26 draws mid-turn; seeded sampling and
argmax. Every session has a twin that speaks alone (`speak`, a batch of one) over the same
models loaded again, so that the batch's pool grows and shrinks on its own.

Precision contract: the batch's decode runs more rows through the same matmuls, which moves
the logits in their last bits only; the codes, the Talker positions and the generators'
states must be equal. Token2Wav decodes every session's next window in one step of the
Code2Wav engine (`test_token2wav_windows_...`, its draws scripted so that the windows fall
where the test wants them), each window a row padded to the step's shape: the PCM within
PCM_LSB of the session's alone."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.duplex import speech as speech_mod
from pipeline.duplex.speech import (
    CHUNK_CODES,
    REPETITION_WINDOW,
    DuplexSpeech,
    LockstepRows,
    SpeechModels,
    TalkerPool,
    draw_rows,
    speak_batch,
)
from pipeline.talker.sampling import apply_repetition_penalty

LSB = 1 / 32768  # the PCM goes through int16 as the reference's does
# Token2Wav's step pads every session's window to the step's rows and DiT window: the
# engine's bound (1e-4, tests/test_code2wav_slots.py) through the int16 round trip
PCM_LSB = 4


def _pcm_close(got: np.ndarray, want: np.ndarray) -> bool:
    """The same PCM length, samples within PCM_LSB."""
    return got.shape == want.shape and (
        want.size == 0 or float(np.abs(got - want).max()) <= PCM_LSB * LSB)

# per session: (seed, greedy, its units as (spoken rows, end_of_turn))
SESSIONS = [
    (100, False, [(12, False), (20, False), (7, True), (9, False), (10, False)]),
    (101, False, [(3, True), (15, False), (20, False), (20, True), (4, False)]),
    (102, False, [(20, False), (20, False), (20, False), (20, True), (6, False)]),
    (103, True, [(0, False), (8, True), (0, False), (16, False), (5, False)]),
]


def _eos_prone(models: SpeechModels) -> SpeechModels:
    """The Talker's EOS logit scaled up (its weight-norm gain)."""
    head = models.talker.model.head_code[0]
    with torch.no_grad():
        head.parametrizations["weight"].original0[models.talker.model.cfg.eos_code] *= 60.0
    head.materialize()
    return models


@pytest.fixture(scope="module")
def models(tiny_checkpoint) -> SpeechModels:
    """Token2Wav with two slots: four sessions speaking at once grow its pool."""
    return _eos_prone(SpeechModels.from_checkpoint(tiny_checkpoint, streams=2))


@pytest.fixture(scope="module")
def alone_models(tiny_checkpoint) -> SpeechModels:
    """The same models again: the sessions alone keep their KV in a pool of their own."""
    return _eos_prone(SpeechModels.from_checkpoint(tiny_checkpoint))


def _spoken(g: torch.Generator, n: int, width: int) -> list[tuple[int, torch.Tensor]]:
    ids = torch.randint(0, 151000, (n,), generator=g).tolist()
    return [(i, torch.randn(width, generator=g)) for i in ids]


def _sessions(models: SpeechModels) -> list[DuplexSpeech]:
    out = []
    for seed, greedy, _ in SESSIONS:
        s = DuplexSpeech(models, seed=seed, greedy=greedy)
        s.prepare(None)
        out.append(s)
    return out


def _twins(models: SpeechModels) -> tuple[list[DuplexSpeech], list[DuplexSpeech]]:
    return _sessions(models), _sessions(models)


def test_sessions_drawn_in_lockstep_equal_each_session_alone(models, alone_models,
                                                             monkeypatch):
    # a short first length: the batch's rows grow (copied) while other sessions hold theirs,
    # and shrink (copied) when the longest turn ends while others go on
    monkeypatch.setattr(speech_mod, "FIRST_KV_POSITIONS", 16)
    steps: list[int] = []  # active rows of every decode
    decode = models.talker.decode

    def counted(cache, codes, positions, active, read_len):
        steps.append(int(active.sum()))
        return decode(cache, codes, positions, active, read_len)

    monkeypatch.setattr(models.talker, "decode", counted)
    alone, batched = _sessions(alone_models), _sessions(models)
    width = models.talker.model.cfg.llm_dim
    inputs = [torch.Generator().manual_seed(k) for k in range(len(SESSIONS))]
    lengths, seen, sizes = set(), set(), []
    with torch.inference_mode():
        for u in range(len(SESSIONS[0][2])):
            items, want = [], []
            for k, (_, _, units) in enumerate(SESSIONS):
                n, eot = units[u]
                spoken = _spoken(inputs[k], n, width)
                want.append(alone[k].speak(spoken, eot))
                items.append((batched[k], spoken, eot))
            before = len(steps)
            got = speak_batch(items)
            kinds = set()
            for k, (g, w) in enumerate(zip(got, want, strict=True)):
                where = f"session {k} unit {u}"
                assert not isinstance(g, BaseException), f"{where}: {g!r}"
                assert g.codes == w.codes, where
                assert _pcm_close(g.pcm, w.pcm), where
                assert batched[k].talker.length == alone[k].talker.length, where
                assert torch.equal(batched[k].generator.get_state(),
                                   alone[k].generator.get_state()), where
                eot = items[k][2]
                n = len(w.codes)
                kinds.add("turn end" if eot else "25 codes" if n == CHUNK_CODES
                          else "early EOS" if n else "EOS first")
                lengths.add(n)
            # the batch stepped several sessions' rows in one decode
            assert max(steps[before:]) >= 3, f"unit {u}: {steps[before:]}"
            if {"turn end", "early EOS", "25 codes"} <= kinds:
                seen.add(u)
            sizes.append(models.pool.cache.max_len)
    assert seen, "no unit had a turn end, an early EOS and a full chunk together"
    assert 0 in lengths and CHUNK_CODES in lengths and any(0 < n < CHUNK_CODES for n in lengths)
    # grown past the first length, then shrunk with turns still held (and spoken on after)
    assert sizes[0] > 16 and max(sizes) > sizes[-1], sizes
    for s in alone + batched:
        s.close()
    assert models.pool.rows_in_use == 0 and models.pool.cache is None


def test_pool_rows_are_taken_per_turn_and_all_free_after_close(models, monkeypatch):
    monkeypatch.setattr(speech_mod, "FIRST_KV_POSITIONS", 16)
    sessions = [s for group in _twins(models) for s in group]
    pool = models.pool
    width = models.talker.model.cfg.llm_dim
    g = torch.Generator().manual_seed(7)
    assert pool.rows_in_use == 0  # prepared sessions hold no row: no turn yet
    with torch.inference_mode():
        out = speak_batch([(s, _spoken(g, 5, width), False) for s in sessions])
    assert not any(isinstance(o, BaseException) for o in out)
    rows = [s.talker.row for s in sessions]
    assert sorted(rows) == list(range(len(sessions))) and pool.rows_in_use == len(sessions)
    short = max(s.talker.length for s in sessions[1:])
    with torch.inference_mode():  # one long turn grows every row ...
        for _ in range(4):
            sessions[0].speak(_spoken(g, 20, width), False)
        assert pool.cache.max_len >= sessions[0].talker.length > 4 * short
        # ... and its end shrinks them back; a turn's end gives its row back
        sessions[0].speak([], True)
        assert sessions[0].talker.row is None and pool.rows_in_use == len(sessions) - 1
        assert pool.cache.max_len < 4 * short
        sessions[0].speak(_spoken(g, 3, width), False)
        assert sessions[0].talker.row == rows[0]  # the lowest free row
    sessions[1].prepare(None)  # prepare mid-turn gives it back too
    assert sessions[1].talker.row is None and pool.rows_in_use == len(sessions) - 1
    engine = models.token2wav
    # a session dropped without close loses its row and its Token2Wav slot
    dropped = sessions.pop(next(j for j, s in enumerate(sessions)
                                if s.stream_id in engine.streams))
    dropped_id = dropped.stream_id
    del dropped
    gc.collect()
    assert pool.rows_in_use == len(sessions) - 1 and dropped_id not in engine.streams
    for s in sessions:
        s.close()
    assert pool.rows_in_use == 0 and pool.cache is None  # the memory goes back


def test_a_bad_chunk_fails_alone_and_the_others_go_on(models):
    alone, batched = _twins(models)
    width = models.talker.model.cfg.llm_dim
    unprepared = DuplexSpeech(models, seed=1)
    g = torch.Generator().manual_seed(3)
    spoken = [_spoken(g, n, width) for n in (4, 9)]
    with torch.inference_mode():
        want = [alone[0].speak(spoken[0], False), alone[2].speak(spoken[1], False)]
        got = speak_batch([
            (batched[0], spoken[0], False),
            (batched[1], [(5, torch.zeros(width // 2))], False),  # hidden rows too narrow
            (unprepared, [], False),
            (batched[2], spoken[1], False),
        ])
    assert isinstance(got[1], ValueError) and "wide" in str(got[1])
    assert isinstance(got[2], RuntimeError) and "before prepare" in str(got[2])
    for g_, w in zip((got[0], got[3]), want, strict=True):
        assert g_.codes == w.codes and _pcm_close(g_.pcm, w.pcm)
    assert batched[1].talker.length == 0 and batched[1].talker.row is None  # nothing ran
    with pytest.raises(ValueError, match="once in a batch"):
        speak_batch([(batched[0], [], False), (batched[0], [], False)])
    for s in alone + batched:
        s.close()
    assert models.pool.rows_in_use == 0


# per session: its units' (codes, end_of_turn); every session starts a turn at unit 0
WINDOW_SCHEDULES = [
    [(25, False), (25, False), (25, False), (25, True)],  # mid-turn, then its turn's end
    [(25, False), (25, False), (25, False), (25, True)],  # the same phases: batched with 0
    [(12, False), (25, False), (20, True), (25, False)],  # a short force-flushed window
    [(25, False), (25, True), (25, False), (9, True)],  # a turn's end, a new turn's start
]


def _scripted_draws(speech: DuplexSpeech, units: list[list[int]]) -> None:
    """The session's Talker draws replaced by a script (`scripted`): per unit its codes,
    then EOS (a unit of CHUNK_CODES draws one more code, dropped at the cap), so that each
    session's Token2Wav windows fall where the test puts them."""
    script = iter(units)

    def start() -> list[int]:
        codes = next(script)
        return codes + ([codes[-1]] if len(codes) == CHUNK_CODES else [speech.eos])

    speech.script = start


@pytest.fixture
def scripted(monkeypatch):
    """TalkerPool's draws read the sessions' scripts (`_scripted_draws`)."""
    queues: dict[int, list[int]] = {}

    def first_draw(pool, chunks):
        for c in chunks:
            queues[id(c.speech)] = c.speech.script()
        return step(pool, chunks)

    def step(pool, chunks):
        return [queues[id(c.speech)].pop(0) for c in chunks]

    monkeypatch.setattr(TalkerPool, "first_draw", first_draw)
    monkeypatch.setattr(TalkerPool, "step", step)


def test_token2wav_windows_of_many_sessions_batched_equal_each_session_alone(
        models, alone_models, scripted):
    """Each round of `speak_batch`'s Token2Wav is ONE step of the models' Code2Wav engine
    over every session's k-th window, whatever its phase or length. Here: turn starts with
    force-flushed windows of two lengths, turns' ends whose last flush is a second round,
    a turn's last full window beside mid-turn ones, a session starting a turn beside
    mid-turn ones; four sessions on an engine of two slots (its pool grows at the first
    round, the resident streams copied).

    Precision contract: the engine's step pads every row to the step's batch size and DiT
    window, and masked softmax and matmuls over more rows move the floats in their last bits
    (the engine's own bound, tests/test_code2wav_slots.py: 1e-4); after the int16 round trip
    a sample may differ by a few LSB. The codes, the code buffers and the windows decoded
    are equal."""
    engine = models.token2wav
    rounds: list[tuple[int, list[tuple[int, int, bool]]]] = []  # (unit, (session, n, last))
    launch = engine.launch
    unit = 0
    g = torch.Generator().manual_seed(11)
    eos = models.talker.model.cfg.eos_code
    alone, batched = _sessions(alone_models), _sessions(models)
    for k, schedule in enumerate(WINDOW_SCHEDULES):
        units = [torch.randint(0, eos, (n,), generator=g).tolist() for n, _ in schedule]
        _scripted_draws(alone[k], units)
        _scripted_draws(batched[k], units)
    ids = {s.stream_id: k for k, s in enumerate(batched)}

    def counted(windows, stream=None):
        rounds.append((unit, sorted((ids[sid], len(c), last)
                                    for sid, (c, last) in windows.items())))
        return launch(windows, stream)

    diff: dict[int, float] = {}  # per session: its largest PCM difference
    with torch.inference_mode():
        for unit in range(len(WINDOW_SCHEDULES[0])):
            want = [alone[k].speak([], s[unit][1]) for k, s in enumerate(WINDOW_SCHEDULES)]
            engine.launch = counted
            try:
                got = speak_batch([(batched[k], [], s[unit][1])
                                   for k, s in enumerate(WINDOW_SCHEDULES)])
            finally:
                del engine.launch
            for k, (g_, w) in enumerate(zip(got, want, strict=True)):
                where = f"session {k} unit {unit}"
                assert not isinstance(g_, BaseException), f"{where}: {g_!r}"
                assert g_.codes == w.codes and len(w.codes) == WINDOW_SCHEDULES[k][unit][0]
                assert g_.pcm.shape == w.pcm.shape and w.pcm.size > 0, where
                diff[k] = max(diff.get(k, 0.0), float(np.abs(g_.pcm - w.pcm).max()))
                a, b = alone[k], batched[k]
                assert a.buffer == b.buffer and a.chunks == b.chunks, where
    assert max(diff.values()) <= PCM_LSB * LSB, {k: v / LSB for k, v in diff.items()}
    assert engine.pool.slots >= len(batched)  # grown (from 2) as the sessions spoke
    # the rounds as planned: per unit, each round's (session, window length, last)
    assert rounds == [
        (0, [(0, 28, False), (1, 28, False), (2, 15, False), (3, 28, False)]),
        (1, [(0, 28, False), (1, 28, False), (2, 28, False), (3, 28, False)]),
        (1, [(3, 3, True)]),
        (2, [(0, 28, False), (1, 28, False), (2, 23, True), (3, 28, False)]),
        (3, [(0, 28, False), (1, 28, False), (2, 28, False), (3, 12, True)]),
        (3, [(0, 3, True), (1, 3, True)]),
    ], rounds
    for s in alone + batched:
        s.close()
    assert not engine.streams and len(engine.pool.free) == engine.pool.slots


def test_a_failed_token2wav_step_fails_its_sessions_and_close_frees_their_slots(
        models, scripted):
    """A Token2Wav step that raises fails every session it decoded (each keeps the window
    still to decode in its buffer); the sessions' next units and their close go on as
    usual, and closing gives every slot back."""
    engine = models.token2wav
    g = torch.Generator().manual_seed(5)
    eos = models.talker.model.cfg.eos_code
    batched = _sessions(models)[:3]
    scripts = [[torch.randint(0, eos, (25,), generator=g).tolist() for _ in range(3)]
               for _ in batched]
    for k, units in enumerate(scripts):
        _scripted_draws(batched[k], units)

    def failing(windows, stream=None):
        raise RuntimeError("flow failed")

    with torch.inference_mode():
        got = speak_batch([(s, [], False) for s in batched])
        assert not any(isinstance(o, BaseException) for o in got)
        before = [list(s.buffer) for s in batched]
        engine.launch = failing
        try:
            got = speak_batch([(s, [], False) for s in batched])
        finally:
            del engine.launch
        for k, s in enumerate(batched):
            assert isinstance(got[k], RuntimeError) and "flow failed" in str(got[k])
            assert s.chunks == 1 and s.buffer == before[k] + scripts[k][1]
        got = speak_batch([(s, [], True) for s in batched])  # the turns end
        assert not any(isinstance(o, BaseException) for o in got)
    assert all(s.chunks == 0 for s in batched) and not engine.streams  # new turns: no slot
    for s in batched:
        s.close()
    assert len(engine.pool.free) == engine.pool.slots and not engine.pool.state


def _plain_draw(logits, recent, eos_masked, temperature, penalty, greedy, generator, eos):
    """One code as `MiniCPMTTS.generate_chunk` draws it for one session, on a (1, V) row:
    the plain path `draw_rows` batches."""
    x = logits[None] / torch.tensor([[temperature]], dtype=torch.float32, device=logits.device)
    if recent:
        k = len(recent)
        history = F.pad(torch.tensor(recent, device=logits.device), (REPETITION_WINDOW - k, 0))
        x = apply_repetition_penalty(x, history[None], torch.tensor([k], device=logits.device),
                                     penalty)
    if eos_masked:
        x[:, eos] = -torch.inf
    scores = F.softmax(x, dim=-1)
    if greedy:
        return int(scores.argmax(dim=-1))
    return int(torch.multinomial(scores, 1, generator=generator))


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="no CUDA"))])
def test_lockstep_draws_equal_each_row_drawn_alone(tiny_checkpoint, device):
    """`draw_rows` over 12 rows (some idle, greedy and sampling, EOS masked or not, other
    temperatures and penalties, windows from empty to past full) for 40 steps: every
    active row draws what the plain (1, V) draw with `torch.multinomial` draws from the
    same generator, leaves the generator where it leaves it, and keeps its window, count
    and next code as the chunk's codes say; idle rows keep their state."""
    from pipeline.checkpoint import ModelSource

    cfg = ModelSource.open(str(tiny_checkpoint)).config.talker
    vocab, eos, slots = cfg.num_audio_tokens, cfg.eos_code, 16
    dev = torch.device(device)
    st = LockstepRows.of(slots, cfg, dev)
    g = torch.Generator().manual_seed(0)
    rows = 12
    active = [r not in (3, 7) for r in range(rows)]
    greedy = [r % 4 == 1 for r in range(rows)]
    temps = [0.8 if r % 3 else 0.6 for r in range(rows)]
    pens = [1.05 if r % 2 else 1.3 for r in range(rows)]
    min_draws = [CHUNK_CODES + 1 if r % 5 == 0 else 0 for r in range(rows)]
    gens = [torch.Generator(device=dev).manual_seed(50 + r) for r in range(rows)]
    twins = [torch.Generator(device=dev).manual_seed(50 + r) for r in range(rows)]
    st.active[:rows] = torch.tensor(active)
    st.temperature[:rows, 0] = torch.tensor(temps)
    st.penalty[:rows, 0] = torch.tensor(pens)
    st.min_draws[:rows] = torch.tensor(min_draws)
    st.noise[:rows][torch.tensor(greedy)] = 1.0
    drawn: list[list[int]] = [[] for _ in range(rows)]
    live = list(active)
    for step in range(40):
        # a logits row per row; EOS pushed up now and then so that chunks end
        logits = torch.randn(rows, vocab, generator=g) * 3
        logits[:, eos] += torch.where(torch.rand(rows, generator=g) < 0.08, 30.0, -30.0)
        logits = logits.to(dev)
        for r in range(rows):
            if live[r] and not greedy[r]:
                st.noise[r].exponential_(generator=gens[r])
        idle_before = st.history[3].clone(), int(st.codes[3])
        draw_rows(st, logits, rows)
        out = st.out[:rows].tolist()
        for r in range(rows):
            if not live[r]:
                continue
            want = _plain_draw(logits[r], drawn[r][-REPETITION_WINDOW:], len(drawn[r]) <
                               min_draws[r], temps[r], pens[r], greedy[r], twins[r], eos)
            assert out[r] == want, (step, r)
            assert torch.equal(gens[r].get_state(), twins[r].get_state()), (step, r)
            if want != eos:
                drawn[r].append(want)
                assert int(st.codes[r]) == want
            live[r] = want != eos and len(drawn[r]) < CHUNK_CODES + 1
            k = min(len(drawn[r]), REPETITION_WINDOW)
            assert int(st.count[r]) == k and int(st.drawn[r]) == len(drawn[r])
            assert st.history[r, REPETITION_WINDOW - k :].tolist() == drawn[r][-k:] if k else True
        assert st.active[:rows].tolist() == live, step
        assert torch.equal(st.history[3], idle_before[0]) and int(st.codes[3]) == idle_before[1]
        if not any(live):
            break
    ends = {len(d) for d in drawn}
    assert CHUNK_CODES + 1 in ends and any(0 < n < CHUNK_CODES + 1 for n in ends), ends


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_lockstep_graphs_replay_the_eager_steps_cuda(tiny_checkpoint):
    """On CUDA the lockstep's steps are graphs (a (rows, keys read) bucket each, captured
    with every row idle): the same codes and PCM as the same steps run eagerly."""
    graphed = _eos_prone(SpeechModels.from_checkpoint(tiny_checkpoint, "cuda"))
    eager = _eos_prone(SpeechModels.from_checkpoint(tiny_checkpoint, "cuda"))
    eager.pool.use_graphs = False
    codes = 0
    for u, (got, want) in enumerate(_side_by_side(graphed, eager)):
        for k, (g_, w) in enumerate(zip(got, want, strict=True)):
            assert not isinstance(g_, BaseException) and not isinstance(w, BaseException)
            assert g_.codes == w.codes and np.array_equal(g_.pcm, w.pcm), (u, k)
            codes += len(w.codes)
    assert codes > 0 and graphed.pool.graph_steps > 0 and eager.pool.graph_steps == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_token2wav_on_its_stream_beside_other_work_equals_it_waited_for_cuda(tiny_checkpoint):
    """On CUDA a Token2Wav step is launched on the models' own stream and `speak_steps`
    yields its Landing while it runs: here the test's thread runs kernels of its own on the
    current stream meanwhile (allocating and freeing memory as a Thinker step would), and
    the codes and PCM equal the same models' steps run on the current stream and waited
    for at once, bit for bit."""
    from pipeline.code2wav.engine import Landing
    from pipeline.duplex.speech import speak_steps

    side = SpeechModels.from_checkpoint(tiny_checkpoint, "cuda")
    plain = SpeechModels.from_checkpoint(tiny_checkpoint, "cuda")
    plain.token2wav_stream = None
    beside = [0]

    def speak(items):
        steps = speak_steps(items)
        while True:
            try:
                step = next(steps)
            except StopIteration as done:
                return done.value
            if isinstance(step, Landing) and not step.ready():
                beside[0] += 1
                x = torch.randn(1024, 1024, device="cuda")
                for _ in range(8):
                    x = torch.tanh(x @ x) + torch.empty_like(x).fill_(float("nan")).nan_to_num()
                del x

    samples = 0
    for u, (got, want) in enumerate(_side_by_side(side, plain, speak)):
        for k, (g_, w) in enumerate(zip(got, want, strict=True)):
            assert not isinstance(g_, BaseException) and not isinstance(w, BaseException)
            assert g_.codes == w.codes and np.array_equal(g_.pcm, w.pcm), (u, k)
            samples += w.pcm.size
    assert samples > 0 and beside[0] > 0


def _side_by_side(one: SpeechModels, other: SpeechModels,
                  speak=speak_batch) -> list[tuple[list, list]]:
    """SESSIONS' units spoken by sessions of `one` (through `speak`) and, alike, of `other`
    (`speak_batch`): per unit the two batches' results."""
    a, b = _sessions(one), _sessions(other)
    width = one.talker.model.cfg.llm_dim
    inputs = [torch.Generator().manual_seed(k) for k in range(len(SESSIONS))]
    out = []
    with torch.inference_mode():
        for u in range(len(SESSIONS[0][2])):
            spoken = [_spoken(inputs[k], units[u][0], width)
                      for k, (_, _, units) in enumerate(SESSIONS)]
            ends = [units[u][1] for _, _, units in SESSIONS]
            out.append(tuple(run([(s, sp, e) for s, sp, e in zip(x, spoken, ends,
                                                                  strict=True)])
                             for x, run in ((a, speak), (b, speak_batch))))
    for s in a + b:
        s.close()
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_token2wav_graphs_replay_the_eager_steps_cuda(tiny_checkpoint):
    """On CUDA the sessions' Token2Wav steps are the Code2Wav engine's graphs (the flow's per
    batch size and DiT window, the vocoder's per chunk shape): the same codes and PCM as the
    same engine's steps run eagerly, over turns' starts, middles and ends."""
    graphed = SpeechModels.from_checkpoint(tiny_checkpoint, "cuda")
    eager = SpeechModels.from_checkpoint(tiny_checkpoint, "cuda")
    eager.token2wav.graphs = eager.token2wav.hift_graphs = None
    samples = 0
    for got, want in _side_by_side(graphed, eager):
        for g_, w in zip(got, want, strict=True):
            assert g_.codes == w.codes and _pcm_close(g_.pcm, w.pcm)
            samples += w.pcm.size
    assert samples > 0 and graphed.token2wav.graphs.replays > 0

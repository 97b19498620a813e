"""The engine's one path (the slot pool, pipeline/code2wav/slots.py, and the DiT's and the
vocoder's fast parts) against the plain per-stream path (tests/_code2wav_plain.py; CPU, fp32).

  * cache bookkeeping is exact: a template round-trips bitwise, and the pool's writes, gathers
    and trims applied to known frames give FlowCache's cat + trim bitwise;
  * the shipped path (batched padded rows, the vocoder's convs as matmuls) equals the plain
    path one stream at a time within the precision contract (PCM max abs <= 1e-4, SNR >= 80
    dB for every chunk, no growth over a 30-chunk stream), for 1, 3 and 8 streams of
    staggered phases, two voices and final chunks of odd lengths;
  * aborting a stream in a batch frees only its slot; a turn beyond the slots and a voice too
    long for one are refused at open; the graph runner's capture on padding rows writes
    nothing a stream reads; the DiT's kernels and split products within the bound.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.code2wav.assets import load_code2wav
from pipeline.code2wav.engine import Code2WavEngine, Code2WavEngineConfig
from pipeline.code2wav.flow import HISTORY_FRAMES, FlowCache
from pipeline.code2wav.hift import fuse_snakes
from pipeline.code2wav.slots import Row
from pipeline.code2wav.voice import VoiceCache, VoicePrompt
from pipeline.graphs import GraphRunner
from pipeline.handoff import CodeChunk
from tests._code2wav_plain import PlainEngine, plain_convs, slot_cache, trimmed


@pytest.fixture(scope="module")
def model(ckpt):
    return load_code2wav(ckpt, "cpu", torch.float32)


@pytest.fixture(scope="module")
def voices(ckpt):
    """The default voice (25 codes) and a longer random one (37 codes)."""
    default = VoiceCache(ckpt / "assets" / "token2wav").default()
    g = torch.Generator().manual_seed(7)
    other = VoicePrompt(
        torch.randint(0, 6561, (1, 37), generator=g),
        torch.randn(1, 192, generator=g),
        torch.randn(1, 74, 80, generator=g),
    )
    return default, other


def _codes(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, 6561, (n,), generator=g).tolist()


def _schedule(n_streams: int, n_codes: list[int], seed: int = 0, stagger: int = 3):
    """Per round, what each stream receives: streams start `stagger` rounds apart and get 7-11
    codes a round, so chunks of every phase are ready together."""
    g = torch.Generator().manual_seed(seed)
    codes = {f"s{i}": _codes(g, n) for i, n in zip(range(n_streams), n_codes)}
    rounds, pos, r = [], dict.fromkeys(codes, 0), 0
    while any(pos[k] < len(c) for k, c in codes.items()):
        rnd = []
        for i, (k, c) in enumerate(codes.items()):
            if r >= stagger * i and pos[k] < len(c):
                n = min(7 + (r + i) % 5, len(c) - pos[k])
                rnd.append((k, c[pos[k] : pos[k] + n], pos[k] + n == len(c), pos[k] == 0))
                pos[k] += n
        rounds.append(rnd)
        r += 1
    return rounds


def _alternating(voices):
    """Stream "sN"'s voice: the two voices in turn."""
    return lambda sid: voices[int(sid[1:]) % 2]


def _plain(flow, hift, cfg, rounds, voice_of, close_after=None):
    """The plain path's PCM of a schedule: one stream at a time, torch's convs."""
    with plain_convs():
        return _play(PlainEngine(flow, hift, cfg), rounds, voice_of, close_after)


def _play(engine, rounds, voice_of, close_after=None):
    """Run a schedule; returns {stream: [pcm chunk, ...]}. `close_after` = (stream, round)."""
    out: dict[str, list[np.ndarray]] = {}
    for r, rnd in enumerate(rounds):
        for sid, codes, final, first in rnd:
            if first:
                engine.open(sid, voice_of(sid))
                out[sid] = []
            if sid in engine.streams:
                engine.feed(sid, CodeChunk(sid, tuple(codes), final))
        for chunk in engine.step():
            out[chunk.request_id].append(chunk.pcm)
        if close_after is not None and r == close_after[1]:
            engine.abort(close_after[0])
    for sid, pcm in engine.drain().items():
        out[sid].extend(pcm)
    return out


def _compare(ref, got, label):
    worst = []
    for sid in ref:
        assert len(ref[sid]) == len(got[sid]), f"{label} {sid}: chunk counts differ"
        per_chunk = []
        for a, b in zip(ref[sid], got[sid]):
            assert a.shape == b.shape
            err = np.abs(a - b).max()
            snr = 10 * np.log10((a.astype(np.float64) ** 2).sum()
                                / max(((a - b).astype(np.float64) ** 2).sum(), 1e-300))
            assert err <= 1e-4 and snr >= 80, f"{label} {sid}: max {err:.3g} SNR {snr:.1f} dB"
            per_chunk.append(err)
        worst.append(max(per_chunk))
        print(label, sid, " ".join(f"{e:.1e}" for e in per_chunk))
        # no drift: the late chunks are no worse than a few times the early ones
        half = len(per_chunk) // 2
        if half >= 3:
            assert max(per_chunk[half:]) <= 10 * max(per_chunk[:half]) + 1e-6
    return max(worst)


def test_template_round_trips_bitwise(model, voices):
    flow, hift, cfg = model
    eng = Code2WavEngine(flow, hift, cfg)
    for v in voices:
        tpl = eng.initial_state(v)
        pool = eng.pool
        slot = pool.admit(tpl.flow, tpl.prompt_frames)
        back = slot_cache(pool, slot)
        assert all(torch.equal(a, b) for a, b in zip(back.tensors(), tpl.flow.tensors()))
        pool.release(slot)


def test_pool_writes_and_trims_equal_cat_and_trim_bitwise(model, voices):
    """The bookkeeping alone, on known frames: for each chunk, write the 'new' frames where
    the plan says (DiT: scattered to free positions; conformer: gathered from [cache || new])
    and read the slot back; it equals FlowCache's cat of [new || cache] (DiT, newest first) and
    [cache || new] (conformer), trimmed to the prompt + 100 frames, bit for bit."""
    flow, hift, cfg = model
    eng = Code2WavEngine(flow, hift, cfg)
    tpl = eng.initial_state(voices[1])
    pool = eng.pool
    slot = pool.admit(tpl.flow, tpl.prompt_frames)
    ref = tpl.flow.clone()
    g = torch.Generator().manual_seed(0)
    p = pool.pool
    for chunk in range(8):
        plan = pool.plan([Row(slot, _codes(g, 28), False)], 2)
        ix = plan.index
        frames = plan.mel_frames[0]
        # DiT: new K frames (S, depth, 2, H, T, dh), written at ix.dit.write like forward_slots
        new_k = torch.randn(*ref.est_att.shape[:4], frames, ref.est_att.shape[5] // 2,
                            generator=g)
        new_v = torch.randn(new_k.shape, generator=g)
        write = ix.dit.write[0, :frames]
        p.dit.k[:, :, :, slot, write] = new_k.permute(0, 1, 2, 4, 3, 5)
        p.dit.v[:, :, :, slot, write] = new_v.permute(0, 1, 2, 4, 3, 5)
        est = torch.cat([torch.cat([new_k, new_v], -1), ref.est_att], dim=4)
        # conformer: new frames per rate, gathered with ix.<rate>.keep like forward_slots
        news = {}
        for name, pool_t, keep, n, t in (
            ("token_att", p.token, ix.token.keep, frames // 2, pool.t_tok),
            ("mel_att", p.mel, ix.mel.keep, frames, pool.t_mel),
        ):
            layers, _, heads, cap, width = pool_t.shape
            new = torch.randn(layers, 1, heads, n, width, generator=g)
            chunk_rows = torch.zeros(layers, 1, heads, t, width)
            chunk_rows[:, :, :, :n] = new
            both = torch.cat([pool_t[:, slot : slot + 1], chunk_rows], dim=3)
            idx = keep[0, 0, :, 0].view(1, 1, 1, cap, 1).expand(layers, 1, heads, cap, width)
            pool_t[:, slot : slot + 1] = both.gather(3, idx)
            news[name] = torch.cat([getattr(ref, name), new], dim=3)
        pool.commit(plan)
        ref = trimmed(FlowCache(news["token_att"], news["mel_att"], ref.lookahead_cnn,
                                ref.up_cnn, ref.est_cnn, est), tpl.prompt_frames, HISTORY_FRAMES)
        got = slot_cache(pool, slot)
        for name in ("token_att", "mel_att", "est_att"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), (chunk, name)
    assert ref.est_len == tpl.prompt_frames + HISTORY_FRAMES  # trimming was exercised


def _pool_with(model, voices):
    """A slot-pool engine's pool with each voice's stream admitted: (pool, their slots)."""
    flow, hift, cfg = model
    eng = Code2WavEngine(flow, hift, cfg)
    slots = [eng.pool.admit(eng.initial_state(v).flow, eng.initial_state(v).prompt_frames)
             for v in voices]
    return eng.pool, slots


def test_plan_reuses_row_positions_without_changing_them(model, voices):
    """A row's conformer mask and relative positions are built once per lengths and reused by
    later steps: every plan over a stream's life, trims included, equals the plan built afresh
    tensor for tensor (a plan that wrote into a reused tensor would make a later one differ)."""
    from pipeline.code2wav import slots as slots_mod
    from pipeline.code2wav.slots import _conformer_mask_rel, flatten

    pool, slots = _pool_with(model, voices)
    g = torch.Generator().manual_seed(9)
    _conformer_mask_rel.cache_clear()
    hits = []
    for _ in range(12):  # past the trim: the lengths stop changing
        rows = [Row(s, _codes(g, 28), False) for s in slots]
        before = _conformer_mask_rel.cache_info().hits
        reused = pool.plan(rows, 3)
        hits.append(_conformer_mask_rel.cache_info().hits - before)
        with pytest.MonkeyPatch.context() as m:  # every row's tensors built afresh
            m.setattr(slots_mod, "_conformer_mask_rel", _conformer_mask_rel.__wrapped__)
            fresh = pool.plan(rows, 3)
        assert all(torch.equal(a, b) for a, b in
                   zip(flatten(reused.index), flatten(fresh.index), strict=True))
        assert torch.equal(reused.tokens, fresh.tokens) and reused.updates == fresh.updates
        pool.commit(reused)
    # once trimmed, each step reuses all its rows' tensors: two rates of each stream's row
    # and of the padding row
    assert hits[-3:] == [2 * (len(slots) + 1)] * 3


def test_flat_pool_indices_address_what_cfg_rows_and_write_do(model, voices):
    """`DiTSlots.at(pool)`: the one flat index per pool write / read the DiT uses reaches the
    same positions as indexing with (cfg, rows, write) and (cfg, rows), bit for bit, padding
    rows included."""
    from pipeline.code2wav.dit import DiTPool

    pool, slots = _pool_with(model, voices)
    g = torch.Generator().manual_seed(5)
    plan = pool.plan([Row(s, _codes(g, 28), False) for s in slots], 3)  # one padding row
    ix = plan.index.dit
    _, _, _, n, cap, h, dh = pool.pool.dit.k.shape
    k = torch.zeros(2, n, cap, h, dh)
    cnn = torch.randn(2, n, *pool.pool.dit.cnn.shape[-2:], generator=g)
    at = ix.at(DiTPool(k, k, cnn))
    assert at.at(DiTPool(k, k, cnn)) is at  # computed once
    new = torch.randn(*ix.write.shape, h, dh, generator=g)
    ref = k.clone()
    ref[ix.cfg, ix.rows, ix.write] = new
    k.view(-1, h, dh).index_put_((at.kv_at,), new.flatten(0, 1))
    assert torch.equal(k, ref)
    assert torch.equal(cnn.flatten(0, 1).index_select(0, at.cnn_at), cnn[ix.cfg[:, 0], ix.rows[:, 0]])


@pytest.mark.parametrize("n_streams", [1, 3, 8])
def test_batched_rows_equal_one_stream_at_a_time(model, voices, n_streams):
    flow, hift, cfg = model
    lengths = [747, 57, 33, 120, 5, 90, 61, 200][:n_streams]  # 747 codes: a 30-chunk stream
    rounds = _schedule(n_streams, lengths, seed=n_streams, stagger=3 if n_streams < 8 else 1)

    voice_of = _alternating(voices)

    plain = _plain(flow, hift, cfg, rounds, voice_of)
    eng = Code2WavEngine(flow, hift, cfg)
    got = _play(eng, rounds, voice_of)
    worst = _compare(plain, got, f"B{n_streams}")
    print(f"B{n_streams} worst {worst:.2e}",
          {k: v for k, v in eng.counters.items() if k.startswith("batch_size")})
    if n_streams == 8:
        assert max(int(k[11:]) for k in eng.counters if k.startswith("batch_size_")) >= 4
    assert len(eng.pool.free) == eng.pool.slots and not eng.pool.state


def test_abort_frees_only_its_slot(model, voices):
    """s1 is closed mid-turn (its slot freed with chunks still pending); s3 opens later and
    takes that slot. The other streams, and s3, decode as the plain path does."""
    flow, hift, cfg = model
    rounds = _schedule(4, [120, 120, 120, 90], seed=4, stagger=4)

    voice_of = _alternating(voices)

    ref = _plain(flow, hift, cfg, rounds, voice_of, close_after=("s1", 8))
    eng = Code2WavEngine(flow, hift, cfg)
    slot_of = {}
    original_open = eng.open

    def open_stream(sid, voice):
        original_open(sid, voice)
        slot_of[sid] = eng.streams[sid].slot

    eng.open = open_stream
    got = _play(eng, rounds, voice_of, close_after=("s1", 8))
    assert slot_of["s3"] == slot_of["s1"]  # the freed slot was reused
    assert len(got["s1"]) < len(got["s0"])
    _compare(ref, got, "abort")
    assert len(eng.pool.free) == eng.pool.slots


def test_turns_beyond_the_slots_and_long_voices_are_refused_at_open(model, voices):
    """A turn beyond `max_streams` is refused (the engine's busy error) until a slot frees;
    a voice prompt longer than a slot holds is refused; neither takes a slot."""
    flow, hift, cfg = model
    eng = Code2WavEngine(flow, hift, cfg, Code2WavEngineConfig(
        max_streams=2, slot_prompt_frames=60))
    eng.open("a", voices[0])
    with pytest.raises(ValueError, match="longer than"):
        eng.open("long", voices[1])  # its prompt: 74 frames
    eng.open("b", voices[0])
    with pytest.raises(RuntimeError, match="slots are in use"):
        eng.open("c", voices[0])
    assert set(eng.streams) == {"a", "b"} and eng.stats()["free_slots"] == 0
    eng.abort("a")
    eng.open("c", voices[0])
    assert eng.stats()["capacity"] == 2


class _EagerGraphs:
    """The graph runner's contract on CPU: a new key runs `fn` on the example inputs twice (as
    the warm-up before a capture does), then every call runs `fn` on the real inputs."""

    replays = captures = fallbacks = 0
    counts = GraphRunner.counts

    def __init__(self):
        self.keys: set = set()

    def __contains__(self, key):
        return key in self.keys

    def run(self, key, inputs, fn, example=None):
        if key not in self.keys:
            self.keys.add(key)
            for _ in range(2):
                fn(*(example or inputs))
            self.captures += 1
        self.replays += 1
        return fn(*inputs)


def test_capture_on_padding_rows_changes_nothing(model, voices):
    flow, hift, cfg = model
    rounds = _schedule(3, [90, 60, 33], seed=6)

    voice_of = _alternating(voices)

    ref = _play(Code2WavEngine(flow, hift, cfg), rounds, voice_of)
    eng = Code2WavEngine(flow, hift, cfg)
    eng.graphs = runner = _EagerGraphs()
    got = _play(eng, rounds, voice_of)
    assert runner.captures >= 2 and {b for b, _ in runner.keys} >= {2, 3}
    _compare(ref, got, "captured")  # a write into a stream's frames would be far off


def test_causal_vocoder_graph_wrapper_computes_vocode_chunk(model, voices):
    """`CausalVocoderGraphs` (what replays the causal vocoder on CUDA) around an eager `run`:
    the same PCM as the vocoder called directly, streams batched by key."""
    from pipeline.code2wav.causal_hift import CausalHiFT
    from pipeline.code2wav.graphs import CausalVocoderGraphs

    flow, hift, cfg = model
    assert isinstance(hift, CausalHiFT)  # the tiny default's layout is minicpmo-utils 1.0.7
    rounds = _schedule(3, [90, 60, 33], seed=8)

    voice_of = _alternating(voices)

    ref = _play(Code2WavEngine(flow, hift, cfg), rounds, voice_of)
    eng = Code2WavEngine(flow, hift, cfg)
    runner = CausalVocoderGraphs(hift, (1, 2, 3))
    runner._eligible = lambda mel, states: True
    keys = []
    runner.run = lambda key, inputs, fn, example=None: keys.append(key) or fn(*inputs)
    eng.hift_graphs = runner
    got = _play(eng, rounds, voice_of)
    assert keys and any(k[0] > 1 for k in keys)
    for sid in ref:
        assert all(np.array_equal(a, b) for a, b in zip(ref[sid], got[sid], strict=True)), sid


def test_compiled_snake_is_snake_for_any_shape():
    """One compiled Snake for every batch, channel count and length, within a few fp32 ulps
    of the eager operations (a fused multiply-add, another sin); off again, exactly eager."""
    from pipeline.code2wav.hift import Snake, fuse_snakes

    g = torch.Generator().manual_seed(11)
    for b, c, t in ((1, 16, 37), (3, 16, 80), (2, 8, 200), (1, 8, 5)):
        act = Snake(c)
        with torch.no_grad():
            act.alpha.copy_(torch.rand(c, generator=g) * 3 + 0.05)
        x = torch.randn(b, c, t, generator=g) * 4
        ref = act(x)
        fuse_snakes(act, True)
        got = act(x)
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
        fuse_snakes(act, False)
        assert torch.equal(act(x), ref)


def test_vocoder_fused_snakes_within_the_bound(model, voices):
    """The vocoder's compiled Snakes (the engine's on CUDA) against the same engine with eager
    Snakes over a long stream and two short ones: within the precision contract, no drift."""
    flow, hift, cfg = model
    rounds = _schedule(3, [300, 60, 33], seed=13)

    voice_of = _alternating(voices)

    ref = _play(Code2WavEngine(flow, hift, cfg), rounds, voice_of)
    eng = Code2WavEngine(flow, hift, cfg)
    fuse_snakes(hift, True)
    try:
        got = _play(eng, rounds, voice_of)
    finally:
        fuse_snakes(hift, False)  # eager Snakes for the module-scoped vocoder, as on CPU
    _compare(ref, got, "fused snakes")


def test_linear_split_k_is_the_same_product_summed_in_another_order():
    from pipeline.code2wav.dit import SPLIT_MIN_K, linear_split_k

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 56, SPLIT_MIN_K, generator=g)  # one chunk's rows
    w = torch.randn(40, SPLIT_MIN_K, generator=g) / SPLIT_MIN_K ** 0.5
    b = torch.randn(40, generator=g)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    for splits in (2, 8):
        got = linear_split_k(x, w, b, splits)
        assert got.shape == ref.shape
        assert (got.double() - ref).abs().max() < 1e-5
        assert not torch.equal(got, torch.nn.functional.linear(x, w, b))  # it did split
    # below SPLIT_MIN_K, a split that does not divide K, or one split: the plain product
    small = x[..., :512]
    assert torch.equal(linear_split_k(small, w[:, :512], b, 8),
                       torch.nn.functional.linear(small, w[:, :512], b))
    assert torch.equal(linear_split_k(x, w, None, 7), torch.nn.functional.linear(x, w))
    many = torch.randn(3, 112, SPLIT_MIN_K, generator=g)  # more rows than SPLIT_MAX_ROWS
    assert torch.equal(linear_split_k(many, w, b, 8), torch.nn.functional.linear(many, w, b))


def test_dit_split_matmuls_within_the_bound(model, voices, monkeypatch):
    """The slot path's q|k|v as one product (views of one joined weight) and its large-K
    products split over K, against the plain path over a 12-chunk stream (no drift), and
    not bitwise the whole products. The tiny DiT's products are below the split size, so
    SPLIT_MIN_K is lowered here to split them as the full-size ones are."""
    from pipeline.code2wav import dit

    flow, hift, cfg = model
    rounds = _schedule(3, [300, 60, 33], seed=9)

    voice_of = _alternating(voices)

    ref = _plain(flow, hift, cfg, rounds, voice_of)
    whole = _play(Code2WavEngine(flow, hift, cfg), rounds, voice_of)
    monkeypatch.setattr(dit, "SPLIT_MIN_K", 1)
    eng = Code2WavEngine(flow, hift, cfg)
    estimator = flow.decoder.estimator
    assert all(b.split_k == dit.SPLIT_K and b.attn.qkv_weight is not None
               for b in estimator.blocks)
    attn = estimator.blocks[0].attn
    inner = attn.num_heads * attn.head_dim
    assert attn.to_k.weight.data_ptr() == attn.qkv_weight[inner:].data_ptr()
    got = _play(eng, rounds, voice_of)
    _compare(ref, got, "split matmuls")
    assert any(not np.array_equal(a, c) for s in whole for a, c in zip(whole[s], got[s]))


@pytest.mark.parametrize("t,w", [(7, 90), (56, 130), (16, 64)])
def test_pool_attention_kernel_is_sdpa_over_the_gathered_window(t, w):
    """`pool_attention` against the slot path's gathers + SDPA: rows of both CFG halves at
    their own slots, q strided as `_heads` leaves it, T and W off the kernel's tiles, a row
    whose first block of keys is all masked, and NaN at pool positions no row attends (the
    kernel must not read them into a sum). On CUDA where there is one (the GPU's kernel),
    else in Triton's interpreter."""
    from pipeline.code2wav import pool_attention as pa

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not pa.runs_here(dev):
        pytest.skip("needs Triton (its interpreter on CPU)")
    g = torch.Generator().manual_seed(t + w)
    heads, dh, slots_n, cap = 4, 16, 3, 160
    k_pool = torch.randn(2, slots_n, cap, heads, dh, generator=g)
    v_pool = torch.randn(2, slots_n, cap, heads, dh, generator=g)
    mask = torch.rand(4, 1, 1, w, generator=g) < 0.5
    mask[..., -3:] = True  # every row keeps a key
    mask[1, ..., : min(64, w - 3)] = False
    unread = ~mask[:, 0, 0].reshape(2, 2, w).any(0)  # (slot in batch, position): no row keeps it
    slots = torch.tensor([2, 0])
    for i, slot in enumerate(slots.tolist()):
        k_pool[:, slot, :w][:, unread[i]] = float("nan")
        v_pool[:, slot, :w][:, unread[i]] = float("nan")
    q = torch.randn(4, t, heads, dh, generator=g).transpose(1, 2)  # (R, H, T, dh), strided
    cfg, rows = torch.tensor([[0], [0], [1], [1]]), slots.repeat(2)[:, None]
    got = pa.pool_attention(*(x.to(dev) for x in (q, k_pool, v_pool, cfg, rows, mask)), w).cpu()
    keys = k_pool[:, slots, :w].reshape(4, w, heads, dh).transpose(1, 2).nan_to_num()
    vals = v_pool[:, slots, :w].reshape(4, w, heads, dh).transpose(1, 2).nan_to_num()
    ref = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
    torch.testing.assert_close(got, ref.transpose(1, 2).reshape(4, t, heads * dh),
                               rtol=0, atol=2e-6)


def test_dit_pool_attention_within_the_bound(ckpt, voices, monkeypatch):
    """The slot path's attention read in place from the pool by one kernel (CUDA; Triton's
    interpreter here), up to MAX_ROWS estimator rows, against the plain path over a 12-chunk
    stream (no drift), and not bitwise the gathers + SDPA (the kernel ran)."""
    from pipeline.code2wav import pool_attention as pa

    if not pa.runs_here(torch.device("cpu")):
        pytest.skip("needs Triton (its interpreter on CPU)")
    flow, hift, cfg = load_code2wav(ckpt, "cpu", torch.float32)  # its own: the kernels stay on
    rounds = _schedule(2, [300, 45], seed=11)

    voice_of = _alternating(voices)

    ref = _plain(flow, hift, cfg, rounds, voice_of)
    base = _play(Code2WavEngine(flow, hift, cfg), rounds, voice_of)
    monkeypatch.setattr(pa, "available", lambda device: True)  # the engine takes it on CPU here
    # one stream's rows take the kernel, two streams' the gathers + SDPA: both paths in a run
    monkeypatch.setattr(pa, "MAX_ROWS", 2)
    kernel_rows = []

    def counted(q, *args):
        kernel_rows.append(q.shape[0])
        return pool_kernel(q, *args)

    pool_kernel = pa.pool_attention
    monkeypatch.setattr(pa, "pool_attention", counted)
    eng = Code2WavEngine(flow, hift, cfg)
    assert all(b.attn.pool_kernel and b.attn.kv_kernel for b in flow.decoder.estimator.blocks)
    got = _play(eng, rounds, voice_of)
    assert kernel_rows and set(kernel_rows) == {2}
    _compare(ref, got, "pool attention")
    assert any(not np.array_equal(a, c) for s in base for a, c in zip(base[s], got[s]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_is_the_two_index_puts(dtype):
    """`write_kv` (one launch) against the slot path's two `index_put_`: the same pools bit
    for bit, v a view of a q|k|v product as the slot path's is."""
    from pipeline.code2wav import pool_attention as pa

    if not pa.runs_here(torch.device("cpu")):
        pytest.skip("needs Triton (its interpreter on CPU)")
    g = torch.Generator().manual_seed(3)
    b, t, heads, dh, slots_n, cap = 4, 9, 4, 16, 3, 40
    qkv = torch.randn(b, t, 3 * heads * dh, generator=g).to(dtype)
    k = torch.randn(b, t, heads, dh, generator=g).to(dtype)
    v = qkv[..., 2 * heads * dh :].reshape(b, t, heads, dh)  # strided, as `Attention.qkv`'s
    at = torch.randperm(2 * slots_n * cap, generator=g)[: b * t]
    pools = [torch.randn(2, slots_n, cap, heads, dh, generator=g).to(dtype) for _ in range(2)]
    want = [p.clone() for p in pools]
    want[0].view(-1, heads, dh).index_put_((at,), k.flatten(0, 1))
    want[1].view(-1, heads, dh).index_put_((at,), v.flatten(0, 1))
    pa.write_kv(k, v, *pools, at)
    assert torch.equal(pools[0], want[0]) and torch.equal(pools[1], want[1])
    with pytest.raises(ValueError, match="contiguous"):
        pa.write_kv(k.transpose(2, 3), v, *pools, at)


def test_dit_kv_write_kernel_gives_the_same_pcm(ckpt, voices, monkeypatch):
    """The slot path's new keys and values written by `write_kv` (CUDA; Triton's interpreter
    here) give the PCM of the two `index_put_`, bit for bit (two staggered streams)."""
    from pipeline.code2wav import pool_attention as pa

    if not pa.runs_here(torch.device("cpu")):
        pytest.skip("needs Triton (its interpreter on CPU)")
    flow, hift, cfg = load_code2wav(ckpt, "cpu", torch.float32)  # its own: the kernels stay on
    rounds = _schedule(2, [120, 45], seed=5)

    voice_of = _alternating(voices)

    base = _play(Code2WavEngine(flow, hift, cfg), rounds, voice_of)
    monkeypatch.setattr(pa, "available", lambda device: True)  # the engine takes it on CPU
    monkeypatch.setattr(pa, "MAX_ROWS", 0)  # the attention stays the gathers + SDPA
    eng = Code2WavEngine(flow, hift, cfg)
    assert all(b.attn.kv_kernel for b in flow.decoder.estimator.blocks)
    got = _play(eng, rounds, voice_of)
    for sid in base:
        assert len(base[sid]) == len(got[sid])
        assert all(np.array_equal(a, c) for a, c in zip(base[sid], got[sid], strict=True))


def test_a_bf16_dit_keeps_sdpa_and_whole_products(monkeypatch):
    """A bf16 estimator has flash SDPA: the fp32 attention kernel is not taken for it (the
    K / V write is); split products would round each partial sum to bf16, so it only joins
    q|k|v (the same products as the three linears)."""
    from pipeline.code2wav import pool_attention as pa
    from pipeline.code2wav.dit import DiT, DiTConfig

    est = DiT(DiTConfig(hidden_size=64, depth=1, num_heads=4, head_dim=16)).to(torch.bfloat16)
    monkeypatch.setattr(pa, "available", lambda device: True)
    est.prepare_slot_path()
    block = est.blocks[0]
    assert not block.attn.pool_kernel and block.attn.kv_kernel
    assert block.split_k == 1 and block.attn.qkv_weight.dtype == torch.bfloat16
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    q, k, v = block.attn.qkv(x)
    block.attn.qkv_weight = block.attn.qkv_bias = None
    q0, k0, v0 = block.attn.qkv(x)
    for a, b in ((q, q0), (k, k0), (v, v0)):
        torch.testing.assert_close(a, b)


def _snr_db(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10((a.astype(np.float64) ** 2).sum()
                               / max(((a - b).astype(np.float64) ** 2).sum(), 1e-300)))


def test_bf16_estimator_stays_close_to_fp32_without_drift(model, voices):
    """`token2wav_precision: bf16` (opt-in) runs the DiT in bf16 with its caches in bf16 and
    everything else in fp32. It changes the audio, so the bound is an SNR against the fp32
    path (the tiny model measures 66-70 dB a chunk), held over a 12-chunk stream: bf16
    rounding in the cached keys must not compound from chunk to chunk."""
    import copy

    flow, hift, cfg = model
    rounds = _schedule(3, [300, 60, 33], seed=9)

    voice_of = _alternating(voices)

    ref = _plain(flow, hift, cfg, rounds, voice_of)
    bf16_flow = copy.deepcopy(flow)  # the engine converts the estimator in place
    eng = Code2WavEngine(bf16_flow, hift, cfg, Code2WavEngineConfig(token2wav_precision="bf16"))
    assert bf16_flow.decoder.estimator.in_proj.weight.dtype == torch.bfloat16
    assert bf16_flow.encoder is not None and next(bf16_flow.encoder.parameters()).dtype == torch.float32
    assert eng.pool.pool.dit.k.dtype == torch.bfloat16
    got = _play(eng, rounds, voice_of)
    for sid in ref:
        assert [a.shape for a in ref[sid]] == [b.shape for b in got[sid]]
        snrs = [_snr_db(a, b) for a, b in zip(ref[sid], got[sid])]
        print("bf16", sid, " ".join(f"{s:.1f}" for s in snrs))
        assert min(snrs) >= 55, f"{sid}: {min(snrs):.1f} dB"
        half = len(snrs) // 2
        if half >= 3:
            assert min(snrs[half:]) >= min(snrs[:half]) - 6


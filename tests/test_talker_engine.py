"""TalkerEngine (CPU, fp32, tiny sizes) vs plain restatements of the reference loops.

The restatements run transformers' LlamaModel over the whole sequence at every step (no
KV cache), follow `MiniCPMTTS.generate` (full_span) and
`TTSStreamingGenerator.generate_with_buffer` (streaming, sliding_recompute) literally,
including their position bookkeeping, and draw with the same per-stream noise stream.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from _talker_ref import PlainTalker
from test_talker_model import hf_llama
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from pipeline.config import TalkerConfig, talker_config_from_hf
from pipeline.handoff import CodeChunk, SpokenChunk, TalkerSpec, TextWanted
from pipeline.presets import tiny_hf_config
from pipeline.talker.engine import TalkerEngine, TalkerEngineConfig
from pipeline.talker.fused import FusedTalker
from pipeline.talker.model import TalkerKVCache, TalkerModel
from pipeline.talker.sampling import TalkerSamplingParams


def tiny_cfg(**kw) -> TalkerConfig:
    # the released answer caps: the tiny default's short ones would end these runs early
    caps = {"min_new_tokens": TalkerConfig.min_new_tokens,
            "max_new_tokens": TalkerConfig.max_new_tokens}
    return replace(talker_config_from_hf(tiny_hf_config()), **{**caps, **kw})


def make_talker(
    cfg: TalkerConfig, eos_bias: float, seed: int = 0, device: str = "cpu"
) -> TalkerModel:
    """Random tiny Talker whose EOS logit gets `eos_bias` (random weights almost never
    pick EOS out of 6562 codes; +2 gives chunks of ~10 codes)."""
    torch.manual_seed(seed)
    talker = TalkerModel(cfg).eval().to(device)
    bias = torch.zeros(cfg.num_audio_tokens, device=device)
    bias[cfg.eos_code] = eos_bias
    talker.head = lambda h: TalkerModel.head(talker, h) + bias  # instance override
    return talker


def ref_penalty(history: torch.Tensor, scores: torch.Tensor, penalty: float) -> torch.Tensor:
    """CustomRepetitionPenaltyLogitsProcessorRepeat(penalty, V, 16), restated."""
    if history.size(1) > 16:
        history = history[:, -16:]
    alpha = torch.pow(penalty, F.one_hot(history, scores.size(1)).sum(1))
    return torch.where(scores < 0, scores * alpha, scores / alpha)


class Reference:
    """Plain restatement of the reference Talker loops (no KV cache)."""

    def __init__(self, talker: TalkerModel, params: TalkerSamplingParams) -> None:
        cfg = talker.cfg
        self.talker, self.cfg, self.params = talker, cfg, params
        self.hf = hf_llama(cfg)
        sd = {k[6:]: v for k, v in talker.state_dict().items() if k.startswith("model.")}
        self.hf.load_state_dict(sd, strict=True)

    def condition(self, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t = self.talker
        h = t.projector_semantic(hidden)
        return t.emb_text(ids) + F.normalize(h, p=2, dim=-1)

    def text_row(self, token_id: int) -> torch.Tensor:
        return self.talker.emb_text.weight[token_id][None]

    def codes_embeds(self, codes: list[int]) -> torch.Tensor:
        return self.talker.emb_code[0].weight[torch.tensor(codes, dtype=torch.long)]

    def last_logits(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.hf(inputs_embeds=embeds[None], position_ids=positions[None]).last_hidden_state
        return self.talker.head(hidden[0, -1])

    def draw(self, logits, history, t, min_new, generator) -> int:
        p = self.params
        x = logits[None].clone() / torch.tensor([[p.temperature]])
        if history:
            ids = torch.tensor([history])
            x = ref_penalty(ids, x, p.repetition_penalty)
            x = TopPLogitsWarper(p.top_p, min_tokens_to_keep=3)(ids, x)
            x = TopKLogitsWarper(p.top_k, min_tokens_to_keep=3)(ids, x)
        if t < min_new:
            x[:, self.cfg.eos_code] = -torch.inf
        noise = torch.empty(self.cfg.num_audio_tokens).exponential_(generator=generator)
        return int((torch.softmax(x[0], dim=-1) / noise.clamp_min(1e-30)).argmax())

    @torch.no_grad()
    def full_span(self, condition: torch.Tensor, seed: int) -> list[int]:
        """`MiniCPMTTS.generate`: prompt, then t = 0..max_new_token-1; returns new_tokens[:t]."""
        cfg = self.cfg
        prompt = torch.cat(
            [condition, self.text_row(cfg.text_eos_token_id), self.text_row(cfg.audio_bos_token_id)]
        )
        g = torch.Generator().manual_seed(seed)
        length = prompt.shape[0]
        new_tokens: list[int] = []
        for t in range(cfg.max_new_tokens):
            # the KV cache holds positions 0..L-1 (prefill) then L+t-1 for each fed code
            positions = torch.arange(length + t)
            embeds = torch.cat([prompt, self.codes_embeds(new_tokens)]) if t else prompt
            history = new_tokens if t else []
            code = self.draw(self.last_logits(embeds, positions), history, t, cfg.min_new_tokens, g)
            new_tokens.append(code)
            if code == cfg.eos_code:
                break
        return new_tokens[:t]

    @torch.no_grad()
    def streaming(
        self, chunks: list[tuple[torch.Tensor, bool]], seed: int, cap: int
    ) -> list[list[int]]:
        """`generate_with_buffer` per text chunk (sliding_recompute). Returns codes per chunk."""
        cfg = self.cfg
        g = torch.Generator().manual_seed(seed)
        text_start_pos, idx = 0, -1
        all_generated: list[int] = []
        chunk_info: list[dict] = []
        per_chunk = []
        for cond, text_finished in chunks:
            idx += 1
            parts = [cond]
            if text_finished:
                parts.append(self.text_row(cfg.text_eos_token_id))
            parts.append(self.text_row(cfg.audio_bos_token_id))
            condition = torch.cat(parts)
            info = {"condition": condition, "audio_tokens": []}
            if idx >= 1:
                prev = chunk_info[-1]
                rec = [prev["condition"]]
                if prev["audio_tokens"]:
                    rec.append(self.codes_embeds(prev["audio_tokens"]))
                current = torch.cat([*rec, condition])
                text_start_pos = 0
            else:
                current = condition
            prefill_len = current.shape[0]
            chunk_tokens: list[int] = []
            for t in range(cap):
                positions = torch.arange(text_start_pos, text_start_pos + prefill_len + t)
                embeds = torch.cat([current, self.codes_embeds(chunk_tokens)]) if t else current
                first = len(all_generated) == 0 and t == 0
                history = [] if first else all_generated
                code = self.draw(self.last_logits(embeds, positions), history, t, 0, g)
                if code == cfg.eos_code:
                    break
                all_generated.append(code)
                chunk_tokens.append(code)
                info["audio_tokens"].append(code)
            chunk_info.append(info)
            text_start_pos += prefill_len + len(chunk_tokens)
            per_chunk.append(chunk_tokens)
        return per_chunk


def spoken(n: int, cfg: TalkerConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 151000, (n,), generator=g)
    return ids, torch.randn(n, cfg.llm_dim, generator=g) * 3


def run(
    engine: TalkerEngine, stream_ids: list[str], max_steps: int = 2000
) -> dict[str, list[CodeChunk]]:
    out: dict[str, list[CodeChunk]] = {s: [] for s in stream_ids}
    for _ in range(max_steps):
        for chunk in engine.step():
            out[chunk.request_id].append(chunk)
        if all(c and c[-1].finished for c in out.values()):
            return out
    raise AssertionError("streams did not finish")


def all_codes(chunks: list[CodeChunk]) -> list[int]:
    return [c for chunk in chunks for c in chunk.codes]


# ---------------------------------------------------------------------------------------


def test_full_span_matches_reference_generate():
    cfg = tiny_cfg()
    talker = make_talker(cfg, eos_bias=2.0)
    ref = Reference(talker, TalkerSamplingParams.from_config(cfg))
    ids, hidden = spoken(23, cfg, seed=5)
    engine = TalkerEngine(talker, TalkerEngineConfig(max_streams=2, mode="full_span"))
    engine.open("a", TalkerSpec(seed=11))
    engine.feed("a", SpokenChunk(ids[:9], hidden[:9]))
    assert engine.step() == []  # full_span waits for the whole span
    engine.feed("a", SpokenChunk(ids[9:], hidden[9:], True))
    got = all_codes(run(engine, ["a"])["a"])
    with torch.no_grad():
        expected = ref.full_span(ref.condition(ids, hidden), seed=11)
    assert got == expected
    assert len(got) >= cfg.min_new_tokens


@pytest.mark.parametrize(
    "eos_bias,expected_len", [(100.0, 50), (-1e4, 59)], ids=["eos-always", "eos-never"]
)
def test_full_span_eos_mask_and_max_length(eos_bias, expected_len):
    cfg = tiny_cfg(max_new_tokens=60)  # min_new_tokens stays 50
    engine = TalkerEngine(make_talker(cfg, eos_bias), TalkerEngineConfig(max_streams=1))
    engine.open("a", TalkerSpec(mode="full_span", seed=0))
    ids, hidden = spoken(5, cfg, seed=0)
    engine.feed("a", SpokenChunk(ids, hidden, True))
    codes = all_codes(run(engine, ["a"])["a"])
    # EOS is masked for draws 0..49, so an always-EOS model stops at exactly 50 codes; a
    # never-EOS one makes 60 draws and, like the reference, drops the one at the cap.
    assert len(codes) == expected_len
    assert cfg.eos_code not in codes


def test_chunks_of_25_released_with_3_lookahead():
    cfg = tiny_cfg(max_new_tokens=60)
    engine = TalkerEngine(make_talker(cfg, -1e4), TalkerEngineConfig(max_streams=2))
    engine.open("a", TalkerSpec(mode="full_span", seed=3))
    ids, hidden = spoken(4, cfg, seed=1)
    engine.feed("a", SpokenChunk(ids, hidden, True))
    released_at = []  # (number of codes when released, chunk)
    for _ in range(100):
        for chunk in engine.step():
            released_at.append((len(engine._streams["a"].codes), chunk))
        if released_at and released_at[-1][1].finished:
            break
    codes = engine._streams["a"].codes
    assert len(codes) == 59
    assert [n for n, _ in released_at] == [28, 53, 59]
    first, second, last = (c for _, c in released_at)
    assert first.codes == tuple(codes[:25]) and first.lookahead == tuple(codes[25:28])
    assert second.codes == tuple(codes[25:50]) and second.lookahead == tuple(codes[50:53])
    assert last.codes == tuple(codes[50:]) and last.finished and last.lookahead == ()
    assert [c.index for _, c in released_at] == [0, 1, 2]
    assert not first.finished and not second.finished


@pytest.mark.parametrize("pad", [False, True], ids=["eager", "padded prefills"])
def test_streaming_matches_reference_generate_with_buffer(pad, monkeypatch):
    """The padded prefills (CUDA graphs on a GPU, run eagerly here): prompts up to 32 rows
    padded to 16 / 32 in the staging slot (the recompute prompts of later chunks are longer
    and prefill as before); fp32 on the CPU, so the padding changes no code."""
    cap = 30
    monkeypatch.setattr("pipeline.talker.engine.STREAMING_CHUNK_MAX_CODES", cap)
    cfg = tiny_cfg()
    talker = make_talker(cfg, eos_bias=2.0)
    ref = Reference(talker, TalkerSamplingParams.from_config(cfg))
    engine = TalkerEngine(talker, TalkerEngineConfig(max_streams=4))
    assert engine.graphs is None and engine.prefill_lengths == ()  # the CPU's own path
    padded, unpadded = [], []
    if pad:
        engine._pad_prefills(32)
        assert engine.prefill_lengths == (16, 32)
        pad, plain = engine._prefill_padded, engine.decoder.prefill
        monkeypatch.setattr(engine, "_prefill_padded", lambda r, i: padded.append(
            r.shape[0]) or pad(r, i))
        monkeypatch.setattr(engine.decoder, "prefill", lambda c, s, p: unpadded.append(
            p.shape[0]) or plain(c, s, p))
    ids, hidden = spoken(27, cfg, seed=7)

    # Stream A: 7 rows (too few to start), then the other 20 with the end of text:
    # chunks [0:10], [10:20] and the last [20:27] (+ text_eos).
    engine.open("A", TalkerSpec(mode="streaming", seed=21))
    engine.feed("A", SpokenChunk(ids[:7], hidden[:7]))
    assert engine.step() == [] and engine._streams["A"].started_units == 0
    engine.feed("A", SpokenChunk(ids[7:], hidden[7:], True))
    # Stream B: 20 rows; the end of text arrives after both chunks started, so the last
    # chunk is empty: [text_eos, audio_bos] only.
    engine.open("B", TalkerSpec(mode="streaming", seed=22))
    engine.feed("B", SpokenChunk(ids[:20], hidden[:20]))
    chunks: dict[str, list[CodeChunk]] = {"A": [], "B": []}
    for _ in range(500):
        for c in engine.step():
            chunks[c.request_id].append(c)
        b = engine._streams["B"]
        if b.started_units == 2 and not b.text_finished:
            engine.feed("B", SpokenChunk(ids[:0], hidden[:0], True))
        if all(v and v[-1].finished for v in chunks.values()):
            break
    with torch.no_grad():
        cond = ref.condition(ids, hidden)
        expected_a = ref.streaming(
            [(cond[:10], False), (cond[10:20], False), (cond[20:], True)], 21, cap
        )
        expected_b = ref.streaming(
            [(cond[:10], False), (cond[10:20], False), (cond[20:], True)], 22, cap
        )
    assert all_codes(chunks["A"]) == [c for part in expected_a for c in part]
    assert all_codes(chunks["B"]) == [c for part in expected_b for c in part]
    if pad:  # both paths ran: first chunks padded, long recomputes not
        assert padded and set(padded) <= {16, 32} and all(n > 32 for n in unpadded)
        assert unpadded
    # The test exercises both ways a chunk ends: EOS (short chunks) and the draw cap.
    lengths = [len(p) for p in expected_a + expected_b]
    assert any(n < cap for n in lengths) and any(n == cap for n in lengths), lengths


def test_streaming_eos_at_every_chunk_start_flushes_empty_final_chunk():
    cfg = tiny_cfg()
    engine = TalkerEngine(make_talker(cfg, 100.0), TalkerEngineConfig(max_streams=1))
    engine.open("s", TalkerSpec(mode="streaming", seed=0))
    ids, hidden = spoken(25, cfg, seed=2)
    engine.feed("s", SpokenChunk(ids, hidden, True))
    chunks = run(engine, ["s"])["s"]
    assert chunks == [CodeChunk("s", (), True, (), 0)]
    assert engine._streams["s"].started_units == 3  # 10 + 10 + 5 rows, no minimum in streaming


def test_batched_decode_equals_one_stream_at_a_time(monkeypatch):
    monkeypatch.setattr("pipeline.talker.engine.STREAMING_CHUNK_MAX_CODES", 20)
    cfg = tiny_cfg(max_new_tokens=45, min_new_tokens=5)
    talker = make_talker(cfg, eos_bias=2.0)
    plan = [
        ("s1", "streaming", 101, 31),
        ("f1", "full_span", 102, 12),
        ("s2", "streaming", 103, 18),
    ]
    data = {sid: spoken(n, cfg, seed=seed) for sid, _, seed, n in plan}
    econf = TalkerEngineConfig(max_streams=4)

    alone = {}
    for sid, mode, seed, n in plan:
        engine = TalkerEngine(talker, econf)
        engine.open(sid, TalkerSpec(mode=mode, seed=seed))
        engine.feed(sid, SpokenChunk(*data[sid], True))
        alone[sid] = run(engine, [sid])[sid]

    # Together: staggered starts, and text arriving in pieces while others decode.
    engine = TalkerEngine(talker, econf)
    together: dict[str, list[CodeChunk]] = {sid: [] for sid, *_ in plan}
    for sid, mode, seed, _ in plan:
        engine.open(sid, TalkerSpec(mode=mode, seed=seed))
    for step in range(2000):
        for sid, _, _, n in plan:
            ids, hidden = data[sid]
            cuts = [0, 6, min(15, n), n]
            piece = {0: 0, 3: 1, 9: 2}.get(step - (5 if sid == "s2" else 0))
            if piece is not None:
                lo, hi = cuts[piece], cuts[piece + 1]
                engine.feed(sid, SpokenChunk(ids[lo:hi], hidden[lo:hi], piece == 2))
        for c in engine.step():
            together[c.request_id].append(c)
        if all(v and v[-1].finished for v in together.values()):
            break
    stats = engine.stats()
    assert stats["prefills"] == sum(e.started_units for e in engine._streams.values())
    assert stats["codes"] == sum(len(all_codes(c)) for c in together.values())
    assert stats["free_slots"] == stats["capacity"] == 4 and stats["decoding_streams"] == 0
    assert stats["graph_replays"] == 0
    assert stats["prefill_ms"] > 0 and stats["decode_ms"] > 0  # where the wall time went
    for sid, chunks in together.items():
        assert [c.codes for c in chunks] == [c.codes for c in alone[sid]], sid
        assert chunks == alone[sid], sid


def test_slots_open_close_and_errors():
    cfg = tiny_cfg(max_new_tokens=30, min_new_tokens=0, max_position_embeddings=64)
    engine = TalkerEngine(make_talker(cfg, 0.0), TalkerEngineConfig(max_streams=2))
    assert engine.step() == [] and not engine.has_work()
    engine.open("a", TalkerSpec(seed=1))
    engine.open("b", TalkerSpec(mode="full_span", seed=2))
    with pytest.raises(RuntimeError, match="no free Talker slot"):
        engine.open("c")
    with pytest.raises(ValueError, match="already open"):
        engine.open("a")
    ids, hidden = spoken(70, cfg, seed=0)
    with pytest.raises(ValueError, match="does not fit"):
        engine.feed("b", SpokenChunk(ids, hidden, True))
    engine.abort("b")  # cancel: slot 1 comes back
    engine.open("c", TalkerSpec(mode="full_span", seed=3))
    assert engine._streams["c"].slot == 1
    engine.feed("a", SpokenChunk(ids[:10], hidden[:10]))
    engine.step()
    assert engine._streams["a"].decoding
    engine.abort("a")  # cancel mid-decode
    assert engine.num_free_slots == 1 and not engine._active.any()
    engine.feed("c", SpokenChunk(ids[:3], hidden[:3], True))
    chunks = run(engine, ["c"])["c"]
    assert chunks[-1].finished and engine.num_free_slots == 2  # finished streams free the slot
    with pytest.raises(ValueError, match="already finished"):
        engine.feed("c", SpokenChunk(ids[:1], hidden[:1]))
    engine.abort("c")
    engine.abort("c")  # idempotent


def test_engine_config_buckets_and_capacity():
    """Graph buckets follow max_streams and the model's positions; a KV budget that cannot
    hold max_streams streams refuses to build, naming the numbers and the knobs."""
    cfg = tiny_cfg(max_position_embeddings=1024)
    talker = make_talker(cfg, 0.0)
    engine = TalkerEngine(talker, TalkerEngineConfig(max_streams=12))
    assert engine.batch_sizes == (1, 2, 4, 8, 12)
    assert engine.kv_lengths == (256, 512, 1024) and engine.max_len == 1024
    assert engine.stats()["capacity"] == 12 and engine.num_free_slots == 12
    assert engine.params == TalkerSamplingParams.from_config(cfg)
    per_slot = TalkerKVCache.bytes_per_slot(cfg, 1024, torch.float32)
    exact = TalkerEngine(talker, TalkerEngineConfig(max_streams=5, kv_cache_bytes=5 * per_slot))
    assert exact.stats()["capacity"] == 5
    with pytest.raises(ValueError, match=r"holds 4 streams .* not max_streams 5: raise "
                                         r"kv_cache_bytes .*memory_fraction.* capacity"):
        TalkerEngine(talker, TalkerEngineConfig(max_streams=5, kv_cache_bytes=5 * per_slot - 1))
    for bad in ({"mode": "duplex"}, {"max_streams": 0}, {"kv_cache_bytes": -1}):
        with pytest.raises(ValueError):
            TalkerEngineConfig(**bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_decode_matches_eager():
    """The compiled forward with the RoPE kernel gives the same codes eagerly and in its
    graphs (the decode step and the padded prefills)."""
    torch._dynamo.reset()
    cfg = tiny_cfg(max_new_tokens=80, min_new_tokens=10, max_position_embeddings=512)
    talker = make_talker(cfg, eos_bias=2.0, device="cuda")
    results = []
    for graphs in (False, True):
        engine = TalkerEngine(talker, TalkerEngineConfig(max_streams=4, cuda_graphs=graphs))
        assert (engine.graphs is not None) == graphs and bool(engine.prefill_lengths) == graphs
        assert engine.decoder.compiled and engine.decoder.rope_kernel
        start = engine.stats()["graph_replays"]  # compiling at start replays a padded prefill
        for i, mode in enumerate(["streaming", "full_span", "streaming"]):
            engine.open(f"s{i}", TalkerSpec(mode=mode, seed=i))
            ids, hidden = spoken(24 + 7 * i, cfg, seed=i)
            engine.feed(f"s{i}", SpokenChunk(ids, hidden, True))
        results.append(run(engine, ["s0", "s1", "s2"]))
        if graphs:  # every decode step and every (padded) prefill replayed
            stats = engine.stats()
            assert stats["graph_replays"] - start == stats["steps"] + stats["prefills"]
    assert results[0] == results[1]


@pytest.mark.parametrize("mode", ["full_span", "streaming"])
def test_fixed_code_count_ignores_eos(mode):
    """Benchmark fixed-length mode: an always-EOS model still gives exactly max_codes codes,
    released as 25 + 25 + 7 for 57, and the stream ends even with text still coming."""
    cfg = tiny_cfg()
    engine = TalkerEngine(make_talker(cfg, eos_bias=100.0), TalkerEngineConfig(max_streams=1))
    engine.open("a", TalkerSpec(mode=mode, seed=0, max_codes=57))
    ids, hidden = spoken(12, cfg, seed=2)
    engine.feed("a", SpokenChunk(ids, hidden, (mode == "full_span")))
    chunks = run(engine, ["a"])["a"]
    assert [len(c.codes) for c in chunks] == [25, 25, 7]
    assert cfg.eos_code not in all_codes(chunks)
    assert engine.num_free_slots == 1
    if mode == "streaming":  # text still coming after the last code: taken and dropped
        engine.feed("a", SpokenChunk(ids, hidden, True))
        assert engine.step() == [] and not engine.has_work()
    with pytest.raises(ValueError, match="max_codes"):
        engine.open("b", TalkerSpec(max_codes=0))


class RecordingSampler:
    """Wraps an engine's sampler: every draw's (logits, active rows, codes), in call order."""

    def __init__(self, sampler) -> None:
        self.sampler, self.calls = sampler, []

    def __call__(self, logits, state, active):
        codes = self.sampler(logits, state, active)
        self.calls.append((logits.clone(), active.clone(), codes.clone()))
        return codes


@pytest.mark.parametrize("compiled", [False, True], ids=["fused", "compiled"])
@pytest.mark.parametrize("temperature", [0.8, 0.0], ids=["sampled", "greedy"])
def test_engine_codes_against_the_plain_forward_over_300_codes(compiled, temperature):
    """The precision contract, bf16 on CPU: three streams of 300 codes each (EOS masked),
    same seeds, on the engine's forward and on the plain one (tests/_talker_ref.py).

    Eager (the CPU's path): every draw's logits and every code equal the plain forward's.
    Compiled (the GPU's path, forced here): logits stay within the compiled bound of
    test_talker_model.py at every draw; a draw can still pick another code where two
    candidates are that close, after which the stream parts (with model seed 0, sampled, a
    stream parts at its 18th code)."""
    torch._dynamo.reset()
    cfg = replace(tiny_cfg(), max_new_tokens=2048, max_position_embeddings=512,
                  temperature=temperature)
    torch.manual_seed(0)
    talker = TalkerModel(cfg).eval().to(torch.bfloat16)
    codes, calls = [], []
    for decoder in (PlainTalker, lambda m: FusedTalker(m, compile=compiled)):
        engine = TalkerEngine(talker, TalkerEngineConfig(max_streams=4, mode="full_span"))
        engine.decoder = decoder(talker)
        engine.sampler = recorder = RecordingSampler(engine.sampler)
        for i in range(3):
            engine.open(f"s{i}", TalkerSpec(seed=100 + i, max_codes=300))
            engine.feed(f"s{i}", SpokenChunk(*spoken(20 + 5 * i, cfg, seed=i), True))
        while engine.has_work():
            engine.step()
        codes.append([engine.stream_codes(f"s{i}") for i in range(3)])
        calls.append(recorder.calls)
    assert [len(c) for c in codes[0]] == [300, 300, 300]
    if not compiled:
        assert codes[0] == codes[1]
        assert all(torch.equal(a[0], b[0]) for a, b in zip(*calls))
        return
    bound = 4 * 2**-7  # x max |logit| of the draw: COMPILED_BOUND of test_talker_model.py
    for (plain, active, plain_codes), (comp, _, comp_codes) in zip(*calls):
        scale = plain[active].abs().max().item()
        diff = (plain - comp)[active].abs().max().item()
        assert diff <= bound * scale, f"compiled logits off by {diff:.3e} at |logits| {scale:.2f}"
        if not torch.equal(plain_codes[active], comp_codes[active]):
            break  # the streams part here: later logits belong to other code histories


def test_cpu_replica_runs_the_portable_path(tiny_source):
    """A CPU replica is built without Inductor (a C++ toolchain and minutes of start-up), the
    RoPE kernel or CUDA graphs: the same forward, eagerly."""
    eng = TalkerEngine.from_source(tiny_source, TalkerEngineConfig(), "cpu")
    assert isinstance(eng.decoder, FusedTalker)
    assert not eng.decoder.compiled and not eng.decoder.rope_kernel
    assert eng.graphs is None and eng.prefill_lengths == ()


def test_a_held_stream_waits_for_resume_and_speaks_the_same(monkeypatch):
    """TalkerSpec.hold: once its first chunk is released the stream is no work of its own
    (the loop would idle) until resume; beside another stream's work it decodes as usual;
    past HOLD_LIMIT_S it goes on alone. Its chunks equal an unheld stream's."""
    monkeypatch.setattr("pipeline.talker.engine.HOLD_LIMIT_S", 60.0)  # no expiry mid-test
    cfg = tiny_cfg()
    talker = make_talker(cfg, eos_bias=-100.0)
    econf = TalkerEngineConfig(max_streams=2)
    ids, hidden = spoken(12, cfg, seed=3)

    def opened(hold: bool) -> TalkerEngine:
        engine = TalkerEngine(talker, econf)
        engine.open("a", TalkerSpec(mode="streaming", seed=5, max_codes=70, hold=hold))
        engine.feed("a", SpokenChunk(ids, hidden, True))
        return engine

    ref = run(opened(False), ["a"])["a"]
    engine = opened(True)
    got: list[CodeChunk] = []
    while engine.has_work():
        got += engine.step()
    assert [len(c.codes) for c in got] == [25]
    held_codes = len(engine.stream_codes("a"))
    assert held_codes == 28  # the first chunk and its lookahead, nothing more

    # Another stream's work: the held stream decodes beside it.
    engine.open("b", TalkerSpec(mode="streaming", seed=6, max_codes=3))
    engine.feed("b", SpokenChunk(ids, hidden, True))
    while engine.has_work():
        got += [c for c in engine.step() if c.request_id == "a"]
    assert len(engine.stream_codes("a")) > held_codes
    assert not engine.has_work()  # b is done, a still held

    engine.resume("a")
    assert engine.has_work()
    got += run(engine, ["a"])["a"]
    assert [c.codes for c in got] == [c.codes for c in ref]
    assert (engine.stats()["holds"], engine.stats()["holds_timed_out"]) == (1, 0)

    # No resume: the hold ends by itself.
    monkeypatch.setattr("pipeline.talker.engine.HOLD_LIMIT_S", 0.0)
    engine = opened(True)
    alone: list[CodeChunk] = []
    while engine.has_work():  # as the engine loop drives it
        alone += engine.step()
    assert all_codes(alone) == all_codes(ref)
    assert (engine.stats()["holds"], engine.stats()["holds_timed_out"]) == (1, 1)


@pytest.mark.parametrize("hold", [True, False])
def test_a_held_stream_whose_first_unit_ends_early_asks_for_the_held_text(hold):
    """A held turn's Thinker holds its text after the first text chunk; should the Talker's
    first unit end (EOS) before its first chunk, the stream says once that it wants text
    (TextWanted, for the ingress to resume the Thinker). Nothing is said before a unit ran,
    nor without a hold, nor once the text is finished."""
    cfg = tiny_cfg()
    engine = TalkerEngine(make_talker(cfg, eos_bias=2.0), TalkerEngineConfig(max_streams=1))
    engine.open("a", TalkerSpec(mode="streaming", seed=1, hold=hold))
    assert engine.step() == []  # no text yet: nothing wanted
    ids, hidden = spoken(14, cfg, seed=4)
    engine.feed("a", SpokenChunk(ids[:10], hidden[:10], False))  # the first text chunk
    wanted, chunks = [], []
    for _ in range(200):
        for out in engine.step():
            (chunks if isinstance(out, CodeChunk) else wanted).append(out)
        if not engine.has_work():
            break
    assert not chunks and len(engine.stream_codes("a")) < 28  # the unit ended early
    assert wanted == ([TextWanted("a")] if hold else [])
    engine.feed("a", SpokenChunk(ids[10:], hidden[10:], True))
    chunks = run(engine, ["a"])["a"]
    assert chunks[-1].finished

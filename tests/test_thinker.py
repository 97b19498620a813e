"""The Thinker end to end on the embedded default checkpoint: media -> encoders -> splice
-> paged continuous batching -> text deltas + spoken-span hidden states.

Fast paths checked against the plain path here: encoder cache hit == miss; requests
admitted together (batched encoders, batched decode) == each alone; the engine's
per-step hidden states == one dense forward over the whole sequence.
"""

from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from pipeline.thinker.llm_engine.engine import EngineConfig
from pipeline.graphs import GraphRunner
from pipeline.handoff import SamplingParams
from pipeline.processing.processor import Processor
from pipeline.thinker.engine import ThinkerEngine, ThinkerEngineConfig


def _png(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _wav(seconds: float, freq: float) -> bytes:
    t = np.arange(int(16000 * seconds)) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), 16000, format="WAV")
    return buf.getvalue()


@pytest.fixture(scope="module")
def engine_factory(tiny_source):
    def make(**kw) -> ThinkerEngine:
        """llm={"launch_ahead": True}: the LLM launches ahead, as on CUDA."""
        llm = dict(kw.pop("llm", {}))
        ahead = llm.pop("launch_ahead", False)
        cfg = ThinkerEngineConfig(llm=EngineConfig(kv_cache_bytes=32 * 2**20, **llm), **kw)
        eng = ThinkerEngine.from_source(tiny_source, cfg, device="cpu")
        eng.llm.launch_ahead = ahead
        return eng

    return make


def _request(
    engine, rid, image_seed=0, audio_freq=440.0, max_tokens=8, speech=True, text="What is it?"
):
    proc = Processor(engine.model.cfg, engine.tokenizer)
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image", "data": _png(500, 700, image_seed)},
                {"type": "audio", "data": _wav(2.0, audio_freq)},
                {"type": "text", "text": text},
            ],
        }
    ]
    return proc.build(
        msgs,
        speech_output=speech,
        request_id=rid,
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def _run(engine, reqs):
    for r in reqs:
        engine.open(r.request_id, r)
    return _collect(engine, [], reqs)


def _collect(engine, deltas, reqs):
    """Every request's stream: the deltas given, then the engine's until it has no work."""
    out = {
        r.request_id: {"ids": [], "text": "", "spoken": [], "hidden": [], "reason": None}
        for r in reqs
    }

    def steps():
        yield from deltas
        while engine.has_work():
            yield from engine.step()

    for d in steps():
        o = out[d.request_id]
        o["ids"] += d.token_ids
        o["text"] += d.text
        o["spoken"] += d.spoken_ids
        if d.spoken_hidden is not None:
            o["hidden"].append(d.spoken_hidden)
        if d.finished:
            o["reason"] = d.finish_reason
    for o in out.values():
        o["hidden"] = torch.cat(o["hidden"]) if o["hidden"] else torch.zeros(0)
    return out


def test_multimodal_request_streams_text_and_spoken_hidden(engine_factory):
    eng = engine_factory()
    req = _request(eng, "a", max_tokens=10)
    assert len(req.image_bounds) > 1 and req.audio_bounds  # sliced image + audio
    out = _run(eng, [req])["a"]
    assert len(out["ids"]) == 10 and out["reason"] == "length"
    assert out["text"] == eng.tokenizer.decode(out["ids"], skip_special_tokens=True)
    # The prompt ends with <|tts_bos|>: every output token but the last one (never fed
    # back on a length stop) comes with its hidden state.
    assert out["spoken"] == out["ids"][:-1]
    assert out["hidden"].shape == (9, eng.model.cfg.llm.hidden_size)
    assert eng.stats()["num_free_blocks"] == eng.stats()["num_total_blocks"]


def test_stage_marks_on_first_and_last_delta(engine_factory):
    eng = engine_factory()
    eng.open("m", _request(eng, "m", max_tokens=4))
    marks = []
    while eng.has_work():
        marks += [d.timings for d in eng.step() if d.timings]
    assert len(marks) == 2  # first token, last token
    first, last = marks
    order = ["admitted", "vision_end", "audio_end", "first_token"]
    assert [first[k] for k in order] == sorted(first[k] for k in order)
    assert last["last_token"] >= last["first_token"] == first["first_token"]


def test_spoken_hidden_equals_dense_forward(engine_factory):
    """Pairing rule of spec 2.2: the row for token t_i is the final-norm hidden at the
    position where t_i was the input. Checked against one dense causal forward."""
    eng = engine_factory()
    req = _request(eng, "d", max_tokens=6)
    out = _run(eng, [req])["d"]
    model = eng.model
    ids = torch.tensor(req.input_ids + out["ids"])
    with torch.inference_mode():
        emb = model.llm.embed(ids)
        img = torch.cat(model.encode_images(req.images))
        aud = model.encode_audios(req.audios)
        rows = iter(img.split(model.cfg.query_num))
        for s, e in req.image_bounds:
            emb[s:e] = next(rows)
        for (s, e), (clip, first, n) in zip(req.audio_bounds, req.audio_segments):
            emb[s:e] = aud[clip][first : first + n]
        dense = model.llm(emb, torch.arange(len(ids)))  # no forward context: one causal seq
        greedy = model.llm.compute_logits(dense[len(req.input_ids) - 1 : -1]).argmax(-1)
    p = len(req.input_ids)
    torch.testing.assert_close(
        out["hidden"], dense[p : p + len(out["spoken"])], atol=1e-4, rtol=1e-4
    )
    assert greedy.tolist() == out["ids"]


def test_encoder_cache_hit_equals_miss(engine_factory):
    # Prefix caching off: the repeat would take its media slots from the LLM's cache and
    # never look the encoders' cache up (tests/test_prefix_cache.py covers that path).
    eng = engine_factory(encoder_cache_size=8, llm={"enable_prefix_caching": False})
    first = _run(eng, [_request(eng, "x")])["x"]
    assert (eng.cache.hits, eng.cache.misses) == (0, 2)
    second = _run(eng, [_request(eng, "y")])["y"]
    assert (eng.cache.hits, eng.cache.misses) == (2, 2)
    assert first["ids"] == second["ids"]
    torch.testing.assert_close(first["hidden"], second["hidden"], atol=0, rtol=0)
    off = engine_factory(encoder_cache_size=0)
    third = _run(off, [_request(off, "z")])["z"]
    assert off.cache.hits == 0 and third["ids"] == first["ids"]


def test_batched_requests_equal_each_alone(engine_factory):
    eng = engine_factory()
    reqs = [
        _request(eng, f"r{i}", image_seed=i, audio_freq=300.0 + 100 * i, max_tokens=5 + i)
        for i in range(3)
    ]
    together = _run(eng, reqs)
    for i, r in enumerate(reqs):
        alone_eng = engine_factory()
        alone = _run(
            alone_eng,
            [
                _request(
                    alone_eng,
                    r.request_id,
                    image_seed=i,
                    audio_freq=300.0 + 100 * i,
                    max_tokens=5 + i,
                )
            ],
        )
        a, b = together[r.request_id], alone[r.request_id]
        assert a["ids"] == b["ids"], r.request_id
        torch.testing.assert_close(a["hidden"], b["hidden"], atol=1e-4, rtol=1e-4)


def test_launch_ahead_streams_the_same_deltas(engine_factory):
    """The LLM engine launching ahead (its CUDA default) under the Thinker: the same ids,
    text, spoken ids and spoken hidden rows per request, and the same finish reasons, with a
    request arriving while another decodes. Its media wait for the step in flight to return
    its ids first (a step that only drains), then encode with nothing in flight."""
    outs = []
    for ahead in (False, True):
        eng = engine_factory(llm={"launch_ahead": ahead, "max_num_batched_tokens": 96})
        assert eng.llm.launch_ahead == ahead
        reqs = [
            _request(eng, f"r{i}", image_seed=i, audio_freq=300.0 + 100 * i, max_tokens=6 + 3 * i)
            for i in range(3)
        ]
        late = reqs.pop()
        for r in reqs:
            eng.open(r.request_id, r)
        early = [d for _ in range(4) for d in eng.step()]  # r0 and r1 decode
        assert eng.llm.in_flight == ahead and eng.llm.has_decodes()
        eng.open(late.request_id, late)
        first = eng.step()
        if ahead:  # only the step in flight came back: the new media wait, nothing launched
            assert first and eng._streams["r2"].todo and not eng.llm.in_flight
            assert not eng.step()  # now encoded, and the next step launched
            assert not eng._streams["r2"].todo and eng.llm.in_flight
        outs.append(_collect(eng, early + first, [*reqs, late]))
        assert eng.stats()["num_free_blocks"] == eng.stats()["num_total_blocks"]
    sync, ahead = outs
    for rid, ref in sync.items():
        got = ahead[rid]
        assert ref["reason"] == "length" and ref["spoken"], rid
        for k in ("ids", "text", "spoken", "reason"):
            assert got[k] == ref[k], (rid, k)
        torch.testing.assert_close(got["hidden"], ref["hidden"], atol=1e-5, rtol=1e-5)


def test_text_only_prompt_without_speech_has_no_spoken_span(engine_factory):
    eng = engine_factory()
    proc = Processor(eng.model.cfg, eng.tokenizer)
    req = proc.build(
        [{"role": "user", "content": "hello"}],
        speech_output=False,
        request_id="t",
        sampling=SamplingParams(max_tokens=4, ignore_eos=True),
    )
    # the prompt ends with <|tts_bos|> either way (the reference's streamed decode), but a
    # text-only turn asks for no hidden states, so nothing is spoken
    assert req.input_ids[-1] == eng.tokens.tts_bos and not req.return_hidden
    out = _run(eng, [req])["t"]
    assert len(out["ids"]) == 4 and out["spoken"] == []


def test_abort_frees_everything(engine_factory):
    eng = engine_factory()
    total = eng.stats()["num_total_blocks"]
    eng.open("p", _request(eng, "p", max_tokens=50))
    eng.open("q", _request(eng, "q", max_tokens=50))
    eng.step()
    eng.step()
    assert eng.stats()["num_free_blocks"] < total
    eng.abort("p")
    eng.abort("q")
    eng.abort("nope")  # unknown: nothing happens
    assert eng.stats()["num_free_blocks"] == total and eng.stats()["open_streams"] == 0
    assert eng.step() == []  # nothing more comes for an aborted request
    assert not eng.has_work()
    # Aborting a request that is still waiting for its encoders.
    eng.open("w", _request(eng, "w"))
    eng.abort("w")
    assert not eng.has_work() and eng.step() == []


def test_bad_requests_are_refused(engine_factory):
    eng = engine_factory()
    req = _request(eng, "b")
    with pytest.raises(ValueError, match="context"):
        eng.open("b", type(req)(**{**req.__dict__, "sampling": SamplingParams(max_tokens=10**6)}))
    s, e = req.image_bounds[0]
    bad = type(req)(**{**req.__dict__, "image_bounds": [(s, e - 1)] + req.image_bounds[1:]})
    with pytest.raises(ValueError, match="image slot"):
        eng.open("b", bad)
    eng.open("b", req)
    with pytest.raises(ValueError, match="duplicate"):
        eng.open("b", req)
    with pytest.raises(ValueError, match="opened as"):
        eng.open("other", req)
    with pytest.raises(ValueError, match="whole prompt"):
        eng.feed("b", None)


def test_uint8_strips_encode_like_normalized_float_strips(engine_factory):
    """Pixels cross processes as bytes; the encoder's on-device normalization (and the zeroed
    padding of a mixed-length batch) must equal feeding the reference's float32 strips."""
    from dataclasses import replace

    from pipeline.processing.image import normalize_pixels

    eng = engine_factory()
    images = _request(eng, "u", image_seed=3).images + _request(eng, "v", image_seed=4).images
    floats = [
        replace(im, pixel_values=[normalize_pixels(s) for s in im.pixel_values]) for im in images
    ]
    assert images[0].pixel_values[0].dtype == torch.uint8
    got, ref = eng.model.encode_images(images, 2), eng.model.encode_images(floats, 2)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_warm_up_runs_every_kind_of_step_and_leaves_a_fresh_engine(engine_factory):
    """The start-up warm-up (CUDA replicas) serves two requests: media, hidden states, a
    mixed step with a prefix-cache hit. After it the engine is idle, nothing is held, and a
    request gives what it gives on an engine that never warmed up."""
    eng, fresh = engine_factory(), engine_factory()
    batches = _vision_batches(eng)
    eng.warm_up()
    assert eng.config.vision_batch_size in batches, "a full vision batch of 448x448 slices"
    st = eng.stats()
    assert not eng.has_work() and st["open_streams"] == 0
    assert st["num_free_blocks"] == st["num_total_blocks"]
    assert st["prefix_cache_hits"] > 0, "the second request reuses the first one's blocks"
    assert st["encoder_cache_misses"] == 2  # one image, one clip
    assert st["max_step_ms"] == st["max_decode_gap_ms"] == 0.0
    got = _run(eng, [_request(eng, "a", max_tokens=6)])["a"]
    want = _run(fresh, [_request(fresh, "a", max_tokens=6)])["a"]
    assert got["ids"] == want["ids"] and got["reason"] == want["reason"] == "length"
    assert torch.equal(got["hidden"], want["hidden"])


def _vision_batches(eng) -> list[int]:
    """Wraps the vision encoder's forward: the list grows by each pass's slice count."""
    sizes: list[int] = []
    forward = eng.model.vpm.forward

    def counted(pixels, *a, **k):
        sizes.append(pixels.shape[0])
        return forward(pixels, *a, **k)

    eng.model.vpm.forward = counted
    return sizes


def _counting_vision(eng, name: str = "encode_images") -> list[int]:
    """Wraps the engine's vision encoder (or `name`, another encoder): the list grows by the
    items of each pass."""
    calls: list[int] = []
    encode = getattr(eng.model, name)

    def counted(items, *a, **k):
        calls.append(len(items))
        return encode(items, *a, **k)

    setattr(eng.model, name, counted)
    return calls


@pytest.mark.parametrize("ahead", [False, True])
def test_images_encoded_ahead_give_the_same_stream(engine_factory, ahead):
    """A request's image and clip handed over before it (`prefetch`, here while another
    request decodes) are encoded by the next step and wait for it: both streams equal the
    ones without the prefetch, and no encoder runs on them again."""
    outs = []
    for prefetch in (False, True):
        eng = engine_factory(llm={"launch_ahead": ahead, "enable_prefix_caching": False})
        calls = _counting_vision(eng)
        clips = _counting_vision(eng, "encode_audios")
        first = _request(eng, "a", image_seed=1, max_tokens=8)
        late = _request(eng, "b", image_seed=2, audio_freq=550.0, max_tokens=5)
        eng.open("a", first)
        early = [d for _ in range(3) for d in eng.step()]  # "a" decodes
        assert eng.llm.has_decodes()
        if prefetch:
            eng.prefetch(late.images + late.audios)
            early += eng.step()
            if ahead:  # the step in flight came back first; the encode is the next step's
                assert eng._prefetch and not eng.llm.in_flight
                early += eng.step()
            assert not eng._prefetch and eng.stats()["prefetch_held"] == 2
            assert calls == [1, 1] and clips == [1, 1]
            eng.prefetch(late.images + late.audios)  # held already: nothing to do
            assert not eng._prefetch
        eng.open("b", late)
        outs.append(_collect(eng, early, [first, late]))
        assert calls == [1, 1] and clips == [1, 1]  # one pass each, whichever way it came
        st = eng.stats()
        assert (st["prefetched"], st["prefetch_hits"], st["prefetch_held"]) == (
            (2, 2, 0) if prefetch else (0, 0, 0))
        assert st["num_free_blocks"] == st["num_total_blocks"]
    plain, ahead_out = outs
    for rid, ref in plain.items():
        got = ahead_out[rid]
        for k in ("ids", "text", "spoken", "reason"):
            assert got[k] == ref[k], (rid, k)
        torch.testing.assert_close(got["hidden"], ref["hidden"], atol=1e-5, rtol=1e-5)


def test_items_sent_ahead_go_in_one_batch_while_a_decode_runs(engine_factory):
    """Items sent ahead of their requests while a decode runs are encoded together in the
    next step, and wait there for their requests: nothing is encoded twice."""
    eng = engine_factory(llm={"enable_prefix_caching": False})
    calls = _counting_vision(eng)
    first = _request(eng, "a", image_seed=1, max_tokens=12)
    late = [_request(eng, f"b{i}", image_seed=10 + i, max_tokens=3) for i in range(3)]
    eng.open("a", first)
    early = [d for _ in range(3) for d in eng.step()]  # "a" decodes
    assert eng.llm.has_decodes() and calls == [1]
    eng.prefetch([r.images[0] for r in late])
    early += eng.step()
    assert calls == [1, 3] and eng.stats()["prefetch_held"] == 3
    for r in late:
        eng.open(r.request_id, r)
    out = _collect(eng, early, [first, *late])
    assert sum(calls) == 4 and eng.stats()["prefetch_hits"] == 3
    assert all(o["reason"] == "length" for o in out.values())


def test_images_sent_ahead_are_bounded_and_skip_what_is_encoded(engine_factory):
    """The store of images encoded ahead holds `prefetch_capacity` (oldest out: a request
    that never came; here with the encoder LRU off); an image an admitted request is
    encoding anyway is not encoded twice; capacity 0 turns prefetching off."""
    eng = engine_factory(prefetch_capacity=2, encoder_cache_size=0,
                         llm={"enable_prefix_caching": False})
    calls = _counting_vision(eng)
    reqs = [_request(eng, f"r{i}", image_seed=i, max_tokens=2) for i in range(3)]
    eng.prefetch([r.images[0] for r in reqs])
    eng.step()
    assert calls == [3] and eng.stats()["prefetch_held"] == 2
    assert reqs[0].images[0].content_hash not in eng._ahead  # the oldest went
    out = _run(eng, [reqs[0]])["r0"]  # encoded again, as without any prefetch
    assert calls == [3, 1] and out["reason"] == "length"
    fresh = _request(eng, "n", image_seed=9, max_tokens=2)
    eng.open("n", fresh)
    eng.prefetch(fresh.images)  # its own request is admitted in the same step
    _collect(eng, [], [fresh])
    assert calls == [3, 1, 1] and eng.stats()["prefetched"] == 3
    off = engine_factory(prefetch_capacity=0)
    off.prefetch(reqs[1].images)
    assert not off.has_work()


@pytest.mark.parametrize("ahead", [False, True])
def test_a_held_request_waits_for_resume_and_streams_the_same(engine_factory, ahead,
                                                             monkeypatch):
    """hold_after_spoken=n: once n spoken rows are out the request is no work of its own
    (launching ahead, the step in flight is drained and none launched) until resume; beside
    another request's work it decodes as usual; past HOLD_LIMIT_S it goes on alone. Its
    stream equals the unheld one's."""
    monkeypatch.setattr("pipeline.thinker.engine.HOLD_LIMIT_S", 60.0)  # no expiry mid-test

    def opened(hold: int) -> tuple[ThinkerEngine, object]:
        eng = engine_factory(llm={"launch_ahead": ahead})
        req = replace(_request(eng, "r", max_tokens=12), hold_after_spoken=hold)
        eng.open("r", req)
        return eng, req

    eng, req = opened(0)
    ref = _collect(eng, [], [req])["r"]
    eng, req = opened(3)
    deltas = []
    while eng.has_work():
        deltas += eng.step()
    spoken = sum(len(d.spoken_ids) for d in deltas)
    assert 3 <= spoken <= 4 and not eng.llm.in_flight and not any(d.finished for d in deltas)
    held_ids = sum(len(d.token_ids) for d in deltas)

    other = _request(eng, "o", image_seed=7, max_tokens=3, speech=False)
    eng.open("o", other)
    while eng.has_work():  # the other request's steps decode the held one too
        deltas += [d for d in eng.step() if d.request_id == "r"]
    assert sum(len(d.token_ids) for d in deltas) > held_ids

    eng.resume("r")
    got = _collect(eng, deltas, [req])["r"]
    for k in ("ids", "text", "spoken", "reason"):
        assert got[k] == ref[k], k
    torch.testing.assert_close(got["hidden"], ref["hidden"], atol=1e-4, rtol=1e-4)
    assert (eng.stats()["holds"], eng.stats()["holds_timed_out"]) == (1, 0)

    monkeypatch.setattr("pipeline.thinker.engine.HOLD_LIMIT_S", 0.0)  # no resume comes
    eng, req = opened(3)
    assert _collect(eng, [], [req])["r"]["ids"] == ref["ids"]
    assert (eng.stats()["holds"], eng.stats()["holds_timed_out"]) == (1, 1)


class _StaticRunner:
    """GraphRunner's contract on the CPU: a key's inputs are copied into its static buffers,
    its output is one static tensor overwritten by every run of that key, and at most
    `max_graphs` keys are kept (least recently used evicted)."""

    counts = GraphRunner.counts

    def __init__(self, max_graphs: int = 32):
        self.max_graphs, self.static = max_graphs, {}
        self.replays = self.captures = self.fallbacks = 0
        self.keys = []

    def __contains__(self, key) -> bool:
        return key in self.static

    def fallback(self) -> None:
        self.fallbacks += 1

    def run(self, key, inputs, fn, example=None):
        self.keys.append(key)
        if key not in self.static:
            self.captures += 1
            bufs = [x.clone() for x in inputs]
            self.static[key] = (bufs, fn(*bufs).clone())
            while len(self.static) > self.max_graphs:
                self.static.pop(next(iter(self.static)))
        bufs, out = self.static.pop(key)
        self.static[key] = (bufs, out)  # most recently used last
        for b, x in zip(bufs, inputs):
            b.copy_(x)
        out.copy_(fn(*bufs))
        self.replays += 1
        return out


def _strips_image(sizes, seed, patch):
    from pipeline.handoff import ImageInput

    g = torch.Generator().manual_seed(seed)
    strips = [torch.randint(0, 256, (3, patch, patch * h * w), generator=g, dtype=torch.uint8)
              for h, w in sizes]
    return ImageInput(strips, torch.tensor(sizes, dtype=torch.int32), f"im{seed}")


def test_an_engine_with_audio_graphs_streams_the_same(engine_factory):
    """The engine hands a step's lone audio clip to its graphs (CUDA only; the CPU runner
    stands in) and streams what an engine without them does; two clips in one step are
    encoded together, eagerly; the stats count both."""
    plain, eng = engine_factory(), engine_factory()
    assert eng.audio_graphs is None  # not on the CPU
    from pipeline.thinker.model import AudioGraphs

    eng.audio_graphs = AudioGraphs.of(eng.model)
    eng.audio_graphs.runner = _StaticRunner()
    a = _run(eng, [_request(eng, "g", audio_freq=350.0)])["g"]
    b = _run(plain, [_request(plain, "g", audio_freq=350.0)])["g"]
    assert a["ids"] == b["ids"]
    torch.testing.assert_close(a["hidden"], b["hidden"], atol=1e-5, rtol=1e-5)
    stats = eng.stats()
    assert (stats["audio_graph_replays"], stats["audio_graph_fallbacks"]) == (1, 0)
    assert eng.audio_graphs.runner.keys == [256]  # a 2 s clip: 200 mel frames
    pair = [_request(eng, f"p{i}", audio_freq=400.0 + 50 * i) for i in range(2)]
    got = _run(eng, pair)
    want = _run(plain, [_request(plain, f"p{i}", audio_freq=400.0 + 50 * i) for i in range(2)])
    assert all(got[r]["ids"] == want[r]["ids"] for r in got)
    assert eng.stats()["audio_graph_fallbacks"] == 1 and eng.stats()["audio_graph_replays"] == 1

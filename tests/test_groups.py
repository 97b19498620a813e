"""Stage groups, in-process (no Ray): two groups of the three servers over fake engines,
wired with LocalHandles as deployments/app.py wires them (each group's Thinker feeds its own
Talker, which pushes to its own Code2Wav). Turns spread over the groups by free window
slots, every hop stays in its group, a group whose stage dies gets no new turns until it
answers again, and the config and builder helpers refuse what cannot be placed.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from test_api import light_source, user
from test_turns import FAST, DyingStream, collect, one_terminal, settled

from deployments.app import num_groups, scaling_options, stage_names
from deployments.config import AppConfig
from deployments.ingress.server import IngressServer
from deployments.stages.code2wav import Code2WavServer
from deployments.stages.placement import PlacementError
from deployments.stages.talker import TalkerServer
from deployments.stages.thinker import ThinkerServer
from deployments.wire import AudioChunk, Done, Error
from fakes import FakeCode2WavEngine, FakeTalkerEngine, FakeThinkerEngine, LocalHandle

SPEECH = {"messages": user("hi"), "modalities": ["text", "audio"], "max_tokens": 16}
TEXT = {"messages": user("hi"), "max_tokens": 6}


@pytest.fixture(scope="module")
def source():
    return light_source()


def two_groups(cfg: dict, source) -> tuple[IngressServer, list[dict[str, object]]]:
    servers, handles = [], ([], [], [])
    for _ in range(2):
        c2w = Code2WavServer(cfg, engine_cls=FakeCode2WavEngine, source=source)
        talker = TalkerServer(cfg, LocalHandle(c2w), engine_cls=FakeTalkerEngine, source=source)
        thinker = ThinkerServer(cfg, LocalHandle(talker), engine_cls=FakeThinkerEngine,
                                source=source)
        servers.append({"thinker": thinker, "talker": talker, "code2wav": c2w})
        for hs, srv in zip(handles, (thinker, talker, c2w)):
            hs.append(LocalHandle(srv))
    return IngressServer(cfg, *handles, source=source), servers


def test_turns_spread_over_groups_and_stay_in_their_group(source):
    cfg = {"capacity": 2, "limits": {"max_tokens": 64},
           "thinker": {"engine": {"step_delay_s": 0.01}}}

    async def main():
        ingress, servers = two_groups(cfg, source)
        # Count, per group, the turns each stage saw: every hop of a turn lands in one group.
        seen = [{k: set() for k in s} for s in servers]
        for g, group in enumerate(servers):
            for name, method in (("thinker", "generate"), ("talker", "session"),
                                 ("code2wav", "stream")):
                srv = group[name]
                orig = getattr(srv, method)

                def spy(*a, orig=orig, g=g, name=name, **k):
                    rid = a[0].request_id if name == "thinker" else a[0]
                    seen[g][name].add(rid)
                    return orig(*a, **k)
                setattr(srv, method, spy)
        evs = await asyncio.gather(*(collect(ingress, SPEECH) for _ in range(8)),
                                   *(collect(ingress, TEXT) for _ in range(2)))
        return ingress, evs, seen, await settled_ingress(ingress)

    ingress, evs, seen, st = asyncio.run(main())
    for e in evs:
        assert isinstance(one_terminal(e), Done), e[-2:]
    assert all(any(isinstance(x, AudioChunk) for x in e) for e in evs[:8])
    turns = [g["turns"] for g in st["groups"]]
    assert sum(turns) == 10 and min(turns) >= 4, st["groups"]  # both groups took turns
    for g in seen:
        # a speech turn opened its Talker and Code2Wav streams in the group of its Thinker
        assert g["talker"] == g["code2wav"] and g["talker"] <= g["thinker"], g
    assert not (seen[0]["thinker"] & seen[1]["thinker"])
    assert st["idle"] and not st["leaks"], st
    assert set(st["stages"]) == {f"{n}-g{i}" for i in range(2)
                                 for n in ("thinker", "talker", "code2wav")}
    # each group's window is its own: at most 2 speech turns in each at once
    assert all(g["window"]["peak_active"] <= 2 for g in st["groups"]), st["groups"]


def test_a_burst_of_turns_routes_on_what_each_group_was_given(source):
    """One turn is in g0's window; then 7 more are routed in one tick. Each turn enters
    its group's window in the same step as its routing, so the next routing decision sees
    it, and the burst splits 4/4 instead of piling onto the group whose window looked
    empty."""
    from deployments.ingress.schemas import ChatCompletionRequest

    cfg = {"capacity": 4, "limits": {"max_tokens": 64},
           "thinker": {"engine": {"step_delay_s": 0.01}}}

    async def main():
        ingress, _ = two_groups(cfg, source)
        turns = [await ingress.prepare(ChatCompletionRequest(**SPEECH)) for _ in range(8)]
        runs = [ingress.turns.run(t) for t in turns]
        first = [asyncio.ensure_future(runs[0].__anext__())]
        for _ in range(5):
            await asyncio.sleep(0)
        assert ingress.groups[0].window.active == 1
        first += [asyncio.ensure_future(r.__anext__()) for r in runs[1:]]  # no yield between
        for _ in range(5):
            await asyncio.sleep(0)
        placed = [g.turns for g in ingress.groups]
        evs = await asyncio.gather(*(_rest(r, f) for r, f in zip(runs, first)))
        return placed, evs, await settled_ingress(ingress)

    placed, evs, st = asyncio.run(main())
    assert placed == [4, 4], placed
    for e in evs:
        assert isinstance(one_terminal(e), Done), e[-2:]
    assert st["idle"] and not st["leaks"], st


async def _rest(gen, first) -> list:
    return [await first, *[ev async for ev in gen]]


async def settled_ingress(ingress: IngressServer) -> dict:
    return await settled(SimpleNamespace(ingress=ingress))  # settled reads `local.ingress`


class DeadTalker(DyingStream):
    """The session stream dies, and the replica answers nothing until `restarted`."""

    restarted = False

    @property
    def stats(self):
        outer = self

        class _M:
            async def remote(self):
                if not outer.restarted:
                    raise RuntimeError("ActorDiedError: The actor died unexpectedly")
                return await outer.inner.stats.remote()
        return _M()


def test_a_group_whose_stage_died_gets_no_turns_until_it_answers(source):
    cfg = {"capacity": 2, "limits": {"max_tokens": 64}, "timeouts": FAST,
           "thinker": {"engine": {"step_delay_s": 0.01}}}

    async def main():
        ingress, _ = two_groups(cfg, source)
        g0 = ingress.groups[0]
        dead = DeadTalker(g0.stages.talker, "session", after=1)
        g0.stages.talker = dead
        first = await collect(ingress, SPEECH)  # lands on g0 (a tie goes to the first group)
        down = g0.down
        during = [await collect(ingress, SPEECH) for _ in range(3)]
        turns_g0 = g0.turns
        dead.restarted = True  # Serve's new replica is up
        for _ in range(100):  # the probe finds g0's stages answering
            if not g0.down:
                break
            await asyncio.sleep(0.02)
        back = not g0.down
        after = await asyncio.gather(*(collect(ingress, SPEECH) for _ in range(4)))
        return first, down, during, turns_g0, back, after, g0.turns, await settled_ingress(
            ingress)

    first, down, during, turns_g0, back, after, turns_end, st = asyncio.run(main())
    err = one_terminal(first)
    assert isinstance(err, Error) and err.reason == "stage_unavailable", err
    assert down and turns_g0 == 1  # the three turns while it was down went to g1
    assert all(isinstance(one_terminal(e), Done) for e in during)
    assert back and turns_end > turns_g0  # it serves again
    assert all(isinstance(one_terminal(e), Done) for e in after)
    assert st["idle"] and not st["leaks"], st


def test_groups_config_and_names(source):
    assert AppConfig().groups == 1
    assert AppConfig.model_validate({"groups": "auto"}).groups == "auto"
    for bad in (0, -1, "two"):
        with pytest.raises(ValueError):
            AppConfig.model_validate({"groups": bad})
    assert stage_names(0, 1) == {"thinker": "Thinker", "talker": "Talker",
                                 "code2wav": "Code2Wav"}
    assert stage_names(1, 2)["talker"] == "Talker-g1"
    # without GPUs (no Ray here): auto = one group; a number is taken as is
    assert num_groups(AppConfig.model_validate({"groups": "auto"}), gpu=False) == 1
    assert num_groups(AppConfig.model_validate({"groups": 3}), gpu=False) == 3
    with pytest.raises(ValueError, match="handle per group"):
        IngressServer({}, [object(), object()], [object()], [object()], source=source)


def test_the_builder_pins_each_groups_stages_to_its_reserved_gpu(monkeypatch):
    """build_omni_app with 2 groups on GPUs: each group's three deployments take their
    fractions of that group's placement-group GPU (tests/test_placement.py proves on a Ray
    cluster with 2 logical GPUs that such replicas share one GPU id)."""
    from deployments.app import build_omni_app
    from deployments.stages import placement

    calls = []

    def fake(n, fractions, *, prefix, gpu):
        calls.append((n, dict(fractions), prefix, gpu))
        if not gpu:
            return [{k: {} for k in fractions} for _ in range(n)]
        return [{k: {"num_gpus": 0, "resources": {f"GPU_group_pg{g}": f}}
                 for k, f in fractions.items()} for g in range(n)]

    monkeypatch.setattr(placement, "group_placement", fake)
    monkeypatch.setattr(placement, "gpu_count", lambda cluster=None: 2 if cluster is None else 0)
    app = build_omni_app({"groups": 2}, use_gpu=True)
    assert calls == [(2, {"thinker": 0.55, "talker": 0.15, "code2wav": 0.2}, "omniray", True)]
    _, thinkers, talkers, code2wavs = app._bound_deployment.init_args
    for g in range(2):
        for stage, dep in (("thinker", thinkers[g]), ("talker", talkers[g]),
                           ("code2wav", code2wavs[g])):
            d = dep._bound_deployment
            assert d.name == stage_names(g, 2)[stage]
            opts = d.ray_actor_options
            assert opts["num_gpus"] == 0 and list(opts["resources"]) == [f"GPU_group_pg{g}"]
    # one group keeps plain fractions: nothing is reserved
    calls.clear()
    one = build_omni_app({}, use_gpu=True)._bound_deployment.init_args
    assert calls == [(1, {"thinker": 0.55, "talker": 0.15, "code2wav": 0.2}, "omniray", False)]
    assert one[1]._bound_deployment.ray_actor_options["num_gpus"] == 0.55


def test_engine_sections_fail_in_the_builder_and_the_yaml_ships_the_code_defaults():
    """A bad engine key fails build_omni_app (before any actor starts), and serve_config.yaml
    ships what the app runs with no config at all: its settings and its engine configs."""
    from pathlib import Path

    import yaml

    from deployments.app import build_omni_app, engine_configs

    with pytest.raises(ValueError, match="unknown engine settings.*max_num_seq"):
        build_omni_app({"thinker": {"engine": {"llm": {"max_num_seq": 4}}}}, use_gpu=False)
    with pytest.raises(ValueError, match="talker.engine"):
        build_omni_app({"talker": {"engine": {"no_such_knob": 1}}}, use_gpu=False)

    shipped = yaml.safe_load(Path(__file__).parents[1].joinpath("serve_config.yaml").read_text())
    cfg = AppConfig.model_validate(shipped["applications"][0]["args"])
    bare = AppConfig()
    assert engine_configs(cfg) == engine_configs(bare)
    strip = {s: {"engine"} for s in ("thinker", "talker", "code2wav")}
    assert cfg.model_dump(exclude=strip) == bare.model_dump(exclude=strip)
    # a partial stage section keeps the stage's other defaults
    partial = AppConfig.model_validate({"code2wav": {"engine": {"slot_prompt_frames": 600}}})
    assert partial.code2wav.engine == {"slot_prompt_frames": 600}
    assert partial.code2wav.num_gpus == 0.2 and partial.code2wav.memory_fraction == 0.23


def test_a_reference_voice_fits_a_code2wav_slot():
    """limits.max_ref_audio_seconds may not outgrow a slot's voice prompt (50 frames a
    second): such a voice would be accepted by the ingress and refused by Code2Wav."""
    with pytest.raises(ValueError, match="slot_prompt_frames"):
        AppConfig.model_validate({"code2wav": {"engine": {"slot_prompt_frames": 400}}})
    fits = {"limits": {"max_ref_audio_seconds": 8},
            "code2wav": {"engine": {"slot_prompt_frames": 400}}}
    assert AppConfig.model_validate(fits).limits.max_ref_audio_seconds == 8


def test_capacity_sets_every_stages_slots_and_only_there():
    """`capacity` sets each stage's slot count, `duplex.max_sessions` the Thinker's guest
    rows, and neither is set in an `engine:` section."""
    from deployments.app import engine_configs

    configs = engine_configs(AppConfig.model_validate({"capacity": 3}))
    assert configs["thinker"].llm.max_num_seqs == 3
    assert configs["talker"].max_streams == 3 and configs["code2wav"].max_streams == 3
    assert AppConfig().capacity == 8
    for args in ({"thinker": {"engine": {"llm": {"max_num_seqs": 4}}}},
                 {"talker": {"engine": {"max_streams": 4}}},
                 {"code2wav": {"engine": {"max_streams": 4}}}):
        with pytest.raises(ValueError, match="follows from capacity"):
            AppConfig.model_validate(args)
    # the Thinker's decode graphs take every ingress replica's duplex sessions' rows
    cfg = AppConfig.model_validate({"capacity": 4, "duplex": {"max_sessions": 16},
                                    "ingress": {"num_replicas": 2}})
    assert engine_configs(cfg)["thinker"].llm.max_guest_rows == 32
    with pytest.raises(ValueError, match="follows from duplex.max_sessions"):
        AppConfig.model_validate({"thinker": {"engine": {"llm": {"max_guest_rows": 4}}}})
    with pytest.raises(ValueError, match="capacity"):
        AppConfig.model_validate({"capacity": 0})


def test_ingress_replicas_split_each_groups_window(source):
    """Several ingress replicas never overfill a group: each admits its share of the window."""
    cfg = AppConfig.model_validate({"capacity": 8, "ingress": {"num_replicas": 3}})
    assert cfg.window_per_ingress() == 2  # 3 x 2 <= 8
    with pytest.raises(ValueError, match="at least ingress.num_replicas"):
        AppConfig.model_validate({"capacity": 2, "ingress": {"num_replicas": 3}})
    ingress, _ = two_groups({"capacity": 8, "ingress": {"num_replicas": 2}}, source)
    assert [g.window.size for g in ingress.groups] == [4, 4]


def test_an_autoscaled_group_wakes_when_the_windows_fill_and_sleeps_when_idle(source):
    cfg = {
        "capacity": 2,
        "limits": {"max_tokens": 64},
        "max_groups": 2,
        "min_groups": 1,
        "group_idle_s": 0.3,
        "thinker": {"engine": {"step_delay_s": 0.02}},  # a turn holds its slot >= 1.3 s
    }

    async def main():
        ingress, _ = two_groups(cfg, source)
        g0, g1 = ingress.groups
        start = (g1.asleep, g1.scalable, g0.scalable)
        asleep_stats = await ingress.stats()
        two = await asyncio.gather(*(collect(ingress, SPEECH) for _ in range(2)))
        quiet = g1.turns, g1.wakes  # two turns fit g0's window: nothing woke

        # Eight, 60 ms apart (g0's turns hold their slots throughout): the third finds g0's
        # window full and wakes g1; the turns that arrive once it is awake go there (the
        # wake has ~0.3 s before the last ones arrive, also on a loaded machine).
        async def later(i: int) -> list:
            await asyncio.sleep(0.06 * i)
            return await collect(ingress, SPEECH)

        eight = await asyncio.gather(*(later(i) for i in range(8)))
        woke = g1.wakes, g1.turns
        await asyncio.sleep(0.4)  # past group_idle_s with nothing in flight
        late = await collect(ingress, SPEECH)
        return (
            start,
            asleep_stats,
            two,
            quiet,
            eight,
            woke,
            late,
            g1.asleep,
            g1.turns,
            await settled_ingress(ingress),
        )

    start, asleep_stats, two, quiet, eight, woke, late, asleep_end, g1_turns, st = asyncio.run(
        main()
    )
    assert start == (True, True, False)
    # a sleeping group's stages are not called (a call would wake it)
    assert "thinker-g1" not in asleep_stats["stages"] and "thinker-g0" in asleep_stats["stages"]
    assert all(isinstance(one_terminal(e), Done) for e in two + eight + [late])
    assert quiet == (0, 0)
    assert woke[0] == 1 and woke[1] >= 2, woke  # one wake, and g1 then took turns
    assert asleep_end and g1_turns == woke[1]  # idle: asleep again, the late turn went to g0
    assert st["groups"][1]["asleep"] and st["idle"] and not st["leaks"], st


def test_autoscaled_groups_config():
    with pytest.raises(ValueError, match="either groups or"):
        AppConfig.model_validate({"groups": 2, "max_groups": 2})
    with pytest.raises(ValueError, match="at least min_groups"):
        AppConfig.model_validate({"max_groups": 1, "min_groups": 2})
    cfg = AppConfig.model_validate({"max_groups": "auto", "min_groups": 2})
    with pytest.raises(PlacementError, match="min_groups"):
        num_groups(cfg, gpu=False)  # auto without GPUs is one group
    cfg = AppConfig.model_validate({"max_groups": 3, "min_groups": 1, "group_idle_s": 10})
    assert num_groups(cfg, gpu=False) == 3
    assert scaling_options(cfg, 0) == {}  # min_groups always run, as fixed replicas
    auto = scaling_options(cfg, 1)["autoscaling_config"]
    assert auto["min_replicas"] == 0 and auto["max_replicas"] == 1
    assert auto["initial_replicas"] == 0 and auto["downscale_to_zero_delay_s"] > 10
    assert scaling_options(AppConfig.model_validate({"groups": 2}), 1) == {}

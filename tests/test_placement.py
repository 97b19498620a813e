"""Stage groups on one GPU each (deployments/placement.py).

The Serve part needs a Ray with two logical GPUs, while the suite shares one local Ray with
one (conftest.py `ray_http`), and one process holds one Ray. So it runs this file as a
script in a fresh process (its own local Ray and Serve, shut down at its end) and asserts on
the JSON that the script prints: two groups of three replicas at the real fractions, what
each replica reports as its GPU, and the PGs' life (reuse, refusals, removal).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from deployments.stages.placement import (
    GroupPlacement,
    PlacementError,
    gpu_count,
    group_placement,
    resolve_groups,
    stage_options,
)

FRACTIONS = {"thinker": 0.55, "talker": 0.15, "code2wav": 0.2}
STAGES = {"thinker": "Thinker", "talker": "Talker", "code2wav": "Code2Wav"}
PREFIX = "placement-test"
ROOT = Path(__file__).resolve().parents[1]


# ---- without Ray ----


def test_stage_options_ask_for_the_groups_gpu_resource():
    placements = [GroupPlacement("p-g0", "aa01"), GroupPlacement("p-g1", "bb02")]
    opts = stage_options(placements, {**FRACTIONS, "cpu_only": 0.0})
    assert opts[0]["thinker"] == {"num_gpus": 0, "resources": {"GPU_group_aa01": 0.55}}
    assert opts[1]["talker"] == {"num_gpus": 0, "resources": {"GPU_group_bb02": 0.15}}
    assert opts[1]["code2wav"]["resources"] == {"GPU_group_bb02": 0.2}
    assert opts[0]["cpu_only"] == {}  # no GPU share: scheduled as before


def test_stage_options_refuse_an_overfull_group():
    with pytest.raises(PlacementError, match="1.10 > 1 GPU"):
        stage_options([GroupPlacement("p-g0", "aa")], {"thinker": 0.75, "talker": 0.35})


def test_without_gpus_nothing_is_reserved():
    assert (
        group_placement(2, FRACTIONS, gpu=False)
        == [{"thinker": {}, "talker": {}, "code2wav": {}}] * 2
    )


def test_auto_groups_is_the_whole_gpu_count():
    assert gpu_count({"GPU": 2.0, "CPU": 16.0}) == 2
    assert gpu_count({"GPU": 2.999999999999}) == 3  # float sums of fractional nodes
    assert gpu_count({"GPU": 1.5}) == 1
    assert resolve_groups("auto", {"GPU": 8.0}) == 8
    assert resolve_groups("auto", {"CPU": 2.0}) == 1  # a CPU cluster still runs one group
    assert resolve_groups(2, {"GPU": 2.0}) == 2
    assert resolve_groups(3, {"CPU": 2.0}) == 3  # no GPUs: groups share the CPUs


@pytest.mark.parametrize(
    "groups,match",
    [
        (3, "needs one whole GPU per group but the cluster has 2"),
        (0, "positive integer"),
        ("two", "positive integer"),
        (True, "positive integer"),
    ],
)
def test_resolve_groups_refuses(groups, match):
    with pytest.raises(PlacementError, match=match):
        resolve_groups(groups, {"GPU": 2.0})


# ---- with Ray Serve, in a fresh process ----


def _probe() -> dict[str, Any]:
    """Run in the child: deploy 2 groups x 3 stages through the placement options."""
    import ray
    from ray import serve

    from deployments.stages.placement import ensure_group_placements, remove_group_placements

    ray.init(
        address="local",
        num_cpus=2,
        num_gpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=128 * 2**20,
    )
    out: dict[str, Any] = {}
    try:
        serve.start(proxy_location="Disabled")
        first = ensure_group_placements(2, prefix=PREFIX)
        again = ensure_group_placements(2, prefix=PREFIX)  # a rebuild, or the task's retry
        out["reused"] = [p.pg_id for p in first] == [p.pg_id for p in again]
        out["pg_names"] = sorted(
            t["name"] for t in ray.util.placement_group_table().values() if t["state"] != "REMOVED"
        )
        options = group_placement(2, FRACTIONS, prefix=PREFIX)
        out["resources"] = [p.resource for p in first]

        class Report:
            def where(self) -> dict[str, Any]:
                return {
                    "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
                    "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                    "node": ray.get_runtime_context().get_node_id(),
                }

        class Probe:
            def __init__(self, **handles: Any) -> None:
                self.handles = handles

            async def __call__(self) -> dict[str, Any]:
                return {name: await h.where.remote() for name, h in self.handles.items()}

        handles = {}
        for g, group in enumerate(options):
            for stage, title in STAGES.items():
                name = f"{title}-g{g}"
                dep = serve.deployment(
                    Report, name=name, ray_actor_options={"num_cpus": 0, **group[stage]}
                )
                handles[name] = dep.bind()
        probe = serve.deployment(Probe, ray_actor_options={"num_cpus": 0}).bind(**handles)
        handle = serve.run(probe, name="placement", route_prefix=None)
        out["replicas"] = handle.remote().result(timeout_s=60)
        free = ray.available_resources()
        out["left"] = [free.get(r, 0.0) for r in out["resources"]]

        # Held PGs are never removed under live replicas (that would abort the raylet).
        out["while_held"] = remove_group_placements(PREFIX, timeout_s=0)
        out["still_serving"] = len(handle.remote().result(timeout_s=60))
        try:
            ensure_group_placements(3, prefix=PREFIX)
        except PlacementError as e:
            out["three_groups"] = str(e)
        try:  # both GPUs are reserved: a further prefix's group cannot be placed
            ensure_group_placements(1, prefix="placement-other", timeout_s=1)
        except PlacementError as e:
            out["no_free_gpu"] = str(e)
        out["other_left"] = [
            t["name"]
            for t in ray.util.placement_group_table().values()
            if t["name"].startswith("placement-other") and t["state"] != "REMOVED"
        ]

        serve.delete("placement")
        out["after_delete"] = remove_group_placements(PREFIX, timeout_s=30)
        for _ in range(100):  # removal returns before the raylet hands the GPUs back
            out["gpus_free"] = ray.available_resources().get("GPU", 0.0)
            if out["gpus_free"] == 2.0:
                break
            time.sleep(0.1)
    finally:
        serve.shutdown()
        ray.shutdown()
    return out


@pytest.fixture(scope="module")
def probe() -> dict[str, Any]:
    pytest.importorskip("ray.serve")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, __file__],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1])


def test_each_group_shares_one_gpu_and_groups_do_not(probe):
    replicas = probe["replicas"]
    assert len(replicas) == 6
    gpus = []
    for g in range(2):
        seen = {
            (replicas[f"{t}-g{g}"]["cuda"], tuple(replicas[f"{t}-g{g}"]["gpu_ids"]))
            for t in STAGES.values()
        }
        assert len(seen) == 1, (g, seen)
        cuda, ids = seen.pop()
        assert len(ids) == 1 and cuda == ids[0]
        gpus.append(cuda)
    assert sorted(gpus) == ["0", "1"]


def test_the_fractions_come_out_of_each_groups_reserved_gpu(probe):
    # 1 - (0.55 + 0.15 + 0.2) of each group's bundle is left.
    assert probe["left"] == pytest.approx([0.1, 0.1])


def test_placement_groups_are_reused_by_name(probe):
    assert probe["reused"]
    assert probe["pg_names"] == [f"{PREFIX}-g0", f"{PREFIX}-g1"]


def test_too_many_groups_fail_clearly_and_leave_nothing(probe):
    assert "3 stage groups need one whole GPU each but the cluster has 2" in probe["three_groups"]
    assert "placement-other-g0: no whole GPU became free in 1 s" in probe["no_free_gpu"]
    assert probe["other_left"] == []


def test_removal_waits_for_the_replicas(probe):
    assert probe["while_held"] == [[], [f"{PREFIX}-g0", f"{PREFIX}-g1"]]
    assert probe["still_serving"] == 6
    assert probe["after_delete"] == [[f"{PREFIX}-g0", f"{PREFIX}-g1"], []]
    assert probe["gpus_free"] == 2.0


if __name__ == "__main__":
    print(json.dumps(_probe()))

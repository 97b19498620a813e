"""Stage groups on one physical GPU each: one placement group (PG) per group.

A group is one replica of each GPU stage, and its three replicas must share one GPU. Plain
fractional `num_gpus` cannot promise that (Ray fills GPUs first-fit, so a second group's
Talker can land beside the first group's Thinker), nor can per-GPU custom resources (they
pick a node's share, not the GPU id that fractional `num_gpus` is served from). So each
group reserves one whole GPU as a single-bundle PG, `{"GPU": 1}`, and its replicas ask for
fractions of that PG's GPU resource, `GPU_group_<pg id>`, in `ray_actor_options["resources"]`
(Serve refuses `scheduling_strategy` there). Ray serves that resource from the bundle's one
GPU instance, and counts it as a GPU: `ray.get_gpu_ids()` and CUDA_VISIBLE_DEVICES name that
GPU in the replica. The indexed name `GPU_group_0_<pg id>` schedules as well but hands the
actor no GPU id, so it is not used.

The PGs are detached and named `<prefix>-g<i>`, so they outlive the task that builds the
app under `serve run serve_config.yaml` and a rebuild (or the task's retry) finds and reuses
them instead of reserving more GPUs. Removing a PG while a replica holds its resource
aborts the raylet (Ray kills only actors scheduled *into* a PG, not actors that ask for its
resource), so removal here waits until the bundle's GPU is wholly free and leaves a PG that
is still held.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

BUNDLE: dict[str, float] = {"GPU": 1.0}
STRATEGY = "STRICT_PACK"
_LIVE = ("PENDING", "PREPARED", "CREATED", "RESCHEDULING")


class PlacementError(RuntimeError):
    """The groups cannot be placed (too few GPUs, or a PG of ours that is not ours)."""


@dataclass(frozen=True)
class GroupPlacement:
    """One group's reserved GPU: the PG's name and id, and the resource its replicas ask for."""

    name: str
    pg_id: str  # hex

    @property
    def resource(self) -> str:
        # The bundle-index-free name: the one Ray maps to a GPU id for the actor.
        return f"GPU_group_{self.pg_id}"

    def actor_options(self, fraction: float) -> dict[str, Any]:
        """Extra ray_actor_options of a replica taking `fraction` of this group's GPU. The
        whole GPU is already reserved by the PG, so `num_gpus` must not ask for more."""
        return {"num_gpus": 0, "resources": {self.resource: fraction}}


def group_name(prefix: str, group: int) -> str:
    return f"{prefix}-g{group}"


def stage_options(
    placements: list[GroupPlacement], fractions: Mapping[str, float]
) -> list[dict[str, dict[str, Any]]]:
    """Per group, per stage: the ray_actor_options to merge over the stage's own (a stage
    with no GPU share gets none). Raises if one group's fractions overfill its GPU."""
    total = sum(fractions.values())
    if total > BUNDLE["GPU"] + 1e-9:
        raise PlacementError(f"one group's stage GPU fractions add up to {total:.2f} > 1 GPU")
    return [
        {stage: (p.actor_options(f) if f > 0 else {}) for stage, f in fractions.items()}
        for p in placements
    ]


def gpu_count(cluster: Mapping[str, float] | None = None) -> int:
    """Whole GPUs in the cluster (`ray.cluster_resources()` unless given)."""
    if cluster is None:
        import ray

        cluster = ray.cluster_resources() if ray.is_initialized() else {}
    return math.floor(cluster.get("GPU", 0.0) + 1e-9)


def resolve_groups(groups: int | str, cluster: Mapping[str, float] | None = None) -> int:
    """`groups: auto` = one group per whole GPU (at least one, so a CPU cluster still runs
    one group); an explicit count must not exceed the GPUs when the cluster has any."""
    gpus = gpu_count(cluster)
    if groups == "auto":
        return max(1, gpus)
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise PlacementError(f"groups must be a positive integer or 'auto', got {groups!r}")
    if gpus and groups > gpus:
        raise PlacementError(
            f"groups: {groups} needs one whole GPU per group but the cluster has {gpus}"
        )
    return groups


def _ours(prefix: str) -> dict[str, dict[str, Any]]:
    """Live PGs named `<prefix>-g<i>` in the whole cluster, by name. The table is global, so
    PGs made by the Serve build task (namespace "serve") are found from any driver."""
    from ray.util import placement_group_table

    pattern = f"{prefix}-g"
    return {
        t["name"]: t
        for t in placement_group_table().values()
        if t["name"].startswith(pattern)
        and t["name"][len(pattern) :].isdigit()
        and t["state"] in _LIVE
    }


def _handle(pg_id: str) -> Any:
    import ray
    from ray.util.placement_group import PlacementGroup

    return PlacementGroup(ray.PlacementGroupID.from_hex(pg_id))


def ensure_group_placements(
    num_groups: int, *, prefix: str = "omniray", timeout_s: float = 60.0
) -> list[GroupPlacement]:
    """Reserve (or find, under the same names) one GPU per group and wait until each is
    placed. On failure the PGs this call created are removed again (they hold nothing yet)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    gpus = gpu_count()
    if num_groups > gpus:
        raise PlacementError(
            f"{num_groups} stage groups need one whole GPU each but the cluster has {gpus}"
        )
    existing = _ours(prefix)
    created: list[Any] = []
    placements: list[GroupPlacement] = []
    for g in range(num_groups):
        name = group_name(prefix, g)
        row = existing.get(name)
        if row is not None:
            if list(row["bundles"].values()) != [BUNDLE] or row["strategy"] != STRATEGY:
                raise PlacementError(
                    f"placement group {name!r} exists with bundles {row['bundles']} / "
                    f"{row['strategy']}, not {BUNDLE} / {STRATEGY}; remove it or pick another "
                    f"prefix"
                )
            placements.append(GroupPlacement(name, row["placement_group_id"]))
            continue
        pg = placement_group([dict(BUNDLE)], strategy=STRATEGY, name=name, lifetime="detached")
        created.append(pg)
        placements.append(GroupPlacement(name, pg.id.hex()))
    deadline = time.monotonic() + timeout_s
    for p in placements:
        ready = _handle(p.pg_id).ready()
        try:
            ray.get(ready, timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            for pg in created:
                remove_placement_group(pg)
            free = ray.available_resources().get("GPU", 0.0)
            raise PlacementError(
                f"{p.name}: no whole GPU became free in {timeout_s:.0f} s for {num_groups} "
                f"stage groups ({gpus} GPUs in the cluster, {free:.2f} unreserved)"
            ) from None
    return placements


def group_placement(
    num_groups: int,
    fractions: Mapping[str, float],
    *,
    prefix: str = "omniray",
    gpu: bool = True,
    timeout_s: float = 60.0,
) -> list[dict[str, dict[str, Any]]]:
    """Per group, the extra ray_actor_options of each stage (`{"thinker": {...}, ...}`),
    reserving the groups' GPUs first. Without GPUs (`gpu=False`) nothing is reserved and
    every stage gets no extra options. Stale groups past `num_groups` are left alone: their
    replicas may still run until Serve replaces the app; `remove_group_placements` frees
    them once they are idle."""
    if not gpu:
        return [{stage: {} for stage in fractions} for _ in range(num_groups)]
    return stage_options(
        ensure_group_placements(num_groups, prefix=prefix, timeout_s=timeout_s), fractions
    )


def remove_group_placements(
    prefix: str = "omniray", *, keep: int = 0, timeout_s: float = 30.0
) -> tuple[list[str], list[str]]:
    """Remove this prefix's PGs from group `keep` on, each once no replica holds any of its
    GPU (waiting up to `timeout_s` for replicas that are shutting down). Returns (removed,
    still held); a held PG is left in place, never removed under a live replica."""
    import ray
    from ray.util.placement_group import remove_placement_group

    todo = {
        name: row for name, row in _ours(prefix).items() if int(name[len(prefix) + 2 :]) >= keep
    }
    removed: list[str] = []
    deadline = time.monotonic() + timeout_s
    while todo:
        free = ray.available_resources()
        for name, row in list(todo.items()):
            p = GroupPlacement(name, row["placement_group_id"])
            # Not yet placed: nothing can hold it. Placed: free only when the bundle's GPU
            # is back whole.
            if row["state"] != "CREATED" or free.get(p.resource, 0.0) >= BUNDLE["GPU"] - 1e-9:
                remove_placement_group(_handle(p.pg_id))
                removed.append(name)
                del todo[name]
        if not todo or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    return sorted(removed), sorted(todo)


def main(argv: list[str] | None = None) -> None:
    """`python -m deployments.stages.placement remove [--prefix P]`: free the groups' GPUs after
    `serve shutdown` / `serve delete` (Serve has no hook for an app's deletion)."""
    import argparse

    import ray

    ap = argparse.ArgumentParser(prog="python -m deployments.stages.placement")
    ap.add_argument("command", choices=["list", "remove"])
    ap.add_argument("--prefix", default="omniray")
    ap.add_argument("--address", default="auto")
    args = ap.parse_args(argv)
    ray.init(address=args.address, log_to_driver=False)
    if args.command == "list":
        for name, row in sorted(_ours(args.prefix).items()):
            print(name, row["placement_group_id"], row["state"])
        return
    removed, held = remove_group_placements(args.prefix)
    print(f"removed {removed or 'none'}; still held by replicas: {held or 'none'}")


if __name__ == "__main__":
    main()

"""The application builder: `serve run serve_config.yaml` imports `build_app(args)`.

    Ingress ──handles──> Thinker ──feed──> Talker ──push──> Code2Wav     (group 0)
       │  └───────────────handles (open / stream / abort)────────┘
       └──> Thinker-g1 ──> Talker-g1 ──> Code2Wav-g1 ...                   (groups: N)

A group is one replica of each stage, bound to its own handles, so every hop of a turn
stays in the group that holds its stream state; the ingress picks a group per turn.

The server classes are plain (undecorated); this module turns them into deployments.
GPU fractions are applied only when the cluster has GPUs, so the same config runs on a
CPU-only machine. Engine classes can be injected (tests use small fakes), as in Ray
Serve LLM's builders. One `capacity` sizes each group: the ingress's window and every
stage's slot count (AppConfig.engine_settings).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ray import serve
from ray.serve import Application

from deployments.config import AppConfig, StageSettings, dataclass_from_dict
from deployments.ingress.server import IngressServer
from deployments.stages.code2wav import Code2WavServer
from deployments.stages.talker import TalkerServer
from deployments.stages.thinker import ThinkerServer

log = logging.getLogger(__name__)


def cluster_has_gpu() -> bool:
    import ray

    if not ray.is_initialized():
        return False
    return ray.cluster_resources().get("GPU", 0) > 0


def _options(name: str, s: StageSettings, gpu: bool,
             extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    actor: dict[str, Any] = {"num_cpus": s.num_cpus}
    if gpu and s.num_gpus > 0:
        actor["num_gpus"] = s.num_gpus
    actor.update(extra or {})
    return {"name": name, "num_replicas": s.num_replicas,
            "max_ongoing_requests": s.max_ongoing_requests, "ray_actor_options": actor,
            "health_check_period_s": s.health_check_period_s,
            "health_check_timeout_s": s.health_check_timeout_s}


def num_groups(cfg: AppConfig, gpu: bool) -> int:
    """The groups the app binds: `groups`, or `max_groups` when autoscaled; auto = one per
    whole GPU in the cluster (1 without GPUs). With GPUs, each group needs a GPU of its own."""
    from deployments.stages.placement import PlacementError, resolve_groups

    n = resolve_groups(cfg.max_groups if cfg.autoscaled else cfg.groups, None if gpu else {})
    if cfg.autoscaled and cfg.min_groups > n:
        raise PlacementError(f"min_groups ({cfg.min_groups}) is more than the {n} groups "
                             f"max_groups allows")
    return n


# Serve takes an idle autoscaled group's replicas down this long after the ingress stopped
# giving it turns, so a turn routed just before the ingress's cut-off never meets a replica
# that is shutting down.
DOWNSCALE_MARGIN_S = 30.0


def scaling_options(cfg: AppConfig, group: int) -> dict[str, Any]:
    """Deployment options of one group's stage replicas beside `_options`' own: a fixed
    replica, or, for an autoscaled group past min_groups, 0 or 1 replica under Serve's own
    autoscaler. The ingress wakes such a group with calls that queue at its handles (Serve
    scales from zero on queued requests) and stops sending it turns after group_idle_s;
    with no request in flight Serve then takes the replica down."""
    if not cfg.autoscaled or group < cfg.min_groups:
        return {}
    delay = cfg.group_idle_s + DOWNSCALE_MARGIN_S
    return {"num_replicas": "auto", "autoscaling_config": {
        "min_replicas": 0, "max_replicas": 1, "initial_replicas": 0,
        "target_ongoing_requests": 1, "upscale_delay_s": 0.0,
        "downscale_delay_s": delay, "downscale_to_zero_delay_s": delay}}


def engine_configs(cfg: AppConfig, stages: tuple[str, ...] = ("thinker", "talker", "code2wav")
                   ) -> dict[str, Any]:
    """Each stage's `engine:` section as its real engine's frozen config, so a bad key or
    value fails here, before any actor starts (the stages validate it again at start)."""
    from deployments.config import dataclass_from_dict
    from pipeline.code2wav.engine import Code2WavEngineConfig
    from pipeline.talker.engine import TalkerEngineConfig
    from pipeline.thinker.engine import ThinkerEngineConfig

    classes = {"thinker": ThinkerEngineConfig, "talker": TalkerEngineConfig,
               "code2wav": Code2WavEngineConfig}
    return {stage: dataclass_from_dict(classes[stage], cfg.engine_settings(stage),
                                       f"{stage}.engine") for stage in stages}


def stage_names(group: int, groups: int) -> dict[str, str]:
    """Deployment names of one group's stages: the plain names for a single group."""
    suffix = f"-g{group}" if groups > 1 else ""
    return {k: f"{v}{suffix}" for k, v in
            (("thinker", "Thinker"), ("talker", "Talker"), ("code2wav", "Code2Wav"))}


def build_omni_app(cfg: AppConfig | dict | None = None, *, thinker_engine_cls: Any = None,
                   talker_engine_cls: Any = None, code2wav_engine_cls: Any = None,
                   use_gpu: bool | None = None) -> Application:
    """Bind the ingress and each group's three stage deployments. `use_gpu=None` asks the
    cluster. With several groups on GPUs, each group reserves a whole GPU (a placement group,
    deployments/stages/placement.py) and its replicas take their fractions of that GPU."""
    from deployments.stages.placement import group_placement

    cfg = AppConfig.model_validate(cfg or {})
    # the real engines' sections (fakes take their settings as they are)
    engine_configs(cfg, tuple(stage for stage, cls in (
        ("thinker", thinker_engine_cls), ("talker", talker_engine_cls),
        ("code2wav", code2wav_engine_cls)) if cls is None))
    gpu = cluster_has_gpu() if use_gpu is None else use_gpu
    n = num_groups(cfg, gpu)
    fractions = {k: s.num_gpus for k, s in cfg.stages().items()}
    # One group keeps plain fractions of the one GPU (nothing to pin it to).
    extras = group_placement(n, fractions, prefix=cfg.name, gpu=gpu and n > 1)
    args = cfg.model_dump()
    log.info("omniray: building app (%d group(s) of capacity %d, %d per ingress replica; GPU "
             "fractions %s)", n, cfg.capacity, cfg.window_per_ingress(), "on" if gpu else "off")
    thinkers, talkers, code2wavs = [], [], []
    for g in range(n):
        names = stage_names(g, n)
        extra = extras[g]

        def opts(stage: str, names=names, extra=extra, g=g) -> dict[str, Any]:
            return {**_options(names[stage], cfg.stages()[stage], gpu, extra.get(stage)),
                    **scaling_options(cfg, g)}

        code2wav = serve.deployment(Code2WavServer, **opts("code2wav")).bind(
            args, engine_cls=code2wav_engine_cls)
        talker = serve.deployment(TalkerServer, **opts("talker")).bind(
            args, code2wav, engine_cls=talker_engine_cls)
        thinker = serve.deployment(ThinkerServer, **opts("thinker")).bind(
            args, talker, engine_cls=thinker_engine_cls)
        thinkers.append(thinker)
        talkers.append(talker)
        code2wavs.append(code2wav)
    ing = cfg.ingress
    ingress = serve.deployment(
        serve.ingress()(IngressServer), name="Ingress", num_replicas=ing.num_replicas,
        max_ongoing_requests=ing.max_ongoing_requests,
        ray_actor_options={"num_cpus": ing.num_cpus},
    )
    if n == 1 and not cfg.autoscaled:
        return ingress.bind(args, thinkers[0], talkers[0], code2wavs[0])
    return ingress.bind(args, thinkers, talkers, code2wavs)


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Entry point for `serve_config.yaml` (`import_path: deployments.app:build_app`)."""
    return build_omni_app(AppConfig.model_validate(args or {}))

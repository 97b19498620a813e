"""The application builder: `serve run serve_config.yaml` imports `build_app(args)`.

    Ingress ──handles──> Thinker ──feed──> Talker ──push──> Code2Wav
       └───────────────handles (open / stream / abort)────────┘

The server classes are plain (undecorated); this module turns them into deployments.
GPU fractions are applied only when the cluster has GPUs, so the same config runs on a
CPU-only machine. Engine classes can be injected (tests use small fakes), as in Ray
Serve LLM's builders.
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve
from ray.serve import Application

from deployments.code2wav import Code2WavServer
from deployments.config import AppConfig, StageSettings
from deployments.ingress import IngressServer
from deployments.talker import TalkerServer
from deployments.thinker import ThinkerServer

log = logging.getLogger(__name__)


def cluster_has_gpu() -> bool:
    import ray

    if not ray.is_initialized():
        return False
    return ray.cluster_resources().get("GPU", 0) > 0


def _options(name: str, s: StageSettings, gpu: bool) -> dict[str, Any]:
    actor: dict[str, Any] = {"num_cpus": s.num_cpus}
    if gpu and s.num_gpus > 0:
        actor["num_gpus"] = s.num_gpus
    return {"name": name, "num_replicas": s.num_replicas,
            "max_ongoing_requests": s.max_ongoing_requests, "ray_actor_options": actor,
            "health_check_period_s": s.health_check_period_s,
            "health_check_timeout_s": s.health_check_timeout_s}


def build_omni_app(cfg: AppConfig | dict | None = None, *, thinker_engine_cls: Any = None,
                   talker_engine_cls: Any = None, code2wav_engine_cls: Any = None,
                   use_gpu: bool | None = None) -> Application:
    """Bind the four deployments. `use_gpu=None` asks the cluster."""
    cfg = AppConfig.model_validate(cfg or {})
    gpu = cluster_has_gpu() if use_gpu is None else use_gpu
    args = cfg.model_dump()
    log.info("omniray: building app (GPU fractions %s)", "on" if gpu else "off")
    code2wav = serve.deployment(Code2WavServer, **_options("Code2Wav", cfg.code2wav, gpu)).bind(
        args, engine_cls=code2wav_engine_cls)
    talker = serve.deployment(TalkerServer, **_options("Talker", cfg.talker, gpu)).bind(
        args, code2wav, engine_cls=talker_engine_cls)
    thinker = serve.deployment(ThinkerServer, **_options("Thinker", cfg.thinker, gpu)).bind(
        args, talker, engine_cls=thinker_engine_cls)
    ing = cfg.ingress
    ingress = serve.deployment(
        serve.ingress()(IngressServer), name="Ingress", num_replicas=ing.num_replicas,
        max_ongoing_requests=ing.max_ongoing_requests,
        ray_actor_options={"num_cpus": ing.num_cpus},
    )
    return ingress.bind(args, thinker, talker, code2wav)


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Entry point for `serve_config.yaml` (`import_path: deployments.app:build_app`)."""
    return build_omni_app(AppConfig.model_validate(args or {}))

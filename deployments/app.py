"""The application builder: `serve run serve_config.yaml` imports `build_app(args)`.

    Ingress ──handles──> Thinker ──feed──> Talker ──push──> Code2Wav
       └───────────────handles (open / stream / abort)────────┘

The server classes are plain (undecorated); this module turns them into deployments.
GPU fractions are applied only when the cluster has GPUs, so the same config runs on a
CPU-only machine. Engine classes can be injected (tests use small fakes), as in Ray
Serve LLM's builders. With `gpu_sharing: mps`, each GPU stage's replica starts with its MPS
client settings in its environment (`runtime_env.env_vars`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
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


# MPS client settings an operator may have set where the app is built; every client must
# use the daemon's pipe directory, so they travel to the replicas unchanged.
MPS_PASSTHROUGH = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


def mps_env_vars(cfg: AppConfig, s: StageSettings,
                 environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The MPS client environment of one GPU stage's replica (empty unless gpu_sharing is mps).

    The CUDA driver reads these when the process creates its context; Ray puts runtime_env
    env_vars in the worker process's environment before the process starts, so they are in
    place before any import touches CUDA."""
    if cfg.gpu_sharing != "mps":
        return {}
    env = {k: environ[k] for k in MPS_PASSTHROUGH if environ.get(k)}
    if s.mps_thread_percentage is not None:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(s.mps_thread_percentage)
    return env


def _options(name: str, s: StageSettings, gpu: bool, cfg: AppConfig) -> dict[str, Any]:
    actor: dict[str, Any] = {"num_cpus": s.num_cpus}
    if gpu and s.num_gpus > 0:  # a replica without a GPU share is not an MPS client
        actor["num_gpus"] = s.num_gpus
        env = mps_env_vars(cfg, s)
        if env:  # Serve merges these into the application's runtime_env
            actor["runtime_env"] = {"env_vars": env}
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
    log.info("omniray: building app (GPU fractions %s, gpu_sharing %s)",
             "on" if gpu else "off", cfg.gpu_sharing)
    code2wav = serve.deployment(
        Code2WavServer, **_options("Code2Wav", cfg.code2wav, gpu, cfg)).bind(
        args, engine_cls=code2wav_engine_cls)
    talker = serve.deployment(TalkerServer, **_options("Talker", cfg.talker, gpu, cfg)).bind(
        args, code2wav, engine_cls=talker_engine_cls)
    thinker = serve.deployment(ThinkerServer, **_options("Thinker", cfg.thinker, gpu, cfg)).bind(
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

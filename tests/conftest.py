"""Shared fixtures: the embedded default checkpoint (written once per cache folder)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # tiny matmuls: threads only add overhead on 2 cores
if not torch.cuda.is_available():
    # Triton kernels (pipeline/code2wav/pool_attention.py) run on CPU tensors in Triton's
    # interpreter; set before any kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_checkpoint():
    from pipeline.checkpoint import default_checkpoint

    return default_checkpoint()


@pytest.fixture(scope="session")
def tiny_source(tiny_checkpoint):
    from pipeline.checkpoint import ModelSource

    return ModelSource.open(str(tiny_checkpoint))


_RAY: dict[str, str] = {}


@pytest.fixture(scope="session")
def metrics_url(ray_http) -> str:
    """The session's Prometheus export (Ray's metrics agent on this node)."""
    return _RAY["metrics_url"]


def _free_port() -> int:
    """A free loopback port below the kernel's ephemeral range (32768-60999) and above Ray's
    worker ports (10002-19999): no outgoing connection is given it while Ray starts."""
    import random
    import socket

    for port in random.sample(range(20000, 32768), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port in 20000-32767")


@pytest.fixture(scope="session")
def ray_http():
    """One local Ray + Serve for the whole session (ray-notes.md), HTTP on a free loopback
    port; every Ray test file deploys its apps on it. Yields the HTTP base URL."""
    pytest.importorskip("ray.serve")
    import os

    import ray
    from ray import serve

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # The replicas import the fakes (tests/fakes.py) the apps are built with: tests/ on the
    # path of every worker this cluster starts (they inherit the driver's environment).
    here = str(Path(__file__).resolve().parent)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if here not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([here, *filter(None, paths)])
    metrics_port = _free_port()
    # One logical GPU: the main app's builder applies its GPU fractions (the scheduling path
    # of a GPU machine) while torch runs on the CPU; other apps are built with use_gpu=False.
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False,
             object_store_memory=384 * 2**20, _metrics_export_port=metrics_port)
    for attempt in range(3):  # a port found free can be taken before the proxy binds it
        port = _free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            break
        except ray.exceptions.RayTaskError as e:
            if "Failed to bind" not in str(e) or attempt == 2:
                raise
            serve.shutdown()
    base = f"http://127.0.0.1:{port}"
    _RAY["metrics_url"] = f"http://127.0.0.1:{metrics_port}/metrics"
    yield base
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_app(ray_http):
    """The main app (tests/apps.py APP_CONFIG: real engines, tiny default) at /, with the
    builder's GPU fractions applied on the session's one logical GPU."""
    import apps
    from ray import serve

    from deployments.app import build_omni_app

    serve.run(build_omni_app(apps.APP_CONFIG), name=apps.APP, route_prefix="/")
    yield ray_http


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> Path:
    """A checkpoint folder holding only the tiny token2wav assets (the embedded default's
    layout), written once for the Code2Wav tests; they read it, or copy it to change it."""
    from pipeline.code2wav.assets import tiny_code2wav_config, write_token2wav_assets

    root = tmp_path_factory.mktemp("ckpt")
    write_token2wav_assets(root / "assets" / "token2wav", tiny_code2wav_config(), seed=0)
    return root

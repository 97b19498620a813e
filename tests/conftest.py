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


@pytest.fixture(scope="session")
def ray_http():
    """One local Ray + Serve for the whole session (ray-notes.md), HTTP on a free loopback
    port; every Ray test file deploys its apps on it. Yields the HTTP base URL."""
    pytest.importorskip("ray.serve")
    import os
    import socket

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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # One logical GPU: the main app's builder applies its GPU fractions (the scheduling path
    # of a GPU machine) while torch runs on the CPU; other apps are built with use_gpu=False.
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False,
             object_store_memory=384 * 2**20, _metrics_export_port=metrics_port)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
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

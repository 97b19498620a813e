"""Shared fixtures: the embedded default checkpoint (written once per cache folder)."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)  # tiny matmuls: threads only add overhead on 2 cores


@pytest.fixture(scope="session")
def tiny_checkpoint():
    from pipeline.checkpoint import default_checkpoint

    return default_checkpoint()


@pytest.fixture(scope="session")
def tiny_source(tiny_checkpoint):
    from pipeline.checkpoint import ModelSource

    return ModelSource.open(str(tiny_checkpoint))

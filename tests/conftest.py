"""Shared fixtures: the embedded default checkpoint (written once per cache folder)."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_checkpoint():
    from pipeline.checkpoint import default_checkpoint

    return default_checkpoint()


@pytest.fixture(scope="session")
def tiny_source(tiny_checkpoint):
    from pipeline.checkpoint import ModelSource

    return ModelSource.open(str(tiny_checkpoint))

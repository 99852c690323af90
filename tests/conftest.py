"""Shared pytest fixtures: tiny random-weight checkpoints for every supported architecture."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# No GPU here: the triton attention backend's kernels run under Triton's interpreter on the CPU. Set
# before anything imports them (Triton reads it when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.helpers import ARCHS, hf_greedy, load_hf_model, make_tiny_model

__all__ = ["hf_greedy", "load_hf_model", "make_tiny_model"]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch -> folder of a tiny checkpoint (built once per test session, ~0.5 s each)."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_model(root / arch, arch) for arch in ARCHS}

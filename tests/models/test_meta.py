"""Modules built on the meta device with torch.nn.init's initialisers skipped (model_executor/meta.py)."""
from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn

from pagedllm.model_executor.meta import on_meta_device


def test_modules_made_inside_are_on_meta_and_no_initialiser_runs():
    outside = torch.zeros(8)
    with on_meta_device():
        linear, embedding = nn.Linear(4, 6), nn.Embedding(10, 4)
        nn.init.normal_(outside)  # skipped: it would write random values into a real tensor
        made = torch.ones(3)  # other factories still run, on the meta device
    assert linear.weight.is_meta and embedding.weight.is_meta and made.is_meta
    assert torch.count_nonzero(outside) == 0
    assert nn.init.normal_(torch.zeros(8)).abs().sum() > 0  # outside the context the initialiser runs again


def test_building_a_model_does_not_import_torch_dynamo():
    """On meta tensors normal_ / uniform_ run PyTorch's Python reference ops, whose first call imports
    torch._dynamo (~1 s of every process that loads a model)."""
    code = ("import sys\nfrom torch import nn\nfrom pagedllm.model_executor.meta import on_meta_device\n"
            "with on_meta_device():\n    nn.Sequential(nn.Embedding(64, 8), nn.Linear(8, 8))\n"
            "print('torch._dynamo' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"

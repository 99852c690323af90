"""The README's runnable code blocks (fenced as `bash runnable` / `python runnable`), run as written against a
temporary `pagedllm serve` of the demo model: only its address differs (a free port instead of 8000)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```(bash|python) runnable\n(.*?)^```", re.S | re.M)


def runnable_blocks() -> list[tuple[str, str]]:
    return BLOCK.findall(README.read_text())


def test_the_readme_has_runnable_blocks_and_names_what_the_repository_holds():
    text = README.read_text()
    assert len(runnable_blocks()) >= 3
    assert "../shared" not in text  # a clone has no such folder
    assert "pagedllm-demo" in text and "qwen2.5-0.5b" in text and "llama-3.1-8b" in text


@pytest.fixture(scope="module")
def readme_env(demo_server):
    """The server's address and an environment whose PATH finds this venv's `pagedllm` and `python`."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return demo_server.url.removeprefix("http://"), env


@pytest.mark.parametrize("index", range(len(runnable_blocks())))
def test_a_runnable_readme_block_runs_as_written(readme_env, index):
    address, env = readme_env
    language, code = runnable_blocks()[index]
    code = code.replace("127.0.0.1:8000", address)
    cmd = ["bash", "-euo", "pipefail", "-c", code] if language == "bash" else [sys.executable, "-c", code]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, f"{code}\nstdout:\n{run.stdout[-2000:]}\nstderr:\n{run.stderr[-3000:]}"
    assert '"error"' not in run.stdout, run.stdout[-2000:]

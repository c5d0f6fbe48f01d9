"""The README's code runs as written: every Python block in it is the text of a file in
`examples/`, and each example runs to completion on this machine (on a CPU: the reference
backend). Bugs these catch: a README snippet that names an API that changed or no longer exists,
a snippet edited without its example (or the reverse), an example that fails on a fresh CPU."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
NEEDS = {"huggingface.py": "transformers"}
"""Example -> the optional package it needs (skipped without it)."""


def readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)


def test_every_python_block_of_the_readme_is_an_example_file():
    blocks = readme_python_blocks()
    assert blocks, "the README shows no Python"
    texts = [path.read_text() for path in EXAMPLES]
    for block in blocks:
        assert any(block.strip() in text for text in texts), block[:200]


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_example_runs(example):
    needed = NEEDS.get(example.name)
    if needed is not None and importlib.util.find_spec(needed) is None:
        pytest.skip(f"needs {needed}")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("TRITON_INTERPRET", None)  # a user's shell: the CPU runs the reference backend
    done = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip(), "the example printed nothing"

"""Shared test set-up: GPU tests are skipped without CUDA; hypothesis profiles (HYPOTHESIS_PROFILE:
ci, the default; dev; long)."""

import os

import torch

# Without a GPU, Triton kernels run under the interpreter. It must be chosen before triton is
# imported anywhere.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=20, deadline=None)
# A fuzzing run to start by hand: fresh random examples each time, many of them.
settings.register_profile("long", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        reason, marks = (
            "an interpreter test (TRITON_INTERPRET is set only without a GPU)",
            ["interpreter"],
        )
    else:
        reason, marks = "needs a CUDA GPU", ["gpu", "multigpu"]
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if any(mark in item.keywords for mark in marks):
            item.add_marker(skip)

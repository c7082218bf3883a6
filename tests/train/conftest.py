"""Shared helpers: a tiny run that trains in about a second on one CPU thread."""

import pytest

TINY = [
    "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "4",
    "--eval-iters", "2", "--warmup", "2", "--log-every", "1", "--threads", "1", "--no-progress",
]  # fmt: skip


@pytest.fixture
def tiny() -> list[str]:
    return list(TINY)

"""Fixtures of the prompt-tool conformance tests: torch on one thread, and run-time tool registrations that a test may add to and gets
back unchanged (the random-weight tiny models are the root conftest's ``tiny_models``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from clova_train.tools import recipes


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread inside the test, as under ``make test``'s pytest-xdist workers (tests/conftest.py).

    The tiny models' operations are so small that a second thread's hand-offs cost more than they save, and on a
    busy 2-core host far more: this suite took 118 s on two threads there, 20 s on one."""
    from clova_train.tools.tiny_common import torch_threads

    with torch_threads(1):
        yield


@pytest.fixture
def restored_registry() -> Iterator[None]:
    """The run-time registrations as they were before the test (a test registers a tool; none stays registered)."""
    registered = dict(recipes._REGISTERED)
    try:
        yield
    finally:
        recipes._REGISTERED.clear()
        recipes._REGISTERED.update(registered)

"""Fixtures of the prompt-tool conformance tests: the registry's tiny models built once per session, and a registry
that a test may add to and gets back unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from clova_train.quickstart import registry


class TinyModels:
    """The tiny model of each kind, with random weights (``pretrain_steps=0``), built on first use under ``root``.

    The conformance tests check plumbing and contracts, not learning, so the seconds-long random-weight builds do
    (the pretrained models of the learning tests take minutes)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.built: dict[str, Path] = {}

    def __call__(self, kind: str) -> Path:
        """The directory of ``kind``'s model (a kind of :data:`~clova_train.quickstart.registry.TINY_MODELS`)."""
        if kind not in self.built:
            self.built[kind] = registry.tiny_model(kind).build(self.root / kind, seed=0, pretrain_steps=0)
        return self.built[kind]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread inside the test, as under ``make test``'s pytest-xdist workers (tests/conftest.py).

    The tiny models' operations are so small that a second thread's hand-offs cost more than they save, and on a
    busy 2-core host far more: this suite took 118 s on two threads there, 20 s on one."""
    from clova_train.quickstart.tiny.common import torch_threads

    with torch_threads(1):
        yield


@pytest.fixture
def restored_registry() -> Iterator[None]:
    """The registry's tables as they were before the test (a test registers a tool; none stays registered)."""
    tools, models = dict(registry.TOOLS), dict(registry.TINY_MODELS)
    try:
        yield
    finally:
        # in place: every module that imported the tables holds these dict objects
        registry.TOOLS.clear()
        registry.TOOLS.update(tools)
        registry.TINY_MODELS.clear()
        registry.TINY_MODELS.update(models)

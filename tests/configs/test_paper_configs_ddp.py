"""The paper configs on two CPU ranks as users run them (issue 37), with tiny models of the real architectures
in place of the hub checkpoints and synthetic data in the real formats (recipes and checks in
helpers/shipped_configs.py): each with its own progress bar, loggers and strategy (DDP, or FSDP2 for the sharded
config)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.shipped_configs import RECIPES, check_shipped_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def masked_concepts_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from clova_train.tools.replace.synthetic import write_masked_concepts

    return write_masked_concepts(tmp_path_factory.mktemp("replace-concepts"), ["orange_circle"], images_per_concept=5,
                                 image_size=16)


@pytest.fixture(scope="module")
def llm_data(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    """111 training samples (5 per batch on 2 ranks: the last global batch holds 1), 121 validation samples."""
    from clova_train.datamodules import SyntheticToolDataModule

    root = tmp_path_factory.mktemp("llm-data")
    SyntheticToolDataModule(str(root), str(tiny_llama_dir), conversations_per_tool=2, negatives=5,
                            eval_conversations_per_tool=1).prepare_data()
    records = json.loads((root / "val.json").read_text())
    (root / "val.json").write_text(json.dumps(records[:21]))  # 11 and 10 on the two ranks
    return root


@pytest.mark.parametrize("config", sorted(c for c in RECIPES if c.startswith("paper/")))
def test_paper_config_runs_on_two_devices_with_its_own_bar_and_loggers(
    config: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    check_shipped_config(config, request, tmp_path)

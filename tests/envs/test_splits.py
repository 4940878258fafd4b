"""The three task splits of the offline worlds (envs/common/world.py) and the wordings held out for test tasks
(SeekingWorld.phrasings_for): disjoint, deterministic, the training draws unchanged, eval read as test."""

from __future__ import annotations

import numpy as np
import pytest

from clova_train.core.errors import DataError
from clova_train.envs import InformationSeekingConfig, ReasoningLoopConfig
from clova_train.envs.avis.seeking_world import TEMPLATES, SeekingWorld
from clova_train.envs.avis.world import make_seeking_task
from clova_train.envs.common.world import HELD_OUT_MODULUS, draw_task_id, split_name, task_split

COUNT_WORDINGS = ("How many {c} {s}s are there?", "What number of {c} {s}s can you find?",
                  "Tell me the count of {c} {s}s?")
HELD_OUT_WORDING = COUNT_WORDINGS[-1]


def test_the_splits_are_disjoint_deterministic_and_training_draws_what_it_drew_before() -> None:
    ids = range(10_000)
    splits = {name: {i for i in ids if task_split(i) == name} for name in ("train", "val", "test")}
    assert sum(map(len, splits.values())) == len(ids) and set().union(*splits.values()) == set(ids)
    assert len(splits["val"]) == len(splits["test"]) == 1000  # the held-out fifth, cut in two halves
    for name in ("train", "val", "test"):
        first, again = np.random.default_rng(3), np.random.default_rng(3)
        drawn = [draw_task_id(first, name) for _ in range(200)]
        assert drawn == [draw_task_id(again, name) for _ in range(200)] and {task_split(i) for i in drawn} == {name}
    old, new = np.random.default_rng(5), np.random.default_rng(5)

    def old_training_draw() -> int:  # the rule before val and test: any id not held out
        while True:
            candidate = int(old.integers(0, 2**31 - 1))
            if candidate % HELD_OUT_MODULUS != 0:
                return candidate

    assert [draw_task_id(new, "train") for _ in range(300)] == [old_training_draw() for _ in range(300)]


def test_eval_is_read_as_test_and_an_unknown_split_is_one_message() -> None:
    assert split_name("eval") == "test" and split_name("val") == "val"
    first, again = np.random.default_rng(1), np.random.default_rng(1)
    assert [draw_task_id(first, "eval") for _ in range(20)] == [draw_task_id(again, "test") for _ in range(20)]
    assert ReasoningLoopConfig(split="eval").problems("hydra") == []
    assert InformationSeekingConfig(split="val").problems("avis") == []
    assert any(p.startswith("hydra.split = 'dev'") and "'val'" in p for p in ReasoningLoopConfig(split="dev").problems(
        "hydra"))
    with pytest.raises(DataError, match="split 'dev': must be one of train, val, test"):
        split_name("dev")


def test_a_test_only_wording_is_never_asked_at_train_or_val_and_is_asked_at_test() -> None:
    world = SeekingWorld(questions={"count": 1.0}, phrasings={**{k: (t,) for k, t in TEMPLATES.items()},
                                                              "count": COUNT_WORDINGS})
    assert world.phrasings_for("count", "test") == COUNT_WORDINGS
    assert world.phrasings_for("count", "train") == world.phrasings_for("count", "val") == COUNT_WORDINGS[:-1]
    held_out = {HELD_OUT_WORDING.format(c=c, s=s) for c in ("red", "green", "blue", "yellow")
                for s in ("circle", "square", "triangle")}
    rng = np.random.default_rng(0)
    for split in ("train", "val", "test"):
        asked = [make_seeking_task(draw_task_id(rng, split), kinds=("count",), world=world).question
                 for _ in range(600)]
        used = sum(question in held_out for question in asked)
        assert (used > 100) if split == "test" else (used == 0), (split, used)
    two = SeekingWorld(phrasings={**world.phrasings, "count": COUNT_WORDINGS[:2]})  # under 3 wordings: none held out
    assert two.phrasings_for("count", "train") == COUNT_WORDINGS[:2]

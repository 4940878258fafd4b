"""The controls fitted on logged play: what they read, what they learn, and that they never see held-out tasks."""

from __future__ import annotations

import numpy as np
import pytest

from clova_train.controller.evaluation import (
    FITTED_PREFIXES, best_rule, fitted_baselines, make_env_fn, planner_top_policy, run_episodes,
)
from clova_train.controller.fitted_controls import (
    REPLAN, EpisodeLog, OutcomeClassifier, QuestionRule, action_for, describe_action, log_episodes, situation,
)
from clova_train.envs import ReasoningLoopConfig
from clova_train.envs.common.world import is_held_out

CONFIG = ReasoningLoopConfig(reject_penalty=30.0)


@pytest.fixture(scope="module")
def train_env():
    env = make_env_fn(CONFIG, "train")()
    yield env
    env.close()


@pytest.fixture(scope="module")
def log(train_env) -> EpisodeLog:
    return log_episodes(train_env, 1500, seed=0)


def test_descriptions_name_probability_ranks_and_map_back(train_env) -> None:
    train_env.reset(seed=3)
    probabilities = train_env.planner_probabilities()
    for action in range(CONFIG.num_samples + 1):
        description = describe_action(train_env, action)
        assert action_for(train_env, description) == action
    assert describe_action(train_env, CONFIG.num_samples) == REPLAN
    assert action_for(train_env, "rank 1") == int(np.argmax(probabilities))
    words, memory, state = situation(train_env)
    assert words == " ".join(train_env.task.question.lower().split()[:2]) and memory == 0 and state is None


def test_logs_are_whole_training_episodes_labelled_by_their_outcome(log: EpisodeLog, train_env) -> None:
    assert len(log.actions) >= 1500 and len(log.observations) == len(log.success) == len(log.episode)
    # each episode's steps carry the same label; episodes are numbered in order
    for episode in range(log.episodes):
        labels = {s for s, e in zip(log.success, log.episode) if e == episode}
        assert len(labels) == 1
    # every logged task is a training task: replaying the logging seeds never draws a held-out id
    for episode in range(20):
        train_env.reset(seed=0 * 1_000_003 + episode)
        assert not is_held_out(train_env.task.task_id)
    assert 0.2 < np.mean(log.success) < 0.6  # random play: right now and then


def test_question_rule_learns_which_rank_to_trust_per_question(log: EpisodeLog) -> None:
    rule = QuestionRule(log)
    # the shapes world's planner ranks its good sample first for counts and last for existence questions
    assert rule.table[("how many", 0, None)][0] == "rank 1"
    assert rule.table[("is there", 0, None)][0] == f"rank {CONFIG.num_samples}"


def test_a_situation_never_logged_falls_back_to_the_best_overall(log: EpisodeLog, train_env) -> None:
    rule = QuestionRule(log)
    train_env.reset(seed=5)
    train_env.task = type(train_env.task)(**{**train_env.task.__dict__, "question": "Zebra quux?"})
    assert rule(None, train_env) == action_for(train_env, rule.fallback[0])


def test_classifier_chooses_on_a_validation_split_and_respects_masks(log: EpisodeLog) -> None:
    classifier = OutcomeClassifier((), seed=0, max_epochs=5).fit(log)
    assert set(classifier.chosen) == {"weight_decay", "epochs", "validation_loss"}
    assert 1 <= classifier.chosen["epochs"] <= 5

    class Masked:
        def action_masks(self) -> np.ndarray:
            return np.array([False, False, True, False, False, False])

    assert classifier(log.observations[0], Masked()) == 2


def test_fitted_controls_read_the_question_and_beat_every_probability_rule() -> None:
    eval_env = make_env_fn(CONFIG, "eval")()
    try:
        results = fitted_baselines(CONFIG, eval_env, 100, 10_000, steps=3000, fit_seed=0, hidden=[64],
                                   per_sample=False)  # those: tests/controller/test_per_sample_controls.py
        planner = run_episodes(eval_env, planner_top_policy, 100, 10_000)
    finally:
        eval_env.close()
    assert [name.split(" (")[0] for name in results] == ["question rule fitted on logs", "logistic regression on logs",
                                                         "MLP [64] on logs"]
    assert all(name.startswith(FITTED_PREFIXES) for name in results)
    # the shapes world puts the good sample at a rank that depends on the question: reading it is what matters
    # (measured: 0.96 for the rule against 0.44 for the planner's top sample)
    rule = results["question rule fitted on logs (3000 steps of random play on training tasks)"]
    assert rule["accuracy"] >= planner["accuracy"] + 0.3
    assert best_rule({**results, "trained controller": {"accuracy": 1.0}})[0].startswith("question rule")
    assert fitted_baselines(CONFIG, None, 10, 0, steps=0, fit_seed=0, hidden=[8]) == {}

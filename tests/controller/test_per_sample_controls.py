"""The per-sample controls: shared weights over HYDRA's samples, settings chosen on the logs' validation split only,
HYDRA, AVIS and HAMMR, and their rows in ``controller evaluate``'s table."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from clova_train.controller import evaluation
from clova_train.controller.evaluation import FITTED_PREFIXES, compare, format_table, make_env_fn, short_name
from clova_train.controller.fitted_controls import EpisodeLog, log_episodes, validation_episodes
from clova_train.controller.per_sample_controls import (
    LOGISTIC_NAME, NEVER, TREES_NAME, CandidateRows, PerSampleControl, per_sample_controls,
)
from clova_train.envs import AgentDispatchConfig, InformationSeekingConfig, ReasoningLoopConfig

CONFIG = ReasoningLoopConfig(reject_penalty=30.0)
STEPS = 300


@pytest.fixture(scope="module")
def hydra() -> tuple[object, EpisodeLog, dict[str, PerSampleControl]]:
    env = make_env_fn(CONFIG, "train")()
    log = log_episodes(env, STEPS, seed=0)
    yield env, log, per_sample_controls(env, log, 0, "test")
    env.close()


def permuted(observation: np.ndarray, layout: CandidateRows, order: np.ndarray) -> np.ndarray:
    """``observation`` with its samples (embeddings and probabilities) listed in ``order``."""
    out = observation.copy()
    for slot, source in enumerate(order):
        (a, b), (c, d) = layout.samples[slot], layout.samples[source]
        out[a:b] = observation[c:d]
    start = layout.probabilities[0]
    out[start:start + len(order)] = observation[start + order]
    return out


def test_hydra_scores_are_permutation_equivariant_over_samples(hydra) -> None:
    env, log, controls = hydra
    layout = CandidateRows.for_env(env)
    assert layout.candidates == CONFIG.num_samples and layout.replan == CONFIG.num_samples
    order = np.array([3, 0, 4, 1, 2])
    for observation in log.observations[:5]:
        moved = permuted(observation, layout, order)
        for interactions in (True, False):
            expected = layout.rows(observation, interactions)[order]
            np.testing.assert_array_equal(layout.rows(moved, interactions), expected)
        for control in controls.values():
            np.testing.assert_allclose(control.scores(moved), control.scores(observation)[order], rtol=1e-6)


def test_settings_are_chosen_on_the_logs_validation_split(hydra) -> None:
    env, log, controls = hydra
    layout = CandidateRows.for_env(env)
    for control in controls.values():
        assert {"validation_log_loss", "threshold"} <= set(control.chosen)
    assert set(controls[f"{LOGISTIC_NAME} on logs (test)"].chosen) >= {"C"}
    assert set(controls[f"{TREES_NAME} on logs (test)"].chosen) >= {"max_depth", "max_iter"}
    # the threshold follows the validation episodes' outcomes: where only their re-plans ended well, re-plan most
    held_out = np.isin(log.episode, validation_episodes(log, 0))
    replans = held_out & (np.asarray(log.actions) == CONFIG.num_samples)
    assert replans.any()
    relabelled = replace(log, success=[float(r) for r in replans])
    control = PerSampleControl("logistic", 0).fit(relabelled, layout)
    assert control.threshold > NEVER
    # ... and not the fitted steps': where only those re-plans ended well, the validation steps say never re-plan
    fitted_replans = ~held_out & (np.asarray(log.actions) == CONFIG.num_samples)
    elsewhere = replace(log, success=[float(r) for r in fitted_replans])
    assert PerSampleControl("logistic", 0).fit(elsewhere, layout).threshold == NEVER


@pytest.mark.parametrize("config", [InformationSeekingConfig(), AgentDispatchConfig()], ids=["avis", "hammr"])
def test_tool_controls_score_every_action_with_its_identity_and_respect_the_mask(config) -> None:
    train_env, eval_env = make_env_fn(config, "train")(), make_env_fn(config, "eval")()
    try:
        log = log_episodes(train_env, 120, seed=0)
        layout = CandidateRows.for_env(train_env)
        n = int(train_env.action_space.n)
        assert layout.replan is None and layout.candidates == n
        rows = layout.rows(log.observations[0], interactions=False)
        np.testing.assert_array_equal(rows[:, -n:], np.eye(n))  # the one-hot identity closes the trees' rows
        controls = per_sample_controls(train_env, log, 0, "test")
        assert len(controls) == 2
        for control in controls.values():
            assert control.threshold == NEVER
            obs, _ = eval_env.reset(seed=10_000)
            for _ in range(3):
                action = control(obs, eval_env)
                assert eval_env.action_masks()[action]
                obs, _, terminated, truncated, _ = eval_env.step(action)
                if terminated or truncated:
                    break
    finally:
        train_env.close()
        eval_env.close()


def test_controller_evaluate_reports_them_and_fits_them_without_the_held_out_tasks(monkeypatch) -> None:
    class FirstSample:  # a "trained controller" that always runs the first sample
        def predict(self, obs, deterministic=True):
            return 0, None

    splits: list[str | None] = []
    held_out_resets = [0]
    resets_during_fits: list[int] = []
    make, fit = evaluation.make_env_fn, PerSampleControl.fit

    def recording_make(config, split=None):
        splits.append(split)
        build = make(config, split)
        if split != "test":
            return build

        def counted():
            env = build()
            reset = env.reset

            def counting_reset(*args, **kwargs):
                held_out_resets[0] += 1
                return reset(*args, **kwargs)

            env.reset = counting_reset
            return env
        return counted

    def recording_fit(self, log, layout):
        before = held_out_resets[0]
        fitted = fit(self, log, layout)
        resets_during_fits.append(held_out_resets[0] - before)
        return fitted

    monkeypatch.setattr(evaluation, "make_env_fn", recording_make)
    monkeypatch.setattr(PerSampleControl, "fit", recording_fit)
    results = compare(CONFIG, FirstSample(), episodes=2, seed=10_000, random_seed=0, control_steps=60, hidden=[8])
    # logged and fitted on training tasks; nothing played on the held-out tasks while fitting
    assert splits == ["test", "train"] and resets_during_fits == [0, 0] and held_out_resets[0] > 0
    table = format_table(results)
    for name in (LOGISTIC_NAME, TREES_NAME):
        (row,) = [n for n in results if n.startswith(name)]
        assert row == f"{name} on logs (60 steps of random play on training tasks)"
        assert f"| {row} |" in table and row.startswith(FITTED_PREFIXES)
        assert 0.0 <= results[row]["accuracy"] <= 1.0
    assert short_name(f"{LOGISTIC_NAME} on logs") == "per_sample_logistic_regression"
    assert short_name(f"{TREES_NAME} on logs") == "per_sample_boosted_trees"
    assert short_name("logistic regression on logs") == "logistic_regression"

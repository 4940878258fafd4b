"""Evaluation of a controller against rules that need no training, on the same held-out tasks.

Which tasks: a run chooses on its ``val`` tasks (the training-time evaluation, ``best_model.zip``; the fitted
controls choose their settings on a validation part of their own training logs) and reports on its ``test`` tasks,
once (:func:`compare`, the final table, ``controller evaluate``); every row of a table carries the split it was
measured on (``tasks``), and training draws neither (:func:`clova_train.envs.common.world.task_split`).

The rules (:func:`baselines`): the planner's highest-probability sample (HYDRA without RL), its lowest, a
random sample, one program from the planner's top sample with no memory and no re-plan (ViperGPT-like), the best fixed sample slot (each slot tried, the best one kept: an upper bound for that rule),
and, in the offline world, an oracle that knows which instruction kinds are right (a ceiling, not a rule). Beside
them, :func:`fitted_baselines` gives the controls that read what the controller reads and learn from logged play of
training tasks (:mod:`clova_train.controller.fitted_controls`: a question rule, logistic regression, an MLP; and
:mod:`clova_train.controller.per_sample_controls`: logistic regression and boosted trees that score each sample or
action on its own with shared weights, re-planning below a threshold chosen on a validation split of the logs).

``run_episodes`` plays ``policy`` on the tasks of seeds ``seed .. seed + episodes - 1`` (the same tasks for every
policy and every evaluation), and returns the means and the per-episode values that SB3's ``evaluations.npz``
keeps (returns, lengths, successes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from clova_train.controller.fitted_controls import MLP_HIDDEN, fitted_controls, log_budget, log_episodes
from clova_train.controller.per_sample_controls import LOGISTIC_NAME, TREES_NAME, per_sample_controls
from clova_train.envs import EnvConfig, ReasoningLoopEnv, make_env
from clova_train.envs.common.episode import episode_score
from clova_train.envs.hydra.scripted import GOOD, ScriptedReasoningLLM

Policy = Callable[[np.ndarray, Any], int]


VALIDATION, TEST = "val", "test"  # the split a run chooses on, and the one it reports


def make_env_fn(config: EnvConfig, split: str | None = None) -> Callable[[], Any]:
    """A builder of ``config``'s environment on ``split`` (``train``, ``val``, ``test``; None: the config's own)."""
    env_config = config if split is None else replace(config, split=split)

    def build() -> Any:
        return make_env(env_config)

    return build


def run_episodes(env: Any, policy: Policy, episodes: int, seed: int) -> dict[str, Any]:
    """Mean accuracy (the benchmark's metric where the environment scores with one, see
    :func:`~clova_train.envs.common.episode.episode_score`), steps, rejects (HYDRA) or infeasible actions (AVIS,
    HAMMR), LLM calls and return of ``policy``, plus per-episode ``returns``/``lengths``/``correct``; where some
    tasks were asked in a wording only test tasks get (an environment with ``asks_held_out_wording``), the accuracy
    on those tasks and their count (``held_out_wording_accuracy``, ``held_out_wording_episodes``)."""
    correct, scores, steps, rejects, returns, llm_calls, held_out = [], [], [], [], [], [], []
    asks_held_out = getattr(env, "asks_held_out_wording", None)
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        held_out.append(bool(asks_held_out()) if callable(asks_held_out) else False)
        total, done, n, info, calls, infeasible = 0.0, False, 0, {}, 0, 0
        while not done:
            obs, reward, terminated, truncated, info = env.step(policy(obs, env))
            total, n, done = total + reward, n + 1, terminated or truncated
            calls += info.get("costs", {}).get("llm_calls", 0)
            infeasible += bool(info.get("infeasible", False))
        correct.append(bool(info.get("correct", False)))
        scores.append(episode_score(info))
        steps.append(n)
        rejects.append(info.get("rejects", infeasible))
        returns.append(total)
        llm_calls.append(calls)
    wording = {}
    if any(held_out):
        wording = {"held_out_wording_accuracy": float(np.mean([s for s, h in zip(scores, held_out) if h])),
                   "held_out_wording_episodes": int(sum(held_out))}
    return {"accuracy": float(np.mean(scores)), "steps": float(np.mean(steps)),
            "rejects": float(np.mean(rejects)), "return": float(np.mean(returns)),
            "llm_calls": float(np.mean(llm_calls)), "episodes": episodes, **wording,
            "returns": returns, "lengths": steps, "correct": correct}


def summary(result: dict[str, Any], split: str) -> dict[str, Any]:
    """The means of :func:`run_episodes` without the per-episode lists, and ``tasks``: the split they were measured
    on."""
    return {**{k: v for k, v in result.items() if k not in ("returns", "lengths", "correct")}, "tasks": split}


def model_policy(model: Any, rule: str | None = None) -> Policy:
    """The model's greedy action (by ``rule``, ``argmax_q`` or ``eq2``, when the model offers both)."""
    if rule is not None and hasattr(model, "greedy_actions"):
        return lambda obs, env: int(model.greedy_actions(obs, rule))
    return lambda obs, env: int(model.predict(obs, deterministic=True)[0])


def planner_top_policy(obs: np.ndarray, env: ReasoningLoopEnv) -> int:
    """HYDRA without RL: the planner's highest-probability sample (never rejects)."""
    return int(np.argmax(env.planner_probabilities()))


def planner_bottom_policy(obs: np.ndarray, env: ReasoningLoopEnv) -> int:
    """The planner's lowest-probability sample (never rejects)."""
    return int(np.argmin(env.planner_probabilities()))


def random_policy(seed: int) -> Policy:
    rng = np.random.default_rng(seed)
    return lambda obs, env: int(rng.integers(env.config.num_samples))


def fixed_slot_policy(slot: int) -> Policy:
    return lambda obs, env: slot


ORACLE_KINDS = ScriptedReasoningLLM()  # reads an instruction's kind from its wording


def oracle_policy(obs: np.ndarray, env: ReasoningLoopEnv) -> int:
    """The first sample of a right kind, else a re-plan (offline world only: the scripted planner's kinds)."""
    for slot, (instruction, _) in enumerate(env.samples):
        if ORACLE_KINDS.instruction_kind(instruction) == GOOD:
            return slot
    return env.config.num_samples


def single_program_env(env: ReasoningLoopEnv) -> ReasoningLoopEnv:
    """The same environment (LLM and its cache, embedder, tools) stopped after one program: a planner that writes one
    plan and a coder that runs it once, with no memory of a step before and no re-plan (ViperGPT's single program)."""
    config = replace(env.config, max_iterations=1, cache_path=None)  # env.llm already goes through the cache
    return ReasoningLoopEnv(config, llm=env.llm, embedder=env.embedder, tools_factory=env.tools_factory)


def other_selection(env: ReasoningLoopEnv, model: Any, episodes: int, seed: int) -> dict[str, dict[str, Any]]:
    """The same Q-network under the other greedy rule (HYDRA's Eq. 2 beside argmax-Q), when the model has
    both rules and the observation carries the planner probabilities; else nothing."""
    rule = getattr(model, "action_selection", None)
    if rule is None or not env.config.observation_tail().probabilities:
        return {}
    other = "argmax_q" if rule == "eq2" else "eq2"
    label = "Eq. 2 (softmax(Q) x planner probability)" if other == "eq2" else "argmax Q"
    return {f"trained controller, {label} selection": run_episodes(env, model_policy(model, other), episodes, seed)}


def baselines(env: Any, episodes: int, seed: int, random_seed: int) -> dict[str, dict[str, Any]]:
    """Every rule of the module docstring on the same held-out tasks (the oracle only for the scripted planner);
    the AVIS and HAMMR environments name their own rules (``reference_policies``)."""
    if not isinstance(env, ReasoningLoopEnv):
        return {name: run_episodes(env, policy, episodes, seed)
                for name, policy in env.reference_policies(random_seed).items()}
    results = {
        "planner top-probability (HYDRA without RL)": run_episodes(env, planner_top_policy, episodes, seed),
        "planner lowest-probability": run_episodes(env, planner_bottom_policy, episodes, seed),
        "random sample": run_episodes(env, random_policy(random_seed), episodes, seed),
    }
    single = single_program_env(env)
    try:
        results["one program from the planner's top sample, no memory (ViperGPT-like)"] = run_episodes(
            single, planner_top_policy, episodes, seed)
    finally:
        single.close()
    slots = [run_episodes(env, fixed_slot_policy(slot), episodes, seed) for slot in range(env.config.num_samples)]
    best = max(range(len(slots)), key=lambda slot: slots[slot]["accuracy"])
    results[f"best fixed sample slot ({best + 1} of {len(slots)})"] = slots[best]
    if isinstance(getattr(env.llm, "backend", env.llm), ScriptedReasoningLLM):  # (possibly behind the call cache)
        results["oracle (knows the right instruction kinds; a ceiling)"] = run_episodes(env, oracle_policy, episodes,
                                                                                        seed)
    return results


def fit_controls(env_config: EnvConfig, steps: int, fit_seed: int, hidden: Sequence[int] = MLP_HIDDEN,
                 per_sample: bool = True) -> dict[str, Policy]:
    """The fitted controls (question rule, logistic regression, MLP ``hidden``, and with ``per_sample`` the per-sample
    logistic regression and boosted trees) learned from ``steps`` logged steps of training tasks (seeded by
    ``fit_seed``; every setting chosen on a validation split of those logs, never on ``val`` or ``test`` tasks);
    nothing when ``steps`` is 0."""
    if steps <= 0:
        return {}
    train_env = make_env_fn(env_config, "train")()
    try:
        log = log_episodes(train_env, steps, fit_seed)
        controls = fitted_controls(train_env, steps, fit_seed, hidden, log)
        if per_sample:
            controls |= per_sample_controls(train_env, log, fit_seed, log_budget(steps))
    finally:
        train_env.close()
    return controls


def fitted_baselines(env_config: EnvConfig, eval_env: Any, episodes: int, seed: int, steps: int, fit_seed: int,
                     hidden: Sequence[int] = MLP_HIDDEN, per_sample: bool = True) -> dict[str, dict[str, Any]]:
    """The controls of :func:`fit_controls`, played on the tasks of ``eval_env`` only once fitted."""
    controls = fit_controls(env_config, steps, fit_seed, hidden, per_sample)
    return play_controls(controls, eval_env, episodes, seed)


def play_controls(controls: dict[str, Policy], env: Any, episodes: int, seed: int) -> dict[str, dict[str, Any]]:
    """Each fitted control of ``controls`` played on ``env``'s tasks of seeds ``seed ..``."""
    return {name: run_episodes(env, policy, episodes, seed) for name, policy in controls.items()}


def short_name(name: str) -> str:
    """The metric key of a rule of :func:`baselines` (``eval/baseline_<key>_accuracy`` in the training logs)."""
    for prefix, key in (("planner top", "planner_top"), ("planner lowest", "planner_lowest"), ("random", "random"),
                        ("one program", "single_program"),
                        ("best fixed", "best_fixed_slot"), ("oracle", "oracle"), ("planner's own", "planner_own"),
                        ("LLM dispatcher", "llm_dispatcher"),
                        ("question rule", "question_rule"), ("logistic regression", "logistic_regression"),
                        (LOGISTIC_NAME, "per_sample_logistic_regression"), (TREES_NAME, "per_sample_boosted_trees"),
                        ("MLP", "mlp")):
        if name.startswith(prefix):
            return key
    return "_".join(name.split()[:3]).lower()


FITTED_PREFIXES = ("question rule", "logistic regression", "MLP", LOGISTIC_NAME, TREES_NAME)  # :func:`fitted_baselines`


def best_rule(results: dict[str, dict[str, Any]], include_fitted: bool = True) -> tuple[str, float]:
    """The control (oracle excluded) with the highest accuracy among ``results``: a rule without training or, with
    ``include_fitted``, a fitted control."""
    excluded = ("trained controller", "oracle") + (() if include_fitted else FITTED_PREFIXES)
    rules = {name: r["accuracy"] for name, r in results.items() if not name.startswith(excluded)}
    name = max(rules, key=rules.__getitem__)
    return name, rules[name]


def compare(env_config: EnvConfig, model: Any, episodes: int, seed: int, random_seed: int, control_steps: int = 0,
            hidden: Sequence[int] = MLP_HIDDEN, split: str = TEST,
            controls: dict[str, Policy] | None = None) -> dict[str, dict[str, Any]]:
    """The controller (under both selection rules when it has them), every rule of :func:`baselines` and the fitted
    controls (``controls`` fitted already, else ``control_steps`` logged steps, seeded by ``random_seed``; MLP
    ``hidden``) on the same tasks of ``split`` (default: the test tasks), each row naming its split."""
    env = make_env_fn(env_config, split)()
    try:
        if controls is None:
            controls = fit_controls(env_config, control_steps, random_seed, hidden)
        results = {"trained controller": run_episodes(env, model_policy(model), episodes, seed),
                   **other_selection(env, model, episodes, seed), **baselines(env, episodes, seed, random_seed),
                   **play_controls(controls, env, episodes, seed)}
    finally:
        env.close()
    return {name: summary(result, env.config.split) for name, result in results.items()}


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """A markdown table of :func:`compare`'s rows, each with the split its tasks came from (``?``: not recorded, a
    table written before splits were named); where some tasks were asked in a wording only test tasks get, a column
    of the accuracy on those."""
    wording = any("held_out_wording_accuracy" in r for r in results.values())
    lines = ["| policy | tasks | accuracy | steps / episode | rejects or infeasible / episode | LLM calls / episode "
             "| return |" + (" accuracy on held-out wordings |" if wording else ""),
             "| --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if wording else "")]
    for name, r in results.items():
        held_out = r.get("held_out_wording_accuracy")
        extra = "" if not wording else \
            f" {held_out:.3f} ({r['held_out_wording_episodes']} tasks) |" if held_out is not None else " - |"
        lines.append(f"| {name} | {r.get('tasks', '?')} | {r['accuracy']:.3f} | {r['steps']:.2f} | {r['rejects']:.2f} | "
                     f"{r.get('llm_calls', float('nan')):.1f} | {r['return']:.1f} |{extra}")
    return "\n".join(lines)

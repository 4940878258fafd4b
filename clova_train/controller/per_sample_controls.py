"""Per-sample controls: one classifier shared by every candidate action, fitted on logged steps of random play.

The controls of :mod:`clova_train.controller.fitted_controls` read the whole observation with one output per action,
so they learn one judgement N times, once per list position, while HYDRA's planner lists its samples in no useful
order. A sceptic scores **each candidate on its own** with one set of weights: this module's controls do that, with
scikit-learn's ``LogisticRegression`` and ``HistGradientBoostingClassifier``.

**Rows** (:class:`CandidateRows`, read from the observation through the environment's ``describe()`` offsets):

* HYDRA (``per_part`` layout): one row per sample ``i``, the same features for every slot: ``[context, sample_i,
  context * sample_i, p_i, p_i - max(p), higher_i / (N - 1)]`` with ``p`` the planner's probabilities and ``higher_i``
  how many samples have a strictly higher one. Nothing depends on the slot, so the scores are permutation-equivariant
  over the samples. The elementwise product lets a linear model read agreement of question and instruction. The
  ``joint`` layout with probabilities gives ``[text, p_i, p_i - max(p), higher_i / (N - 1)]``; without probabilities
  nothing in the observation tells the samples apart, and no per-sample control is built.
* AVIS and HAMMR: one row per action ``a``: ``[shared context (question, memory, graph state), a's own bits (AVIS:
  excluded, suggested by the planner, feasible; HAMMR: called, the LLM dispatcher's choice, feasible), one-hot of
  a]``: tools and agents are named, not exchangeable like samples, so the identity is a feature. For the linear
  model only, the context times the one-hot follows (a weight per (context entry, action): without it a linear score
  ranks the actions the same way for every question); the trees find such interactions themselves.

**Label**: the step's outcome, read as the score of the answer its episode ended with from this step on (a step that
answers: its own answer's score, 1/0 or a benchmark's metric such as VQA accuracy; a step that does not: the score the
logged random continuation reached; 0 when the episode ran out of steps). A step's own answer alone would score every
step that does not answer (a comparison's first count, a search before the answer) 0, whatever it was worth.
Fractional scores are fitted as two weighted rows (label 1 with weight s, label 0 with weight 1 - s). HYDRA's
re-plan steps are no candidate's row: they enter only the choice of the threshold.

**Acting**: every feasible candidate is scored, the best one is taken; HYDRA re-plans (action N) when no sample
scores above the threshold. AVIS and HAMMR have no re-plan action: the best feasible action is taken.

**Choices, on a validation split of the logs only** (a fifth of the logged episodes, held out of the fit, as the
other fitted controls split them; the reported held-out tasks are never seen, not even logged):

* hyperparameters (:data:`LOGISTIC_GRID`: ``C``; :data:`TREES_GRID`: ``max_depth``, and the boosting iterations
  :data:`TREES_ITERATIONS`) by the validation rows' log-loss; the chosen model is then refitted on every logged step;
* the re-plan threshold among "never" and quantiles of the best sample's validation score
  (:data:`THRESHOLD_QUANTILES`), by the importance-weighted value of the validation steps: the logging policy is
  uniform over the feasible actions, so ``mean_t(1[a_t = control(s_t)] * |feasible_t| * label_t)`` estimates the
  outcome of acting as the control at one step and as logged after it (ties: the lowest threshold).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from clova_train.controller.fitted_controls import EpisodeLog, feasible_actions, validation_episodes

LOGISTIC_GRID: tuple[dict[str, Any], ...] = tuple({"C": c} for c in (0.01, 0.1, 1.0))
TREES_GRID: tuple[dict[str, Any], ...] = tuple({"learning_rate": 0.1, "max_depth": depth} for depth in (3, 6))
TREES_ITERATIONS = (25, 50, 100, 150)  # boosting iterations tried (one fit: the validation loss after each stage)
THRESHOLD_QUANTILES = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5)
NEVER = -np.inf  # the threshold that never re-plans
PER_ACTION_PARTS = ("excluded", "suggested", "called", "llm_choice", "action_mask")  # AVIS, HAMMR: an action's bits
LOGISTIC_NAME = "per-sample logistic regression"
TREES_NAME = "per-sample boosted trees"


@dataclass(frozen=True)
class CandidateRows:
    """Turns one observation into one feature row per candidate action (module docstring).

    Args:
        context: ``[start, end)`` of the parts every candidate shares.
        samples: HYDRA: ``[start, end)`` of each sample's embedding (empty in the ``joint`` layout).
        probabilities: HYDRA: ``[start, end)`` of the N planner probabilities; ``None`` elsewhere.
        per_action: AVIS, HAMMR: ``[start, end)`` of each part with one entry per action.
        actions: how many actions (HYDRA: N + 1, re-plan included).
        replan: HYDRA's re-plan action (N), ``None`` where there is none.
    """

    context: tuple[tuple[int, int], ...]
    samples: tuple[tuple[int, int], ...]
    probabilities: tuple[int, int] | None
    per_action: tuple[tuple[int, int], ...]
    actions: int
    replan: int | None

    @classmethod
    def for_env(cls, env: Any) -> CandidateRows | None:
        """The rows of ``env``'s observation (its ``describe()`` offsets); ``None`` when its observation tells the
        samples apart by nothing (HYDRA's ``joint`` layout without probabilities) or the actions (an environment that
        does not describe its observation, or describes no part with one entry per action)."""
        if not hasattr(env, "describe"):
            return None
        description = env.describe()
        parts = {name: (int(span[0]), int(span[1])) for name, span in description["observation_parts"].items()}
        actions = int(env.action_space.n)
        if description["environment"] == "hydra":
            samples = tuple(span for name, span in parts.items() if name.startswith("sample_"))
            probabilities = parts.get("probabilities")
            if probabilities is None:
                return None
            context = tuple(span for name, span in parts.items()
                            if name != "probabilities" and not name.startswith("sample_"))
            return cls(context, samples, probabilities, (), actions, actions - 1)
        per_action = tuple(parts[name] for name in PER_ACTION_PARTS if name in parts)
        if not per_action:
            return None
        context = tuple(span for name, span in parts.items() if name not in PER_ACTION_PARTS)
        return cls(context, (), None, per_action, actions, None)

    @property
    def candidates(self) -> int:
        """How many actions get a row (HYDRA: the N samples; AVIS, HAMMR: every action)."""
        return self.actions - (self.replan is not None)

    def rows(self, observation: np.ndarray, interactions: bool) -> np.ndarray:
        """``[candidates, features]`` float32 rows of one observation; ``interactions``: add the products of the
        module docstring (HYDRA: context x sample; AVIS, HAMMR: context x one-hot)."""
        obs = np.asarray(observation, dtype=np.float32)
        context = np.concatenate([obs[a:b] for a, b in self.context])
        n = self.candidates
        shared = np.broadcast_to(context, (n, len(context)))
        if self.replan is not None:
            assert self.probabilities is not None
            p = obs[self.probabilities[0]:self.probabilities[1]]
            higher = (p[None, :] > p[:, None]).sum(axis=1) / max(1, n - 1)
            ranks = np.stack([p, p - p.max(), higher], axis=1)
            if not self.samples:
                return np.concatenate([shared, ranks], axis=1).astype(np.float32)
            samples = np.stack([obs[a:b] for a, b in self.samples])
            extra = [shared * samples] if interactions else []
            return np.concatenate([shared, samples, *extra, ranks], axis=1).astype(np.float32)
        bits = np.stack([obs[a:b] for a, b in self.per_action], axis=1)
        identity = np.eye(n, dtype=np.float32)
        extra = [(identity[:, :, None] * context[None, None, :]).reshape(n, -1)] if interactions else []
        return np.concatenate([shared, bits, identity, *extra], axis=1).astype(np.float32)


def _weighted(features: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fractional labels as two weighted binary rows each (module docstring); zero weights dropped."""
    x = np.concatenate([features, features])
    y = np.concatenate([np.ones(len(labels)), np.zeros(len(labels))]).astype(int)
    w = np.concatenate([labels, 1.0 - labels])
    keep = w > 0
    return x[keep], y[keep], w[keep]


_THREADS: Any = None  # threadpoolctl's controller of the loaded native thread pools, found once


def _one_thread() -> Any:
    """A context with the native thread pools (OpenMP, BLAS) at one thread: the rows are few and the scoring runs
    at every step, where waking a pool costs more than it saves (and far more on a loaded machine)."""
    global _THREADS
    from threadpoolctl import ThreadpoolController

    if _THREADS is None:
        _THREADS = ThreadpoolController()
    return _THREADS.limit(limits=1)


def _fitted(kind: str, params: dict[str, Any], seed: int, features: np.ndarray, labels: np.ndarray,
            weights: np.ndarray) -> Any:
    """The learner ``kind`` with ``params`` fitted on weighted rows (a constant where the rows hold one class)."""
    from sklearn.dummy import DummyClassifier

    if len(np.unique(labels)) < 2:
        if not len(labels):  # no logged step ran a candidate: every score 0
            features, labels = np.zeros((1, features.shape[1])), np.zeros(1, dtype=int)
        return DummyClassifier(strategy="prior").fit(features, labels)
    model = _estimator(kind, params, seed)
    weight_key = f"{model.steps[-1][0]}__sample_weight" if hasattr(model, "steps") else "sample_weight"
    with _one_thread():
        return model.fit(features, labels, **{weight_key: weights})


def _estimator(kind: str, params: dict[str, Any], seed: int) -> Any:
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if kind == "logistic":
        return make_pipeline(StandardScaler(), LogisticRegression(C=params["C"], max_iter=500))
    return HistGradientBoostingClassifier(**{"max_iter": max(TREES_ITERATIONS), **params}, early_stopping=False,
                                          random_state=seed)


def _scores_under(model: Any, settings: dict[str, Any], features: np.ndarray) -> np.ndarray:
    """``model``'s scores of ``features`` under ``settings`` (one of :func:`_staged`'s)."""
    for staged_settings, scores in _staged(model, {k: v for k, v in settings.items() if k != "max_iter"}, features):
        if staged_settings == settings:
            return scores
    return _scores(model, features)


def _staged(model: Any, params: dict[str, Any], features: np.ndarray) -> list[tuple[dict[str, Any], np.ndarray]]:
    """The settings a fitted ``model`` stands for and its scores of ``features`` under each: the boosted trees after
    each of :data:`TREES_ITERATIONS` stages, anything else as it is."""
    if not hasattr(model, "staged_predict_proba") or 1 not in list(model.classes_):
        return [(params, _scores(model, features))]
    column, wanted, staged = list(model.classes_).index(1), set(TREES_ITERATIONS), []
    with _one_thread():
        for stage, probabilities in enumerate(model.staged_predict_proba(features), start=1):
            if stage in wanted:
                staged.append(({**params, "max_iter": stage}, probabilities[:, column]))
    return staged


def _scores(model: Any, features: np.ndarray) -> np.ndarray:
    """P(label 1) of each row; a model fitted on one class only gives that class's probability."""
    classes = list(model.classes_)
    if 1 not in classes:
        return np.zeros(len(features))
    with _one_thread():
        return model.predict_proba(features)[:, classes.index(1)]


class PerSampleControl:
    """The control of the module docstring with one learner (``kind``: ``logistic`` or ``trees``).

    Args:
        kind: ``logistic`` (:data:`LOGISTIC_GRID`) or ``trees`` (:data:`TREES_GRID`).
        seed: seed of the validation split and of the trees.
    """

    def __init__(self, kind: str, seed: int = 0) -> None:
        if kind not in ("logistic", "trees"):
            raise ValueError(f"per-sample learner must be 'logistic' or 'trees', got {kind!r}")
        self.kind, self.seed = kind, seed
        self.layout: CandidateRows | None = None
        self.model: Any = None
        self.threshold: float = NEVER
        self.chosen: dict[str, Any] = {}

    @property
    def grid(self) -> tuple[dict[str, Any], ...]:
        return LOGISTIC_GRID if self.kind == "logistic" else TREES_GRID

    def fit(self, log: EpisodeLog, layout: CandidateRows) -> PerSampleControl:
        """Choose on the validation episodes of ``log`` (module docstring), then refit on all of it."""
        from sklearn.metrics import log_loss

        self.layout = layout
        interactions = self.kind == "logistic"
        validation = np.isin(log.episode, validation_episodes(log, self.seed))
        if validation.all():  # one episode logged: validate on what was fitted
            fit_part = np.ones(len(validation), dtype=bool)
        else:
            fit_part = ~validation
        actions, labels = np.asarray(log.actions), np.asarray(log.success, dtype=float)
        candidate = np.ones(len(actions), dtype=bool) if layout.replan is None else actions != layout.replan
        row_step = np.flatnonzero(candidate)  # the logged step of each row
        width = layout.rows(log.observations[0], interactions).shape[1]
        rows = np.stack([layout.rows(log.observations[step], interactions)[actions[step]] for step in row_step]
                        ) if row_step.size else np.zeros((0, width), dtype=np.float32)
        row_labels = labels[row_step]
        in_fit, in_validation = fit_part[row_step], validation[row_step]
        x_fit, y_fit, w_fit = _weighted(rows[in_fit], row_labels[in_fit])
        if not in_validation.any():  # no validation step ran a sample: validate on what was fitted
            in_validation = in_fit
        x_valid, y_valid, w_valid = _weighted(rows[in_validation], row_labels[in_validation])
        best: tuple[float, dict[str, Any], Any] | None = None
        for params in self.grid:
            model = _fitted(self.kind, params, self.seed, x_fit, y_fit, w_fit)
            for settings, scores in _staged(model, params, x_valid):
                loss = float(log_loss(y_valid, scores, sample_weight=w_valid, labels=[0, 1]))
                if best is None or loss < best[0]:
                    best = (loss, settings, model)
        assert best is not None
        self.threshold = self._threshold(best[2], best[1], log, validation) if layout.replan is not None else NEVER
        self.model = _fitted(self.kind, best[1], self.seed, *_weighted(rows, row_labels))
        self.chosen = {**best[1], "validation_log_loss": best[0],
                       "threshold": None if self.threshold == NEVER else self.threshold}
        return self

    def _threshold(self, model: Any, settings: dict[str, Any], log: EpisodeLog, validation: np.ndarray) -> float:
        """The re-plan threshold with the best importance-weighted value on the validation steps (module docstring),
        scored by ``model`` under ``settings`` (fitted without them)."""
        assert self.layout is not None
        steps = np.flatnonzero(validation)
        n = self.layout.candidates
        rows = np.concatenate([self.layout.rows(log.observations[step], self.kind == "logistic") for step in steps])
        scores = _scores_under(model, settings, rows).reshape(len(steps), n)
        scores = np.where(np.stack([log.masks[step][:n] for step in steps]), scores, -np.inf)
        best_sample, best_score = scores.argmax(axis=1), scores.max(axis=1)
        actions = np.asarray(log.actions)[steps]
        feasible = np.asarray([log.masks[s].sum() for s in steps], dtype=float)
        labels = np.asarray(log.success, dtype=float)[steps]
        candidates = [NEVER, *sorted(set(np.quantile(best_score, THRESHOLD_QUANTILES).tolist()))]
        values = []
        for threshold in candidates:
            acted = np.where(best_score > threshold, best_sample, self.layout.replan)
            values.append(float(np.mean((acted == actions) * feasible * labels)))
        return candidates[int(np.argmax(values))]  # first maximum: the lowest threshold

    def scores(self, observation: np.ndarray) -> np.ndarray:
        """The fitted model's score of every candidate in ``observation``."""
        assert self.layout is not None and self.model is not None, "fit() first"
        return _scores(self.model, self.layout.rows(observation, self.kind == "logistic"))

    def __call__(self, obs: np.ndarray, env: Any) -> int:
        assert self.layout is not None
        mask = feasible_actions(env)
        scores = np.where(mask[:self.layout.candidates], self.scores(obs), -np.inf)
        best = int(np.argmax(scores))
        if self.layout.replan is not None and mask[self.layout.replan] and not scores[best] > self.threshold:
            return self.layout.replan
        if not np.isfinite(scores[best]):  # nothing feasible among the candidates
            return int(np.flatnonzero(mask)[0]) if mask.any() else best
        return best


def per_sample_controls(layout_env: Any, log: EpisodeLog, seed: int, budget: str) -> dict[str, PerSampleControl]:
    """The two per-sample controls fitted on ``log`` (logged on ``layout_env``'s training tasks), named with
    ``budget``; nothing where the observation tells no samples apart."""
    layout = CandidateRows.for_env(layout_env)
    if layout is None:
        return {}
    return {f"{LOGISTIC_NAME} on logs ({budget})": PerSampleControl("logistic", seed).fit(log, layout),
            f"{TREES_NAME} on logs ({budget})": PerSampleControl("trees", seed).fit(log, layout)}

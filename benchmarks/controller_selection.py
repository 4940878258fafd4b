"""HYDRA Eq. 2 against argmax-Q, over seeds: the quickstart controller trained with each greedy rule, each Q-network
evaluated under both rules, beside the rules without training, on the same 200 held-out tasks.

Eq. 2 is ``argmax_i softmax(Q)_i * P_P(d_i)`` over the N samples, re-planning when the reject action is the
controller's top choice (:mod:`clova_train.envs.common.selection` gives the paper's words). Each training seed is
one ``clova-train controller fit`` of ``configs/quickstart/controller_dqn.yaml`` (30,000 steps) with
``--train.seed`` and ``--dqn.action_selection``; its ``evaluation.json`` holds the trained controller under its own
rule, the same Q-network under the other rule and every rule without training. Reported: the mean over seeds with
a 95% Student t interval from the seed-to-seed variation, and the paired difference Eq. 2 - argmax per seed
(scipy).

    python benchmarks/controller_selection.py [--seeds 0 1 2 3 4] [--runs-dir DIR] [--no-record]

``--runs-dir`` keeps the runs (a rerun reuses every finished one); the default is a temporary directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import REPO, controller_evaluation  # noqa: E402
from results_file import add_seeded_run_arguments, machine, publish, runs_directory, seed_interval  # noqa: E402

CONFIG = REPO / "configs/quickstart/controller_dqn.yaml"
RULES = ("argmax_q", "eq2")
OWN = "trained controller"
PLANNER = "planner top-probability (HYDRA without RL)"
UNTRAINED = (PLANNER, "planner lowest-probability", "random sample", "best fixed sample slot (5 of 5)")


def run(rule: str, seed: int, runs: Path) -> dict[str, dict]:
    """The evaluation of the quickstart controller trained with ``rule`` from ``seed`` (trained if not there yet)."""
    out = runs / f"{rule}-{seed}"
    return controller_evaluation(out, "--config", str(CONFIG), f"--train.seed={seed}", f"--dqn.action_selection={rule}",
                                 f"--hydra.cache_path={out}.sqlite")


def other_rule_row(evaluation: dict[str, dict]) -> str:
    (name,) = [k for k in evaluation if k.startswith(OWN + ",")]
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_seeded_run_arguments(parser)
    args = parser.parse_args()
    with runs_directory(args.runs_dir) as runs:
        results = {rule: [run(rule, seed, runs) for seed in args.seeds] for rule in RULES}
    policies: dict[str, list[float]] = {}
    for rule in RULES:
        other = "eq2" if rule == "argmax_q" else "argmax_q"
        policies[f"trained with {rule}, selected by {rule}"] = [r[OWN]["accuracy"] for r in results[rule]]
        policies[f"trained with {rule}, selected by {other}"] = [r[other_rule_row(r)]["accuracy"] for r in results[rule]]
    for name in UNTRAINED:
        policies[name] = [r[name]["accuracy"] for r in results["argmax_q"]]
    rows = [f"| {name} | {seed_interval(values)} | {', '.join(f'{v:.3f}' for v in values)} |"
            for name, values in policies.items()]
    for rule in RULES:
        eq2 = policies[f"trained with {rule}, selected by eq2"]
        argmax = policies[f"trained with {rule}, selected by argmax_q"]
        differences = [a - b for a, b in zip(eq2, argmax)]
        rows.append(f"| paired difference Eq. 2 - argmax (trained with {rule}) | {seed_interval(differences, signed=True)} | "
                    f"{', '.join(f'{d:+.3f}' for d in differences)} |")
    publish("controller_selection", "Controller action selection: HYDRA Eq. 2 against argmax-Q",
            f"cpu: {machine()}",
            f"Held-out accuracy on 200 tasks, `configs/quickstart/controller_dqn.yaml` (30,000 steps), seeds "
            f"{', '.join(map(str, args.seeds))}; mean [95% t interval over seeds]. Command: "
            f"`python benchmarks/controller_selection.py --seeds {' '.join(map(str, args.seeds))}`",
            ["policy", "accuracy", "per seed"], rows, record=not args.no_record)


if __name__ == "__main__":
    main()

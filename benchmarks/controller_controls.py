"""Each trained controller against the controls a sceptic would pick, over seeds, in worlds it was and was not
tuned on.

For every (environment, world, seed), one ``clova-train controller fit`` of the environment's quickstart config
(``--train.seed``; nothing else changed, so the DQN's settings are the ones chosen on the ``shapes`` world) writes
``evaluation.json``: on the same held-out tasks, the trained controller, the rules without training (HYDRA: the
planner's top, lowest and random sample, the best fixed slot; AVIS: the planner LLM's own choice with every in-context
example in view, a random feasible tool; HAMMR: the prompted LLM dispatcher, which sees each agent's description
and example questions, a random agent, each agent always, the flat ``generic`` agent with every tool and example
among them), the oracle (a ceiling), and the controls fitted on as many logged steps of random play on training
tasks as the DQN trains for (``clova_train.controller.fitted_controls``: a question rule, logistic regression, an MLP
of the DQN's width; ``clova_train.controller.per_sample_controls``: logistic regression and boosted trees that score
each sample, or each AVIS/HAMMR action, on its own with shared weights, HYDRA re-planning below a threshold; every
setting of every fitted control chosen on a validation split of the logs, never on the held-out tasks). Reported per
policy: the mean held-out accuracy over seeds with a 95% Student t interval from
the seed-to-seed variation, and the paired difference DQN - control per seed, with its t interval (scipy).

HYDRA, AVIS and HAMMR on task files (``--environments hydra-benchmark avis-benchmark hammr-benchmark``):
``configs/quickstart/controller_<environment>_benchmark.yaml``, trained on the GQA-format set and evaluated by VQA
accuracy on the OK-VQA-format set that ``clova_train.quickstart.hydra_benchmark`` writes, with model-backed tools
(tiny OWL-ViT, CLIP, BLIP pretrained on synthetic shapes, unprompted).

HYDRA worlds: ``quickstart`` (the shipped ``shapes`` world with the quickstart's rewards, re-plans cost 30: where the
DQN's settings were chosen), every world named with ``--worlds`` with that world file's own rewards (default:
``shapes-replan``, where a re-plan pays off a step later), and ``--random-worlds K`` worlds drawn by
:func:`random_world` (question mix, where the planner puts its good sample per step, how often a list holds one,
confidence range, rewards), written to world files that the CLI reads like any user's; nobody tuned anything on
them.

AVIS and HAMMR worlds: the quickstart's (``seeking``: every untrained baseline already answers everything) and every
world named with ``--seeking-worlds`` (default: ``seeking-paraphrased``, where questions come in wordings unlike the
in-context examples, so the prompted planner and dispatcher misroute some of them).

    python benchmarks/controller_controls.py [--environments hydra avis hammr] [--worlds shapes shapes-replan]
        [--random-worlds 2] [--seeking-worlds seeking-paraphrased] [--seeds 0 1 2 3 4] [--runs-dir DIR]
        [--no-record] [--total-timesteps N] [--eval-episodes K]

``--runs-dir`` keeps the runs (a rerun reuses every finished one); the default is a temporary directory.
``--total-timesteps`` and ``--eval-episodes`` shrink the runs (the DQN's steps, and so the fitted controls' logged
steps, and the held-out tasks) for a quick look: such tables are printed, never recorded.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import REPO, controller_evaluation  # noqa: E402
from results_file import add_seeded_run_arguments, machine, publish, runs_directory, seed_interval  # noqa: E402

from clova_train.controller.evaluation import FITTED_PREFIXES  # noqa: E402
from clova_train.envs.hydra.reasoning_world import REWARD_KEYS, STEPS  # noqa: E402

CONFIGS = {"hydra": "controller_dqn.yaml", "avis": "controller_avis.yaml", "hammr": "controller_hammr.yaml",
           "hydra-benchmark": "controller_hydra_benchmark.yaml", "avis-benchmark": "controller_avis_benchmark.yaml",
           "hammr-benchmark": "controller_hammr_benchmark.yaml"}
BENCHMARKS = ("hydra-benchmark", "avis-benchmark", "hammr-benchmark")  # on the task files of the offline benchmark
SECTIONS = {name: name.split("-")[0] for name in BENCHMARKS}  # an environment's config section, if not its name
OWN = "trained controller"


def random_world(seed: int) -> dict:
    """A HYDRA world file's content drawn from ``seed`` (the benchmark's held-out worlds)."""
    rng = np.random.default_rng(seed)
    low = round(float(rng.uniform(0.05, 0.5)), 2)
    first = round(float(rng.uniform(0.2, 1.0)), 2)
    return {
        "name": f"random-{seed}",
        "questions": {kind: int(rng.integers(0, 4)) or 1 for kind in ("count", "exists", "colour", "compare")},
        "planner": {"confidence": [low, round(float(rng.uniform(low + 0.2, 1.0)), 2)],
                    "has_good": [first, round(float(rng.uniform(first, 1.0)), 2)],
                    "good_rank": {step: ("random" if rng.random() < 0.2 else int(rng.integers(-2, 3)))
                                  for step in STEPS},
                    "malformed": round(float(rng.uniform(0, 0.1)), 2)},
        "tools": {"guess_right_one_in": int(rng.integers(2, 5))},
        "rewards": {"r1": 100, "alpha": 100, "error_penalty": 10, "reject_penalty": int(rng.integers(0, 31))},
    }


def run(environment: str, world: str | None, seed: int, runs: Path, budget: tuple[str, ...] = ()) -> dict[str, dict]:
    """The evaluation of one controller fit (trained if not there yet); ``budget``: options that shrink it."""
    shrunk = "".join(f"-{option.split('.')[-1].replace('=', '')}" for option in budget)
    out = runs / f"{environment}-{Path(world).stem if world else 'quickstart'}-{seed}{shrunk}"
    if world is None:
        world_args = []
    elif environment == "hydra":
        world_args = [f"--hydra.world={world}", *(f"--hydra.{key}=null" for key in REWARD_KEYS)]
    else:
        world_args = [f"--{environment}.world={world}"]
    section = SECTIONS.get(environment, environment)
    return controller_evaluation(  # the world's own rewards, not the quickstart's
        out, "--config", str(REPO / "configs/quickstart" / CONFIGS[environment]), f"--train.seed={seed}",
        f"--{section}.cache_path=null", "--train.eval_every=0", "--train.log_formats=[csv]", "--force", *world_args,
        *budget,
        env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})


def table(environment: str, world: str | None, seeds: list[int], runs: Path, record: bool,
          drawn: int | None = None, budget: tuple[str, ...] = ()) -> None:
    """One environment and world over ``seeds``: print (and with ``record`` append) its table; ``drawn``: the seed of
    a world drawn by :func:`random_world`; ``budget``: options that shrink the runs (then nothing is recorded)."""
    evaluations = [run(environment, world, seed, runs, budget) for seed in seeds]
    record = record and not budget
    shared = [name for name in evaluations[0] if all(name in e for e in evaluations)]
    fitted = [n for n in shared if n.startswith(FITTED_PREFIXES)]
    oracle = [n for n in shared if n.startswith("oracle")]
    names = [OWN, *(n for n in shared if n not in (OWN, *fitted, *oracle)), *fitted, *oracle]
    ours = [e[OWN]["accuracy"] for e in evaluations]
    rows = []
    for name in names:
        values = [e[name]["accuracy"] for e in evaluations]
        difference = "-" if name == OWN else seed_interval([a - b for a, b in zip(ours, values)], signed=True)
        rows.append(f"| {name} | {seed_interval(values)} | {difference} | {', '.join(f'{v:.3f}' for v in values)} |")
    label = f"{environment}, {'the quickstart' if world is None else 'world ' + Path(world).stem}"
    if environment in BENCHMARKS:
        label = (f"{SECTIONS[environment]} on task files: trained on the GQA-format set, evaluated on the "
                 "OK-VQA-format set (VQA accuracy), tiny OWL-ViT / CLIP / BLIP tools")
    shown = f"<runs-dir>/random-{drawn}.yaml (random_world({drawn}))" if drawn else world
    nulls = " ".join(f"--hydra.{key}=null" for key in REWARD_KEYS)
    if environment in BENCHMARKS:
        setting, option = "", ""
    elif environment != "hydra":
        setting = "" if world is None else f" with `--{environment}.world={world}`"
        option = " --seeking-worlds" if world is None else f" --seeking-worlds {world}"
    else:
        setting = "" if world is None else f" with `--hydra.world={shown} {nulls}` (the world file's rewards)"
        option = (f" --worlds --random-worlds {drawn}" if drawn else "" if world is None
                  else f" --worlds {world} --random-worlds 0")
    publish("controller_controls", "Controllers against the controls: rules, fitted learners, seeds, worlds",
            f"{label}, cpu: {machine()}",
            f"Held-out accuracy ({evaluations[0][OWN]['episodes']:.0f} tasks), `configs/quickstart/"
            f"{CONFIGS[environment]}`{setting}, seeds "
            f"{', '.join(map(str, seeds))}: mean [95% t interval over seeds]; DQN - control: paired per seed. "
            f"Command: `python benchmarks/controller_controls.py --environments {environment}"
            f"{option} --seeds {' '.join(map(str, seeds))}"
            f"{''.join(' --' + o.split('.')[-1].replace('_', '-').replace('=', ' ') for o in budget)}`",
            ["policy", "accuracy", "DQN - policy", "per seed"], rows, record)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--environments", nargs="+", default=["hydra", "avis", "hammr"], choices=list(CONFIGS),
                        help="<environment>-benchmark: that environment on the GQA- and OK-VQA-format files of make "
                             "demo-hydra-benchmark")
    parser.add_argument("--worlds", nargs="*", default=["shapes-replan"],
                        help="HYDRA worlds besides the quickstart's (presets or files; each with its own rewards)")
    parser.add_argument("--random-worlds", type=int, default=2, help="HYDRA worlds drawn by random_world (seeds 1..K)")
    parser.add_argument("--seeking-worlds", nargs="*", default=["seeking-paraphrased"],
                        help="AVIS and HAMMR worlds besides the quickstart's (presets or files)")
    parser.add_argument("--total-timesteps", type=int, default=None,
                        help="the DQN's steps (and the fitted controls' logged steps) instead of the config's; "
                             "not recorded")
    parser.add_argument("--eval-episodes", type=int, default=None,
                        help="held-out tasks instead of the config's; not recorded")
    add_seeded_run_arguments(parser)
    args = parser.parse_args()
    budget = tuple(f"--train.{key}={value}" for key, value in (("total_timesteps", args.total_timesteps),
                                                                ("eval_episodes", args.eval_episodes))
                   if value is not None)
    with runs_directory(args.runs_dir) as runs:
        for environment in args.environments:
            if environment in BENCHMARKS:
                from clova_train.quickstart.hydra_benchmark import prepare

                prepare()  # the quickstart config's task files and tool exports (reused when already written)
                table(environment, None, args.seeds, runs, not args.no_record, budget=budget)
                continue
            if environment != "hydra":
                for world in [None, *args.seeking_worlds]:
                    table(environment, world, args.seeds, runs, not args.no_record, budget=budget)
                continue
            for world in [None, *args.worlds]:
                table(environment, world, args.seeds, runs, not args.no_record, budget=budget)
            for k in range(1, args.random_worlds + 1):
                path = runs / f"random-{k}.yaml"
                path.write_text(yaml.safe_dump(random_world(k), sort_keys=False))
                table(environment, str(path), args.seeds, runs, not args.no_record, drawn=k, budget=budget)


if __name__ == "__main__":
    main()

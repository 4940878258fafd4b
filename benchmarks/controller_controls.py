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
DQN's settings were chosen) and every world named with ``--worlds`` with that world file's own rewards (default:
``shapes-replan``, where a re-plan pays off a step later). AVIS and HAMMR worlds: the quickstart's (``seeking``:
every untrained baseline already answers everything) and every world named with ``--seeking-worlds`` (default:
``seeking-paraphrased``, where questions come in wordings unlike the in-context examples, so the prompted planner
and dispatcher misroute some of them, and ``seeking-delayed``, where besides the web and image searches answer only
once a caption or a classification, each useless by itself and costing a little, is in memory).

For every environment, ``--random-worlds K`` worlds drawn by :mod:`clova_train.envs.common.random_worlds` with
seeds ``B .. B+K-1`` (``--world-seed-base B``, default 1000): HYDRA's question mix, planner and rewards; AVIS's and
HAMMR's question mix, wordings, guess rate, per-call costs and tools that need another's result first (delayed
payoff). The generators were designed on seeds below 100; nobody tuned anything on the worlds of seeds 1000 and
up. Each is written to a world file that the CLI reads like any user's.

Per row: the policy's mean held-out accuracy, DQN - policy and policy - best control (the fitted control with the
highest mean), paired per seed with 95% t intervals, and the training cost (issue 51, point 5): per seed, the
training steps at which the DQN's validation evaluations (``evaluations.npz``, 5 per run) first reached the best
control's mean held-out accuracy, or for a fitted control its logged steps if its own held-out accuracy did; "never"
when not reached.

    python benchmarks/controller_controls.py [--environments hydra avis hammr] [--worlds shapes-replan]
        [--seeking-worlds seeking-paraphrased seeking-delayed] [--random-worlds 4] [--world-seed-base 1000] [--seeds 0 1 2 3 4]
        [--runs-dir DIR] [--no-record] [--total-timesteps N] [--eval-episodes K] [--without-quickstart-world]

``--runs-dir`` keeps the runs (a rerun reuses every finished one); the default is a temporary directory.
``--total-timesteps`` and ``--eval-episodes`` shrink the runs (the DQN's steps, and so the fitted controls' logged
steps, and the held-out tasks) for a quick look: such tables are printed, never recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import REPO, controller_evaluation  # noqa: E402
from results_file import add_seeded_run_arguments, machine, publish, runs_directory, seed_interval  # noqa: E402

from clova_train.controller.evaluation import FITTED_PREFIXES  # noqa: E402
from clova_train.envs.common.random_worlds import write_random_world  # noqa: E402
from clova_train.envs.hydra.reasoning_world import REWARD_KEYS  # noqa: E402

CONFIGS = {"hydra": "controller_dqn.yaml", "avis": "controller_avis.yaml", "hammr": "controller_hammr.yaml",
           "hydra-benchmark": "controller_hydra_benchmark.yaml", "avis-benchmark": "controller_avis_benchmark.yaml",
           "hammr-benchmark": "controller_hammr_benchmark.yaml"}
BENCHMARKS = ("hydra-benchmark", "avis-benchmark", "hammr-benchmark")  # on the task files of the offline benchmark
SECTIONS = {name: name.split("-")[0] for name in BENCHMARKS}  # an environment's config section, if not its name
OWN = "trained controller"
WORLD_SEED_BASE = 1000  # drawn worlds' first seed: far from the seeds (< 100) the generators were designed on
EVALUATIONS = "evaluations.npz"  # the run's validation log (clova_train.controller.callbacks)
EVALUATIONS_PER_RUN = 5  # validation evaluations over a run's training steps (for the steps to reach a control)
WORDING = "held_out_wording_accuracy"  # a row's accuracy on test tasks asked in a wording training never used
WORDING_TEXT = (" Held-out wordings: the test tasks whose question is in the wording of its kind that no training or "
                "validation task is asked in (mean [interval] over seeds; their count is in evaluation.json).")


def config_steps(environment: str, budget: tuple[str, ...]) -> int:
    """The training steps of a run: ``--total-timesteps`` if given, else the quickstart config's."""
    for option in budget:
        if option.startswith("--train.total_timesteps="):
            return int(option.split("=", 1)[1])
    config = yaml.safe_load((REPO / "configs/quickstart" / CONFIGS[environment]).read_text())
    return int(config["train"]["total_timesteps"])


def run_directory(environment: str, world: str | None, seed: int, runs: Path, budget: tuple[str, ...]) -> Path:
    shrunk = "".join(f"-{option.split('.')[-1].replace('=', '')}" for option in budget)
    return runs / f"{environment}-{Path(world).stem if world else 'quickstart'}-{seed}{shrunk}"


def run(environment: str, world: str | None, seed: int, runs: Path, budget: tuple[str, ...] = ()) -> dict[str, dict]:
    """The evaluation of one controller fit (trained if not there yet); ``budget``: options that shrink it."""
    out = run_directory(environment, world, seed, runs, budget)
    if world is None:
        world_args = []
    elif environment == "hydra":
        world_args = [f"--hydra.world={world}", *(f"--hydra.{key}=null" for key in REWARD_KEYS)]
    else:
        world_args = [f"--{environment}.world={world}"]
    section = SECTIONS.get(environment, environment)
    every = max(1, config_steps(environment, budget) // EVALUATIONS_PER_RUN)
    return controller_evaluation(  # the world's own rewards, not the quickstart's
        out, "--config", str(REPO / "configs/quickstart" / CONFIGS[environment]), f"--train.seed={seed}",
        f"--{section}.cache_path=null", f"--train.eval_every={every}", "--train.log_formats=[csv]", "--force",
        *world_args, *budget,
        env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})


def logged_steps(run_dir: Path) -> int:
    """The steps of random play a run's fitted controls learnt from (``train.control_steps``, null: the DQN's
    ``train.total_timesteps``), from the run's ``config.json``."""
    train = json.loads((run_dir / "config.json").read_text())["train"]
    return int(train["total_timesteps"] if train.get("control_steps") is None else train["control_steps"])


def steps_to_reach(run_dir: Path, target: float) -> int | None:
    """The training steps at which the run's validation log (:data:`EVALUATIONS`) first shows an accuracy of at
    least ``target`` (None: never, or no log)."""
    path = run_dir / EVALUATIONS
    if not path.is_file():
        return None
    with np.load(path) as saved:
        for steps, accuracy in zip(saved["timesteps"], saved["accuracy"]):
            if accuracy >= target:
                return int(steps)
    return None


def training_cost(name: str, values: list[float], best: float, run_dirs: list[Path] | None,
                  logged: list[int]) -> str:
    """Point 5 of issue 51: per seed, the steps at which ``name`` first reached the best control's mean held-out
    accuracy ``best``: a trained controller's (``run_dirs``: its runs) first validation evaluation at or above it, a
    fitted control's logged steps if its held-out accuracy is; "never" otherwise."""
    if run_dirs is not None:
        reached = [steps_to_reach(run_dir, best) for run_dir in run_dirs]
    elif name.startswith(FITTED_PREFIXES):
        reached = [steps if value >= best else None for value, steps in zip(values, logged)]
    else:
        return "-"  # a rule without training, or the oracle
    return ", ".join("never" if steps is None else f"{steps:,}" for steps in reached)


def held_out_cells(evaluations: list[dict[str, dict]], name: str) -> str:
    """The two cells of a world whose test tasks include questions in a wording training never used: ``name``'s
    accuracy on those tasks and the DQN's paired difference there ("-" where a seed's row lacks it)."""
    values = [e[name].get(WORDING) for e in evaluations]
    if any(v is None for v in values):
        return "- | - | "
    ours = [e[OWN][WORDING] for e in evaluations]
    difference = "-" if name == OWN else seed_interval([a - b for a, b in zip(ours, values)], signed=True)
    return f"{seed_interval(values)} | {difference} | "


def table(environment: str, world: str | None, seeds: list[int], runs: Path, record: bool,
          drawn: int | None = None, budget: tuple[str, ...] = (), q_networks: tuple[str, ...] = ()) -> None:
    """One environment and world over ``seeds``: print (and with ``record`` append) its table; ``drawn``: the seed of
    a world drawn at random (:mod:`clova_train.envs.common.random_worlds`); ``budget``: options that shrink the runs
    (then nothing is recorded); ``q_networks``: more DQN runs, one per ``dqn.q_network`` named, each a row."""
    evaluations = [run(environment, world, seed, runs, budget) for seed in seeds]
    trained = {OWN: [run_directory(environment, world, seed, runs, budget) for seed in seeds]}
    for q_network in q_networks:
        options = (*budget, f"--dqn.q_network={q_network}")
        name = f"{OWN} (dqn.q_network: {q_network})"
        for evaluation, seed in zip(evaluations, seeds):
            evaluation[name] = run(environment, world, seed, runs, options)[OWN]
        trained[name] = [run_directory(environment, world, seed, runs, options) for seed in seeds]
    record = record and not budget
    shared = [name for name in evaluations[0] if all(name in e for e in evaluations)]
    fitted = [n for n in shared if n.startswith(FITTED_PREFIXES)]
    oracle = [n for n in shared if n.startswith("oracle")]
    extras = [n for n in trained if n != OWN]
    names = [OWN, *extras, *(n for n in shared if n not in (OWN, *extras, *fitted, *oracle)), *fitted, *oracle]
    ours = [e[OWN]["accuracy"] for e in evaluations]
    control = max(fitted, key=lambda n: np.mean([e[n]["accuracy"] for e in evaluations])) if fitted else None
    controls = [e[control]["accuracy"] for e in evaluations] if control else []
    best = float(np.mean(controls)) if control else None
    logged = [logged_steps(run_dir) for run_dir in trained[OWN]]
    every = max(1, config_steps(environment, budget) // EVALUATIONS_PER_RUN)
    wording = all(WORDING in e[OWN] for e in evaluations)  # some test tasks asked in a held-out wording
    rows = []
    for name in names:
        values = [e[name]["accuracy"] for e in evaluations]
        difference = "-" if name == OWN else seed_interval([a - b for a, b in zip(ours, values)], signed=True)
        versus = "-" if not control or name == control else \
            seed_interval([a - b for a, b in zip(values, controls)], signed=True)
        cost = "-" if best is None else training_cost(name, values, best, trained.get(name), logged)
        rows.append(f"| {name} | {seed_interval(values)} | {difference} | {versus} | {cost} | "
                    f"{held_out_cells(evaluations, name) if wording else ''}{', '.join(f'{v:.3f}' for v in values)} |")
    label = f"{environment}, {'the quickstart' if world is None else 'world ' + Path(world).stem}"
    if environment in BENCHMARKS:
        label = (f"{SECTIONS[environment]} on task files: trained on the GQA-format set, evaluated on the "
                 "OK-VQA-format set (VQA accuracy), tiny OWL-ViT / CLIP / BLIP tools")
    kind = "hydra" if environment == "hydra" else "seeking"
    shown = f"<runs-dir>/{Path(world).name} (random_{kind}_world({drawn}))" if drawn is not None else world
    nulls = " ".join(f"--hydra.{key}=null" for key in REWARD_KEYS)
    if environment in BENCHMARKS:
        setting, option = "", ""
    elif environment != "hydra":
        setting = "" if world is None else f" with `--{environment}.world={shown}`"
        option = (f" --seeking-worlds --random-worlds 1 --world-seed-base {drawn}" if drawn is not None
                  else " --seeking-worlds --random-worlds 0" if world is None
                  else f" --seeking-worlds {world} --random-worlds 0")
    else:
        setting = "" if world is None else f" with `--hydra.world={shown} {nulls}` (the world file's rewards)"
        option = (f" --worlds --random-worlds 1 --world-seed-base {drawn}" if drawn is not None
                  else " --worlds --random-worlds 0" if world is None else f" --worlds {world} --random-worlds 0")
    best_text = f"best control: {control} ({best:.3f})" if control else "no fitted control"
    publish("controller_controls", "Controllers against the controls: rules, fitted learners, seeds, worlds",
            f"{label}, cpu: {machine()}",
            f"Held-out accuracy ({evaluations[0][OWN]['episodes']:.0f} tasks), `configs/quickstart/"
            f"{CONFIGS[environment]}`{setting}, seeds "
            f"{', '.join(map(str, seeds))}: mean [95% t interval over seeds]; DQN - policy and policy - best "
            f"control: paired per seed; {best_text}. Steps to the best control: per seed, the training steps at "
            f"which the DQN's validation accuracy (every {every:,} steps) first "
            f"reached the best control's mean held-out accuracy, or a fitted control's {logged[0]:,} logged steps if "
            f"its held-out accuracy did (never: not reached).{WORDING_TEXT if wording else ''} Command: "
            f"`python benchmarks/controller_controls.py "
            f"--environments {environment}{option}"
            f"{' --q-networks ' + ' '.join(q_networks) if q_networks else ''} --seeds {' '.join(map(str, seeds))}"
            f"{''.join(' --' + o.split('.')[-1].replace('_', '-').replace('=', ' ') for o in budget)}`",
            ["policy", "accuracy", "DQN - policy", "policy - best control", "steps to the best control",
             *(["accuracy on held-out wordings", "DQN - policy there"] if wording else []), "per seed"], rows, record)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--environments", nargs="+", default=["hydra", "avis", "hammr"], choices=list(CONFIGS),
                        help="<environment>-benchmark: that environment on the GQA- and OK-VQA-format files of make "
                             "demo-hydra-benchmark")
    parser.add_argument("--worlds", nargs="*", default=["shapes-replan"],
                        help="HYDRA worlds besides the quickstart's (presets or files; each with its own rewards)")
    parser.add_argument("--random-worlds", type=int, default=2,
                        help="worlds drawn at random per environment (HYDRA, AVIS, HAMMR), seeds B..B+K-1")
    parser.add_argument("--q-networks", nargs="*", default=[], choices=["mlp", "per_sample"],
                        help="HYDRA: more DQN runs with these dqn.q_network values (per_sample: the shared per-sample "
                             "scorer), each its own row beside the config's")
    parser.add_argument("--world-seed-base", type=int, default=WORLD_SEED_BASE,
                        help="B: the first seed of the drawn worlds (designs were decided on seeds below 100)")
    parser.add_argument("--without-quickstart-world", action="store_true",
                        help="leave out the quickstart's world (its table is already recorded: a run of other worlds)")
    parser.add_argument("--seeking-worlds", nargs="*", default=["seeking-paraphrased", "seeking-delayed"],
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
            extra = tuple(args.q_networks) if environment == "hydra" else ()  # per_sample reads HYDRA's samples
            if environment in BENCHMARKS:
                from clova_train.quickstart.hydra_benchmark import prepare

                prepare()  # the quickstart config's task files and tool exports (reused when already written)
                table(environment, None, args.seeds, runs, not args.no_record, budget=budget, q_networks=extra)
                continue
            named = args.worlds if environment == "hydra" else args.seeking_worlds
            for world in [*([] if args.without_quickstart_world else [None]), *named]:
                table(environment, world, args.seeds, runs, not args.no_record, budget=budget, q_networks=extra)
            kind = "hydra" if environment == "hydra" else "seeking"
            for seed in range(args.world_seed_base, args.world_seed_base + args.random_worlds):
                path = write_random_world(kind, seed, runs / f"random-{kind}-{seed}.yaml")
                table(environment, str(path), args.seeds, runs, not args.no_record, drawn=seed, budget=budget,
                      q_networks=extra)


if __name__ == "__main__":
    main()

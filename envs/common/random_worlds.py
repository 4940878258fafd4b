"""Worlds drawn at random, for benchmarks that must run on worlds nobody tuned anything on.

:func:`random_hydra_world` draws a HYDRA world file (:mod:`clova_train.envs.hydra.reasoning_world`): the question
mix, where the planner puts its good sample per step, how often a list holds one, its confidence range, the
rewards. :func:`random_seeking_world` draws an AVIS / HAMMR world file (:mod:`clova_train.envs.avis.seeking_world`):
the question mix, each kind's wordings from a vocabulary (the first always the canonical one, so the in-context
examples stay right for some questions), the guessing tool's rate, per-call costs of tools and agents, and tools
that answer only once memory holds another tool's result (delayed payoff: the first call earns nothing now).
The same seed always gives the same world, and every drawn world loads.

Write one to a file (the CLI reads it like any user's)::

    python -m clova_train.envs.common.random_worlds seeking 1000 world.yaml
    python -m clova_train.envs.common.random_worlds hydra 1000 world.yaml
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from clova_train.envs.avis.seeking_world import SEEKING_KINDS, TEMPLATES
from clova_train.envs.hydra.reasoning_world import STEPS

HYDRA_KINDS = ("count", "exists", "colour", "compare")  # the question kinds of HYDRA worlds
WORDINGS: dict[str, tuple[str, ...]] = {  # other ways users ask each kind (each reads as its own kind only)
    "count": ("What number of {c} {s}s can you find?", "Count the {c} {s}s for me.",
              "Tell me how many {s}s in {c} the picture holds.", "{c} {s}s: how many?"),
    "exists": ("Can you find a {c} {s}?", "Does the picture contain a {c} {s}?", "Any {c} {s} in sight?",
               "Tell me whether a {c} {s} appears."),
    "colour": ("Which colour does the leftmost {s} have?", "The {s} furthest to the left: its colour?",
               "Name the colour of the first {s} from the left.", "What is the hue of the leftmost {s}?"),
    "entity": ("The leftmost {s} is the emblem of which guild?", "Whose emblem is the leftmost {s}?",
               "Name the guild that uses the leftmost {s} as emblem.", "Which guild does the leftmost {s} stand for?"),
    "fact": ("When did the guild whose emblem is the leftmost {s} start?",
             "Founding year of the guild behind the leftmost {s}?",
             "The guild with the leftmost {s} as emblem dates from which year?",
             "How old is the guild of the leftmost {s}: founded when?"),
}
PREREQUISITES = (  # (tool, the tool whose result it needs first): pairs the avis graph lets an agent satisfy
    ("text_search", "caption"), ("image_search", "caption"), ("text_search", "classify"),
    ("image_search", "classify"), ("classify", "caption"), ("select", "caption"), ("detect", "caption"),
)
COSTED_TOOLS = ("caption", "vqa", "detect", "select", "classify", "image_search", "text_search")
COSTED_AGENTS = ("counter", "existence", "colour", "entity", "fact", "generic")  # the quickstart HAMMR agents


def random_hydra_world(seed: int) -> dict[str, Any]:
    """A HYDRA world file's content drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    low = round(float(rng.uniform(0.05, 0.5)), 2)
    first = round(float(rng.uniform(0.2, 1.0)), 2)
    return {
        "name": f"random-{seed}",
        "questions": {kind: int(rng.integers(0, 4)) or 1 for kind in HYDRA_KINDS},
        "planner": {"confidence": [low, round(float(rng.uniform(low + 0.2, 1.0)), 2)],
                    "has_good": [first, round(float(rng.uniform(first, 1.0)), 2)],
                    "good_rank": {step: ("random" if rng.random() < 0.2 else int(rng.integers(-2, 3)))
                                  for step in STEPS},
                    "malformed": round(float(rng.uniform(0, 0.1)), 2)},
        "tools": {"guess_right_one_in": int(rng.integers(2, 5))},
        "rewards": {"r1": 100, "alpha": 100, "error_penalty": 10, "reject_penalty": int(rng.integers(0, 31))},
    }


def random_seeking_world(seed: int) -> dict[str, Any]:
    """An AVIS / HAMMR world file's content drawn from ``seed`` (see the module docstring)."""
    rng = np.random.default_rng([seed, 51])
    phrasings = {}
    for kind in SEEKING_KINDS:
        others = list(WORDINGS[kind])
        picked = rng.choice(len(others), size=int(rng.integers(1, len(others) + 1)), replace=False)
        phrasings[kind] = [TEMPLATES[kind], *(others[int(i)] for i in sorted(picked))]
    pairs = rng.choice(len(PREREQUISITES), size=int(rng.integers(1, 3)), replace=False)
    requires: dict[str, str] = {}
    for index in pairs:
        tool, needed = PREREQUISITES[int(index)]
        if tool not in requires and needed not in requires:  # one prerequisite per tool, no chains
            requires[tool] = needed
    costs = {tool: round(float(rng.uniform(0.1, 1.5)), 2) for tool in COSTED_TOOLS if rng.random() < 0.4}
    costs.update({f"agent:{agent}": round(float(rng.uniform(0.1, 2.0)), 2) for agent in COSTED_AGENTS
                  if rng.random() < 0.3})
    return {
        "name": f"random-seeking-{seed}",
        "questions": {kind: int(rng.integers(0, 4)) or 1 for kind in SEEKING_KINDS},
        "phrasings": phrasings,
        "tools": {"guess_right_one_in": int(rng.integers(2, 6)), "call_costs": costs, "requires": requires},
    }


DRAWERS = {"hydra": random_hydra_world, "seeking": random_seeking_world}


def write_random_world(kind: str, seed: int, path: str | Path) -> Path:
    """Write the world ``DRAWERS[kind](seed)`` draws to ``path`` as YAML (the folder made if missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(DRAWERS[kind](seed), sort_keys=False), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a world drawn at random to a YAML world file.")
    parser.add_argument("environment", choices=sorted(DRAWERS), help="hydra, or seeking (AVIS and HAMMR)")
    parser.add_argument("seed", type=int)
    parser.add_argument("path", help="the YAML file to write")
    args = parser.parse_args(argv)
    print(write_random_world(args.environment, args.seed, args.path))


if __name__ == "__main__":
    main()

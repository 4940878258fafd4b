"""A sixth tool from a test folder: docs/architecture.md's "A tool is a folder", walked with a toy tool packaged the
way a user's package is installed, and nothing of this repository edited.

``tests/plugins/`` holds ``toy_tool/`` (the tool, its datamodules, synthetic data, tiny builder, demo, smoke-run data
and ``recipe.py`` with its two configs) and ``toy_tool-0.1.dist-info/``, the metadata installing such a package
leaves: its ``entry_points.txt`` declares ``[clova_train.tool_recipes] toy = toy_tool.recipe:RECIPE``, and nothing
else. ``importlib.metadata`` finds a distribution in any ``sys.path`` folder, so ``PYTHONPATH=tests/plugins`` is the
whole installation; the suite's own path (setup.cfg: ``tests benchmarks``) leaves it out, so no other test sees the
toy.

The slow tests run, in fresh processes with that ``PYTHONPATH``: ``make demo-toy`` (the Makefile's one ``demo-%``
rule: ``clova-train tiny-model toy``, ``fit`` of the toy's quickstart config, ``export``, the toy's demo module,
``report`` and ``serve``; run in a temporary folder, so the config's relative ``checkpoints/`` paths land there), the
conformance suite with its ``[toy]`` ids, and the two benchmarks that iterate over the recipes. The fast tests check
how the recipe is found, and that a broken or clashing plug-in is refused naming itself.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from clova_train.core.errors import ClovaTrainError
from clova_train.tools.recipes import RECIPE_ENTRY_POINT_GROUP, register_tool, tool_recipes

REPO = Path(__file__).resolve().parents[2]
PLUGINS = REPO / "tests" / "plugins"
TOY_CLASS = "toy_tool.tool.ToyPromptClassifier"
QUICKSTART_CONFIG = PLUGINS / "toy_tool" / "configs" / "toy_prompt.yaml"


# ---------------------------------------------------------------------- fresh processes with the plug-in installed
def installed(pythonpath: Path = PLUGINS) -> dict[str, str]:
    """The environment of a process that has the plug-in installed (``pythonpath`` on its path), on one torch
    thread as the suite's own workers; without this pytest's variables (a pytest-xdist worker's name, options), so
    that a pytest it starts is a plain run."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return {**environment, "PYTHONPATH": str(pythonpath), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def run(step: str, command: list[str], cwd: Path = REPO, timeout: float = 300,
        env: dict[str, str] | None = None) -> str:
    """Run ``command`` (``python`` stands for this interpreter) and return its output (stdout and stderr together);
    a failure names ``step`` and shows the output's end."""
    completed = subprocess.run(program(command), cwd=cwd, env=env or installed(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return succeeded(step, command, completed.returncode, completed.stdout)


def program(command: list[str]) -> list[str]:
    """``command`` with ``python`` standing for this interpreter."""
    return [sys.executable, *command[1:]] if command[0] == "python" else command


def succeeded(step: str, command: list[str], returncode: int | None, output: str) -> str:
    """``output``, once ``command`` is found to have exited 0 (else a failure naming ``step``)."""
    assert returncode == 0, f"{step}: {' '.join(command)} exited {returncode}:\n{output[-4000:]}"
    return output


# ---------------------------------------------------------------------- fast: how the recipe is found
def test_the_recipe_is_found_through_its_entry_point_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.metadata import distribution

    from clova_train.quickstart.tiny_models import tiny_models
    from clova_train.tools import recipes

    if str(PLUGINS) not in sys.path:  # the suite's own path leaves the plug-in out
        assert "toy" not in tool_recipes()
    monkeypatch.syspath_prepend(str(PLUGINS))
    found = tool_recipes()
    assert found["toy"] is importlib.import_module("toy_tool.recipe").RECIPE and "toy" not in recipes._REGISTERED
    assert list(found)[-1] == "toy"  # after the package's own tools
    assert tiny_models()["toy"] is found["toy"].tiny_model
    points = distribution("toy-tool").entry_points
    assert [(p.group, p.name, p.value) for p in points] == [(RECIPE_ENTRY_POINT_GROUP, "toy", "toy_tool.recipe:RECIPE")]
    assert Path(found["toy"].quickstart_config) == QUICKSTART_CONFIG  # absolute: the configs ship in the package


def test_the_demo_request_is_the_purple_centroid(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe holds the centroid as a literal, so that reading it imports no torch; it is the computed one."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    from toy_tool.recipe import PURPLE_CENTROID, RECIPE
    from toy_tool.synthetic import concept_centroid

    assert list(PURPLE_CENTROID) == pytest.approx(concept_centroid("purple").tolist(), abs=5e-4)
    assert RECIPE.demo_request == {"vectors": [list(PURPLE_CENTROID)], "concept": "purple"}


def declare(site: Path, name: str, value: str) -> Path:
    """A distribution in ``site`` declaring ``name = value`` under the recipe entry-point group; returns ``site``."""
    info = site / f"{name}_plug_in-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-plug-in\nVersion: 0.1\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(f"[{RECIPE_ENTRY_POINT_GROUP}]\n{name} = {value}\n", encoding="utf-8")
    return site


@pytest.mark.parametrize(("value", "message"), [
    ("no_such_plug_in_module:RECIPE", r"the tool recipe 'broken' \(no_such_plug_in_module:RECIPE, entry point group "
                                      r"'clova_train.tool_recipes'\) failed to load: No module named"),
    ("json:dumps", r"the entry point 'broken' \(json:dumps\) of group 'clova_train.tool_recipes' is a function, "
                   r"not a ToolRecipe"),
], ids=["missing module", "not a recipe"])
def test_a_broken_plug_in_names_its_entry_point(value: str, message: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(declare(tmp_path, "broken", value)))
    with pytest.raises(ClovaTrainError, match=message):
        tool_recipes()


CLASHES = """
import dataclasses

from toy_tool.recipe import RECIPE

NAMED_CLIP = dataclasses.replace(RECIPE, name="clip")
CLIP_MODEL = dataclasses.replace(RECIPE, name="toy2", tiny_model=dataclasses.replace(RECIPE.tiny_model, kind="clip"))
"""


@pytest.mark.parametrize(("attribute", "installed_message", "registered_message"), [
    ("NAMED_CLIP", "two tool recipes are named 'clip': clova_train.tools.clip.tool.PromptedClip and " + TOY_CLASS,
     "a recipe named 'clip' is already registered"),
    ("CLIP_MODEL", "two tiny models are named 'clip': the 'clip' recipe's "
                   r"\(clova_train.tools.clip.tiny:build_quickstart_clip\) and the 'toy2' recipe's "
                   r"\(toy_tool.tiny:build_toy_model\)",
     "a tiny model named 'clip' is already registered"),
], ids=["tool name", "tiny-model kind"])
def test_a_plug_in_may_not_take_a_shipped_tools_name_or_model(
        attribute: str, installed_message: str, registered_message: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, restored_registry: None) -> None:
    """Installed (an entry point) or registered at run time, a recipe whose name or tiny-model kind is CLIP's is
    refused: it would replace CLIP's in the CLI, the demos and the suite."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    (tmp_path / "clashing_recipes.py").write_text(CLASHES, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    clashing = getattr(importlib.import_module("clashing_recipes"), attribute)
    with pytest.raises(ClovaTrainError, match=registered_message):
        register_tool(clashing)
    declare(tmp_path / "site", "clash", f"clashing_recipes:{attribute}")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(ClovaTrainError, match=installed_message):
        tool_recipes()


def test_a_fresh_process_finds_the_tool_class_through_the_recipe_alone(tmp_path: Path) -> None:
    """``export`` and ``serve`` resolve ``tool.json``'s class path in a process that never imported the tool: the
    recipe's entry point is enough (the plug-in declares nothing under ``clova_train.prompt_tools``), and the same
    module importable without the distribution's metadata is not (nothing imports a module a file names)."""
    probe = ["python", "-c", "from clova_train.tools.base import registered_tool; "
             f"from importlib.metadata import entry_points; print(registered_tool({TOY_CLASS!r})); "
             "print(sorted(e.value for e in entry_points(group='clova_train.prompt_tools')))"]
    assert run("installed", probe).splitlines()[-2:] == [f"<class '{TOY_CLASS}'>", "[]"]
    shutil.copytree(PLUGINS / "toy_tool", tmp_path / "toy_tool", ignore=shutil.ignore_patterns("__pycache__"))
    assert run("module without metadata", probe, env=installed(tmp_path)).splitlines()[-2] == "None"


# ---------------------------------------------------------------------- slow: the CLI, make, the suite, benchmarks
# The two benchmark runs take about as long as the demo and the conformance run together, each a chain of
# one-threaded processes: they run one after the other in a background thread from the first slow test on, beside
# the demo and the suite (two processes at a time, for 2 cores), and their tests wait for their outputs.
BENCHMARKS: dict[str, Callable[[Path], list[str]]] = {
    "test_the_smoke_run_drives_the_toys_paper_config": lambda tmp: [
        "python", "benchmarks/smoke_real.py", "--configs", "toy", "--models", str(tmp / "models"),
        "--output", str(tmp / "runs"), "--no-record", "--no-activation-modes", "--timeout", "240"],
    "test_the_prompt_tuning_benchmark_times_the_toy": lambda tmp: [
        "python", "benchmarks/prompt_tuning.py", "--tool", "toy", "--instances", "4", "--chunk-size", "2",
        "--steps", "3", "--repeats", "1", "--no-record"],
}
BENCHMARK_TIMEOUT = 600


class Background:
    """Commands run one after another in a thread, each in a process group of its own, from the repository root."""

    def __init__(self, commands: dict[str, list[str]]) -> None:
        self.commands = commands
        self.results: dict[str, tuple[int | None, str]] = {}
        self.finished = {name: threading.Event() for name in commands}
        self.process: subprocess.Popen | None = None
        self.stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for name, command in self.commands.items():
            try:
                if not self.stopping:
                    self.process = subprocess.Popen(program(command), cwd=REPO, env=installed(),
                                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                                    start_new_session=True)
                    output, _ = self.process.communicate()
                    self.results[name] = (self.process.returncode, output)
            except OSError as error:
                self.results[name] = (None, f"did not start: {error}")
            finally:
                self.finished[name].set()

    def output(self, name: str) -> str:
        """The output of the command started for test ``name``, once it has exited 0 (else a failure)."""
        assert name in self.commands, f"{name} is not a background command"
        if not self.finished[name].wait(BENCHMARK_TIMEOUT):
            return succeeded(name, self.commands[name], None, f"still running after {BENCHMARK_TIMEOUT} s")
        returncode, output = self.results.get(name, (None, "not run: the module's tests were stopped"))
        return succeeded(name, self.commands[name], returncode, output)

    def stop(self) -> None:
        """Stop the running command's process group (the benchmark and the processes it started)."""
        self.stopping = True
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.thread.join(30)


@pytest.fixture(scope="module")
def benchmarks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Background]:
    """The benchmark commands of this module's selected tests, started in the background."""
    selected = {item.name for item in request.session.items if item.module is request.module}
    commands = {name: command(tmp_path_factory.mktemp(name.removeprefix("test_")))
                for name, command in BENCHMARKS.items() if name in selected}
    background = Background(commands)
    yield background
    background.stop()


def demo_steps(output: str) -> dict[str, tuple[str, str]]:
    """The demo's output split at the commands it prints before running each (``clova-train ...``, ``python -m
    ...``): per step (the subcommand, or the module), its command line and what it printed."""
    steps: dict[str, tuple[str, str]] = {}
    current, lines = "", []
    for line in output.splitlines():
        if re.match(r"(clova-train|python -m) ", line):
            current = line.split()[1] if line.startswith("clova-train") else line.split()[2]
            steps[current] = (line, "")
            lines = []
        elif current:
            lines.append(line)
            steps[current] = (steps[current][0], "\n".join(lines))
    return steps


@pytest.mark.slow  # seven fresh processes: make, the demo runner, tiny-model, fit, export, the demo, report, serve
@pytest.mark.usefixtures("benchmarks")  # started beside it
def test_make_demo_builds_fits_exports_demonstrates_reports_and_serves_the_toy(tmp_path: Path) -> None:
    """The CLI knows the toy's tiny model and the demo runner its recipe; ``make demo-toy`` runs the Makefile's
    ``demo-%`` rule in a temporary folder (``BIN`` this interpreter's, ``STAMP`` empty: installed already), where the
    quickstart config's relative ``checkpoints/`` paths land, and each step does its part."""
    if shutil.which("make") is None:
        pytest.skip("needs make (the demo rule is the Makefile's)")
    help_text = run("tiny-model --help", ["python", "-m", "clova_train", "tiny-model", "--help"])
    help_text = " ".join(help_text.split())  # argparse wraps its lines
    assert re.search(r"\{[^}]*\btoy\b[^}]*\}", help_text) and "toy: a linear classifier" in help_text, help_text
    listed = run("demo --list", ["python", "-m", "clova_train.quickstart.demo", "--list"]).split()
    assert listed[-1] == "toy", listed

    work = tmp_path / "demo"
    work.mkdir()
    in_repo = sorted((REPO / "checkpoints").glob("*toy*"))
    make = ["make", "--no-print-directory", "-f", str(REPO / "Makefile"), "demo-toy",
            f"BIN={Path(sys.executable).parent}", "STAMP="]
    completed = subprocess.run(make, cwd=work, env=installed(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, timeout=300)
    output, steps = completed.stdout, demo_steps(completed.stdout)
    succeeded(f"make demo-toy, at its step {list(steps)[-1] if steps else 'make'}", make, completed.returncode, output)
    assert "-m clova_train.quickstart.demo toy" in output.splitlines()[0], output[:2000]
    assert list(steps) == ["tiny-model", "fit", "export", "toy_tool.demo", "report", "serve"], output[-4000:]

    command, _ = steps["tiny-model"]
    assert command == "clova-train tiny-model toy checkpoints/models/toy", command
    model = work / "checkpoints" / "models" / "toy"
    assert {p.name for p in model.iterdir()} == {"toy_classifier.json", "toy_classifier.safetensors"}, "tiny-model"

    command, printed = steps["fit"]
    assert command.startswith(f"clova-train fit --config {QUICKSTART_CONFIG} "), command
    run_dir = work / "checkpoints" / "quickstart_toy"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["tool"], summary["tried"]) == ("toy_classifier", 4) and summary["accepted"] >= 1, ("fit", summary)
    assert json.loads((run_dir / "tool.json").read_text())["class_path"] == TOY_CLASS, "fit"
    assert json.loads((run_dir / "run.json").read_text())["tool"], "fit: run.json"

    command, printed = steps["export"]
    assert command == "clova-train export checkpoints/quickstart_toy --output checkpoints/quickstart_toy/export"
    export = run_dir / "export"
    assert all((export / name).is_file() for name in ("tool.json", "pool.safetensors", "export.json")), "export"

    # the demo module, on the export in a fresh process: held-out purple vectors are called purple through the
    # prompts only, the other classes keep their names
    command, printed = steps["toy_tool.demo"]
    table = {row.split()[0]: [int(v.rstrip("%")) for v in row.split()[1:]] for row in printed.splitlines()
             if re.match(r"(red|green|blue|purple) ", row)}
    assert set(table) == {"red", "green", "blue", "purple"}, ("demo", printed)
    assert table["purple"][0] <= 10 and table["purple"][1] >= 50, ("demo", table)
    assert all(table[c][1] >= 90 for c in ("red", "green", "blue")), ("demo", table)

    command, printed = steps["report"]
    assert command == "clova-train report checkpoints/quickstart_toy", command
    assert "instance" in (run_dir / "report" / "report.md").read_text(), "report"

    command, printed = steps["serve"]
    assert command.startswith("clova-train serve checkpoints/quickstart_toy/export --request "), command
    assert json.loads(printed.strip().splitlines()[-1]) == {"labels": ["purple"], "prompted": True}, ("serve", printed)

    assert sorted((REPO / "checkpoints").glob("*toy*")) == in_repo, "the demo wrote into the repository"


@pytest.mark.slow  # a pytest run in a fresh process
@pytest.mark.usefixtures("benchmarks")  # started beside it
def test_the_conformance_suite_checks_the_toy(tmp_path: Path) -> None:
    """``tests/tools/test_conformance.py`` parametrizes over the recipes it finds: installed, the toy is one."""
    output = run("conformance suite", ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA",
                                       f"--basetemp={tmp_path / 'pytest'}", "tests/tools/test_conformance.py",
                                       "-k", "toy"])
    passed = set(re.findall(r"^PASSED tests/tools/test_conformance.py::(\w+\[toy\])", output, re.MULTILINE))
    assert passed == {"test_configs_name_the_recipes_classes[toy]", "test_tool_keeps_the_prompt_tool_contract[toy]",
                      "test_a_short_fit_exports_and_serves[toy]"}, output[-3000:]


@pytest.mark.slow  # the benchmark builds the tiny model and times two methods in a fresh process
def test_the_prompt_tuning_benchmark_times_the_toy(benchmarks: Background) -> None:
    """Without benchmark settings in its recipe, ``--tool toy`` times the engine against the plain per-instance
    loop on the toy's tiny model (random weights) and its synthetic data; ``--no-record`` only prints the table."""
    output = benchmarks.output("test_the_prompt_tuning_benchmark_times_the_toy")
    rows = [line for line in output.splitlines() if line.startswith("|")]
    assert any("engine" in row for row in rows) and any("sequential" in row for row in rows), output[-3000:]


@pytest.mark.slow  # four fresh processes: build, fit, export, serve
def test_the_smoke_run_drives_the_toys_paper_config(benchmarks: Background) -> None:
    """``benchmarks/smoke_real.py --configs toy`` builds the recipe's model with its ``module:function``, writes its
    data at the paper config's paths, fits, exports and serves, all under its ``--output``; ``--no-record`` only
    prints the table."""
    output = benchmarks.output("test_the_smoke_run_drives_the_toys_paper_config")
    rows = [line for line in output.splitlines() if line.startswith(f"| {PLUGINS / 'toy_tool'}")]
    assert rows and "build ok, fit ok, export ok, serve ok" in rows[-1], output[-3000:]

"""Running ``clova-train`` from the tests: in this process, in a subprocess, and serving an export in a fresh
process; the arguments of a small, quiet CLIP prompt-tuning fit."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from clova_train.cli import main

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"

# `clova-train fit` on one CPU process, one epoch, seeded, without logger, progress bar or model summary. Quiet
# on purpose: the tests built on it (DDP included) compare what is learned, pools and summaries, and read the
# output for messages; the shipped configs' own bars, loggers and callbacks on several ranks are run as users
# run them in configs/test_quickstart_configs_ddp.py and configs/test_paper_configs_ddp.py.
QUIET_CPU_FIT = [
    "fit", "--seed_everything=0", "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.max_epochs=1",
    "--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
]
FAST_MODEL_ARGS = [
    "--model.class_path=clova_train.models.PromptTuning",
    "--model.init_args.tool.class_path=clova_train.tools.clip.tool.PromptedClip",
    "--model.init_args.tool.init_args.pretrained=null",
    "--model.init_args.tool.init_args.num_prompt_tokens=4",
    "--model.init_args.steps=15",
]


def fit_args(tiny_clip_dir: Path, data_root: Path, run_dir: Path, *extra: str) -> list[str]:
    """CLI arguments of a small CLIP prompt-tuning fit."""
    return [
        *QUIET_CPU_FIT,
        f"--trainer.default_root_dir={run_dir}",
        *FAST_MODEL_ARGS,
        f"--model.init_args.tool.init_args.model_name=local-dir:{tiny_clip_dir}",
        "--data.class_path=clova_train.datamodules.ConceptFolderDataModule",
        f"--data.init_args.root={data_root}",
        "--data.init_args.image_size=32",
        "--data.init_args.val_per_concept=2",
        "--data.init_args.chunk_size=4",
        *extra,
    ]


def run_fit(*args: str) -> int:
    """Run the CLI in this process; returns its exit status."""
    saved_argv = sys.argv
    sys.argv = ["clova-train"]  # LightningCLI warns when pytest's own arguments are on sys.argv
    try:
        return main(list(args))
    except SystemExit as stop:  # argument errors exit through jsonargparse
        return int(stop.code or 0)
    finally:
        sys.argv = saved_argv


def run_cli_captured(args: list[str]) -> subprocess.CompletedProcess:
    """Run the CLI in this process with its output captured, as :func:`run_cli_subprocess` returns it: for commands
    that stop before any work (``--help``, ``--print_config``), where a fresh interpreter would only repeat the imports."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = run_fit(*args)
    return subprocess.CompletedProcess(["clova-train", *args], code, stdout.getvalue(), stderr.getvalue())


STACKS_WAIT = 10  # seconds a timed-out run's processes get to print their stacks before they are killed


def run_cli_subprocess(args: list[str], timeout: float = 300, cwd: Path = REPO, **kwargs) -> subprocess.CompletedProcess:
    """Run ``python -m clova_train`` in a subprocess (the only way to test multi-process DDP); ``tests/`` is on its
    path, so its arguments may name the callbacks of :mod:`helpers.kill` and :mod:`helpers.progress`.

    The run is a process group of its own (its DDP ranks and DataLoader workers with it). Past ``timeout`` every
    process of the group is sent SIGABRT, which makes each print the Python stack of every thread (faulthandler),
    then killed; the test fails with those stacks, so a hang seen once in CI says where it hung."""
    env = {**os.environ, "PYTHONPATH": str(TESTS), "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}
    command = [sys.executable, "-m", "clova_train", *args]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                          start_new_session=True, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGABRT)
            try:
                stdout, stderr = process.communicate(timeout=STACKS_WAIT)
            except subprocess.TimeoutExpired:
                _signal_group(process.pid, signal.SIGKILL)
                stdout, stderr = process.communicate()
            _signal_group(process.pid, signal.SIGKILL)  # the other ranks and workers, if the first one ended
            raise AssertionError(f"{' '.join(command)} timed out after {timeout} s; the stacks of its processes "
                                 f"(SIGABRT, faulthandler):\n{stderr[-60000:]}\n--- stdout:\n{stdout[-2000:]}") from None
        finally:
            if process.poll() is None:
                _signal_group(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def serve_in_fresh_process(export: Path, request: dict) -> dict:
    """Serve one JSON request from ``export`` in a fresh Python process that must not import Lightning."""
    script = (
        "import json, sys\n"
        "from clova_train.tools.prompt_server import PromptToolServer\n"
        f"server = PromptToolServer.from_export({str(export)!r})\n"
        f"print(json.dumps(server.serve(json.loads({json.dumps(json.dumps(request))}))))\n"
        "assert not any(name.startswith('lightning') for name in sys.modules), 'serving imported lightning'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])

"""The pieces ``make gpu-check`` adds to the benchmarks: the serving-latency benchmark (run for real against a small
export on loopback, as the GPU check runs it), the LoRA benchmark's steady-state rate, and the GPU check's stage plan
(a stage whose inputs the smoke run did not leave is skipped and listed, never started)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.common import REPO

BENCHMARKS = REPO / "benchmarks"


def _benchmark(name: str):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_percentiles_interpolate_between_ranks_and_rates_count_failures() -> None:
    serving = _benchmark("serving_latency")
    values = [0.4, 0.1, 0.3, 0.2]
    assert serving.percentile(values, 50) == pytest.approx(0.25)
    assert serving.percentile(values, 99) == pytest.approx(0.3 + 0.1 * 0.97)
    assert serving.percentile([0.5], 99) == 0.5
    result = serving.summary([0.1, 0.2, 0.3], wall=2.0, failed=1)
    assert result["p50_ms"] == pytest.approx(200) and result["requests"] == 4 and result["requests_per_s"] == 2.0


def test_lora_steady_rate_counts_only_the_steps_after_the_start() -> None:
    lora = _benchmark("lora_finetune")
    result = {"times": [0.0, 1.0, 2.0, 4.0], "step_tokens": [100, 10, 20, 40]}
    assert lora.steady_rate(result, 1) == pytest.approx(60 / 3)
    assert lora.steady_rate(result, 2) == pytest.approx(40 / 2)
    assert lora.steady_rate(result, 3) is None


def test_gpu_check_stages_name_what_they_build_and_load_and_tools_narrow_them() -> None:
    check = _benchmark("gpu_check")
    planned = check.stages(check.SMOKE_CASES)
    assert list(planned) == ["smoke", "prompt", "serving", "lora"]
    for name, stage in planned.items():  # every command is a benchmark script that exists
        assert stage.commands and all(Path(c.args[0]).is_file() for c in stage.commands), name
    assert [c.models for c in planned["prompt"].commands] == [("owlvit-base-patch32",), ("clip-vit-l14",)]
    clip, llm = planned["serving"].commands
    assert clip.exports == ("clip",) and llm.models == ("vicuna-13b",) and "--random-lora-on" in llm.args
    assert [c.name for c in planned["prompt"].commands + planned["serving"].commands] == ["loc", "clip", "clip", "llm"]


def test_gpu_check_skips_a_command_whose_export_is_missing_and_builds_missing_models(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage loop without a GPU: the serving command of an export the smoke run did not leave is skipped and
    named in the summary (exit 1), the prompt command's model is built first, and nothing else is started."""
    import torch

    check = _benchmark("gpu_check")
    started: list[str] = []
    monkeypatch.setattr(check, "why_not", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "a test GPU")
    monkeypatch.setattr(check, "SMOKE_OUTPUT", tmp_path / "runs")
    monkeypatch.setattr(check, "MODELS", tmp_path / "models")
    monkeypatch.setattr(check, "run_within", lambda command, seconds, cwd=None: started.append(command[1]) or 0)
    monkeypatch.setattr(check, "build_model", lambda name, seconds: started.append(f"build {name}") or 0)
    assert check.main(["--stages", "prompt", "serving", "--tools", "loc", "clip", "--budget-minutes", "5"]) == 1
    assert started == ["build owlvit-base-patch32", str(BENCHMARKS / "prompt_tuning.py"), "build clip-vit-l14",
                       str(BENCHMARKS / "prompt_tuning.py")]


def test_gpu_check_smoke_cases_take_any_recipe_name_after_its_ordered_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A recipe the ordering list does not name (a plug-in's, here registered at run time) is a smoke case: run last by
    default, accepted by --smoke-cases; a name no recipe or case has is refused before anything starts."""
    import dataclasses

    import torch

    from clova_train.tools.recipes import TinyModel, register_tool, tool_recipe, unregister_tool

    check = _benchmark("gpu_check")
    started: list[list[str]] = []
    monkeypatch.setattr(check, "why_not", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "a test GPU")
    monkeypatch.setattr(check, "SMOKE_OUTPUT", tmp_path / "runs")
    monkeypatch.setattr(check, "MODELS", tmp_path / "models")
    monkeypatch.setattr(check, "run_within", lambda command, seconds, cwd=None: started.append(command) or 0)
    register_tool(dataclasses.replace(tool_recipe("loc"), name="sixth",
                                      tiny_model=TinyModel("sixth-tiny", "sixth:build", 0, "a test's plug-in")))
    try:
        assert check.smoke_case_names() == [*check.SMOKE_CASES, "sixth"]
        assert check.main(["--stages", "smoke", "--smoke-cases", "sixth", "loc", "--budget-minutes", "5"]) == 0
        with pytest.raises(SystemExit):
            check.main(["--stages", "smoke", "--smoke-cases", "seventh"])
    finally:
        unregister_tool("sixth")
    (command,) = started
    assert command[1] == str(BENCHMARKS / "smoke_real.py")
    assert command[command.index("--configs") + 1:command.index("--budget-minutes")] == ["sixth", "loc"]


@pytest.mark.slow
def test_serving_latency_measures_a_live_server_and_the_in_process_baseline(clip_export: Path, concept_root: Path,
                                                                            tmp_path: Path) -> None:
    image = concept_root / "purple" / "purple_001.png"
    request = f'{{"images": ["{image}"], "labels": ["purple", "red"]}}'
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "serving_latency.py"), str(clip_export), "--request", request,
         "--clients", "1", "2", "--requests", "4", "--baseline-requests", "2", "--no-record",
         "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    table = done.stdout[done.stdout.index("| method |"):]
    assert "| clova-train serve (HTTP) | 1 | 4 |" in table and "| clova-train serve (HTTP) | 2 | 4 |" in table
    assert "| in-process loop (baseline, no server) | 1 | 2 |" in table
    assert all(line.endswith("| 0 |") for line in table.strip().splitlines()[2:])  # no request failed
    assert "POST /v1/clip" in done.stdout

"""The real-size smoke check (``make smoke-real``) and the GPU check (``make gpu-check``).

The architectures the builders use match the real checkpoints' parameter counts (on the meta device, no weights); one
config, LOC on OWL-ViT B/32 (153 M parameters, the smallest real-size model), runs through the runner as ``make
smoke-real`` runs it: build, fit, export, serve, its table row; the GPU check without a GPU stops at once, saying why.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.common import REPO

BENCHMARKS = REPO / "benchmarks"


def _millions(module: torch.nn.Module) -> float:
    return sum(p.numel() for p in module.parameters()) / 1e6


def architectures() -> dict[str, float]:
    """Each real-size entry's parameter count, from the same config functions the builders use, on the meta device."""
    import open_clip
    from transformers import (BlipForQuestionAnswering, LlamaConfig, LlamaForCausalLM, MaskFormerForInstanceSegmentation,
                              OwlViTForObjectDetection)

    from real_size import models

    with torch.device("meta"):
        return {
            "clip-vit-l14": _millions(open_clip.CLIP(**models.open_clip_vit_l14_config())),
            "blip-vqa-capfilt-large": _millions(BlipForQuestionAnswering(models.blip_vqa_large_config())),
            "owlvit-base-patch32": _millions(OwlViTForObjectDetection(models.owlvit_b32_config())),
            "maskformer-swin-base-coco": _millions(MaskFormerForInstanceSegmentation(
                models.maskformer_swin_b_config([f"class {i}" for i in range(models.COCO_PANOPTIC_CLASSES)]))),
            "sd-inpainting": sum(_millions(part) for part in models.sd15_inpainting_parts().values()),
            "vicuna-stand-in": _millions(LlamaForCausalLM(LlamaConfig(**models.VICUNA_STAND_IN))),
            "vicuna-13b": _millions(LlamaForCausalLM(LlamaConfig(**models.VICUNA_13B))),
        }


def test_real_size_architectures_have_the_real_checkpoints_parameter_counts() -> None:
    from real_size.models import REAL_SIZES

    counted = architectures()
    assert set(counted) == set(REAL_SIZES)
    # the published counts: open_clip ViT-L-14 427.6 M, SD-1.5 inpainting UNet 859.5 + VAE 83.7 + CLIP-L text 123.1
    for name, millions in counted.items():
        assert millions == pytest.approx(REAL_SIZES[name].parameters, rel=1e-3), name
    assert counted["vicuna-13b"] == pytest.approx(13015.9, rel=1e-4)


def test_every_paper_config_has_a_smoke_case() -> None:
    """Each tool recipe's paper config runs through the case its recipe declares; the LLM's and the controller's
    configs have theirs; the table names the shipped configs by their file names under configs/paper."""
    from clova_train.tools.recipes import tool_recipes

    smoke_real = _smoke_real()
    chosen = smoke_real.cases(Path("models"))
    for name, recipe in tool_recipes().items():
        assert recipe.smoke_real is not None, f"the {name} recipe has no smoke-real case"
        case = chosen[name]
        assert case.path == REPO / recipe.paper_config and case.kind == "prompt"
        assert (case.model, case.inner_steps) == (recipe.smoke_real.model, recipe.smoke_real.inner_steps)
        assert case.overrides == [*recipe.smoke_real.overrides, *smoke_real.PROMPT_RUN]
    labels = {case.label for case in chosen.values()}
    assert labels == {path.name for path in (REPO / "configs" / "paper").glob("*.yaml")}
    assert all(case.path.is_file() for case in chosen.values())


PLUG_IN = """
from pathlib import Path

import torch
from safetensors.torch import save_file


def build(directory):
    save_file({"weight": torch.zeros(3, 4)}, str(Path(directory) / "model.safetensors"))
    return directory


def data(workdir, full):
    (Path(workdir) / "data").mkdir(parents=True, exist_ok=True)
    (Path(workdir) / "data" / "seen.txt").write_text("full" if full else "few")
    return {"image": "data/seen.txt", "concept": "sixth"}
"""


@pytest.fixture
def sixth_tool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A plug-in recipe registered at run time: its paper config outside configs/paper, its real-size model built by
    its own ``module:function`` (a module on PYTHONPATH, as a plug-in package is installed)."""
    import dataclasses

    from clova_train.tools.recipes import SmokeRealCase, TinyModel, register_tool, tool_recipe, unregister_tool

    plug_ins = tmp_path / "plug_ins"
    plug_ins.mkdir()
    (plug_ins / "sixth_tool_plug_in.py").write_text(PLUG_IN)
    monkeypatch.syspath_prepend(str(plug_ins))
    monkeypatch.setenv("PYTHONPATH", str(plug_ins))
    config = tmp_path / "sixth_prompt.yaml"
    config.write_text("trainer:\n  default_root_dir: runs/sixth\n")
    recipe = dataclasses.replace(
        tool_recipe("clip"), name="sixth", paper_config=str(config),
        tiny_model=TinyModel("sixth-tiny", "sixth_tool_plug_in:build", 0, "a test's plug-in"),
        smoke_real=SmokeRealCase("sixth_tool_plug_in:build", ("--model.init_args.tool.init_args.model_name={model}",),
                                 "sixth_tool_plug_in:data", 2))
    register_tool(recipe)
    yield recipe
    unregister_tool("sixth")


def test_a_plug_in_recipe_is_a_case_with_its_own_config_model_and_data(sixth_tool, tmp_path: Path) -> None:
    from real_size import model_folder

    smoke_real = _smoke_real()
    case = smoke_real.cases(tmp_path / "models")["sixth"]
    assert case.label == sixth_tool.paper_config and case.path == Path(sixth_tool.paper_config)
    assert case.model == "sixth_tool_plug_in:build" and case.inner_steps == 2
    assert case.overrides[0] == "--model.init_args.tool.init_args.model_name={model}"
    assert case.data(tmp_path / "work", True) == {"image": "data/seen.txt", "concept": "sixth"}
    assert (tmp_path / "work" / "data" / "seen.txt").read_text() == "full"
    assert smoke_real.config_setting(case, "trainer.default_root_dir") == "runs/sixth"
    # built as the listed models are, in its own process, and reused once finished
    stage = smoke_real.build_stage(case.model, tmp_path / "models", timeout=300)
    assert stage.returncode == 0, stage.tail
    folder = tmp_path / "models" / model_folder(case.model)
    assert json.loads((folder / "real_size.json").read_text()) == {"checkpoint": case.model, "parameters": 12}
    assert smoke_real.build_stage(case.model, tmp_path / "models", timeout=300).returncode == 0


def test_configs_take_a_plug_in_case_and_the_table_names_its_config(sixth_tool, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    smoke_real = _smoke_real()
    assert smoke_real.main(["--configs", "sixth", "--budget-minutes", "0", "--no-record",
                            "--models", str(tmp_path / "models"), "--output", str(tmp_path / "runs")]) == 1
    assert f"| {sixth_tool.paper_config} | - |" in capsys.readouterr().out
    assert json.loads((tmp_path / "runs" / "sixth" / "row.json").read_text())["config"] == sixth_tool.paper_config
    with pytest.raises(SystemExit):
        smoke_real.main(["--configs", "seventh", "--no-record"])


def _smoke_real():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import smoke_real
    finally:
        sys.path.remove(str(BENCHMARKS))
    return smoke_real


def test_beside_runs_the_llm_cases_in_a_queue_of_their_own() -> None:
    smoke_real = _smoke_real()
    chosen = smoke_real.cases(Path("models"))
    names = ["llm", "controller", "clip", "llm-sharded", "vqa"]
    assert smoke_real.queues(chosen, names, beside=False) == [names]
    assert smoke_real.queues(chosen, names, beside=True) == [["llm", "llm-sharded"], ["controller", "clip", "vqa"]]
    assert smoke_real.queues(chosen, ["clip", "vqa"], beside=True) == [["clip", "vqa"]]


def test_cases_past_the_budget_are_skipped_listed_and_the_table_still_written(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "smoke_real.py"), "--configs", "controller", "vqa", "--budget-minutes", "0",
         "--no-record", "--models", str(tmp_path / "models"), "--output", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert done.returncode == 1
    assert "skipped: controller, vqa" in done.stderr and "Traceback" not in done.stderr
    table = done.stdout[done.stdout.index("| config |"):]
    assert "| controller_dqn_hydra.yaml | - |" in table and "skipped: 0 s of the 0-minute budget left" in table
    row = json.loads((tmp_path / "runs" / "vqa" / "row.json").read_text())
    assert row["stages"] == {} and row["skipped"]
    assert not (tmp_path / "models").exists()  # nothing was built


def test_the_phase_table_has_a_row_only_where_phases_were_measured() -> None:
    smoke_real = _smoke_real()
    case = smoke_real.cases(Path("models"))["seg"]
    gb = 10**9
    probe = {"phase_peak_bytes": {"prepare": 2 * gb, "inner steps": 5 * gb, "gate": 3 * gb, "validation": 7 * gb},
             "peak_gpu_bytes": 7.4 * gb}
    expected = "| seg_prompt_maskformer.yaml | 2.0 | 5.0 | 3.0 | - | 7.0 | 7.4 |"
    assert smoke_real.phase_peak_row(case, {"probe": probe}) == expected
    assert len(smoke_real.PHASE_COLUMNS) == 7
    assert smoke_real.phase_peak_row(case, {"probe": {"phase_peak_bytes": None}}) is None
    assert smoke_real.phase_peak_row(case, {"skipped": "budget"}) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the check runs on a GPU here")
def test_gpu_check_without_a_gpu_stops_at_once_and_says_why() -> None:
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "gpu-check: not run:" in done.stderr and "sees no CUDA device" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
@pytest.mark.real_size
def test_smoke_real_runs_one_config_through_build_fit_export_and_serve(tmp_path: Path) -> None:
    from real_size.models import REAL_SIZES

    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "smoke_real.py"), "--configs", "loc", "--no-record",
         "--models", str(tmp_path / "models"), "--output", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    row = json.loads((tmp_path / "runs" / "loc" / "row.json").read_text())
    assert {name: stage["returncode"] for name, stage in row["stages"].items()} == {"build": 0, "fit": 0, "export": 0, "serve": 0,
                                                                                    "memory": 0}
    assert row["parameters_m"] == pytest.approx(REAL_SIZES["owlvit-base-patch32"].parameters, rel=0.01)
    assert row["activations_mb"] > 10  # 100 prompt tokens through ViT-B/32 at 768 px: hundreds of MB
    assert row["probe"]["batch_seconds"] and row["stages"]["fit"]["peak_rss_gb"] > 0.5
    # the real layout: the served reply came from the real-size model, the export names it
    served = (tmp_path / "runs" / "loc" / "serve.log").read_text()
    assert '"boxes"' in served, served[-2000:]
    table = done.stdout[done.stdout.index("| config |"):]
    assert "loc_prompt_owlvit.yaml | 153.2 M |" in table and "fit ok, export ok, serve ok" in table


class CountingGauge:
    """A stand-in for CUDA's peak counter: the peak since the last reset is 1000 times the resets so far."""

    def __init__(self) -> None:
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1

    def peak(self) -> int:
        return 1000 * self.resets


def _probed_toy_fit(tmp_path: Path, probe: object, accelerator: str = "cpu") -> dict:
    from lightning import Trainer

    from clova_train.models import PromptTuning
    from plugins.toy_tool.data import SyntheticToyDataModule
    from plugins.toy_tool.tiny import build_toy_model
    from plugins.toy_tool.tool import ToyPromptClassifier

    tool = ToyPromptClassifier(str(build_toy_model(tmp_path / "toy", pretrain_steps=0)))
    trainer = Trainer(accelerator=accelerator, devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False, callbacks=[probe],
                      default_root_dir=str(tmp_path / "run"))
    data = SyntheticToyDataModule(root=str(tmp_path / "data"), chunk_size=4)
    trainer.fit(PromptTuning(tool, steps=3, pool_path=str(tmp_path / "run" / "pool.safetensors")), data)
    return json.loads((tmp_path / "probe.json").read_text())


def test_step_probe_gives_each_phase_of_a_prompt_tuning_fit_its_own_peak(tmp_path: Path) -> None:
    """The phases in the order they run, each peak read before the next reset, the whole fit's peak over all of them
    (the counter's resets notwithstanding); on the CPU the probe measures no phases at all."""
    from real_size.probe import PhasePeaks, StepProbe

    probe = StepProbe(str(tmp_path / "probe.json"))
    probe.phases = PhasePeaks(CountingGauge())  # what on_fit_start sets on a CUDA device
    record = _probed_toy_fit(tmp_path, probe)
    peaks = record["phase_peak_bytes"]
    assert set(peaks) == {"prepare", "inner steps", "gate"}, peaks  # no bare "training step"; the toy validates nothing
    assert peaks["prepare"] < peaks["inner steps"] < peaks["gate"]  # one chunk after another: the last chunk's
    assert record["peak_gpu_bytes"] == 1000 * probe.phases.gauge.resets >= max(peaks.values())
    assert len(record["batch_seconds"]) >= 2  # several chunks, each split the same way

    probe.on_validation_start(None, None)  # type: ignore[arg-type]
    probe.on_validation_end(None, None)  # type: ignore[arg-type]
    assert probe.phases.peaks["validation"] == 1000 * probe.phases.gauge.resets

    (tmp_path / "cpu").mkdir()
    assert _probed_toy_fit(tmp_path / "cpu", StepProbe(str(tmp_path / "cpu" / "probe.json")))["phase_peak_bytes"] is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: torch's CUDA peak counter")
def test_step_probe_measures_phases_on_a_gpu(tmp_path: Path) -> None:
    from real_size.probe import StepProbe

    record = _probed_toy_fit(tmp_path, StepProbe(str(tmp_path / "probe.json")), accelerator="cuda")
    peaks = record["phase_peak_bytes"]
    assert {"prepare", "inner steps", "gate"} <= set(peaks) and all(v > 0 for v in peaks.values())
    assert record["peak_gpu_bytes"] >= max(peaks.values())

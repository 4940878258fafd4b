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

    from clova_train.quickstart.real_size import models

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
    from clova_train.quickstart.real_size.models import REAL_SIZES

    counted = architectures()
    assert set(counted) == set(REAL_SIZES)
    # the published counts: open_clip ViT-L-14 427.6 M, SD-1.5 inpainting UNet 859.5 + VAE 83.7 + CLIP-L text 123.1
    for name, millions in counted.items():
        assert millions == pytest.approx(REAL_SIZES[name].parameters, rel=1e-3), name
    assert counted["vicuna-13b"] == pytest.approx(13015.9, rel=1e-4)


def test_every_paper_config_has_a_smoke_case() -> None:
    smoke_real = _smoke_real()
    configs = {case.config for case in smoke_real.cases(Path("models")).values()}
    assert configs == {path.name for path in (REPO / "configs" / "paper").glob("*.yaml")}


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the check runs on a GPU here")
def test_gpu_check_without_a_gpu_stops_at_once_and_says_why() -> None:
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "gpu-check: not run:" in done.stderr and "sees no CUDA device" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_smoke_real_runs_one_config_through_build_fit_export_and_serve(tmp_path: Path) -> None:
    from clova_train.quickstart.real_size.models import REAL_SIZES

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

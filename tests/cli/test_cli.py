"""The command line: configs, help, and one clear message for each kind of bad input."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml

from helpers.common import REPO, fit_args, run_cli_subprocess, run_fit

CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))


def test_configs_exist() -> None:
    names = {p.relative_to(REPO / "configs").as_posix() for p in CONFIGS}
    assert {"quickstart/clip_prompt.yaml", "paper/clip_prompt_vit_l14.yaml", "quickstart/vqa_prompt.yaml",
            "paper/vqa_prompt_blip.yaml", "quickstart/loc_prompt.yaml",
            "paper/loc_prompt_owlvit.yaml", "quickstart/seg_prompt.yaml", "paper/seg_prompt_maskformer.yaml",
            "quickstart/replace_prompt.yaml", "paper/replace_prompt_sd_inpaint.yaml"} <= names


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.relative_to(REPO / "configs").as_posix())
def test_every_config_parses_against_the_signatures(config: Path, capsys: pytest.CaptureFixture) -> None:
    if config.name == "loop.yaml":  # `clova-train loop` (the closed loop), not LightningCLI
        assert run_fit("loop", "--config", str(config), "--print_config") == 0
        printed = yaml.safe_load(capsys.readouterr().out)
        assert {"tools", "llm", "world"} <= set(printed)
        for tool in printed["tools"].values():  # each tool's fit config is one of these parsed files
            assert (REPO / tool["fit_config"]).is_file()
        return
    if "controller" in config.name:  # `clova-train controller fit` (SB3), not LightningCLI
        assert run_fit("controller", "fit", "--config", str(config), "--print_config") == 0
        assert {"environment", "hydra", "dqn", "train"} <= set(yaml.safe_load(capsys.readouterr().out))
        return
    assert run_fit("fit", "--config", str(config), "--print_config") == 0
    printed = capsys.readouterr().out
    assert "class_path: clova_train.models." in printed and "class_path: clova_train.datamodules." in printed
    loggers = yaml.safe_load(printed)["trainer"]["logger"]
    if config.name.startswith("loop_"):  # a fit the closed loop runs: its output goes to the fit's fit.log
        assert loggers is False
        return
    assert sorted(logger["class_path"].rsplit(".", 1)[1] for logger in loggers) == ["CSVLogger", "TensorBoardLogger"]


def test_paper_controller_config_keeps_hydra_values(capsys: pytest.CaptureFixture) -> None:
    run_fit("controller", "fit", "--config", str(REPO / "configs/paper/controller_dqn_hydra.yaml"), "--print_config")
    config = yaml.safe_load(capsys.readouterr().out)
    hydra, dqn = config["hydra"], config["dqn"]
    assert (hydra["num_samples"], hydra["r1"], hydra["alpha"], hydra["reject_penalty"]) == (5, 100.0, 100.0, 0.0)
    assert (hydra["embedder"]["model"], hydra["embedder"]["dim"], hydra["layout"]) == ("text-embedding-3-small", 1536, "joint")
    assert (dqn["net_arch"], dqn["learning_rate"], dqn["batch_size"], dqn["learning_starts"]) == ([512], 1e-4, 128, 1000)
    assert dqn["exploration_initial_eps"] == 0.2 and dqn["exploration_final_eps"] > 0
    assert (dqn["exploration_schedule"], dqn["exploration_decay"], dqn["exploration_decay_every"]) == ("hydra_step", 0.02, 200)
    assert dqn["action_selection"] == "eq2" and hydra["probability_features"] is True


def test_paper_config_keeps_paper_values(capsys: pytest.CaptureFixture) -> None:
    import yaml

    run_fit("fit", "--config", str(REPO / "configs/paper/clip_prompt_vit_l14.yaml"), "--print_config")
    model = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]
    tool = model["tool"]["init_args"]
    assert (tool["model_name"], tool["pretrained"]) == ("ViT-L-14", "openai")
    assert (tool["num_prompt_tokens"], tool["prompt_depth"], model["lr"], model["steps"]) == (100, 3, 0.01, 100)


def test_paper_vqa_config_keeps_paper_values(capsys: pytest.CaptureFixture) -> None:
    import yaml

    run_fit("fit", "--config", str(REPO / "configs/paper/vqa_prompt_blip.yaml"), "--print_config")
    model = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]
    tool = model["tool"]["init_args"]
    assert (tool["model_name"], tool["num_prompt_tokens"], tool["top_k"]) == ("Salesforce/blip-vqa-capfilt-large", 16, 20)
    assert (model["lr"], model["steps"]) == (0.001, 100)


def test_paper_grounding_configs_keep_paper_values(capsys: pytest.CaptureFixture) -> None:
    run_fit("fit", "--config", str(REPO / "configs/paper/loc_prompt_owlvit.yaml"), "--print_config")
    config = yaml.safe_load(capsys.readouterr().out)
    model, data = config["model"]["init_args"], config["data"]["init_args"]
    tool = model["tool"]["init_args"]
    assert (tool["model_name"], tool["num_prompt_tokens"], tool["num_negatives"]) == ("google/owlvit-base-patch32", 100, 13)
    assert (tool["score_threshold"], tool["gate_iou"], model["lr"], model["steps"]) == (0.1, 0.6, 0.0005, 100)
    assert model["early_stop_every"] > 0 and data["max_images"] == 200
    run_fit("fit", "--config", str(REPO / "configs/paper/seg_prompt_maskformer.yaml"), "--print_config")
    config = yaml.safe_load(capsys.readouterr().out)
    model, data = config["model"]["init_args"], config["data"]["init_args"]
    tool = model["tool"]["init_args"]
    assert (tool["model_name"], tool["num_prompt_tokens"], tool["top_k"]) == ("facebook/maskformer-swin-base-coco", 100, 10)
    assert (model["lr"], model["steps"], data["max_images"]) == (0.1, 100, 50)


def test_paper_replace_config_keeps_paper_values(capsys: pytest.CaptureFixture) -> None:
    run_fit("fit", "--config", str(REPO / "configs/paper/replace_prompt_sd_inpaint.yaml"), "--print_config")
    config = yaml.safe_load(capsys.readouterr().out)
    model, data = config["model"]["init_args"], config["data"]["init_args"]
    tool = model["tool"]["init_args"]
    assert (tool["model_name"], tool["resolution"], model["lr"]) == ("runwayml/stable-diffusion-inpainting", 512, 0.005)
    assert config["data"]["class_path"] == "clova_train.datamodules.MaskedConceptDataModule"
    assert data["val_per_concept"] == 2 and tool["gate_margin"] == 0.02


def test_help_documents_model_arguments(capsys: pytest.CaptureFixture) -> None:
    assert run_fit("fit", "--model.help", "clova_train.models.PromptTuning") == 0
    text = capsys.readouterr().out
    assert "Adam learning rate" in text and "clova_train.tools.clip.tool.PromptedClip" in text
    assert run_fit("fit", "--model.class_path=clova_train.models.PromptTuning",
                   "--model.tool.help", "clova_train.tools.clip.tool.PromptedClip") == 0
    assert "prompt tokens in each prompted vision block" in capsys.readouterr().out


def test_repeated_config_and_dotted_override(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    override = tmp_path / "override.yaml"
    override.write_text("model:\n  init_args:\n    steps: 7\n")
    quickstart = str(REPO / "configs/quickstart/clip_prompt.yaml")
    assert run_fit("fit", "--config", quickstart, "--config", str(override), "--model.init_args.lr=0.5",
                   "--print_config") == 0
    out = capsys.readouterr().out
    assert "steps: 7" in out and "lr: 0.5" in out


def test_unknown_config_key_names_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "configs/quickstart/clip_prompt.yaml").read_text().replace("steps: 60", "stepz: 60"))
    assert run_fit("fit", "--config", str(bad)) == 2
    assert "stepz" in capsys.readouterr().err


def test_python_dash_m_entry_point() -> None:
    result = run_cli_subprocess(["--help"], timeout=120)
    assert result.returncode == 0 and "fit" in result.stdout and "export" in result.stdout


def expect_failure(args: list[str], capsys: pytest.CaptureFixture, run_dir: Path) -> str:
    assert run_fit(*args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert not (run_dir / "pool.safetensors").exists(), "no partial pool"
    return err[-1]


def test_missing_concept_root(tiny_clip_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    message = expect_failure(fit_args(tiny_clip_dir, tmp_path / "nowhere", tmp_path), capsys, tmp_path)
    assert message == f"clova-train: error: concept root folder not found: {tmp_path / 'nowhere'}"


def test_missing_and_empty_concept_folder(tiny_clip_dir: Path, concept_root: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    message = expect_failure(fit_args(tiny_clip_dir, concept_root, tmp_path, "--data.init_args.concepts=[zebra]"),
                             capsys, tmp_path)
    assert message == f"clova-train: error: concept folder not found: {concept_root / 'zebra'}"
    data = tmp_path / "data"
    shutil.copytree(concept_root, data)
    for image in (data / "blue").iterdir():
        image.unlink()
    message = expect_failure(fit_args(tiny_clip_dir, data, tmp_path), capsys, tmp_path)
    assert message.startswith(f"clova-train: error: concept folder {data / 'blue'} holds no images")


def test_unreadable_image(tiny_clip_dir: Path, concept_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = tmp_path / "data"
    shutil.copytree(concept_root, data)
    broken = data / "green" / "green_004.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n this is not really a png")
    message = expect_failure(fit_args(tiny_clip_dir, data, tmp_path), capsys, tmp_path)
    assert message.startswith(f"clova-train: error: unreadable image {broken}")


def test_missing_model_directory(concept_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    message = expect_failure(fit_args(tmp_path / "no-model", concept_root, tmp_path), capsys, tmp_path)
    assert message.startswith(f"clova-train: error: CLIP model directory not found: {tmp_path / 'no-model'}")


def test_existing_pool_of_another_model_is_refused_and_kept(
    tiny_clip_dir: Path, concept_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from clova_train.core.pool import PoolSpec, PromptPool

    pool_path = tmp_path / "pool.safetensors"
    other = PromptPool(PoolSpec("clip", "open_clip:someothermodel", (3, 4, 64), 64))
    other.add("red", torch.rand(1, 64), torch.rand(1, 3, 4, 64))
    other.save(pool_path)
    before = pool_path.read_bytes()
    assert run_fit(*fit_args(tiny_clip_dir, concept_root, tmp_path)) == 2
    err = capsys.readouterr().err
    assert "does not fit this model: model_identity is 'open_clip:someothermodel'" in err
    assert pool_path.read_bytes() == before


def test_sharding_strategies_are_refused_with_reason(tiny_clip_dir: Path) -> None:
    """FSDP needs a GPU, so the strategy check is exercised directly on the module."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    from clova_train.core.errors import ModelError
    from clova_train.models import PromptTuning
    from clova_train.tools.clip.tool import PromptedClip

    module = PromptTuning(PromptedClip(f"local-dir:{tiny_clip_dir}", None, num_prompt_tokens=4))
    module._trainer = SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(ModelError, match="not FSDPStrategy: sharding strategies would split and average"):
        module._check_strategy()


def test_top_level_help_lists_every_subcommand_under_the_program_name() -> None:
    from clova_train.cli import COMMANDS

    done = run_cli_subprocess(["--help"], timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("usage: clova-train ")
    for command in ("fit", "validate", "test", "predict", "export", "serve", "controller", "tiny-model"):
        assert command in COMMANDS and f"    {command}" in done.stdout, command
    bare = run_cli_subprocess([], timeout=60)
    assert bare.returncode == 2 and "tiny-model" in bare.stdout
    unknown = run_cli_subprocess(["frobnicate"], timeout=60)
    assert unknown.returncode == 2 and "unknown command 'frobnicate'" in unknown.stderr


@pytest.mark.parametrize("command", ["export", "serve", "predict", "tiny-model", "controller"])
def test_subcommand_help_does_not_import_lightning(command: str) -> None:
    import subprocess
    import sys

    code = ("import sys\nfrom clova_train.cli import main\ntry:\n    main([%r, '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'torch')))" % command)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"usage: clova-train {command}" in done.stdout
    heavy = done.stdout.strip().splitlines()[-1]
    assert "lightning" not in heavy and ("'torch'" not in heavy or command == "controller"), heavy


@pytest.mark.parametrize(("name", "train", "evaluation"), [
    ("controller_dqn_hydra_gqa.yaml", "gqa", "gqa"), ("controller_dqn_hydra_okvqa.yaml", "okvqa", "okvqa")])
def test_the_benchmark_controller_configs_read_task_files_and_take_null_overrides(
        name: str, train: str, evaluation: str, capsys: pytest.CaptureFixture) -> None:
    run_fit("controller", "fit", "--config", str(REPO / "configs/paper" / name), "--hydra.tasks.tools.server_url=null",
            "--hydra.tasks.train.split=null", "--print_config")
    tasks = yaml.safe_load(capsys.readouterr().out)["hydra"]["tasks"]
    assert (tasks["train"]["format"], tasks["eval"]["format"]) == (train, evaluation)
    assert tasks["tools"]["server_url"] is None and tasks["train"]["split"] is None  # null, not the text 'None'
    assert {"loc", "classify", "vqa", "depth"} <= {key for key, value in tasks["tools"].items() if value}

"""The LoRA export's model card: front matter, base, data, last validation metrics, how to load."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from clova_train.export.model_card import last_validation_metrics, lora_model_card, run_directory


def fake_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    (run / "logs" / "version_0").mkdir(parents=True)
    (run / "logs" / "version_0" / "metrics.csv").write_text(
        "epoch,step,train/loss,val/all/SR,val/seen/SR_act\n0,9,1.5,,\n0,9,,0.25,0.5\n1,19,0.9,,\n1,19,,0.75,oops\n")
    (run / "logs" / "version_0" / "config.yaml").write_text(yaml.safe_dump({
        "data": {"class_path": "clova_train.datamodules.ToolInstructionDataModule",
                 "init_args": {"train_file": "data/train.json", "tokenizer": "x"}}}))
    (run / "data_report.json").write_text(json.dumps({"train": {"records": 10, "kept": 9, "too_long": [4], "invalid": []}}))
    return run


def test_card_reports_data_metrics_and_a_hub_base(tmp_path: Path) -> None:
    run = fake_run(tmp_path)
    assert run_directory(run / "checkpoints" / "last.ckpt") == run and run_directory(run) == run
    assert last_validation_metrics(run) == {"val/all/SR": 0.75, "val/seen/SR_act": 0.5}  # last value, bad cells skipped
    card = lora_model_card(kind="adapter", base_name="lmsys/vicuna-13b-v1.5", base_copied=False, source=run,
                           hparams={"lr": 3e-4}, adapter_config={"r": 16, "target_modules": ["q_proj"]})
    front = yaml.safe_load(card.split("---")[1])
    assert front["base_model"] == "lmsys/vicuna-13b-v1.5" and front["library_name"] == "peft"
    assert "| `val/all/SR` | 0.750 |" in card and "| `val/seen/SR_act` | 0.500 |" in card
    assert "ToolInstructionDataModule" in card and "data/train.json" in card and "9 of 10 records kept; left out: 1 too long (" in card
    assert '"r": 16' in card and '"lr": 0.0003' in card
    assert 'from_pretrained("lmsys/vicuna-13b-v1.5")' in card


def test_card_of_a_local_base_says_how_to_make_it_portable(tmp_path: Path) -> None:
    base = tmp_path / "my-llama"
    base.mkdir()
    card = lora_model_card(kind="merged", base_name=str(base), base_copied=False, source=tmp_path, hparams={},
                           adapter_config={}, dtype="bfloat16")
    assert "base_model" not in yaml.safe_load(card.split("---")[1])  # the hub validates it: only hub ids go there
    assert "--base-model-id" in card and "No validation metrics were logged" in card and "bfloat16" in card
    copied = lora_model_card(kind="adapter", base_name=str(base), base_copied=True, source=tmp_path, hparams={},
                             adapter_config={})
    assert 'from_pretrained("base/")' in copied

"""The LoRA tool LLM on several processes, shown to be right: 2 DDP ranks train what one device trains at the same
global batch, validation scores every sample once on uneven shards, a sharded (FSDP2) run exports the same adapter,
and a run killed inside an epoch resumes to exactly the adapter of an uninterrupted run. Sharded, only rank 0 reads
the base (the others build it on the meta device and start from rank 0's weights), a restored checkpoint wins over
them, and a base rank 0 cannot load stops every rank with its message.

Tolerance of the cross-layout comparisons: 1e-4 on LoRA weights of magnitude ~0.1 after 12 AdamW steps. The runs
compute the same sums over the same samples in other shapes (sub-batches, other padding), so they differ by float
rounding only: 1.2e-6 measured. The same two runs with each rank averaging its own batch (the model's own loss, what
DDP gives without this module's global token normalisation) differ by 3.3e-3, 30 times the tolerance.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.common import run_cli_subprocess
from helpers.kill import kill_at_chunk

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4
SHARDED = ('--trainer.strategy={"class_path": "lightning.pytorch.strategies.ModelParallelStrategy", '
           '"init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1}}')


@pytest.fixture(scope="module")
def small_data(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    """111 training samples (with 2 x 5 per step the last global batch holds 1: rank 1 gets a weightless copy) and
    53 validation samples (27 and 26 on 2 ranks)."""
    from clova_train.datamodules import SyntheticToolDataModule

    root = tmp_path_factory.mktemp("small-tools")
    SyntheticToolDataModule(str(root), str(tiny_llama_dir), conversations_per_tool=2, negatives=5).prepare_data()
    records = json.loads((root / "val.json").read_text())
    (root / "val_odd.json").write_text(json.dumps(records[:53]))
    assert len(json.loads((root / "train.json").read_text())) == 111
    return root


def fit_args(data: Path, model: Path, out: Path, *extra: str) -> list[str]:
    """The quickstart config on the small data, with a CSV logger the tests read and no progress bar: these tests
    compare adapters and metrics; the config's own bar and loggers on several ranks are run in
    configs/test_quickstart_configs_ddp.py and configs/test_paper_configs_ddp.py."""
    return [
        "fit", "--config", "configs/quickstart/tool_llm_lora.yaml",
        f"--model.init_args.model_name_or_path={model}", "--model.init_args.max_new_tokens=8",
        f"--data.init_args.root={data}", f"--data.init_args.tokenizer={model}",
        "--data.init_args.conversations_per_tool=2", "--data.init_args.negatives=5",
        "--data.init_args.eval_conversations_per_tool=1",
        f"--data.init_args.val_file={data / 'val_odd.json'}",
        f"--trainer.default_root_dir={out}", "--trainer.enable_progress_bar=false", "--trainer.max_epochs=1",
        "--trainer.check_val_every_n_epoch=1",
        f'--trainer.logger={{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {{"save_dir": "{out}", "name": "logs"}}}}',
        *extra,
    ]


def run(args: list[str]) -> None:
    result = run_cli_subprocess(args, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]


def adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def validation_metrics(run_dir: Path) -> dict[str, float]:
    rows = list(csv.DictReader((run_dir / "logs" / "version_0" / "metrics.csv").open()))
    values = {k: float(v) for row in rows for k, v in row.items() if k.startswith("val/") and v}
    assert values, rows
    return values


@pytest.fixture(scope="module")
def one_device(small_data: Path, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("one-device")
    run(fit_args(small_data, tiny_llama_dir, out, "--data.init_args.batch_size=10",
                 "--model.init_args.lora_dropout=0.0"))
    return out


def test_two_ddp_ranks_train_what_one_device_trains(one_device: Path, small_data: Path, tiny_llama_dir: Path,
                                                     tmp_path: Path) -> None:
    run(fit_args(small_data, tiny_llama_dir, tmp_path, "--data.init_args.batch_size=5",
                 "--model.init_args.lora_dropout=0.0", "--trainer.devices=2", "--trainer.strategy=ddp"))
    assert largest_difference(adapter(one_device), adapter(tmp_path)) < TOLERANCE
    assert [p.name for p in tmp_path.rglob("adapter_config.json")] == ["adapter_config.json"]  # rank 0 writes it
    for metrics in (validation_metrics(one_device), validation_metrics(tmp_path)):
        assert metrics["val/all/samples"] == 53  # every validation sample once, none twice


def test_uneven_validation_shards_give_exactly_the_one_device_metrics(one_device: Path, small_data: Path,
                                                                       tiny_llama_dir: Path, tmp_path: Path) -> None:
    args = fit_args(small_data, tiny_llama_dir, tmp_path, "--trainer.devices=2", "--trainer.strategy=ddp",
                    f"--ckpt_path={one_device / 'checkpoints' / 'last.ckpt'}")
    args[0] = "validate"
    run(args)
    assert validation_metrics(tmp_path) == validation_metrics(one_device)  # the same weights, 27 + 26 samples


def test_a_sharded_run_exports_the_adapter_of_an_unsharded_run(one_device: Path, small_data: Path,
                                                                 tiny_llama_dir: Path, tmp_path: Path) -> None:
    run(fit_args(small_data, tiny_llama_dir, tmp_path, "--data.init_args.batch_size=5",
                 "--model.init_args.lora_dropout=0.0", "--model.init_args.gradient_checkpointing=true",
                 "--trainer.devices=2", SHARDED, "--trainer.limit_val_batches=0"))
    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    assert checkpoint.is_dir() and len(list(checkpoint.glob("*.distcp"))) == 2  # one shard per rank
    result = run_cli_subprocess(["export", str(checkpoint), "-o", str(tmp_path / "export")])
    assert result.returncode == 0, result.stderr[-3000:]
    exported = adapter(tmp_path / "export")
    assert largest_difference(exported, adapter(one_device)) < TOLERANCE
    assert largest_difference(exported, adapter(tmp_path)) < 1e-6  # the run's own adapter, gathered at its end


def test_a_run_killed_inside_an_epoch_resumes_to_the_uninterrupted_adapter(small_data: Path, tiny_llama_dir: Path,
                                                                            tmp_path: Path) -> None:
    common = ["--data.init_args.batch_size=8", "--model.init_args.checkpoint_every_n_steps=3",
              "--trainer.limit_val_batches=0"]  # LoRA dropout 0.05 (the quickstart's): the random state matters
    reference = tmp_path / "reference"
    run(fit_args(small_data, tiny_llama_dir, reference, *common))
    killed = tmp_path / "killed"
    killer = kill_at_chunk(8)
    result = run_cli_subprocess(fit_args(small_data, tiny_llama_dir, killed, *common, killer), timeout=400)
    assert result.returncode == -9, result.stderr[-3000:]
    last = killed / "checkpoints" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=False)
    assert saved["global_step"] == 6 and not (killed / "adapter").exists()  # mid-epoch (14 steps), no adapter
    run(fit_args(small_data, tiny_llama_dir, killed, *common, f"--ckpt_path={last}"))
    resumed, uninterrupted = adapter(killed), adapter(reference)
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)  # bit for bit


def probe(directory: Path) -> str:
    """The ``fit``/``validate`` argument that adds :class:`tool_llm.sharded_probe.ShardedStartProbe`."""
    return ('--trainer.callbacks=[{"class_path": "tool_llm.sharded_probe.ShardedStartProbe", '
            '"init_args": {"directory": "%s"}}]' % directory)


def records(directory: Path, hook: str) -> list[dict]:
    return [torch.load(directory / f"{hook}-rank{rank}.pt", weights_only=False) for rank in (0, 1)]


def test_sharded_only_rank_0_reads_the_base_and_a_restored_checkpoint_wins(small_data: Path, tiny_llama_dir: Path,
                                                                          tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from clova_train.models.sharded_loading import non_persistent_buffers

    run(fit_args(small_data, tiny_llama_dir, tmp_path / "fit", "--data.init_args.batch_size=5", "--trainer.devices=2",
                 SHARDED, "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=0", probe(tmp_path / "fit")))
    started = records(tmp_path / "fit", "fit_start")  # after the strategy set the model up, before the first step
    assert [r["loads"] for r in started] == [[str(tiny_llama_dir)], []]
    checkpoint = load_file(str(tiny_llama_dir / "model.safetensors"))
    full_bytes = sum(t.numel() * t.element_size() for t in checkpoint.values())
    assert started[0]["bytes_before_sharding"] > full_bytes and started[1]["bytes_before_sharding"] == 0
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_llama_dir))
    fresh_buffers = {f"base_model.model.{name}": b for name, b in non_persistent_buffers(fresh)}
    assert any(name.endswith("rotary_emb.inv_freq") for name in fresh_buffers)
    for r in started:
        base = {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
                for k, v in r["parameters"].items() if "lora_" not in k}
        assert base.keys() == checkpoint.keys()
        assert all(torch.equal(base[k], checkpoint[k]) for k in checkpoint)  # rank 0's checkpoint, on every rank
        lora_b = [k for k in r["parameters"] if ".lora_B." in k]
        assert lora_b and all(not r["local_shards"][k].any() and not r["parameters"][k].any() for k in lora_b)
        assert r["buffers"].keys() == fresh_buffers.keys()
        assert all(torch.equal(r["buffers"][k], fresh_buffers[k]) for k in fresh_buffers)  # rotary inv_freq
    assert all(torch.equal(started[0]["parameters"][k], started[1]["parameters"][k]) for k in started[0]["parameters"])

    # A restored checkpoint wins over rank 0's initial weights (the trained LoRA B is no longer zero).
    args = fit_args(small_data, tiny_llama_dir, tmp_path / "validate", "--trainer.devices=2", SHARDED,
                    "--trainer.limit_val_batches=1", f"--ckpt_path={tmp_path / 'fit' / 'checkpoints' / 'last.ckpt'}",
                    probe(tmp_path / "validate"))
    args[0] = "validate"
    run(args)
    trained = adapter(tmp_path / "fit")
    assert all(trained[k].any() for k in trained if ".lora_B." in k)
    validated = records(tmp_path / "validate", "validation_start")
    assert [r["loads"] for r in validated] == [[str(tiny_llama_dir)], []]
    for r in validated:
        lora = {k.replace(".default.", "."): v for k, v in r["parameters"].items() if "lora_" in k}
        assert lora.keys() == trained.keys() and all(torch.equal(lora[k], trained[k]) for k in trained)


def test_a_base_rank_0_cannot_load_stops_every_sharded_rank_with_its_message(small_data: Path, tiny_llama_dir: Path,
                                                                             tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "llama"
    shutil.copytree(tiny_llama_dir, broken)
    weights = broken / "model.safetensors"
    with weights.open("r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)
    args = fit_args(small_data, broken, tmp_path / "run", "--trainer.devices=2", SHARDED)
    args[args.index(f"--data.init_args.tokenizer={broken}")] = f"--data.init_args.tokenizer={tiny_llama_dir}"
    result = run_cli_subprocess(args, timeout=200)  # rank 1 does not wait for a model that never comes
    assert result.returncode == 2
    assert result.stderr.count(f"cannot load the causal LM from '{broken}': SafetensorError") == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr

"""The BLIP VQA prompt tool: contract, gates, learning, serving from an export, bad inputs (on the pretrained tiny
BLIP, built per session: slow). DDP and resuming a killed run are the engine's, tested once on CLIP
(engine/test_multiprocess.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clova_train.tools.vqa.tool import BlipVqa, VqaInstance
from helpers.common import QUIET_CPU_FIT, run_fit
from helpers.runs import assert_same_pools, load_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tool(tiny_blip_dir: Path) -> BlipVqa:
    """On random weights: the tool's contracts, not what it learns."""
    return BlipVqa(str(tiny_blip_dir), num_prompt_tokens=4, max_answer_tokens=4)


@pytest.fixture(scope="module")
def pretrained_tool(pretrained_blip_dir: Path) -> BlipVqa:
    """On the quickstart's pretrained BLIP: for the learning tests."""
    return BlipVqa(str(pretrained_blip_dir), num_prompt_tokens=4, max_answer_tokens=4)


def records(root: Path) -> list[VqaInstance]:
    from clova_train.datamodules.prompt_tuning.vqa_records import VqaRecords

    dataset = VqaRecords(root / "train.jsonl", None)
    return [dataset[i] for i in range(len(dataset))]


def vqa_fit_args(blip_dir: Path, records_file: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        *QUIET_CPU_FIT,
        f"--trainer.default_root_dir={run_dir}",
        "--model.class_path=clova_train.models.PromptTuning",
        "--model.init_args.tool.class_path=clova_train.tools.vqa.tool.BlipVqa",
        f"--model.init_args.tool.init_args.model_name={blip_dir}",
        "--model.init_args.tool.init_args.num_prompt_tokens=4",
        "--model.init_args.tool.init_args.max_answer_tokens=4",
        "--model.init_args.tool.init_args.top_k=3",
        "--model.init_args.lr=0.03", "--model.init_args.steps=20",
        "--data.class_path=clova_train.datamodules.VqaRecordDataModule",
        f"--data.init_args.records={records_file}",
        "--data.init_args.chunk_size=8",
        *extra,
    ]


# ---------------------------------------------------------------------- the tool
def test_blip_passes_check_tool(tool: BlipVqa, vqa_root: Path) -> None:
    from clova_train.tools.check import check_tool

    instances = [i for i in records(vqa_root) if not i.keep_unchanged]
    instances[1].question = "what colour is the large shape in this picture?"  # other lengths: padding is masked
    report = check_tool(tool, instances[:3])
    assert report["max_cross_row_gradient"] == 0.0 and report["unmodified_max_difference"] == 0.0


def test_zero_prompt_is_exactly_the_unmodified_tool(tool: BlipVqa, vqa_root: Path) -> None:
    instances = records(vqa_root)[:3]
    ctx = tool.prepare(instances)
    answers = tool.encode_answers([i.answer for i in instances])
    plain = tool.decoder_logits(ctx.question, answers, None)
    zero = tool.decoder_logits(ctx.question, answers, torch.zeros(3, *tool.prompt_shape))
    torch.testing.assert_close(plain, zero, atol=1e-5, rtol=0)


def tune(tool: BlipVqa, instances: list[VqaInstance], steps: int, lr: float = 0.03,
         seed: int = 0) -> tuple[torch.Tensor, list[float]]:
    ctx = tool.prepare(instances)
    start = torch.rand(len(instances), *tool.prompt_shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    prompts = (start * tool.init_scale()).requires_grad_()
    optimizer = torch.optim.Adam([prompts], lr=lr)
    history = []
    for _ in range(steps):
        losses = tool.instance_losses(ctx, prompts)
        history.append(float(losses.sum()))
        optimizer.zero_grad()
        losses.sum().backward()
        optimizer.step()
    return prompts.detach(), history


@pytest.mark.learning
def test_tuning_lowers_the_loss_and_flips_the_gate(pretrained_tool: BlipVqa, vqa_root: Path) -> None:
    orange = [i for i in records(vqa_root) if i.instance_id in ("orange_000", "orange_001")]
    ctx = pretrained_tool.prepare(orange)
    assert pretrained_tool.decode(pretrained_tool.greedy(ctx.question, None)) != ["orange", "orange"]  # the tool is wrong without help
    assert not any(r.passed for r in pretrained_tool.gate(ctx, torch.zeros(2, *pretrained_tool.prompt_shape)))
    generator = torch.Generator().manual_seed(3)
    for scale in (pretrained_tool.init_scale(), 0.3, 1.0):  # control: random prompts of the same structure do not pass
        random = (torch.rand(2, *pretrained_tool.prompt_shape, generator=generator) * 2 - 1) * scale
        assert not any(r.passed for r in pretrained_tool.gate(ctx, random))
    passed = 0
    for seed in range(3):  # 6 tunings: 2 instances x 3 prompt seeds
        prompts, history = tune(pretrained_tool, orange, 40, seed=seed)
        assert history[-1] < 0.2 * history[0]
        passed += sum(r.passed for r in pretrained_tool.gate(ctx, prompts))
    assert passed >= 5, f"{passed} of 6 tuned prompts passed"


@pytest.mark.learning
def test_gate_rejects_a_wrong_inferred_answer(pretrained_tool: BlipVqa, vqa_root: Path) -> None:
    """Trained towards the answer the loop inferred ('yellow'), the prompt cannot fix the gold 'orange'."""
    (wrong,) = [i for i in records(vqa_root) if i.instance_id == "orange_003"]
    assert wrong.answer != wrong.val_answer == "orange"
    prompts, history = tune(pretrained_tool, [wrong], 40)
    assert history[-1] < min(0.1, history[0])  # it learned the inferred answer...
    ctx = pretrained_tool.prepare([wrong])
    (result,) = pretrained_tool.gate(ctx, prompts)
    assert not result.passed and result.rejections[0].kind == "wrong answer"  # ...which the gate refuses
    assert f"answered {wrong.answer!r}" in result.rejections[0].detail


@pytest.mark.learning
def test_greedy_and_teacher_forced_gates_agree(pretrained_tool: BlipVqa, vqa_root: Path) -> None:
    instances = [i for i in records(vqa_root) if not i.keep_unchanged]
    ctx = pretrained_tool.prepare(instances)
    verdicts = []
    generator = torch.Generator().manual_seed(1)
    candidates = [torch.zeros(len(instances), *pretrained_tool.prompt_shape)]
    candidates += [(torch.rand(len(instances), *pretrained_tool.prompt_shape, generator=generator) * 2 - 1) * s for s in (0.5, 2, 8)]
    for steps in (5, 10, 20, 40):
        candidates.append(tune(pretrained_tool, instances, steps)[0])
    for prompts in candidates:
        greedy = [r.passed for r in pretrained_tool.gate(ctx, prompts)]
        forced = [r.passed for r in pretrained_tool.quick_gate(ctx, prompts)]
        assert greedy == forced
        verdicts += greedy
    assert len(verdicts) == 8 * len(instances) and any(verdicts) and not all(verdicts)


# ---------------------------------------------------------------------- runs, export, serving
@pytest.fixture(scope="module")
def vqa_reference_run(tiny_blip_dir: Path, vqa_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run on the random-weight BLIP (what the engine does with any weights)."""
    run_dir = tmp_path_factory.mktemp("vqa-reference")
    assert run_fit(*vqa_fit_args(tiny_blip_dir, vqa_root / "train.jsonl", run_dir)) == 0
    return run_dir


@pytest.fixture(scope="module")
def pretrained_vqa_run(pretrained_blip_dir: Path, vqa_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run on the pretrained BLIP, whose prompts learn: for the learning tests."""
    run_dir = tmp_path_factory.mktemp("vqa-pretrained")
    assert run_fit(*vqa_fit_args(pretrained_blip_dir, vqa_root / "train.jsonl", run_dir)) == 0
    return run_dir


def test_records_marked_correct_enter_the_pool_as_zero_prompts(vqa_reference_run: Path) -> None:
    """Whatever the weights: every record is tried once, and those the loop marked correct are kept unchanged."""
    pool, summary = load_run(vqa_reference_run)
    assert summary["tried"] == 10 and summary["tool"] == "blip_vqa"
    accepted = {r["instance_id"] for r in summary["instances"] if r["accepted"]}
    assert {"red_000", "red_001", "red_002", "red_003"} <= accepted
    _, prompts, ids = pool.entry(None)
    assert sorted(ids) == sorted(accepted)
    assert all(prompt.abs().sum() == 0 for instance_id, prompt in zip(ids, prompts) if instance_id.startswith("red"))


@pytest.mark.learning
def test_run_keeps_zero_prompts_for_correct_records(pretrained_vqa_run: Path) -> None:
    pool, summary = load_run(pretrained_vqa_run)
    assert summary["tried"] == 10 and summary["tool"] == "blip_vqa"
    accepted = {r["instance_id"] for r in summary["instances"] if r["accepted"]}
    assert {"red_000", "red_001", "red_002", "red_003"} <= accepted
    assert "orange_003" not in accepted and {"purple_000", "purple_001"}.isdisjoint(accepted)
    assert accepted & {"orange_000", "orange_001", "orange_002"}, "the test needs learned prompts"
    features, prompts, ids = pool.entry(None)
    assert pool.concepts == [""] and len(ids) == len(accepted)
    for instance_id, prompt in zip(ids, prompts):
        assert (prompt.abs().sum() == 0) == instance_id.startswith("red")


def test_prompts_do_not_depend_on_chunk_size(tiny_blip_dir: Path, vqa_root: Path, vqa_reference_run: Path,
                                             tmp_path: Path) -> None:
    run_dir = tmp_path / "chunk1"
    assert run_fit(*vqa_fit_args(tiny_blip_dir, vqa_root / "train.jsonl", run_dir, "--data.init_args.chunk_size=1")) == 0
    pool, summary = load_run(run_dir)
    reference_pool, reference = load_run(vqa_reference_run)
    assert [(r["instance_id"], r["accepted"], r["steps"]) for r in summary["instances"]] == [
        (r["instance_id"], r["accepted"], r["steps"]) for r in reference["instances"]]
    assert_same_pools(pool, reference_pool)


@pytest.mark.learning
def test_export_serves_in_a_fresh_process_and_changes_answers(pretrained_vqa_run: Path, vqa_root: Path,
                                                               tmp_path: Path) -> None:
    from clova_train.cli import main

    out = tmp_path / "export"
    assert main(["export", str(pretrained_vqa_run), "-o", str(out)]) == 0
    assert json.loads((out / "export.json").read_text())["learner"] == "prompt_tool"
    # held-out orange images, each with its own question (the forms the tiny BLIP was pretrained on)
    held_out = [json.loads(line) for line in (vqa_root / "eval.jsonl").read_text().splitlines()]
    held_out = [record for record in held_out if record["answer"] == "orange"]
    images = [vqa_root / record["image"] for record in held_out]
    code = (
        "import sys, json, torch, numpy as np\n"
        "from PIL import Image\n"
        "from clova_train.tools.prompt_server import PromptToolServer\n"
        f"s = PromptToolServer.from_export({str(out)!r})\n"
        f"paths = {[str(p) for p in images]!r}\n"
        "imgs = [torch.from_numpy(np.asarray(Image.open(p).convert('RGB')).copy()).permute(2, 0, 1) for p in paths]\n"
        f"qs = {[record['question'] for record in held_out]!r}\n"
        "class NoPrompt:\n"
        "    def prompts_for(self, concept, features): return None\n"
        "print(json.dumps({'pool': s.answer(imgs, qs), 'plain': s.tool.answer(NoPrompt(), imgs, qs),\n"
        "                  'served': s.serve({'image': paths[0], 'question': qs[0]})}))\n"
        "assert 'lightning' not in sys.modules, 'serving imported lightning'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    answers = json.loads(result.stdout.strip().splitlines()[-1])
    assert answers["plain"] != answers["pool"]
    assert sum(a == "orange" for a in answers["pool"]) > sum(a == "orange" for a in answers["plain"])
    assert answers["served"] == {"answer": answers["pool"][0]}


# ---------------------------------------------------------------------- bad input
BAD_RECORDS = {
    "malformed": ('{"image": "images/x.png", "question": "q?", "answer": "red"}\n{"image": broken\n', "line 2: not valid JSON"),
    "missing_image": ('{"image": "images/none.png", "question": "q?", "answer": "red"}\n', "line 1: image not found"),
    "empty_question": ('{"image": "IMG", "question": "  ", "answer": "red"}\n', "line 1: field 'question' must be a non-empty string"),
    "empty_answer": ('{"image": "IMG", "question": "what?", "answer": ""}\n', "line 1: field 'answer' must be a non-empty string"),
    "missing_field": ('{"image": "IMG", "answer": "red"}\n', "line 1: missing field 'question'"),
    "not_object": ('["IMG", "q", "a"]\n', "line 1: a record must be a JSON object"),
    "empty_file": ("\n", "is empty"),
    "long_answer": ('{"id": "long", "image": "IMG", "question": "what colour?", "answer": "red green blue yellow purple"}\n',
                    "answer 'red green blue yellow purple' is 6 tokens with [SEP]; the tool decodes at most max_answer_tokens=4"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_bad_records_fail_with_one_message_and_no_pool(case: str, tiny_blip_dir: Path, vqa_root: Path,
                                                       tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    text, message = BAD_RECORDS[case]
    image = sorted((vqa_root / "images").glob("train_red_*.png"))[0]
    data = tmp_path / "data.jsonl"
    data.write_text(text.replace("IMG", str(image)))
    run_dir = tmp_path / "run"
    assert run_fit(*vqa_fit_args(tiny_blip_dir, data, run_dir)) == 2
    err = capsys.readouterr().err
    assert "clova-train: error:" in err and message in err and "Traceback" not in err
    assert str(data) in err  # the message names the records file
    assert not (run_dir / "pool.safetensors").exists()


def test_pool_of_another_model_is_refused(vqa_reference_run: Path, tiny_blip_dir: Path, tmp_path: Path) -> None:
    from clova_train.core.errors import ExportError
    from clova_train.quickstart.tiny_models import tiny_model
    from clova_train.tools.prompt_server import PromptToolServer

    other = tiny_model("blip").build(tmp_path / "other-blip", seed=1, pretrain_steps=0)
    export = tmp_path / "export"
    shutil.copytree(vqa_reference_run, export, ignore=shutil.ignore_patterns("checkpoints"))
    tool = json.loads((export / "tool.json").read_text())
    tool["init_args"]["model_name"] = str(other)
    (export / "tool.json").write_text(json.dumps(tool))
    with pytest.raises(ExportError, match="prompts were trained on blip_vqa:"):
        PromptToolServer.from_export(export)
    tool.pop("identity")
    (export / "tool.json").write_text(json.dumps(tool))
    from clova_train.core.errors import PoolError

    with pytest.raises(PoolError, match="does not fit this model: model_identity is 'blip_vqa:.*' in the pool but"):
        PromptToolServer.from_export(export)

"""``clova-train report``: a prompt-tuning run drawn from what it wrote; controller and LoRA logs in the formats
stable-baselines3 and Lightning's CSV logger write; a directory that is no run gets one message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clova_train.cli import main
from helpers.common import fit_args, run_fit


def test_a_prompt_tuning_run_gets_learning_curves_gate_and_evaluation(tiny_clip_dir: Path, concept_root: Path,
                                                                      tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    assert run_fit(*fit_args(tiny_clip_dir, concept_root, run, "--trainer.limit_val_batches=0")) == 0
    summary = json.loads((run / "summary.json").read_text())
    curves = [item["loss_curve"] for item in summary["instances"]]
    assert curves and all(len(c) == item["steps"] for c, item in zip(curves, summary["instances"]))
    assert all(c[-1] == pytest.approx(item["loss"], rel=1e-4) for c, item in zip(curves, summary["instances"]))
    (run / "evaluation").mkdir()
    (run / "evaluation" / "validate.json").write_text(json.dumps({"stage": "validate", "per_concept": [
        {"concept": "red", "n": 4, "accuracy_no_prompt": {"mean": 0.5, "ci95": [0.2, 0.8]},
         "accuracy_pool": {"mean": 0.75, "ci95": [0.3, 0.95]},
         "accuracy_pool - accuracy_no_prompt": {"mean": 0.25, "ci95": [-0.1, 0.6]}}]}))

    assert main(["report", str(run)]) == 0
    assert capsys.readouterr().out.strip() == f"report: {run / 'report' / 'report.md'}"
    page = (run / "report" / "report.md").read_text()
    for picture in ("learning_curves.png", "gate_acceptance.png", "evaluation_validate.png"):
        assert f"]({picture})" in page and (run / "report" / picture).stat().st_size > 1000
    for concept in {item["concept"] for item in summary["instances"]}:  # the gate table: tried and accepted
        mine = [item for item in summary["instances"] if item["concept"] == concept]
        assert f"| {concept} | {len(mine)} | {sum(item['accepted'] for item in mine)} |" in page
    assert "+0.250 [-0.100, +0.600]" in page  # the paired difference with its interval
    assert main(["report", str(run)]) == 0  # a rerun replaces the report
    assert not [p for p in run.iterdir() if p.name.startswith(".report")]  # no staging directory left


def test_controller_and_lora_logs_become_curves_and_tables(tmp_path: Path) -> None:
    controller = tmp_path / "controller"
    (controller / "logs").mkdir(parents=True)
    (controller / "logs" / "progress.csv").write_text(
        "time/total_timesteps,rollout/ep_rew_mean,rollout/accuracy,eval/accuracy,eval/baseline_random_accuracy\n"
        "100,0.5,0.4,,\n200,0.9,0.6,0.7,0.3\n300,1.1,0.8,0.85,0.3\n")
    (controller / "evaluation.json").write_text(json.dumps({
        "trained controller": {"accuracy": 0.85, "steps": 2.1, "tasks": "test"},
        "random sample": {"accuracy": 0.3, "steps": 2.5, "tasks": "test"}}))
    assert main(["report", str(controller)]) == 0
    page = (controller / "report" / "report.md").read_text()
    assert "| rollout/ep_rew_mean | 3 | 0.500 | 1.100 | 1.100 |" in page
    assert "| eval/accuracy | 2 | 0.700 | 0.850 | 0.850 |" in page
    assert "## Controls (test tasks)" in page and "held-out" not in page  # the final table is played on test
    assert "| trained controller | 0.850 | 2.100 |" in page and (controller / "report" / "controls.png").is_file()

    lora = tmp_path / "lora"
    (lora / "adapter").mkdir(parents=True)
    (lora / "adapter" / "adapter_config.json").write_text("{}")
    (lora / "logs" / "version_0").mkdir(parents=True)
    (lora / "logs" / "version_0" / "metrics.csv").write_text(
        "epoch,step,train/loss,val/seen/SR,val/seen/SR_act,val/unseen/SR,val/unseen/samples\n"
        "0,9,2.0,,,,\n0,9,,0.25,0.5,0.0,32\n1,19,1.0,,,,\n1,19,,0.75,0.9,0.125,32\n")
    assert main(["report", str(lora)]) == 0
    page = (lora / "report" / "report.md").read_text()
    assert "| train/loss | 2 | 2.000 | 2.000 | 1.000 |" in page
    assert "| seen | 0.750 | 0.900 |" in page and "| unseen | 0.125 | - |" in page  # the last evaluation, per group
    assert "val/seen/SR" in page and "samples" not in page.split("Success rates per group (val)")[1].split("##")[0]
    # a later `clova-train test` (or a resume) writes another version: the report keeps the training curves too
    (lora / "logs" / "version_1").mkdir()
    (lora / "logs" / "version_1" / "metrics.csv").write_text("epoch,step,test/all/SR,test/all/SR_t\n1,19,0.5,0.9\n")
    assert main(["report", str(lora)]) == 0
    page = (lora / "report" / "report.md").read_text()
    assert "| train/loss | 2 |" in page and "| all | 0.500 | 0.900 |" in page


def test_stored_without_tuning_is_not_counted_as_accepted(tmp_path: Path) -> None:
    run = tmp_path / "vqa"
    run.mkdir()
    instances = [{"instance_id": f"q{i}", "concept": None, "accepted": True, "rejections": [], "loss": 0.0, "steps": 0,
                  "loss_curve": []} for i in range(3)]
    instances += [{"instance_id": "t0", "concept": None, "accepted": False, "loss": 2.0, "steps": 4,
                   "rejections": [{"kind": "held-out answer", "detail": "x"}], "loss_curve": [3.0, 2.5, 2.1, 2.0]},
                  {"instance_id": "t1", "concept": None, "accepted": True, "loss": 0.5, "steps": 2, "rejections": [],
                   "loss_curve": [1.0, 0.5]}]
    (run / "summary.json").write_text(json.dumps({"complete": True, "instances": instances}))
    assert main(["report", str(run)]) == 0
    page = (run / "report" / "report.md").read_text()
    assert "| (all) | 2 | 1 | 0.500 | 3 | held-out answer (1) |" in page
    assert "| accepted | 1 | 1.000 | 0.500 | 2.000 |" in page and "| rejected | 1 | 3.000 | 2.000 | 4.000 |" in page


def test_the_report_never_replaces_the_run_or_an_unrelated_folder(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"instances": []}))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    for output, words in ((run, "would replace the run directory"), (tmp_path, "would replace the run directory"),
                          (tmp_path / "notes", "is not an earlier report")):
        assert main(["report", str(run), "--output", str(output)]) == 2
        assert words in capsys.readouterr().err
    assert (run / "summary.json").is_file() and (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    assert main(["report", str(run), "--output", str(tmp_path / "out")]) == 0
    assert main(["report", str(run), "--output", str(tmp_path / "out")]) == 0  # an earlier report is replaced


def test_a_directory_that_is_no_run_gets_one_message(tmp_path: Path, capsys) -> None:
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is neither a run nor an export" in err and "Traceback" not in err
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "run directory not found" in capsys.readouterr().err
    assert not (tmp_path / "report").exists()


def test_learning_curves_draw_early_stopped_zero_and_many_instances(tmp_path: Path) -> None:
    from clova_train.report.figures import instance_learning_curves

    stopped = {"accepted": True, "loss_curve": [2.0, 1.0]}  # passed the quick gate after two steps
    slow = [{"accepted": True, "loss_curve": [3.0, 2.5, 2.0, 1.5]} for _ in range(400)]
    zero = {"accepted": False, "loss_curve": [1.0, 0.0]}  # a loss that reached 0: no log axis
    table = instance_learning_curves([stopped, *slow, zero, {"accepted": True, "loss_curve": []}], tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 1000
    assert "| accepted | 401 | 3.000 | 1.500 | 4.000 |" in table and "| rejected | 1 | 1.000 | 0.000 | 2.000 |" in table
    assert instance_learning_curves([], tmp_path / "b.png").count("\n") == 1  # no instance: an empty table, no crash


def _drawn_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list:
    """Every kind of report picture, drawn from small synthetic inputs; the figures as drawn."""
    from clova_train.report import figures
    from clova_train.report.runs import Series

    drawn = []
    save = figures._save
    monkeypatch.setattr(figures, "_save", lambda figure, path: (save(figure, path), drawn.append(figure)))
    instances = [{"concept": name, "accepted": k % 3 > 0, "steps": 4, "loss_curve": [2.0, 1.5, 1.2, 1.0 + k / 10],
                  "rejections": [] if k % 3 else [{"kind": "validation"}]}
                 for k, name in enumerate(["purple", "orange", "a rather long concept name for a label"] * 3)]
    figures.instance_learning_curves(instances, tmp_path / "a.png")
    figures.gate_acceptance(instances, tmp_path / "b.png")
    figures.per_concept_evaluation({"stage": "test", "per_concept": [
        {"concept": c, "n": 9, "accuracy_no_prompt": {"mean": 0.5, "ci95": [0.2, 0.8]},
         "accuracy_pool": {"mean": 0.7, "ci95": [0.4, 0.9]}} for c in ("purple", "orange")]}, tmp_path / "c.png")
    steps = [100.0, 200.0, 300.0]
    series = {"rollout/ep_rew_mean": Series(steps, [10.0, 120.0, 190.0]), "rollout/accuracy": Series(steps, [0.2, 0.5, 0.8]),
              "eval/accuracy": Series(steps, [0.3, 0.6, 0.9]),
              "eval/baseline_question_rule_accuracy": Series(steps, [0.5, 0.5, 0.5]),
              "val/seen/SR": Series(steps, [0.1, 0.4, 0.6]), "val/unseen/SR_act": Series(steps, [0.0, 0.1, 0.2]),
              "val/no_tool/SR": Series(steps, [0.5, 0.8, 0.9])}
    figures.curves(series, ["rollout/ep_rew_mean", "rollout/accuracy"], tmp_path / "d.png", "environment steps",
                   "Training episodes: mean return and accuracy", "accuracy (0-1)",
                   right=("rollout/ep_rew_mean", "mean episode return"))
    figures.curves(series, ["eval/accuracy", "eval/baseline_question_rule_accuracy"], tmp_path / "e.png",
                   "environment steps", "Periodic evaluation", "accuracy (0-1)")
    figures.grouped_last_values(series, "val", tmp_path / "f.png", "val: GPT4Tools success rates per group")
    figures.policy_comparison({"trained controller": {"accuracy": 0.9},
                               "per-sample logistic regression on logs (1500 steps of random play on training tasks)":
                                   {"accuracy": 0.93},
                               "oracle (the good path of the question's kind; a ceiling)": {"accuracy": 1.0}},
                              tmp_path / "g.png")
    return drawn


def test_every_report_picture_reads_on_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each kind of picture: a title, both axes labelled, legends in words (no raw metric key), scales that differ on
    axes of their own, and no text cut at the figure's edge (long titles and control names are wrapped)."""
    import re

    drawn = _drawn_figures(tmp_path, monkeypatch)
    assert len(drawn) == 7
    for figure in drawn:
        renderer = figure.canvas.get_renderer()
        box = figure.bbox
        main = figure.axes[0]
        assert main.get_title(), figure
        for axes in figure.axes:
            assert axes.get_ylabel(), (main.get_title(), "y label")
        assert main.get_xlabel(), (main.get_title(), "x label")
        legend = main.get_legend()
        for text in legend.get_texts() if legend else []:
            assert not re.search(r"\w/\w|baseline_|_accuracy", text.get_text()), text.get_text()
        figure.canvas.draw()
        for axes in figure.axes:  # everything drawn (titles, labels, tick labels, legend) inside the picture
            extent = axes.get_tightbbox(renderer)
            assert extent.x0 >= box.x0 - 1 and extent.x1 <= box.x1 + 1 and extent.y0 >= box.y0 - 1 \
                and extent.y1 <= box.y1 + 1, (main.get_title(), extent, box)
    reward = drawn[3]
    assert len(reward.axes) == 2  # return and accuracy on axes of their own
    assert {t.get_text() for t in drawn[5].axes[0].get_legend().get_texts()} >= {"SR (the whole step right)"}
    assert any("\n" in t.get_text() for t in drawn[6].axes[0].get_yticklabels())  # a long control name wrapped

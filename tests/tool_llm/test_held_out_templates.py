"""The synthetic tool data is split by request template (and by tool for unseen tools): no validation or test request
repeats a training template, and the nearest-record control keeps no hand-written rule that encodes the split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clova_train.core.errors import DataError
from clova_train.datamodules import SyntheticToolDataModule
from clova_train.datamodules.tool_llm.template_split import record_template, request_template, split_templates
from clova_train.datamodules.tool_llm.tool_conversations import (
    ALL_TOOLS, CHAIN_COMMANDS, CHAINS, CHAT, COMMANDS, CONDITIONS, SEEN_TOOLS, STYLES, UNSEEN_TOOLS,
)
from clova_train.tooluse.metrics import ToolUsageSuccessRate
from clova_train.tooluse.react import parse_react
from clova_train.tooluse.retrieval_baseline import DescriptionMatcher, NearestRecordBaseline

SPLITS = ("train", "val", "test")


def generated(root: Path, seed: int) -> dict[str, list[dict[str, str]]]:
    SyntheticToolDataModule(str(root), "unused", conversations_per_tool=3, eval_conversations_per_tool=2,
                            negatives=24, render_seed=seed).prepare_data()
    return {split: json.loads((root / f"{split}.json").read_text()) for split in SPLITS}


def called(records: list[dict[str, str]]) -> set[str]:
    return {step.action for r in records for step in parse_react(r["output"]).tool_steps}


def test_every_seen_tool_has_templates_for_each_split_and_each_template_is_recognised_as_itself() -> None:
    for tool in SEEN_TOOLS:
        if tool not in CHAINS:
            assert len({r.text for r in COMMANDS[tool]}) >= 5, tool
    assert len(set(CHAIN_COMMANDS)) >= 5 and len({q for q, _ in CHAT}) >= 10
    fill = {"obj": "red circle", "obj2": "blue square", "shape": "circle", "style": STYLES[0],
            "condition": next(iter(CONDITIONS.values()))}
    for template in [r.text for rs in COMMANDS.values() for r in rs] + CHAIN_COMMANDS + [q for q, _ in CHAT]:
        assert request_template(template.format(**fill)) == template
    assert request_template("Segment this image, please, now") is None


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_no_validation_or_test_request_repeats_a_training_template(tmp_path: Path, seed: int) -> None:
    data = generated(tmp_path, seed)
    keys = {split: [record_template(r) for r in records] for split, records in data.items()}
    assert all(template is not None for split in SPLITS for template, _ in keys[split])
    templates = {split: {template for template, _ in keys[split]} for split in SPLITS}
    assert not templates["train"] & templates["val"] and not templates["train"] & templates["test"]
    assert not templates["val"] & templates["test"]
    for held_out in ("val", "test"):
        assert not set(keys[held_out]) & set(keys["train"])  # (template, step) pairs of the chains' context samples
    # Every seen tool is asked for in each split (with that split's own wordings); unseen tools never in training,
    # and those of validation never in test.
    tools = {split: called(records) for split, records in data.items()}
    assert set(SEEN_TOOLS) <= tools["train"] and set(SEEN_TOOLS) <= tools["val"] and set(SEEN_TOOLS) <= tools["test"]
    assert not tools["train"] & set(UNSEEN_TOOLS)
    unseen_val, unseen_test = tools["val"] & set(UNSEEN_TOOLS), tools["test"] & set(UNSEEN_TOOLS)
    assert unseen_val and unseen_test and not unseen_val & unseen_test and unseen_val | unseen_test == set(UNSEEN_TOOLS)
    assert all(set(r) == {"instruction", "input", "output"} for split in SPLITS for r in data[split])  # GPT4Tools JSON


def test_the_split_is_written_down_deterministic_and_seeded(tmp_path: Path) -> None:
    data = generated(tmp_path / "a", 3)
    assert data == generated(tmp_path / "b", 3)
    written = json.loads((tmp_path / "a" / "template_split.json").read_text())
    assert written == split_templates(3).describe() and "max(1, n // 5) to test" in written["rule"]
    module = SyntheticToolDataModule(str(tmp_path / "a"), "unused", conversations_per_tool=3,
                                     eval_conversations_per_tool=2, negatives=24, render_seed=3)
    assert module.report_extras() == {"template_split": written}  # what data_report.json gets beside the counts
    assert split_templates(3).describe() != split_templates(4).describe()
    for split in SPLITS:
        listed = written["splits"][split]["requests"]
        assert all(len(listed[tool]) >= (3 if split == "train" else 1) for tool in SEEN_TOOLS if tool not in CHAINS)


def test_data_of_the_old_layout_is_refused_not_reused(tmp_path: Path) -> None:
    old = {"conversations_per_tool": 3, "eval_conversations_per_tool": 2, "negatives": 24, "tools_per_prompt": 4,
           "render_seed": 0}
    (tmp_path / "synthetic.json").write_text(json.dumps(old))
    with pytest.raises(DataError, match="remove it or choose another root"):
        generated(tmp_path, 0)


def test_the_plain_control_cannot_name_a_tool_it_never_saw_and_its_variants_are_named(tmp_path: Path) -> None:
    data = generated(tmp_path, 0)
    unseen = [r for r in data["test"] if called([r]) & set(UNSEEN_TOOLS)]
    plain = NearestRecordBaseline(data["train"])
    assert not called([{"output": plain.predict(r)} for r in unseen]) & set(UNSEEN_TOOLS)
    rates = ToolUsageSuccessRate("paper", sorted(called(data["train"])))
    rates.update([plain.predict(r) for r in unseen], [r["output"] for r in unseen])
    assert float(rates.compute()["unseen/SR"]) == 0.0
    renaming = NearestRecordBaseline(data["train"], tool_choice="renaming rule")
    assert called([{"output": renaming.predict(r)} for r in unseen]) & set(UNSEEN_TOOLS)
    with pytest.raises(ValueError, match="tool_choice must be one of"):
        NearestRecordBaseline(data["train"], tool_choice="oracle")  # type: ignore[arg-type]


def tool_record(request: str, tools: list[str], output_tool: str | None = None) -> dict[str, str]:
    listed = "".join(f"> {t}: {ALL_TOOLS[t][0]} Input: image path.\n" for t in tools)
    output = (f"Thought: Do I need to use a tool? Yes\nAction: {output_tool}\nAction Input: image/a.png\nObservation:"
              if output_tool else "")
    return {"instruction": f"TOOLS:\n{listed}\nNew input: {request}\n", "input": "", "output": output}


def test_the_description_control_learns_its_word_associations_from_training_records_only() -> None:
    pairs = [("Please estimate the depth", "Predict Depth On Image", "Segment the Image"),
             ("Give me a segmentation of everything", "Segment the Image", "Predict Depth On Image"),
             ("Find where the circle is", "Detect the Given Object", "Line Detection On Image"),
             ("Show me the straight lines", "Line Detection On Image", "Detect the Given Object")]
    train = [tool_record(request, sorted([tool, other]), tool) for request, tool, other in pairs]
    matcher = DescriptionMatcher(train)
    depth, segment = ALL_TOOLS["Predict Depth On Image"][0], ALL_TOOLS["Segment the Image"][0]
    assert matcher.score(["estimate", "depth"], depth) > matcher.score(["estimate", "depth"], segment)
    assert DescriptionMatcher([]).score(["estimate", "depth"], depth) == 0.0  # nothing learned, nothing preferred
    assert "Action: Predict Depth On Image" in NearestRecordBaseline(train, tool_choice="descriptions").predict(
        tool_record("Could you estimate the depth", ["Predict Depth On Image", "Segment the Image"]))


def test_the_description_control_reaches_tools_it_never_saw_by_their_descriptions(tmp_path: Path) -> None:
    data = generated(tmp_path, 0)
    unseen = [r for r in data["val"] if called([r]) & set(UNSEEN_TOOLS)]
    learned = NearestRecordBaseline(data["train"], tool_choice="descriptions")
    rates = ToolUsageSuccessRate("paper", sorted(called(data["train"])))
    rates.update([learned.predict(r) for r in unseen], [r["output"] for r in unseen])
    assert float(rates.compute()["unseen/SR_act"]) > 0.0

"""SR_t / SR_act / SR_args / SR on hand-worked fixtures, in the paper's and the public script's modes."""

from __future__ import annotations

import pytest

from clova_train.tooluse.metrics import ToolUsageSuccessRate, score_gpt4tools, score_paper
from clova_train.tooluse.react import parse_react

YES = "Thought: Do I need to use a tool? Yes"
NO = "Thought: Do I need to use a tool? No"


def step(tool: str, args: str, observation: str = "") -> str:
    return f"{YES}\nAction: {tool}\nAction Input: {args}\nObservation: {observation}".rstrip()


ONE_STEP = step("Segment the Given Object", "image/abc.png, young boy")
TWO_STEPS = "\n".join([
    step("Segment the Image", "image/abc.png", "image/seg.png"),
    step("Generate Image Condition On Segmentations", "image/seg.png, a ski resort", "image/out.png"),
    NO, "AI: Result saved as image/out.png",
])
NO_TOOL = f"{NO}\nAI: Hello there."

CASES = {
    # name: (prediction, reference, paper scores, gpt4tools scores) as (SR_t, SR_act, SR_args, SR)
    "correct": (ONE_STEP, ONE_STEP, (1, 1, 1, 1), (1, 1, 1, 1)),
    "wrong tool": (step("Detect the Given Object", "image/abc.png, young boy"), ONE_STEP, (1, 0, 1, 0), (1, 0, 1, 0)),
    # text: BLEU of "a young girl" vs "young boy": 1 of 3 unigrams match, no brevity penalty -> 1/3;
    # paper (order 2, add-one smoothing for bigrams: (0+1)/(2+1)) -> sqrt(1/3 * 1/3) = 1/3.
    # paper: other file name -> 0, args (0 + 1/3)/2; the public script never compares paths -> (1 + 1/3)/2.
    "wrong args": (step("Segment the Given Object", "image/other.png, a young girl"), ONE_STEP,
                   (1, 1, 1 / 6, 0), (1, 1, 2 / 3, 1)),
    # only the first of two steps: paper args (1 + 0)/2; the script averages every item over 2 positions.
    "missing step": (step("Segment the Image", "image/abc.png"), TWO_STEPS, (0, 0, 0.5, 0), (0.5, 0.5, 0.5, 0)),
    "extra step": (ONE_STEP + "\n" + step("Get Photo Description", "image/abc.png"), ONE_STEP,
                   (0, 0, 0.5, 0), (0.5, 0.5, 0.5, 0)),
    "no tool, correct": (f"{NO}\nAI: Hi!", NO_TOOL, (1, 1, 1, 1), (1, 1, 1, 1)),
    "no tool, used a tool": (step("Get Photo Description", "image/abc.png"), NO_TOOL, (0, 0, 0, 0), (0, 0, 0, 0)),
    "no tool, no AI reply": (NO, NO_TOOL, (0, 0, 0, 0), (0, 0, 0, 0)),
    # A .jpg path: the script scores it as text (BLEU-1 of different single tokens = 0); the paper by file name.
    "jpg path moved": (step("Get Photo Description", "other/a.jpg"), step("Get Photo Description", "image/a.jpg"),
                       (1, 1, 1, 1), (1, 1, 0, 0)),
}


@pytest.mark.parametrize("name", CASES)
def test_paper_mode(name: str) -> None:
    prediction, reference, expected, _ = CASES[name]
    assert score_paper(parse_react(prediction), parse_react(reference)) == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("name", CASES)
def test_gpt4tools_mode(name: str) -> None:
    prediction, reference, _, expected = CASES[name]
    assert score_gpt4tools(prediction, reference) == pytest.approx(expected, abs=1e-4)


def test_trailing_no_after_last_action_is_not_penalised_by_the_script() -> None:
    prediction = ONE_STEP + f"\n{NO}\nAI: done"
    assert score_gpt4tools(prediction, ONE_STEP) == pytest.approx((1, 1, 1, 1))
    assert score_paper(parse_react(prediction), parse_react(ONE_STEP)) == pytest.approx((1, 1, 1, 1))


@pytest.mark.parametrize("mode", ["paper", "gpt4tools"])
def test_metric_groups_seen_unseen_and_no_tool(mode: str) -> None:
    metric = ToolUsageSuccessRate(mode=mode, seen_tools=["Segment the Given Object", "Get Photo Description"])
    unseen = step("Detect Face", "image/abc.png")
    predictions = [ONE_STEP, step("Detect the Given Object", "image/abc.png, young boy"), unseen, f"{NO}\nAI: Hi!", NO]
    references = [ONE_STEP, ONE_STEP, unseen, NO_TOOL, NO_TOOL]
    metric.update(predictions[:2], references[:2])
    metric.update(predictions[2:], references[2:])
    result = {k: float(v) for k, v in metric.compute().items()}
    assert result["seen/SR"] == pytest.approx(0.5) and result["seen/SR_act"] == pytest.approx(0.5)
    assert result["seen/SR_t"] == pytest.approx(1.0)
    assert result["unseen/SR"] == pytest.approx(1.0)
    assert result["no_tool/SR"] == pytest.approx(0.5)
    assert result["all/SR"] == pytest.approx(3 / 5)


def test_metric_rejects_mismatched_lengths_and_modes() -> None:
    with pytest.raises(ValueError, match="mode must be"):
        ToolUsageSuccessRate(mode="strict")
    with pytest.raises(ValueError, match="2 predictions for 1 references"):
        ToolUsageSuccessRate().update(["a", "b"], ["a"])


def test_parser_reads_steps_and_reply() -> None:
    parsed = parse_react(TWO_STEPS)
    assert [s.action for s in parsed.tool_steps] == ["Segment the Image", "Generate Image Condition On Segmentations"]
    assert parsed.tool_steps[1].action_input == "image/seg.png, a ski resort"
    assert parsed.decisions == ["Yes", "Yes", "No"] and parsed.reply == "Result saved as image/out.png"

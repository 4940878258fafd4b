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
    assert (result["all/samples"], result["seen/samples"], result["no_tool/samples"]) == (5, 2, 2)


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


# ------------------------------------------------------------------ the public script's edge cases, hand-worked
def coco_perfect(n: int) -> float:
    """pycocoevalcap BLEU-1 of n words against themselves: p1 (n + 1e-15)/(n + 1e-9) times the brevity penalty
    exp(1 - 1/r), r = (n + 1e-15)/(n + 1e-9) < 1 because of the epsilons."""
    import math

    r = (n + 1e-15) / (n + 1e-9)
    return r * math.exp(1 - 1 / r)


EDGE_CASES = {
    # name: (prediction, reference, paper scores, gpt4tools scores), compared to 1e-15
    # "AI:" in mid-line: the script searches anywhere; the paper's parser needs it at a line start.
    "AI mid-line": (f"{NO}\nSure. AI: hello", NO_TOOL, (0, 0, 0, 0), (1, 1, 1, 1)),
    # No space after "?": no decision for the script (thought 0 over one position); the paper's parser reads it.
    "tool?Yes": (ONE_STEP.replace("tool? Yes", "tool?Yes"), ONE_STEP, (1, 1, 1, 1),
                 (0, 1, (1 + coco_perfect(2)) / 2, 0)),
    # An empty "Action Input: " is still a step for the script: the prediction has 2 steps, the reference 1.
    # action: [1, 0] -> 0.5; args: step 1 matches ((1 + perfect(2)) / 2), step 2 missing -> halved.
    "empty action input": (ONE_STEP + "\n" + step("Get Photo Description", ""), ONE_STEP, (0, 0, 0.5, 0),
                           (0.5, 0.5, (1 + coco_perfect(2)) / 4, 0)),
    # One wrong .jpg path (scored as text: (0 + 1e-15)/(1 + 1e-9), times the penalty for r just below 1) and one
    # exact text argument: args just below 0.5, so the script's SR is 0; the paper compares file names.
    "wrong jpg + exact text": (step("Detect the Given Object", "image/b.jpg, young boy"),
                               step("Detect the Given Object", "image/a.jpg, young boy"), (1, 1, 0.5, 0),
                               (1, 1, ((1e-15 / (1 + 1e-9)) * coco_perfect(1) / ((1 + 1e-15) / (1 + 1e-9)) + coco_perfect(2)) / 2, 0)),
}


@pytest.mark.parametrize("name", EDGE_CASES)
def test_public_script_edge_cases_in_both_modes(name: str) -> None:
    prediction, reference, paper, gpt4tools = EDGE_CASES[name]
    assert score_gpt4tools(prediction, reference) == pytest.approx(gpt4tools, rel=1e-12, abs=1e-15)
    assert score_paper(parse_react(prediction), parse_react(reference)) == pytest.approx(paper, abs=1e-4)


def test_a_perfect_text_match_is_just_below_one_as_in_pycocoevalcap() -> None:
    from clova_train.tooluse.metrics import coco_bleu1

    assert coco_bleu1("young boy", "young boy") == pytest.approx(0.999999999, abs=1e-15)
    assert coco_bleu1("young boy", "young boy") < 1.0
    assert coco_bleu1("a b c", "a b c") == pytest.approx(coco_perfect(3), rel=1e-15)


def test_bleu1_agrees_with_pycocoevalcap_on_random_strings() -> None:
    """The formula against the library the public script imports (a dev dependency), on 300 random pairs."""
    import random

    from clova_train.tooluse.metrics import coco_bleu1

    from pycocoevalcap.bleu.bleu import Bleu  # a dev dependency (setup.cfg)

    bleu = Bleu(n=1)
    rng = random.Random(0)
    words = ["a", "boy", "young", "image/a.png", "red", ",", "the", "x"]
    for _ in range(300):
        cand = " ".join(rng.choice(words) for _ in range(rng.randint(0, 6)))
        ref = " ".join(rng.choice(words) for _ in range(rng.randint(0, 6)))
        expected = bleu.compute_score({1: [ref]}, {1: [cand]}, verbose=0)[0][0]
        assert coco_bleu1(cand, ref) == pytest.approx(expected, rel=1e-12, abs=1e-300), (cand, ref)

"""The nearest-record control of the tool LLM: what it copies, what it carries over, and that it is scored like
the LLM."""

from __future__ import annotations

import pytest

from clova_train.datamodules.tool_llm.tool_conversations import SEEN_TOOLS, generate_dataset, records_from_conversation
from clova_train.tooluse.metrics import ToolUsageSuccessRate
from clova_train.tooluse.retrieval_baseline import NearestRecordBaseline

HEAD = ("GPT4Tools has access to the following tools:\n\n> Detect the Given Object: Useful to find an object. "
        "Input: image path, text.\n> Segment the Given Object: Useful to cut out an object. Input: image path, text.\n\n"
        "Previous conversation:\nHuman: Provide an image named {image}. Description: shapes.\nAI: Received.\n\n")


def record(image: str, request: str, steps: str = "", output: str = "") -> dict:
    return {"instruction": HEAD.format(image=image) + f"New input: {request}\n{steps}", "input": "", "output": output}


def test_words_and_image_paths_are_carried_over_from_the_nearest_record() -> None:
    neighbour = record("image/aaaa.png", "Detect the blue circle in the picture",
                       output="Thought: Do I need to use a tool? Yes\nAction: Detect the Given Object\n"
                              "Action Input: image/aaaa.png, blue circle\nObservation:")
    baseline = NearestRecordBaseline([neighbour])
    asked = record("image/bbbb.png", "Detect the red square in the picture")
    assert baseline.predict(asked) == ("Thought: Do I need to use a tool? Yes\nAction: Detect the Given Object\n"
                                       "Action Input: image/bbbb.png, red square\nObservation:")


def test_a_later_step_uses_the_observation_and_an_unlisted_tool_becomes_a_listed_one() -> None:
    step = "Thought: Do I need to use a tool? Yes\nAction: {tool}\nAction Input: {image}\nObservation: {seen}\n"
    neighbour = record("image/aaaa.png", "Cut out the box of the circle",
                       step.format(tool="Detect the Given Object", image="image/aaaa.png", seen="image/cccc.png"),
                       output="Thought: Do I need to use a tool? Yes\nAction: Segment Anything\n"
                              "Action Input: image/cccc.png, circle\nObservation:")
    asked = record("image/bbbb.png", "Cut out the box of the square",
                   step.format(tool="Detect the Given Object", image="image/bbbb.png", seen="image/dddd.png"))
    predicted = NearestRecordBaseline([neighbour], tool_choice="renaming rule").predict(asked)
    assert "Action: Segment the Given Object" in predicted  # the listed tool most like the neighbour's
    assert "Action Input: image/dddd.png, square" in predicted


def test_on_its_own_training_records_it_is_right_and_it_is_scored_as_the_llm_is() -> None:
    conversations, negatives = generate_dataset(list(SEEN_TOOLS), 2, 6, 4, seed=0)
    records = [r for c in conversations for r in records_from_conversation(c, True)] + negatives
    baseline = NearestRecordBaseline(records)
    rates = ToolUsageSuccessRate("paper", list(SEEN_TOOLS))
    rates.update([baseline.predict(r) for r in records], [r["output"] for r in records])
    assert float(rates.compute()["all/SR"]) > 0.95
    with pytest.raises(ValueError, match="at least one training record"):
        NearestRecordBaseline([])

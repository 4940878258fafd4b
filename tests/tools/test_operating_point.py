"""The margin a prompt pool is served at: one check for every tool that has one, run before any model loads."""

from __future__ import annotations

import math

import pytest

from clova_train.core.errors import ModelError
from clova_train.tools.clip.tool import PromptedClip
from clova_train.tools.loc.tool import OwlVitLoc
from clova_train.tools.operating_point import NEVER, check_margin
from clova_train.tools.vqa.tool import BlipVqa

HOSTILE = [-0.01, 1.0001, math.nan, math.inf, True, "0.1", [0.1], {"margin": 0.1}]


@pytest.mark.parametrize("value", [0, 0.0, 0.25, 1, NEVER])
def test_a_margin_in_range_comes_back_as_a_float(value: float) -> None:
    margin = check_margin("answer_margin", value)
    assert isinstance(margin, float) and margin == float(value)


def test_none_is_a_margin_only_where_the_tool_allows_serving_without_one() -> None:
    assert check_margin("detection_margin", None, optional=True) is None
    with pytest.raises(ModelError, match=r"^classify_margin must be a number in \[0, 1\], got None$"):
        check_margin("classify_margin", None)


@pytest.mark.parametrize("value", HOSTILE, ids=repr)
def test_anything_else_is_refused_naming_the_parameter_and_the_value(value: object) -> None:
    with pytest.raises(ModelError) as refused:
        check_margin("detection_margin", value, optional=True)
    assert str(refused.value) == f"detection_margin must be null or a number in [0, 1], got {value!r}"


@pytest.mark.parametrize(("tool", "parameter"), [(PromptedClip, "classify_margin"), (BlipVqa, "answer_margin"),
                                                 (OwlVitLoc, "detection_margin")])
@pytest.mark.parametrize("value", [-0.5, 2, math.nan, "high"], ids=repr)
def test_each_tool_refuses_a_bad_margin_before_it_loads_a_model(tool: type, parameter: str, value: object) -> None:
    # the model name cannot load: the margin's message, not a loading failure, proves the check ran first
    with pytest.raises(ModelError, match=rf"^{parameter} must be "):
        tool(model_name="local-dir:/nonexistent/model", **{parameter: value})

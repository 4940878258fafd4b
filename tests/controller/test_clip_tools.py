"""Prompt-tuned CLIP serving the reasoning loop's verify_property (this package's tools behind the agent)."""

from __future__ import annotations

from pathlib import Path

import pytest

from clova_train.envs import ReasoningLoopConfig, ReasoningLoopEnv
from clova_train.envs.hydra.clip_tools import ClipPromptTools, clip_tools_factory, render_task
from clova_train.envs.common.world import COLOURS, SceneTools, make_task
from clova_train.core.pool import PromptPool
from clova_train.sandbox import PatchRef
from clova_train.tools.clip.tool import PromptedClip
from clova_train.tools.prompt_server import PromptToolServer


@pytest.fixture(scope="module")
def server(tiny_clip_dir: Path) -> PromptToolServer:
    tool = PromptedClip(f"local-dir:{tiny_clip_dir}", None, num_prompt_tokens=5, prompt_depth=2)
    return PromptToolServer(tool, PromptPool(tool.pool_spec()))  # empty pool: the unprompted tool


def test_verify_property_is_answered_by_clip_on_the_rendered_scene(server: PromptToolServer) -> None:
    right = total = 0
    for task_id in range(1, 30):
        task = make_task(task_id)
        tools = ClipPromptTools(server, render_task(task), SceneTools(task), COLOURS)
        for k, obj in enumerate(task.objects):
            patch = PatchRef(task.image_id, *obj.box)  # the object's own box: find returns just it
            other = COLOURS[(COLOURS.index(obj.colour) + 1 + k % 3) % len(COLOURS)]
            right += tools.verify_property(patch, obj.shape, obj.colour)
            right += not tools.verify_property(patch, obj.shape, other)
            total += 2
        assert tools.classifications >= 2 * len(task.objects)
    assert right / total > 0.7, f"CLIP's verify_property matched the annotations {right}/{total} times"


def test_env_runs_with_clip_tools(server: PromptToolServer) -> None:
    env = ReasoningLoopEnv(ReasoningLoopConfig(), tools_factory=clip_tools_factory(server, COLOURS))
    try:
        for task_id in (i for i in range(1, 300) if make_task(i).question_type == "colour"):
            env.reset(seed=0, options={"task_id": task_id})
            good = [i for i, (s, _) in enumerate(env.samples) if "verify_property" in s]
            if good:
                break
        _, _, terminated, _, info = env.step(good[0])
        assert terminated and info["status"] == "ok" and info["answer"] in COLOURS
        assert env.tools.classifications > 0
    finally:
        env.close()

"""The code sandbox: every attack is stopped, reported in the observation, and the environment keeps running."""

from __future__ import annotations

import numpy as np
import pytest

import clova_train.sandbox as sandbox_module
from clova_train.backends import ChatBackend
from clova_train.envs import ReasoningLoopConfig, ReasoningLoopEnv
from clova_train.envs.world import SceneTools, make_task
from clova_train.sandbox import ImagePatch, Sandbox

ATTACKS = {
    "read a file": ("text = open('/etc/passwd').read()", "violation", "name 'open' is not allowed"),
    "open a socket": ("import socket\nsocket.create_connection(('127.0.0.1', 80))", "violation", "import of socket"),
    "import os": ("import os\nos.listdir('/')", "violation", "import of os"),
    "import subprocess": ("import subprocess\nsubprocess.run(['ls'])", "violation", "import of subprocess"),
    "import ctypes": ("from ctypes import CDLL", "violation", "import of ctypes"),
    "dunder escape": ("classes = ().__class__.__base__.__subclasses__()", "violation", "attribute '__subclasses__'"),
    "format escape": ("leak = '{0.__class__}'.format(1)", "violation", "attribute 'format'"),
    "builtins by name": ("b = __builtins__", "violation", "name '__builtins__'"),
    "infinite loop": ("while True:\n    pass", "timeout", "timeout"),
    "memory bomb": ("hog = [0] * (10 ** 10)", "memory", "MemoryError"),
    "fork": ("import os\nos.fork()", "violation", "import of os"),
    "fork via posix": ("from posix import fork\nfork()", "violation", "import of posix"),
}


class AttackLLM(ChatBackend):
    """Planner: slot 0 is the attack, slot 1 a harmless step. Coder: the attack code or a harmless line."""

    def __init__(self, attack: str) -> None:
        self.attack = attack

    def identity(self) -> dict:
        return {"kind": "attack"}

    def chat(self, messages: list[dict]) -> str:
        prompt = messages[-1]["content"]
        if "Write Python code" in prompt:
            code = self.attack if "Instruction: attack" in prompt else "n = len(image_patch.find('circle'))"
            return f"```python\n{code}\n```"
        return "1. [0.9] attack\n2. [0.1] count circles"


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_is_stopped_reported_and_the_env_keeps_running(name: str) -> None:
    code, status, message = ATTACKS[name]
    config = ReasoningLoopConfig(num_samples=2, sandbox_timeout_s=1.0, sandbox_memory_mb=200)
    env = ReasoningLoopEnv(config, llm=AttackLLM(code), render_mode="ansi")
    try:
        obs, _ = env.reset(seed=0)
        obs_after, reward, terminated, truncated, info = env.step(0)
        assert info["status"] == status and message in info["error"]
        assert reward == 100.0 - 1 - config.error_penalty and not (terminated or truncated)
        assert f"-> {status}" in env.memory.text() and f"-> {status}" in env.render()  # in the observation text
        assert not np.array_equal(obs, obs_after)
        _, _, _, _, info = env.step(1)  # the environment (and a restarted worker) keeps working
        assert info["status"] == "ok"
    finally:
        env.close()


class Tools:
    def find(self, patch, name):
        return [(0, 0, 4, 4), (10, 0, 14, 4)] if name == "circle" else []

    def llm_query(self, patch, question):
        return "yes"


@pytest.fixture
def unchecked(monkeypatch: pytest.MonkeyPatch):
    """The sandbox with its static check switched off: the worker's own limits must still hold."""
    monkeypatch.setattr(sandbox_module, "check_code", lambda source: None)
    with Sandbox(timeout_s=2.0, memory_limit_mb=200) as sandbox:
        yield sandbox


SUBCLASSES = "[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == {name!r}][0]"


@pytest.mark.parametrize(("code", "error"), [
    ("import os", "ImportError"),  # no __import__ in the restricted builtins
    ("f = open('/etc/passwd')", "NameError"),
    (f"{SUBCLASSES.format(name='_wrap_close')}.__init__.__globals__['fork']()", "PermissionError"),
    (f"{SUBCLASSES.format(name='_wrap_close')}.__init__.__globals__['system']('true')", "PermissionError"),
    (f"{SUBCLASSES.format(name='_wrap_close')}.__init__.__globals__['open']('/etc/hostname', 0)",
     "Too many open files"),  # os.open: no spare file descriptors
])
def test_worker_limits_hold_without_the_static_check(unchecked: Sandbox, code: str, error: str) -> None:
    result = unchecked.run(code, {}, Tools(), "img", (64, 64))
    assert result.status == "error" and error in result.error, result


def test_variables_persist_explicitly_and_tools_are_forwarded() -> None:
    with Sandbox() as sandbox:
        first = sandbox.run("patches = image_patch.find('circle')\nprint(len(patches))", {}, Tools(), "img", (64, 64))
        assert first.ok and first.stdout == "2\n" and first.tool_calls == 1
        assert first.variables["patches"][1] == ImagePatch("img", 10, 0, 14, 4)
        second = sandbox.run("final_answer = str(len(patches) + extra)", {**first.variables, "extra": 1}, Tools(),
                             "img", (64, 64))
        assert second.variables["final_answer"] == "3"
        sandbox._kill()  # nothing lives in the worker: a fresh one sees the same variables
        third = sandbox.run("x = patches[0].horizontal_center", first.variables, Tools(), "img", (64, 64))
        assert third.variables["x"] == 2.0


def test_scene_tools_answer_from_the_annotations() -> None:
    task = make_task(3)
    with Sandbox() as sandbox:
        colour, shape = task.objects[0].colour, task.objects[0].shape
        result = sandbox.run(f"n = len(image_patch.find('{colour} {shape}'))\nd = image_patch.compute_depth()",
                             {}, SceneTools(task), task.image_id, (64, 64))
        assert result.variables["n"] == sum(o.colour == colour and o.shape == shape for o in task.objects)
        unknown = sandbox.run("x = image_patch.segment('circle')", {}, SceneTools(task), task.image_id, (64, 64))
        assert unknown.status == "error" and "AttributeError" in unknown.error

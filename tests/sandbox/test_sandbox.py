"""The code sandbox against an escape corpus: every attempt is stopped, penalised, reported, and leaves no trace.

Three groups:

* :data:`ESCAPES` go through the whole environment (restriction layer, locked-down worker, JSON wire, fresh tool
  API per run). Each must end in a non-``ok`` status (the error penalty), read or write no file, run no
  command, return no secret, and the next step of the same episode must run correctly.
* :data:`OS_ESCAPES` run with the restriction layer switched off (full Python in the worker): the worker's own
  isolation (empty environment, nobody, rlimits, seccomp, stubs) and the JSON-only wire must hold alone.
* :data:`HOSTILE_OUTPUTS` are programs that may succeed but produce hostile output (huge, amplified, invalid
  text): the training process must stay small and the environment must go on.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from clova_train.llm.backends import ChatBackend
from clova_train.envs import ReasoningLoopConfig, ReasoningLoopEnv
from clova_train.envs.common.world import SceneTools, make_task
from clova_train.sandbox import PatchRef, PolicyViolation, Sandbox, restricted_compile
from clova_train.sandbox import policy
from helpers.common import REPO

SECRET_ENV = "CLOVA_SANDBOX_TEST_SECRET"
SECRET = "s3cret-canary-7f3a9"
SUBCLASSES = "[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '{name}'][0]"
WRAP_CLOSE_GLOBALS = SUBCLASSES.format(name="_wrap_close") + ".__init__.__globals__"

# name -> code; {secret} is a file holding SECRET, {target} a file that must never appear, {secret_env} the
# name of an environment variable of the training process holding SECRET.
ESCAPES: dict[str, str] = {
    # match statements: class and mapping patterns read attributes by name
    "match class pattern __class__": "match image_patch:\n    case object(__class__=c):\n        x = c",
    "match class pattern __globals__": "match llm_query:\n    case object(__globals__=g):\n        final_answer = str(g)",
    "match bound method __func__": "match image_patch.find:\n    case object(__func__=f):\n        final_answer = str(f)",
    "match mapping pattern": "match {{'a': 1}}:\n    case {{'a': v}}:\n        final_answer = v",
    "match sequence capture": "match [1, 2]:\n    case [a, *rest]:\n        final_answer = a",
    # pickle and imports
    "import pickle": "import pickle\nfinal_answer = pickle.dumps(1)",
    "__import__ pickle": "p = __import__('pickle')",
    "from import": "from pickle import loads",
    "relative import": "from . import sandbox",
    "import ctypes": "from ctypes import CDLL\nCDLL(None).system(b'touch {target}')",
    # os.open and file descriptors
    "os.open": "import os\nos.open('{target}', 65)",
    "os.open via subclasses": WRAP_CLOSE_GLOBALS + "['open']('{target}', 65)",
    "os.write to descriptor": "import os\nos.write(1, b'x')",
    # environment reads
    "os.environ": "import os\nfinal_answer = str(os.environ)",
    "environ via function globals": "final_answer = str(image_patch.find.__globals__['os'].environ)",
    "llm_query globals": "final_answer = str(llm_query.__globals__)",
    "method globals via __init__": "g = image_patch.__init__.__globals__",
    "getenv via subclasses": WRAP_CLOSE_GLOBALS + "['getenv']('{secret_env}')",
    # tool tampering
    "replace ImagePatch.find": "ImagePatch.find = lambda self, name: []",
    "setattr ImagePatch": "setattr(ImagePatch, 'find', None)",
    "replace instance method": "image_patch.find = None",
    "alias tool methods": "ImagePatch.exists = ImagePatch.find",
    "delete tool method": "del ImagePatch.find",
    "replace llm_query attribute": "llm_query.answer = 'yes'",
    # parser and compiler bombs
    "nested unary minus": "x = " + "-" * 3000 + "1",
    "nested parentheses": "x = " + "(" * 500 + "1" + ")" * 500,
    "lambda chain": "f = " + "lambda: " * 1000 + "1",
    "nested lists": "x = " + "[" * 1000 + "]" * 1000,
    "nested not": "x = " + "not " * 5000 + "1",
    "nested ifs": "".join("    " * i + "if 1:\n" for i in range(120)) + "    " * 120 + "x = 1",
    "over-long program": "x = 1" + " + 1" * 6000,
    # lone surrogates
    "surrogate answer": "final_answer = '\\ud800'",
    "surrogate dict key answer": "final_answer = {{'\\udfff': 1}}",
    # amplification: small in the worker, huge once expanded
    "amplified list answer": "final_answer = ['a' * 10**6] * 1000",
    "large string answer": "final_answer = 'a' * 10**7",
    "amplified dict answer": "final_answer = dict.fromkeys(range(10**5), 'x' * 100)",
    "deeply nested answer": "x = 1\nfor i in range(50):\n    x = [x]\nfinal_answer = x",
    "huge integer answer": "final_answer = 10 ** 5000",
    "many small items answer": "final_answer = list(range(10**6))",
    # resource bombs
    "infinite loop": "while True:\n    pass",
    "memory bomb list": "hog = [0] * (10 ** 10)",
    "memory bomb string": "hog = 'a' * (10 ** 10)",
    "cpu bomb power": "x = 10 ** 10 ** 8",
    "unbounded recursion": "def f():\n    return f()\nf()",
    "tool call flood": "for i in range(10 ** 6):\n    image_patch.find('circle')",
    "sort bomb": "s = sorted(range(10 ** 9))",
    # fork and exec
    "os.fork": "import os\nos.fork()",
    "posix fork": "from posix import fork\nfork()",
    "subprocess run": "import subprocess\nsubprocess.run(['touch', '{target}'])",
    "os.system via __import__": "__import__('os').system('touch {target}')",
    "Popen via subclasses": SUBCLASSES.format(name="Popen") + "(['touch', '{target}'])",
    "system via subclasses": WRAP_CLOSE_GLOBALS + "['system']('touch {target}')",
    "exec builtin": "exec(\"import os\")",
    "eval builtin": "eval(\"__import__('os')\")",
    "compile builtin": "c = compile('1', 'x', 'exec')",
    "breakpoint": "breakpoint()",
    # file and socket access
    "read secret file": "text = open('{secret}').read()",
    "write file": "open('{target}', 'w').write('x')",
    "io.open": "import io\nio.open('{target}', 'w')",
    "pathlib read": "import pathlib\nfinal_answer = pathlib.Path('{secret}').read_text()",
    "listdir": "from os import listdir\nfinal_answer = str(listdir('/'))",
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', 80))",
    "urllib": "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:1')",
    # frame, traceback, generator and code walks
    "generator frame": "def g():\n    yield 1\nf = g().gi_frame.f_back.f_globals",
    "generator expression frame": "x = (i for i in [1])\nf = x.gi_frame",
    "generator code": "x = (i for i in [1])\nc = x.gi_code",
    "traceback frame": "try:\n    1 / 0\nexcept Exception as e:\n    t = e.__traceback__.tb_frame.f_globals",
    "exception with_traceback walk": "try:\n    1 / 0\nexcept Exception as e:\n    t = e.with_traceback(None).__traceback__",
    "function code": "f = lambda: 0\nc = f.__code__",
    "function globals": "f = lambda: 0\ng = f.__globals__",
    "bound method self class": "x = image_patch.find.__self__.__class__",
    "builtins by name": "b = __builtins__",
    "loader by name": "x = __loader__",
    "type builtin": "t = type(image_patch)",
    "getattr builtin": "t = getattr(image_patch, '__class__')",
    "vars builtin": "v = vars(image_patch)",
    "globals builtin": "g = globals()",
    "dir builtin": "d = dir()",
    "class definition": "class A:\n    pass",
    "global statement": "def f():\n    global image_patch\n    image_patch = None\nf()",
    "with statement": "with open('{secret}') as f:\n    x = f.read()",
    "async function": "async def f():\n    pass",
    "walrus": "final_answer = (x := 1)",
    # format-string tricks
    "str.format attribute walk": "leak = '{{0.__class__}}'.format(1)",
    "str.format tool globals": "leak = '{{0.find.__globals__}}'.format(image_patch)",
    "unbound str.format": "f = str.format\nleak = f('{{0.__class__}}', 1)",
    "format_map": "leak = '{{x}}'.format_map({{'x': 1}})",
    "f-string dunder": "leak = f'{{image_patch.find.__globals__}}'",
    "f-string nested format spec": "w = 10\nleak = f'{{image_patch!r:>{{w}}}}'",
    "string.Formatter": "import string\nleak = string.Formatter().format('{{0.__class__}}', 1)",
}

# restriction layer off: Python's full builtins inside the locked-down worker
OS_ESCAPES: dict[str, str] = {
    "read secret file": "final_answer = open('{secret}').read()",
    "read /etc/shadow": "final_answer = open('/etc/shadow').read()",
    "write file": "open('{target}', 'w').write('x')",
    "os.open create": "import os\nos.open('{target}', os.O_CREAT | os.O_WRONLY)",
    "posix open create": "import sys\nsys.modules['posix'].open('{target}', 65)",
    "os.system": "import os\nos.system('touch {target}')",
    "posix system": "import sys\nsys.modules['posix'].system('touch {target}')",
    "fork via subclasses": WRAP_CLOSE_GLOBALS + "['fork']()",
    "subprocess": "import subprocess\nsubprocess.run(['touch', '{target}'])",
    "libc system": "import ctypes\nctypes.CDLL(None).system(b'touch {target}')",
    "libc open": "import ctypes\nfinal_answer = ctypes.CDLL(None).open(b'{target}', 65, 0o644)",
    "libc socket": "import ctypes\nfinal_answer = ctypes.CDLL(None).socket(2, 1, 0)",
    "libc setuid root": "import ctypes\nfinal_answer = ctypes.CDLL(None).setuid(0)",
    "environment": "import os\nfinal_answer = str(dict(os.environ))",
    "parent environment from /proc": "import os\nfinal_answer = open(f'/proc/{{os.getppid()}}/environ').read()",
    "socket connect": "import socket\nsocket.create_connection(('127.0.0.1', 9))",
    "kill the parent": "import os\nos.kill(os.getppid(), 9)",
    "listdir": "import os\nfinal_answer = str(os.listdir('/'))",
    "pickle on the pipe": (
        "import ctypes, struct\nlibc = ctypes.CDLL(None)\n"
        "body = b\"cposix\\nsystem\\n(S'touch {target}'\\ntR.\"\n"
        "message = struct.pack('!I', len(body)) + body\n"
        "for fd in range(3, 16):\n    libc.write(fd, message, len(message))\nimport time\ntime.sleep(0.3)"),
    "forged result on the pipe": (
        "import ctypes, struct, json\nlibc = ctypes.CDLL(None)\n"
        "body = json.dumps({{'op': 'done', 'status': 'ok', 'variables': {{'$d': [['final_answer', 'forged']]}}}}).encode()\n"
        "message = struct.pack('!I', len(body)) + body\n"
        "for fd in range(3, 16):\n    libc.write(fd, message, len(message))\nimport time\ntime.sleep(0.3)"),
    "oversized message header": (
        "import ctypes, struct\nlibc = ctypes.CDLL(None)\n"
        "for fd in range(3, 16):\n    libc.write(fd, struct.pack('!I', 2**31), 4)\nimport time\ntime.sleep(0.3)"),
    "json nesting bomb on the pipe": (
        "import ctypes, struct\nlibc = ctypes.CDLL(None)\nbody = b'[' * 200000 + b']' * 200000\n"
        "message = struct.pack('!I', len(body)) + body\n"
        "for fd in range(3, 16):\n    libc.write(fd, message, len(message))\nimport time\ntime.sleep(0.3)"),
    "memory bomb": "hog = bytearray(2 * 1024 ** 3)",
    "lower the parent's limits": "import os, resource\nresource.prlimit(os.getppid(), resource.RLIMIT_NOFILE, (3, 3))",
    "libc prlimit on the parent": (
        "import ctypes, os\nlimit = (ctypes.c_ulong * 2)(3, 3)\n"
        "final_answer = ctypes.CDLL(None, use_errno=True).prlimit(os.getppid(), 7, limit, None)"),
}

# may succeed, but their output must stay bounded and valid
HOSTILE_OUTPUTS: dict[str, str] = {
    "print a lone surrogate": "print('\\udc80' * 10)",
    "print ten megabytes": "print('a' * 10**7)",
    "amplified kept variable": "x = ['a' * 10**6] * 1000\nfinal_answer = 'ok'",
    "huge exception message": "raise ValueError('v' * 10**7)",
    "surrogate exception message": "raise ValueError('\\udc80')",
    "many variables": "\n".join(f"v{i} = 'x' * 10000" for i in range(40)) + "\nfinal_answer = 'ok'",
}


class AttackLLM(ChatBackend):
    """Planner: slot 0 is the attack, slot 1 a harmless step. Coder: the attack code or a harmless line."""

    def __init__(self) -> None:
        self.attack = "pass"

    def identity(self) -> dict:
        return {"kind": "attack"}

    def chat(self, messages: list[dict]) -> str:
        prompt = messages[-1]["content"]
        if "Write Python code" in prompt:
            code = self.attack if "Instruction: attack" in prompt else "n = len(image_patch.find('circle'))"
            return f"```python\n{code}\n```"
        return "1. [0.9] attack\n2. [0.1] count circles"


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.fixture(scope="module")
def canaries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("canaries")
    secret = root / "secret.txt"
    secret.write_text(SECRET)
    secret.chmod(0o644)
    root.chmod(0o755)
    return {"secret": str(secret), "target": str(root / "created-by-attack"), "secret_env": SECRET_ENV}


@pytest.fixture(scope="module")
def attack_env() -> ReasoningLoopEnv:
    os.environ[SECRET_ENV] = SECRET  # a key in the training process's environment
    config = ReasoningLoopConfig(num_samples=2, sandbox_timeout_s=1.0, sandbox_memory_mb=200)
    env = ReasoningLoopEnv(config, llm=AttackLLM(), render_mode="ansi")
    yield env
    env.close()
    os.environ.pop(SECRET_ENV, None)


def assert_no_trace(canaries: dict[str, str], *texts: object) -> None:
    assert not Path(canaries["target"]).exists(), "the attack created a file"
    for text in texts:
        assert SECRET not in str(text), "a secret reached the training process"


@pytest.mark.parametrize("name", list(ESCAPES))
def test_escape_is_stopped_penalised_and_the_episode_goes_on(name: str, attack_env: ReasoningLoopEnv,
                                                            canaries: dict[str, str]) -> None:
    env = attack_env
    env.llm.attack = ESCAPES[name].format(**canaries)
    obs, _ = env.reset(seed=3)
    before = rss_mb()
    obs_after, reward, terminated, truncated, info = env.step(0)
    assert rss_mb() - before < 50, "the training process grew"
    assert info["status"] in ("violation", "error", "timeout", "memory"), info
    assert info["error"] and len(info["error"]) <= 600
    assert reward == 100.0 - 1 - env.config.error_penalty and not (terminated or truncated)
    assert f"-> {info['status']}" in env.memory.text() and f"-> {info['status']}" in env.render()
    assert not np.array_equal(obs, obs_after)
    assert_no_trace(canaries, info, env.render(), env.variables)
    _, _, _, _, info = env.step(1)  # the same episode goes on, with an intact tool API
    assert info["status"] == "ok", info
    assert env.variables["n"] == sum(o.shape == "circle" for o in env.task.objects)


class Tools:
    def find(self, patch, name):
        return [(0, 0, 4, 4), (10, 0, 14, 4)] if name == "circle" else []

    def llm_query(self, patch, question):
        return "yes"


@pytest.fixture(scope="module")
def unrestricted() -> Sandbox:
    with Sandbox(timeout_s=2.0, memory_limit_mb=200, restricted=False) as sandbox:
        yield sandbox


@pytest.mark.parametrize("name", list(OS_ESCAPES))
def test_worker_isolation_holds_without_the_restriction_layer(name: str, unrestricted: Sandbox,
                                                              canaries: dict[str, str]) -> None:
    os.environ[SECRET_ENV] = SECRET
    try:
        result = unrestricted.run(OS_ESCAPES[name].format(**canaries), {}, Tools(), "img", (64, 64))
    finally:
        os.environ.pop(SECRET_ENV, None)
    assert_no_trace(canaries, result)
    if result.ok:  # nothing it did had an effect: every call it made failed
        answer = result.variables.get("final_answer", -1)
        assert answer in (-1, "forged") or "PermissionError" in str(answer) or answer == "{'LC_CTYPE': 'C.UTF-8'}", result
    after = unrestricted.run("final_answer = len(image_patch.find('circle'))", {}, Tools(), "img", (64, 64))
    assert after.ok and after.variables["final_answer"] == 2, after


def test_isolation_layers_are_reported() -> None:
    with Sandbox() as sandbox:
        sandbox.run("x = 1", {}, Tools(), "img", (8, 8))
        layers = sandbox.isolation
    assert set(layers) >= {"descriptors", "rlimits", "user", "processes", "stubs", "seccomp"}
    if os.geteuid() == 0:
        assert layers["user"].startswith("on")
    if Path("/proc/self/status").read_text().find("Seccomp:") >= 0:  # a Linux kernel with seccomp
        assert layers["seccomp"].startswith("on"), layers


@pytest.mark.parametrize("name", list(HOSTILE_OUTPUTS))
def test_hostile_output_stays_bounded(name: str, attack_env: ReasoningLoopEnv, canaries: dict[str, str]) -> None:
    env = attack_env
    env.llm.attack = HOSTILE_OUTPUTS[name]
    before = rss_mb()
    env.reset(seed=4)
    _, _, _, _, info = env.step(0)
    texts = [env.render(), env.memory.text(), info["error"], str(env.variables)]
    assert all(len(t) < 20_000 for t in texts)
    for text in texts:
        text.encode("utf-8")  # well-formed: it can enter a prompt, a cache key, an HTTP request
    assert rss_mb() - before < 100
    if "final_answer" in HOSTILE_OUTPUTS[name]:
        assert info["answer"] == "ok" and "x" not in env.variables
    else:
        env.step(1)
        assert env.variables["n"] == sum(o.shape == "circle" for o in env.task.objects)


def test_amplification_does_not_grow_the_training_process(attack_env: ReasoningLoopEnv) -> None:
    env = attack_env
    before = rss_mb()
    for code in ("final_answer = ['a' * 10**6] * 1000", "x = [['b' * 10**5] * 100] * 100",
                 "final_answer = {i: 'c' * 10**4 for i in range(10**3)}"):
        env.llm.attack = code
        env.reset(seed=5)
        env.step(0)
    assert rss_mb() - before < 100


@pytest.mark.parametrize("code", [
    ESCAPES["match class pattern __class__"], ESCAPES["str.format attribute walk"], ESCAPES["generator frame"],
    ESCAPES["traceback frame"], ESCAPES["function globals"], ESCAPES["import pickle"], ESCAPES["class definition"],
    ESCAPES["nested unary minus"], ESCAPES["global statement"], "x = image_patch.find.__self__",
])
def test_restriction_layer_refuses_language_escapes_alone(code: str) -> None:
    """In this process, with no worker: the restriction layer refuses at compile time or in a guard."""
    try:
        compiled = restricted_compile(code.format(secret="/nonexistent", target="/nonexistent", secret_env="X"))
    except (PolicyViolation, SyntaxError, RecursionError, MemoryError):
        return
    scope = {"__builtins__": policy.safe_builtins(), **policy.guards(), "image_patch": object()}
    with pytest.raises((AttributeError, NameError, TypeError)):
        exec(compiled, scope)  # noqa: S102


@pytest.mark.parametrize("limits", [{"memory_limit_mb": -1}, {"timeout_s": 0}, {"output_chars": float("nan")},
                                    {"max_message_bytes": -5}, {"memory_limit_mb": 4}])
def test_bad_sandbox_limits_are_one_clear_error(limits: dict) -> None:
    from clova_train.sandbox import SandboxError

    with pytest.raises(SandboxError, match="sandbox limits must be positive numbers"):
        Sandbox(**limits)


def test_guards_refuse_format_and_mro_at_run_time() -> None:
    scope = {"__builtins__": policy.safe_builtins(), **policy.guards()}
    for code in ("x = 'a'.format", "x = str.format_map", "x = int.mro"):
        with pytest.raises(AttributeError):
            exec(restricted_compile(code), dict(scope))  # noqa: S102


def test_tool_tampering_does_not_outlive_the_run() -> None:
    with Sandbox(restricted=False) as sandbox:  # even with full Python, the next run gets a fresh API
        tampered = sandbox.run("ImagePatch.find = lambda self, name: []\nx = len(image_patch.find('circle'))", {},
                               Tools(), "img", (64, 64))
        assert tampered.ok and tampered.variables["x"] == 0
        fresh = sandbox.run("x = len(image_patch.find('circle'))", {}, Tools(), "img", (64, 64))
        assert fresh.variables["x"] == 2 and sandbox.restarts == 0


def test_variables_persist_explicitly_and_tools_are_forwarded() -> None:
    with Sandbox() as sandbox:
        first = sandbox.run("patches = image_patch.find('circle')\nprint(len(patches))", {}, Tools(), "img", (64, 64))
        assert first.ok and first.stdout == "2\n" and first.tool_calls == 1
        assert first.variables["patches"][1] == PatchRef("img", 10, 0, 14, 4)
        second = sandbox.run("final_answer = str(len(patches) + extra)", {**first.variables, "extra": 1}, Tools(),
                             "img", (64, 64))
        assert second.variables["final_answer"] == "3"
        sandbox._kill()  # nothing lives in the worker: a fresh one sees the same variables
        third = sandbox.run("x = patches[0].horizontal_center\ny = (1, {'a': {2}})", first.variables, Tools(),
                            "img", (64, 64))
        assert third.variables["x"] == 2.0 and third.variables["y"] == (1, {"a": {2}})


def test_scene_tools_answer_from_the_annotations() -> None:
    task = make_task(3)
    with Sandbox() as sandbox:
        colour, shape = task.objects[0].colour, task.objects[0].shape
        result = sandbox.run(f"n = len(image_patch.find('{colour} {shape}'))\nd = image_patch.compute_depth()",
                             {}, SceneTools(task), task.image_id, (64, 64))
        assert result.variables["n"] == sum(o.colour == colour and o.shape == shape for o in task.objects)
        unknown = sandbox.run("x = image_patch.segment('circle')", {}, SceneTools(task), task.image_id, (64, 64))
        assert unknown.status == "error" and "AttributeError" in unknown.error


def test_a_failing_tool_is_an_error_for_the_program_not_the_trainer() -> None:
    class Broken:
        def find(self, patch, name):
            raise RuntimeError("the detector ran out of GPU memory")

    with Sandbox() as sandbox:
        result = sandbox.run("x = image_patch.find('circle')", {}, Broken(), "img", (64, 64))
        assert result.status == "error" and "ran out of GPU memory" in result.error
        caught = sandbox.run("try:\n    x = image_patch.find('a')\nexcept Exception:\n    x = 'handled'", {}, Broken(),
                             "img", (64, 64))
        assert caught.ok and caught.variables["x"] == "handled"


def test_the_wire_refuses_garbage_with_one_error_kind() -> None:
    """Random messages and values, as a compromised worker could send: WireError or a value, nothing else."""
    import json
    import random
    import socket

    from clova_train.sandbox import wire

    rng = random.Random(0)
    atoms = [None, True, 0, -1, 10**99, 10**100, 1.5, "x", "\udc80", "$d", "$t", "$s", "$p", "$f", "nan", [], {}]

    def value(depth: int = 0):
        if depth > 10 or rng.random() < 0.3:
            return rng.choice(atoms)
        if rng.random() < 0.5:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(["$d", "$t", "$s", "$p", "$f", "op", "k"]): value(depth + 1) for _ in range(rng.randint(1, 2))}

    for _ in range(3000):
        try:
            wire.decode_value(value())
        except wire.WireError:
            pass
    left, right = socket.socketpair()
    channel = wire.Channel(right, limit=1 << 16)
    try:
        for _ in range(300):
            body = (json.dumps(value()).encode() if rng.random() < 0.5
                    else bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64))))
            left.sendall(wire.HEADER.pack(len(body)) + body)
            try:
                message = channel.receive(deadline=time.monotonic() + 5)
                assert type(message) is dict and type(message["op"]) is str
            except wire.WireError:
                pass
    finally:
        left.close()
        right.close()


SECCOMP_ONLY = """
import ctypes, os, resource, sys
from clova_train.sandbox.isolation import _install_seccomp, _load_seccomp

victim = int(sys.argv[1])
print(_install_seccomp(_load_seccomp())[:3])
libc = ctypes.CDLL(None, use_errno=True)
limit = (ctypes.c_ulong * 2)(3, 3)
print(libc.prlimit(victim, resource.RLIMIT_NOFILE, limit, None), ctypes.get_errno())
try:
    resource.prlimit(victim, resource.RLIMIT_AS, (1 << 20, 1 << 20))
    print("changed")
except OSError as err:
    print("refused", err.errno)
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))       # its own limits: allowed (pid 0)
resource.prlimit(os.getpid(), resource.RLIMIT_CORE, (0, 0))  # and by its own pid
print("own ok")
"""


def test_seccomp_alone_keeps_a_worker_from_another_process_limits(tmp_path: Path) -> None:
    """The worker keeps the trainer's uid when the trainer is not root, so no file permission or privilege stands
    between them: seccomp must refuse prlimit64 on any other pid (it would lower the trainer's limits) while the
    worker's own setrlimit keeps working. Shown as root, who could change any process's limits without the filter."""
    import signal
    import subprocess
    import sys

    if "Seccomp:" not in Path("/proc/self/status").read_text():
        pytest.skip("no seccomp on this kernel")
    victim = subprocess.Popen(["sleep", "60"])
    try:
        before = Path(f"/proc/{victim.pid}/limits").read_text()
        done = subprocess.run([sys.executable, "-c", SECCOMP_ONLY, str(victim.pid)], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stderr[-3000:]
        layer, libc_call, python_call, own = done.stdout.strip().splitlines()
        assert layer == "on:" and libc_call.split()[0] == "-1" and python_call.startswith("refused") and own == "own ok"
        assert Path(f"/proc/{victim.pid}/limits").read_text() == before
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()


def test_a_surrogate_literal_is_refused_by_the_sandbox_and_made_well_formed_before_it() -> None:
    """Code with a lone surrogate stops in the sandbox (it cannot be compiled or sent as UTF-8); through the
    environment the coder's reply is made well-formed before it is parsed (issue 32), so the same line runs."""
    with Sandbox(timeout_s=2.0) as sandbox:
        result = sandbox.run("x = '\udc80'", {}, Tools(), "img", (8, 8))
    assert result.status in ("violation", "error") and result.error, result
    env = ReasoningLoopEnv(ReasoningLoopConfig(num_samples=2, sandbox_timeout_s=1.0), llm=AttackLLM(), render_mode="ansi")
    try:
        env.llm.attack = "x = '\udc80'"
        env.reset(seed=3)
        _, reward, _, _, info = env.step(0)
        assert info["status"] == "ok" and np.isfinite(reward), info
        env.render().encode("utf-8")
    finally:
        env.close()

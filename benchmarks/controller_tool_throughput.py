"""HYDRA's environment with model-backed ``ImagePatch`` tools: environment steps per second at 1, 2 and 4
environments, in-process tools against one shared ``clova-train serve``, beside the offline world's annotation tools.

Every environment plays the same tasks (a GQA-format training set of rendered scenes, ``--scale`` times the shapes
world's 64 px, written by ``clova_train.envs.tasks.offline.write_offline_benchmark``) with random actions, and the
planner / coder is one fixed chat backend whose every program calls ``find``, ``compute_depth``, ``verify_property``
(LOC then CLASSIFY on crops around what LOC found), ``exists`` and ``crop(...).simple_query``: five ``ImagePatch``
calls per step that runs code (``info["tool_calls"]``; a reject, one action in N + 1, runs none). The tools are the
random-weight tiny CLIP, OWL-ViT and BLIP VQA exports (tool.json and an empty pool: the unprompted tools) and a tiny
Depth Anything, written as ``make demo-hydra-benchmark`` writes them (``clova_train.quickstart.hydra_benchmark``)
but without pretraining. Settings:

* ``annotation tools``: the baseline, ``ReasoningLoopConfig()`` without tasks: the offline world's scene
  annotations answer the same programs (no model, no image), under ``DummyVecEnv`` and ``SubprocVecEnv``;
* ``in-process tools, DummyVecEnv``: one process; its environments share one client (the models loaded once);
* ``in-process tools, SubprocVecEnv``: each worker process loads its own copy of the models;
* ``clova-train serve, SubprocVecEnv``: one ``clova-train serve`` of the exports and the depth model (started here on
  127.0.0.1, a free port, waited for on ``GET /health``, stopped with SIGTERM), every worker calling it through
  ``ImageToolsConfig.server_url`` (images sent as PNG ``data:`` URLs over loopback HTTP).

Every request reaches the models: the tools' memory of earlier answers (``ImageToolsConfig.remembered_answers``,
where it exists) is off. Every process runs torch on ``--torch-threads`` threads (default 1: with torch's default of
one per core, 2 to 4 processes on 2 shared cores made each request 5-20x slower), and a program may run for
``--sandbox-timeout`` seconds (its tool calls count in it; the environment's default of 2 s stops programs on tools
this slow).

Each setting runs in its own Python process (so the memory of one does not count in another's); in it, for each
environment count, stable-baselines3's vector environment is built (each environment loads or connects to its tools
as it is built, once per process), reset and stepped ``--warmup`` times, then ``--steps`` environment steps (all
environments together) are timed. Memory: the proportional set size (PSS: shared pages divided among the processes
sharing them, so the sum is what the run holds) of the setting's process and all its children (vector-environment
workers, sandbox workers), plus the server's process group for the served setting, taken after the timed steps.

A second table, where a step's time goes: one environment in the in-process setting's process and one in the served
setting's, ``--breakdown-steps`` steps each running the program, with the environment, the sandbox, PNG encoding,
``data:`` URL files, the models and the HTTP requests timed apart (their functions wrapped with timers). Both tables
are appended to ``benchmarks/results/controller_tool_throughput.md`` with the machine.

    python benchmarks/controller_tool_throughput.py [--steps 120] [--warmup 4] [--envs 1 2 4] [--breakdown-steps 20]
                                                    [--torch-threads 1] [--scale 4] [--workdir DIR] [--no-record]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_file import machine, publish, runs_directory  # noqa: E402
from serving_latency import free_port, healthy  # noqa: E402

from clova_train.llm.backends import ChatBackend  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TRAIN_IDS = [i for i in range(1, 25) if i % 5]  # the world's training tasks (id % 5 != 0)
EVAL_IDS = [5, 10]  # the writer needs an evaluation set too; it is not played
SETTINGS = {
    "annotations-dummy": "baseline: annotation tools (offline world), DummyVecEnv",
    "annotations-subproc": "baseline: annotation tools (offline world), SubprocVecEnv",
    "local-dummy": "in-process tools, DummyVecEnv (one process, one copy of the models)",
    "local-subproc": "in-process tools, SubprocVecEnv (a copy of the models per worker)",
    "served-subproc": "one clova-train serve, SubprocVecEnv (workers call it via server_url)",
}
BREAKDOWN = {"local-dummy": "in-process tools", "served-subproc": "clova-train serve"}  # settings profiled
PROGRAM = ("```python\nfound = image_patch.find('red circle')\nnear = image_patch.compute_depth()\n"
           "shown = image_patch.verify_property('circle', 'red')\nthere = image_patch.exists('square')\n"
           "crop = image_patch.crop(0, 0, 10, 10)\nreply = crop.simple_query('what colour?')\n"
           "final_answer = str(len(found)) if near > -1e9 and isinstance(shown, bool) else reply\n```")


class EveryToolProgram(ChatBackend):
    """Planner and coder in one: five equally likely instructions, and for each the same program calling every
    ImagePatch tool the models serve, then answering (the episode ends at the first step that runs code)."""

    def chat(self, messages: list[dict]) -> str:
        if "Write Python code" in messages[-1]["content"]:
            return PROGRAM
        return "\n".join(f"{i}. [0.5] Look and count." for i in range(1, 6))

    def identity(self) -> dict:
        return {"kind": "every-tool-benchmark"}


# ---------------------------------------------------------------------- tiny tools and tasks (the parent process)
def write_tasks_and_tools(root: Path, scale: int) -> dict:
    """The tasks (GQA-format training set, OK-VQA-format evaluation set of rendered scenes) and the tools: the
    tiny CLIP (CLASSIFY), OWL-ViT (LOC) and BLIP VQA (VQA) with random weights, exported with an empty pool (the
    unprompted tool), and a random-weight tiny Depth Anything, as ``make demo-hydra-benchmark`` writes them
    (:func:`clova_train.quickstart.hydra_benchmark.prepare`, without pretraining). A spec of plain values."""
    from clova_train.envs.tasks.offline import write_offline_benchmark
    from clova_train.quickstart.hydra_benchmark import prepare

    files = write_offline_benchmark(root, TRAIN_IDS, EVAL_IDS, scale=scale)
    written = prepare(root, root / "models", scale=scale, pretrain_steps=0)  # the tasks are there: tools only
    return {"files": {name: dataclasses.asdict(f) for name, f in files.items()},
            "tools": {role: str(written[role]) for role in ("loc", "classify", "vqa", "depth")}}


def start_server(tools: dict[str, str], workdir: Path, env: dict[str, str],
                 timeout: float = 300) -> tuple[str, subprocess.Popen]:
    """``clova-train serve`` of the exports and the depth model on a free loopback port, in its own process group;
    its base URL once ``/health`` answers."""
    port = free_port()
    command = [sys.executable, "-m", "clova_train", "serve", tools["loc"], tools["classify"], tools["vqa"],
               tools["depth"], "--port", str(port)]
    log = (workdir / "server.log").open("w")
    server = subprocess.Popen(command, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env=env)
    log.close()  # the server writes through its own copy
    deadline = time.monotonic() + timeout
    while not healthy(port):
        if server.poll() is not None or time.monotonic() > deadline:
            stop_server(server)
            raise SystemExit(f"controller_tool_throughput: the server did not come up:\n"
                             f"{(workdir / 'server.log').read_text()[-3000:]}")
        time.sleep(0.5)
    return f"http://127.0.0.1:{port}", server


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (SIGKILL if it has not stopped within 30 s)."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


# ---------------------------------------------------------------------- one setting (its own process)
def memory_mib(pids: list[int]) -> tuple[float, int]:
    """PSS (``/proc/<pid>/smaps_rollup``; RSS where that cannot be read) of ``pids`` and all their descendants, summed,
    in MiB; how many processes that is (Linux ``/proc``)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, todo = set(), [pid for pid in pids if pid in parents]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += [child for child, parent in parents.items() if parent == pid]
    total_kb = 0
    for pid in found:
        for name, key in (("smaps_rollup", "Pss:"), ("status", "VmRSS:")):
            try:
                lines = Path(f"/proc/{pid}/{name}").read_text().splitlines()
            except OSError:
                continue
            values = [int(line.split()[1]) for line in lines if line.startswith(key)]
            if values:
                total_kb += values[0]
                break
    return total_kb / 1024, len(found)


def env_config(setting: str, files: dict, tools: dict[str, str], server_url: str | None, sandbox_timeout_s: float):
    from clova_train.envs import ReasoningLoopConfig
    from clova_train.envs.tasks.source import BenchmarkTasksConfig
    from clova_train.tools.image_patch import ImageToolsConfig

    if setting.startswith("annotations"):
        return ReasoningLoopConfig(sandbox_timeout_s=sandbox_timeout_s)
    # every request reaches the models: no answers remembered across episodes, where the tools can remember them
    fields = {f.name for f in dataclasses.fields(ImageToolsConfig)}
    fresh = {"remembered_answers": 0} if "remembered_answers" in fields else {}
    tools = ImageToolsConfig(**tools, server_url=server_url, **fresh)
    return ReasoningLoopConfig(sandbox_timeout_s=sandbox_timeout_s, tasks=BenchmarkTasksConfig(
        train=files["gqa-train"], eval=files["okvqa-eval"], tools=tools))


class Timers:
    """Seconds and counts by name, and :meth:`wrap` to time a function under a name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.counts[name] = self.counts.get(name, 0) + 1

    def wrap(self, name, function):  # noqa: ANN001, ANN201
        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.add(name if isinstance(name, str) else name(*args, **kwargs), time.perf_counter() - started)
        return timed


def breakdown(config, steps: int) -> dict:  # noqa: ANN001
    """Where one environment's step goes (this process, no vector environment, every step running the program):
    seconds per step in the environment (planner, observation, reset), the sandbox (worker, wire, exec), the tool
    calls' Python, PNG ``data:`` URL encoding, turning ``data:`` URLs into temporary files (in-process tools), the
    models (in-process: each server's ``serve``, reading the images included) or the HTTP requests (the server's
    work included); mean milliseconds per request by role; boxes per LOC request."""
    from contextlib import contextmanager

    import clova_train.tools.image_patch as image_patch
    import clova_train.tools.tool_clients as tool_clients
    from clova_train.envs import ReasoningLoopEnv
    from clova_train.sandbox import Sandbox

    timers = Timers()
    boxes: list[int] = []
    saved = (image_patch.png_data_url, tool_clients.materialised_images, Sandbox.run, Sandbox._serve,
             tool_clients.HttpToolClient.request)
    materialise = tool_clients.materialised_images

    @contextmanager
    def timed_materialise(payload):  # noqa: ANN001, ANN202
        started = time.perf_counter()
        manager = materialise(payload)
        value = manager.__enter__()
        timers.add("data: URLs to files", time.perf_counter() - started)
        try:
            yield value
        finally:
            started = time.perf_counter()
            manager.__exit__(None, None, None)
            timers.add("data: URLs to files", time.perf_counter() - started)

    image_patch.png_data_url = timers.wrap("PNG data: URLs", image_patch.png_data_url)
    tool_clients.materialised_images = timed_materialise
    Sandbox.run = timers.wrap("sandbox run", Sandbox.run)
    Sandbox._serve = staticmethod(timers.wrap("tool calls", Sandbox._serve))
    tool_clients.HttpToolClient.request = timers.wrap(lambda client, role, payload: f"HTTP {role}",
                                                      tool_clients.HttpToolClient.request)
    env = ReasoningLoopEnv(config, llm=EveryToolProgram())
    try:
        client = config.tasks.tools.client()
        loaded = getattr(client, "client", client)  # the loaded (or HTTP) client under a remembering wrapper
        for role, server in getattr(loaded, "servers", {}).items():
            server.serve = timers.wrap(f"model {role}", server.serve)
        request = client.request

        def counted(role, payload):  # noqa: ANN001, ANN202
            reply = request(role, payload)
            if role == tool_clients.LOC:
                boxes.append(len(reply.get("boxes", [])))
            return reply

        client.request = counted
        env.reset(seed=0)
        for _ in range(2):  # warm-up
            env.step(0)
            env.reset()
        timers.seconds.clear()
        timers.counts.clear()
        boxes.clear()
        started = time.perf_counter()
        for _ in range(steps):
            env.step(0)  # a picked instruction: the program runs and answers, the episode ends
            env.reset()
        total = time.perf_counter() - started
    finally:
        env.close()
        del client.request
        for role, server in getattr(loaded, "servers", {}).items():
            del server.serve
        (image_patch.png_data_url, tool_clients.materialised_images, Sandbox.run, Sandbox._serve,
         tool_clients.HttpToolClient.request) = saved
    return {"steps": steps, "total": total, "seconds": timers.seconds, "counts": timers.counts,
            "boxes_per_loc": sum(boxes) / max(len(boxes), 1)}


def run_setting(args: argparse.Namespace) -> None:
    """Every environment count of ``args.setting``: one JSON line each."""
    import numpy as np
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    from clova_train.envs import ReasoningLoopEnv
    from clova_train.envs.tasks.formats import TaskFiles

    spec = json.loads(Path(args.spec).read_text())
    files = {name: TaskFiles(**fields) for name, fields in spec["files"].items()}
    config = env_config(args.setting, files, spec["tools"], spec.get("server_url"), args.sandbox_timeout)
    problems = config.problems("hydra")
    if problems:
        raise SystemExit("; ".join(problems))
    vec_env_cls = SubprocVecEnv if args.setting.endswith("subproc") else DummyVecEnv
    rng = np.random.default_rng(0)
    for n_envs in args.envs:
        loaded = time.perf_counter()
        # each environment loads (or connects to) its tools as it is built: once per process
        vec = make_vec_env(lambda: ReasoningLoopEnv(config, llm=EveryToolProgram()), n_envs=n_envs, seed=0,
                           vec_env_cls=vec_env_cls)
        try:
            vec.reset()
            for _ in range(args.warmup):
                vec.step(rng.integers(vec.action_space.n, size=n_envs))
            warm = time.perf_counter() - loaded
            rounds = max(1, args.steps // n_envs)
            calls = ran = failed = 0
            started = time.perf_counter()
            for _ in range(rounds):
                _, _, _, infos = vec.step(rng.integers(vec.action_space.n, size=n_envs))
                calls += sum(info.get("tool_calls", 0) for info in infos)
                ran += sum(info.get("status") is not None for info in infos)
                failed += sum(info.get("status") not in (None, "ok") for info in infos)
            seconds = time.perf_counter() - started
            memory, processes = memory_mib([os.getpid(), *spec.get("server_pids", [])])
        finally:
            vec.close()
        print(json.dumps({"setting": args.setting, "envs": n_envs, "steps": rounds * n_envs, "seconds": seconds,
                          "tool_calls": calls, "code_steps": ran, "warmup_s": warm, "memory_mib": memory,
                          "processes": processes, "failed": failed}), flush=True)
    if args.setting in BREAKDOWN and args.breakdown_steps > 0:
        print(json.dumps({"breakdown": args.setting, **breakdown(config, args.breakdown_steps)}), flush=True)


# ---------------------------------------------------------------------- the parent: build, run, report
def child_environment(args: argparse.Namespace) -> dict[str, str]:
    """The environment of the setting's process and the server (inherited by their workers): torch's intra-op
    threads per process (``--torch-threads``; 0: torch's default, one per core)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if args.torch_threads > 0:
        env.update(OMP_NUM_THREADS=str(args.torch_threads), MKL_NUM_THREADS=str(args.torch_threads))
    return env


def measure(setting: str, spec_path: Path, args: argparse.Namespace) -> list[dict]:
    command = [sys.executable, str(Path(__file__).resolve()), "--run-setting", setting, "--spec", str(spec_path),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--sandbox-timeout",
               str(args.sandbox_timeout), "--breakdown-steps", str(args.breakdown_steps),
               "--envs", *map(str, args.envs)]
    result = subprocess.run(command, cwd=spec_path.parent, capture_output=True, text=True, env=child_environment(args))
    if result.returncode != 0:
        raise SystemExit(f"controller_tool_throughput: {setting} failed:\n{result.stderr[-4000:]}")
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def breakdown_rows(found: dict[str, dict]) -> list[str]:
    """The breakdown table's rows: milliseconds per step by part, then per request by role, for each setting."""
    names = [name for name in BREAKDOWN if name in found]

    def per_step(name: str, *keys: str) -> float:
        result = found[name]
        return 1000 * sum(v for k, v in result["seconds"].items() if k in keys or (k.split()[0] + " *") in keys) \
            / result["steps"]

    parts = {
        "environment: planner, observation, reset, scoring": lambda n: 1000 * found[n]["total"] / found[n]["steps"]
        - per_step(n, "sandbox run"),
        "sandbox: worker, wire, the program's own code":
            lambda n: per_step(n, "sandbox run") - per_step(n, "tool calls"),
        "tool calls' own Python (ImagePatch: crops, boxes)": lambda n: per_step(n, "tool calls")
        - per_step(n, "PNG data: URLs", "data: URLs to files", "model *", "HTTP *"),
        "PNG data: URL encoding of patches and crops": lambda n: per_step(n, "PNG data: URLs"),
        "data: URLs written to temporary files (in-process client)": lambda n: per_step(n, "data: URLs to files"),
        "models (serve, image files read and decoded)": lambda n: per_step(n, "model *"),
        "HTTP requests (the server's work included)": lambda n: per_step(n, "HTTP *"),
        "total per step": lambda n: 1000 * found[n]["total"] / found[n]["steps"],
    }
    rows = [f"| {part} | " + " | ".join(f"{value(n):.1f}" for n in names) + " |" for part, value in parts.items()]
    for role in ("LOC", "CLASSIFY", "VQA", "DEPTH"):
        cells = []
        for name in names:
            result = found[name]
            key = next((k for k in result["counts"] if k.split()[-1] == role), None)
            cells.append("-" if key is None else f"{1000 * result['seconds'][key] / result['counts'][key]:.1f} ms x "
                         f"{result['counts'][key] / result['steps']:.1f}")
        rows.append(f"| {role}: per request x requests per step (in-process: the model's serve alone) | "
                    + " | ".join(cells) + " |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120, help="timed environment steps per cell (all environments)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed vector steps after the first reset")
    parser.add_argument("--envs", type=int, nargs="+", default=[1, 2, 4], help="environment counts")
    parser.add_argument("--scale", type=int, default=4, help="task images are 64 * scale pixels square")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch intra-op threads of every process (0: torch's default, one per core)")
    parser.add_argument("--sandbox-timeout", type=float, default=60.0,
                        help="sandbox_timeout_s: a program's wall time, its tool calls included")
    parser.add_argument("--breakdown-steps", type=int, default=20,
                        help="steps of one environment timed part by part, in-process and served (0: none)")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the tasks and tiny tools here and reuse them on a rerun (default: temporary)")
    parser.add_argument("--no-record", action="store_true", help="print the table without appending it")
    parser.add_argument("--run-setting", choices=list(SETTINGS), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_setting:
        args.setting = args.run_setting
        run_setting(args)
        return

    workdir = args.workdir.resolve() if args.workdir else None
    os.chdir(REPO)  # the tool recipes name their quickstart configs relative to the repository
    started = time.perf_counter()
    results: list[dict] = []
    breakdowns: dict[str, dict] = {}
    with runs_directory(workdir) as workdir:
        spec_path = workdir / "spec.json"
        built = workdir / f"built-{args.scale}.json"  # a --workdir run reuses the tasks and tools it wrote
        if built.exists():
            spec = json.loads(built.read_text())
        else:
            spec = write_tasks_and_tools(workdir / f"scale-{args.scale}", args.scale)
            built.write_text(json.dumps(spec))
        tools = spec["tools"]
        for setting in args.settings:
            server = None
            if setting.startswith("served"):
                server_url, server = start_server(tools, workdir, child_environment(args))
                spec_path.write_text(json.dumps({**spec, "server_url": server_url, "server_pids": [server.pid]}))
            else:
                spec_path.write_text(json.dumps(spec))
            try:
                began = time.perf_counter()
                for line in measure(setting, spec_path, args):
                    if "breakdown" in line:
                        breakdowns[line["breakdown"]] = line
                    else:
                        results.append(line)
                print(f"{setting}: {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
            finally:
                if server is not None:
                    stop_server(server)
    baseline = {r["envs"]: r["steps"] / r["seconds"] for r in results if r["setting"] == "annotations-dummy"}
    rows = []
    for r in results:
        rate = r["steps"] / r["seconds"]
        relative = f"{rate / baseline[r['envs']]:.3f}" if r["envs"] in baseline else "-"
        rows.append(f"| {SETTINGS[r['setting']]} | {r['envs']} | {rate:.1f} | {r['tool_calls'] / r['seconds']:.1f} | "
                    f"{r['tool_calls'] / max(r['code_steps'], 1):.1f} | {r['failed']} | {relative} | "
                    f"{r['memory_mib']:.0f} | {r['processes']} | {r['warmup_s']:.1f} |")
    publish("controller_tool_throughput", "HYDRA environment throughput with model-backed ImagePatch tools",
            f"cpu: {machine()}",
            f"Random actions, {args.steps} timed environment steps per row (all environments together) after "
            f"{args.warmup} untimed vector steps; tasks: GQA-format rendered scenes of {64 * args.scale} px; tools: "
            "tiny random-weight OWL-ViT (LOC), CLIP (CLASSIFY), BLIP VQA exports and a tiny Depth Anything; every "
            "program calls find, compute_depth, verify_property, exists and simple_query (a reject runs none). "
            "Memory: PSS of the setting's processes (vector-environment and sandbox workers, the server's group "
            "where it has one), MiB, and how many processes that is. Start: seconds from building the vector environment (worker processes started, "
            "models loaded or the server connected) to the end of the warm-up. Failed: timed code steps that did not "
            f"end ok. Torch threads per process: {args.torch_threads or 'torch default'}; sandbox timeout "
            f"{args.sandbox_timeout:g} s. "
            f"Whole run {time.perf_counter() - started:.0f} s.",
            ["setting", "envs", "steps/s", "tool calls/s", "tool calls / code step", "failed",
             "steps/s vs DummyVecEnv baseline", "memory MiB", "processes", "start s"], rows, record=not args.no_record)
    if breakdowns:
        boxes = ", ".join(f"{BREAKDOWN[n]} {b['boxes_per_loc']:.1f}" for n, b in breakdowns.items())
        publish("controller_tool_throughput", "HYDRA environment throughput with model-backed ImagePatch tools",
                f"cpu: {machine()}",
                f"Where a step's time goes: one environment in the setting's process, {args.breakdown_steps} steps "
                "each running the program (no rejects), milliseconds per step by part (each part's functions timed "
                "by wrapping them); then milliseconds per request and requests per step by role. Boxes LOC finds per "
                f"request (random weights; verify_property classifies a crop around each): {boxes}.",
                ["part", *(BREAKDOWN[n] for n in BREAKDOWN if n in breakdowns)],
                breakdown_rows(breakdowns), record=not args.no_record)


if __name__ == "__main__":
    main()

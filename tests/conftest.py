"""Shared fixtures: a tiny pretrained CLIP saved in open_clip's layout and synthetic concept folders."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# ATen's portable (non-vectorised) kernels, set before torch is imported (here and in every subprocess a test
# starts). The tiny models are pretrained and tuned for minutes, and rounding differs between ATen's SSE, AVX2
# and AVX-512 kernels; over hundreds of steps that gives another model. Seen on an AVX-512 host: an OWL-ViT
# that never learned the LOC tests' concept, a BLIP whose prompts no longer changed its answers. The learning
# tests were calibrated on hosts without AVX; with these kernels an AVX-512 host passes them too.
# oneDNN chooses its own kernels from the CPU; on a host with AMX its bf16 attention kernels ask ATen for VNNI
# packing, which ATen's portable kernels refuse ("pack_vnni2 is only supported when avx512 is supported": the bf16
# paper configs fail), so oneDNN is capped below AMX (a cap: no change on hosts without AMX).
PORTABLE_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_FP16"}
for _name, _value in PORTABLE_KERNELS.items():
    os.environ.setdefault(_name, _value)

import pytest  # noqa: E402
import torch  # noqa: E402
from filelock import FileLock  # noqa: E402

from clova_train.cli import main
from clova_train.synthetic.shapes import write_concept_folders
from clova_train.quickstart.tiny.clip import make_tiny_clip

REPO = Path(__file__).resolve().parents[1]
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one pytest-xdist worker per core; with torch's default of one thread per core each,
    # the workers' threads contend and the suite takes more than twice as long
    torch.set_num_threads(1)
# `clova-train fit` on one CPU process, one epoch, seeded, without logger, progress bar or model summary. Quiet
# on purpose: the tests built on it (DDP included) compare what is learned, pools and summaries, and read the
# output for messages; the shipped configs' own bars, loggers and callbacks on several ranks are run as users
# run them in test_shipped_configs_ddp.py.
QUIET_CPU_FIT = [
    "fit", "--seed_everything=0", "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.max_epochs=1",
    "--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
]
FAST_MODEL_ARGS = [
    "--model.class_path=clova_train.models.PromptTuning",
    "--model.init_args.tool.class_path=clova_train.tools.clip.PromptedClip",
    "--model.init_args.tool.init_args.pretrained=null",
    "--model.init_args.tool.init_args.num_prompt_tokens=4",
    "--model.init_args.steps=15",
]


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_clip(tmp_path_factory.mktemp("tiny-clip"), seed=0, pretrain_steps=150)


@pytest.fixture(scope="session")
def concept_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_concept_folders(
        tmp_path_factory.mktemp("concepts"), ["red", "green", "blue", "purple"], images_per_concept=6, image_size=32
    )


def fit_args(tiny_clip_dir: Path, data_root: Path, run_dir: Path, *extra: str) -> list[str]:
    """CLI arguments of a small CLIP prompt-tuning fit."""
    return [
        *QUIET_CPU_FIT,
        f"--trainer.default_root_dir={run_dir}",
        *FAST_MODEL_ARGS,
        f"--model.init_args.tool.init_args.model_name=local-dir:{tiny_clip_dir}",
        "--data.class_path=clova_train.datamodules.ConceptFolderDataModule",
        f"--data.init_args.root={data_root}",
        "--data.init_args.image_size=32",
        "--data.init_args.val_per_concept=2",
        "--data.init_args.chunk_size=4",
        *extra,
    ]


def run_fit(*args: str) -> int:
    """Run the CLI in this process; returns its exit status."""
    saved_argv = sys.argv
    sys.argv = ["clova-train"]  # LightningCLI warns when pytest's own arguments are on sys.argv
    try:
        return main(list(args))
    except SystemExit as stop:  # argument errors exit through jsonargparse
        return int(stop.code or 0)
    finally:
        sys.argv = saved_argv


def run_cli_subprocess(args: list[str], timeout: float = 300, cwd: Path = REPO, **kwargs) -> subprocess.CompletedProcess:
    """Run ``python -m clova_train`` in a subprocess (the only way to test multi-process DDP)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "clova_train", *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd, **kwargs,
    )


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from clova_train.quickstart.tiny.llama import make_tiny_llama, tool_corpus

    texts, prompts = tool_corpus(0)
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), texts, prompts, pretrain_steps=300)


@pytest.fixture(scope="session")
def tool_data_root(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    from clova_train.datamodules import SyntheticToolDataModule

    root = tmp_path_factory.mktemp("tool-data")
    SyntheticToolDataModule(str(root), str(tiny_llama_dir), conversations_per_tool=8, negatives=40).prepare_data()
    return root


# The pretrained tiny models of the LOC, SEG and REPLACE learning tests (the quickstarts' own models): minutes
# to build, so they are built once per checkout under checkpoints/ (ignored by git), at most two at a time,
# one core each (each pretrains on one thread and comes out the same on every machine). Kind: (directory,
# pretraining steps, extra environment of the build). The MaskFormer is built on oneDNN's SSE4.1 kernels as
# well: its convolutions go through oneDNN, and its SEG test was calibrated on a host without AVX. Its matrix
# products go through MKL, whose kernels also follow the CPU: built with MKL's own AVX-512 kernels on an Intel
# host with AMX, it was another segmenter (random prompts passed its gate 8 times in 8), so MKL runs in its
# conditional-numerical-reproducibility mode (MKL_CBWR=COMPATIBLE: the same results on every x86 CPU).
PRETRAINED_MODELS = {
    "owlvit": ("tiny-owlvit-1500-aten-default", 1500, {}),
    "maskformer": ("tiny-maskformer-6q-2000-aten-default-onednn-sse41-mkl-cbwr", 2000,
                   {"ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_CBWR": "COMPATIBLE"}),
    "sd-inpaint": ("tiny-sd-inpaint-1200-aten-default", 1200, {}),
}
PARALLEL_BUILDS = 2


MODEL_CACHE = REPO / "checkpoints" / "test-cache"
PRETRAINED_TEST_FILES = ("test_loc_learning.py", "test_seg_learning.py", "test_grounding_runs.py",
                         "test_replace_learning.py", "test_quickstart_configs_ddp.py",
                         "test_paper_configs_ddp.py")
_early_build: list[threading.Thread] = []


@pytest.fixture(scope="session")
def pretrained_models() -> dict[str, Path]:
    return _pretrained_models()


def _pretrained_models() -> dict[str, Path]:
    """The models' directories, built first if missing; one process builds, the others wait for it."""
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(MODEL_CACHE / ".build.lock"):
        return _build_pretrained_models(MODEL_CACHE)


def _start_pretrained_builds(node_ids: list[str]) -> None:
    """Start building the models in the background as soon as the collected tests are known to need them,
    so that the build overlaps the other tests instead of stalling the worker that first asks for them."""
    if _early_build or not any(i.split("::")[0].endswith(PRETRAINED_TEST_FILES) for i in node_ids):
        return

    def build() -> None:
        try:
            _pretrained_models()
        except Exception:  # the fixture retries and reports the failure in the test that needs the models
            pass

    _early_build.append(threading.Thread(target=build, daemon=True))
    _early_build[0].start()


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown to pytest without the plugin
def pytest_xdist_node_collection_finished(node: object, ids: list[str]) -> None:
    """Under pytest-xdist (the controller learns what the workers collected)."""
    _start_pretrained_builds(ids)


def pytest_collection_finish(session: pytest.Session) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # a plain pytest run
        _start_pretrained_builds([item.nodeid for item in session.items])


def pytest_sessionfinish(session: pytest.Session) -> None:
    for thread in _early_build:  # leave no half-finished build behind the session
        thread.join()


def _build_pretrained_models(cache: Path) -> dict[str, Path]:
    directories = {kind: cache / name for kind, (name, _, _) in PRETRAINED_MODELS.items()}
    waiting = [kind for kind in PRETRAINED_MODELS if not directories[kind].is_dir()]
    running: dict[str, tuple[Path, subprocess.Popen]] = {}
    while waiting or running:
        while waiting and len(running) < PARALLEL_BUILDS:
            kind = waiting.pop(0)
            name, steps, environment = PRETRAINED_MODELS[kind]
            staging = cache / f".{name}.partial"
            shutil.rmtree(staging, ignore_errors=True)
            running[kind] = (staging, subprocess.Popen(
                [sys.executable, "-m", "clova_train", "tiny-model", kind, str(staging), "--pretrain-steps", str(steps)],
                cwd=REPO, env={**os.environ, **environment}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True))
        kind = next(iter(running))
        staging, process = running.pop(kind)
        output, _ = process.communicate(timeout=1200)
        assert process.returncode == 0, f"building the tiny {kind} failed:\n{output[-3000:]}"
        staging.rename(directories[kind])  # complete or absent: an interrupted build is redone
    return directories


@pytest.fixture(scope="session")
def pretrained_owlvit_dir(pretrained_models: dict[str, Path]) -> Path:
    return pretrained_models["owlvit"]


@pytest.fixture(scope="session")
def pretrained_maskformer_dir(pretrained_models: dict[str, Path]) -> Path:
    return pretrained_models["maskformer"]


@pytest.fixture(scope="session")
def pretrained_sd_dir(pretrained_models: dict[str, Path]) -> Path:
    return pretrained_models["sd-inpaint"]


@pytest.fixture(scope="session")
def tiny_sd_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight tiny inpainting pipeline (seconds to build: for the tool's contract and plumbing)."""
    from clova_train.quickstart.tiny.sd_inpaint import make_tiny_inpainting

    return make_tiny_inpainting(tmp_path_factory.mktemp("tiny-sd"), pretrain_steps=0)


# The data and tiny models that several test modules (and the shipped configs' multi-device runs) use.
@pytest.fixture(scope="session")
def tiny_blip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from clova_train.quickstart.tiny.blip import make_tiny_blip
    from clova_train.quickstart.tiny.common import torch_threads

    # The model these tests were checked against is pretrained on two threads (as on a 2-core machine): its
    # arithmetic depends on the thread count, and a one-thread build answers "what colour" with shape names.
    with torch_threads(2):
        return make_tiny_blip(tmp_path_factory.mktemp("tiny-blip"), seed=0, pretrain_steps=300)


@pytest.fixture(scope="session")
def vqa_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """orange (4 records, the last with a wrong inferred answer), purple (2), red (2 marked correct)."""
    from clova_train.synthetic.vqa import write_vqa_records

    root = write_vqa_records(tmp_path_factory.mktemp("vqa"), ["orange"], ["red"], images_per_colour=4,
                             wrong_answers=1, eval_per_colour=6, seed=0)
    more = write_vqa_records(tmp_path_factory.mktemp("vqa-purple"), ["purple"], [], images_per_colour=2,
                             wrong_answers=0, eval_per_colour=6, seed=1)
    lines = (more / "train.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    for record in records:
        record["image"] = str(more / record["image"])
    with (root / "train.jsonl").open("a") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in records)
    return root


@pytest.fixture(scope="module")
def loc_scenes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from clova_train.synthetic.grounding import write_coco_scenes

    return write_coco_scenes(tmp_path_factory.mktemp("loc-scenes"), ["purple circle", "orange square"], 16,
                             distractor_colours=["red", "green", "blue", "yellow"], objects_per_image=2, seed=1)


@pytest.fixture(scope="module")
def seg_scenes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from clova_train.synthetic.grounding import write_coco_scenes

    return write_coco_scenes(tmp_path_factory.mktemp("seg-scenes"), ["purple circle", "red circle"], 16,
                             distractor_colours=["red", "green", "blue", "yellow"], objects_per_image=2, seed=1)


def serve_in_fresh_process(export: Path, request: dict) -> dict:
    """Serve one JSON request from ``export`` in a fresh Python process that must not import Lightning."""
    script = (
        "import json, sys\n"
        "from clova_train.tools.serving import PromptToolServer\n"
        f"server = PromptToolServer.from_export({str(export)!r})\n"
        f"print(json.dumps(server.serve(json.loads({json.dumps(json.dumps(request))}))))\n"
        "assert not any(name.startswith('lightning') for name in sys.modules), 'serving imported lightning'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def clip_export(tiny_clip_dir: Path, concept_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An export of a small CLIP prompt-tuning run (the served prompt tool of the HTTP tests)."""
    run_dir = tmp_path_factory.mktemp("clip-run")
    assert run_fit(*fit_args(tiny_clip_dir, concept_root, run_dir)) == 0
    out = run_dir.parent / f"{run_dir.name}-export"
    assert main(["export", str(run_dir), "-o", str(out)]) == 0
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serving(args: list[str], env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """``clova-train serve ARGS`` on 127.0.0.1 in its own process group: (base URL, process) once /health answers;
    stopped (SIGTERM, then SIGKILL) on exit."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "clova_train", "serve", *args, "--port", str(port)],
        cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None:
                pytest.fail(f"the server exited: {process.stdout.read()[-3000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the server did not come up within 180 s")
            time.sleep(0.5)
        yield base, process
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=20)

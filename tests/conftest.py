"""Shared fixtures: the tiny models (random-weight ones built per session, pretrained ones cached per checkout),
synthetic data, a CLIP export; the plain helpers are in ``tests/helpers``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from clova_train.cli import main
from clova_train.quickstart.tiny_models import tiny_model
from clova_train.tools.recipes import TinyModel
from clova_train.tools.clip.tiny import make_tiny_clip
from clova_train.tools.clip.synthetic import write_concept_folders
from helpers.tiny_models import build_environment, cache_name

from helpers.common import REPO, fit_args, run_fit
import helpers.contained  # noqa: F401  sets the forkserver's preload before SB3's SubprocVecEnv can start it bare

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one pytest-xdist worker per core; with torch's default of one thread per core each,
    # the workers' threads contend and the suite takes more than twice as long. The same holds for the processes
    # the tests start (CLI runs, servers, benchmarks): they inherit the environment, so one thread each too (a DDP
    # rank on CPU gets one anyway: Lightning divides the cores among the ranks of a machine).
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# The slow tier (`make test-fast` leaves it out; the marker is registered in setup.cfg). Modules mark their own slow
# tests; these fixtures make every test that uses them slow, whatever its own cost: the first user in a process
# pretrains a tiny BLIP or Llama (minutes on 2 cores), or waits for the cached LOC, SEG and REPLACE models.
SLOW_FIXTURES = frozenset({"tiny_blip_dir", "pretrained_blip_dir", "tiny_llama_dir", "tool_data_root",
                           "pretrained_models"})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.slow)


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Path]) -> Path:
    """``build(directory)`` run once for the whole test run: under pytest-xdist the first worker to ask builds into
    the run's shared base directory while the others wait on a lock, then all read it (a session fixture would
    pretrain the same model again in every worker: identical, since every worker pretrains on one thread)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the directory every worker's base directory is in, new for each run
    directory, marker = root / f"shared-{name}", root / f"shared-{name}.built"
    with FileLock(str(root / f"shared-{name}.lock")):
        if not marker.exists():
            shutil.rmtree(directory, ignore_errors=True)  # a worker that failed while building left a part
            built = Path(build(directory))
            marker.write_text(str(built.resolve().relative_to(directory.resolve())))
    return directory / marker.read_text()


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Not the registry's CLIP (that one has the quickstart's misconceptions): the engine tests were calibrated on
    # this plainer, shorter-pretrained one.
    return built_once(tmp_path_factory, "tiny-clip", lambda d: make_tiny_clip(d, seed=0, pretrain_steps=150))


@pytest.fixture(scope="session")
def concept_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_concept_folders(
        tmp_path_factory.mktemp("concepts"), ["red", "green", "blue", "purple"], images_per_concept=6, image_size=32
    )


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Not the registry's Llama (no copy-document phase, the default model size): what the LoRA tests were
    # calibrated on.
    from clova_train.quickstart.tiny_llama import make_tiny_llama, tool_corpus

    return built_once(tmp_path_factory, "tiny-llama", lambda d: make_tiny_llama(d, *tool_corpus(0), pretrain_steps=300))


@pytest.fixture(scope="session")
def lora_export(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An exported adapter (``--merged``) on the tiny Llama with seeded random LoRA weights (serving does not care
    how they were learned; its replies, plans included, are poor), built once per test run: what the HTTP serving
    tests and the environments' served-LLM tests serve with ``clova-train serve``."""
    return built_once(tmp_path_factory, "lora-export", lambda d: _write_lora_export(tiny_llama_dir, d))


def _write_lora_export(tiny_llama_dir: Path, root: Path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clova_train.tooluse.prompt_template import TEMPLATE_FILE, PromptTemplate

    run_dir = root / "lora-run"
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM"))
    model.save_pretrained(str(run_dir / "adapter"))
    AutoTokenizer.from_pretrained(str(tiny_llama_dir)).save_pretrained(str(run_dir / "adapter"))
    (run_dir / "adapter" / TEMPLATE_FILE).write_text(json.dumps(PromptTemplate().to_dict()))
    out = root / "lora-run-export"
    assert main(["export", str(run_dir), "-o", str(out), "--merged"]) == 0
    return out


@pytest.fixture(scope="session")
def tool_data_root(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    from clova_train.datamodules import SyntheticToolDataModule

    root = tmp_path_factory.mktemp("tool-data")
    SyntheticToolDataModule(str(root), str(tiny_llama_dir), conversations_per_tool=8, negatives=40).prepare_data()
    return root


# The pretrained tiny models of the LOC, SEG and REPLACE learning tests (the quickstarts' own models, from the
# tool recipes): minutes to build, so they are built once per checkout under checkpoints/test-cache/ (ignored
# by git), at most two at a time, one core each (each pretrains on one thread and comes out the same on every
# machine), each in a process that starts with the recipe's environment for it (the MaskFormer's oneDNN and
# MKL modes). An entry's name holds a hash of its builder's code (helpers/tiny_models.py): a changed builder is
# rebuilt, never silently reused. Kind: pretraining steps (None: the recipe's own).
PRETRAINED_MODELS: dict[str, int | None] = {"owlvit": None, "maskformer": None, "sd-inpaint": None}
PARALLEL_BUILDS = 2


MODEL_CACHE = REPO / "checkpoints" / "test-cache"
# The test files that use the pretrained models (by basename): their collection starts the builds early.
PRETRAINED_TEST_FILES = ("test_loc_learning.py", "test_seg_learning.py", "test_replace_learning.py")
_early_build: list[threading.Thread] = []


@pytest.fixture(scope="session")
def pretrained_models() -> dict[str, Path]:
    return _pretrained_models()


def _pretrained_models() -> dict[str, Path]:
    """The models' directories, built first if missing; one process builds, the others wait for it."""
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(MODEL_CACHE / ".build.lock"):
        return _build_pretrained_models(MODEL_CACHE)


def _start_pretrained_builds(config: pytest.Config, node_ids: list[str]) -> None:
    """Start building the models in the background as soon as the collected tests are known to need them,
    so that the build overlaps the other tests instead of stalling the worker that first asks for them."""
    if config.option.collectonly or _early_build:
        return
    if not any(i.split("::")[0].endswith(PRETRAINED_TEST_FILES) for i in node_ids):
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
    _start_pretrained_builds(node.config, ids)


def pytest_collection_finish(session: pytest.Session) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # a plain pytest run
        _start_pretrained_builds(session.config, [item.nodeid for item in session.items])


def pytest_sessionfinish(session: pytest.Session) -> None:
    for thread in _early_build:  # leave no half-finished build behind the session
        thread.join()


def _build_pretrained_models(cache: Path) -> dict[str, Path]:
    models = {kind: tiny_model(kind) for kind in PRETRAINED_MODELS}
    steps = {kind: models[kind].pretrain_steps if count is None else count for kind, count in PRETRAINED_MODELS.items()}
    directories = {kind: cache / cache_name(models[kind], steps[kind]) for kind in PRETRAINED_MODELS}
    waiting = [kind for kind in PRETRAINED_MODELS if not directories[kind].is_dir()]
    running: dict[str, tuple[Path, subprocess.Popen]] = {}
    while waiting or running:
        while waiting and len(running) < PARALLEL_BUILDS:
            kind = waiting.pop(0)
            staging = cache / f".{directories[kind].name}.partial"
            shutil.rmtree(staging, ignore_errors=True)
            running[kind] = (staging, subprocess.Popen(
                [sys.executable, "-m", "clova_train", "tiny-model", kind, str(staging), "--pretrain-steps",
                 str(steps[kind])],
                cwd=REPO, env=build_environment(models[kind]), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
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


# Random-weight recipe models (seconds to build: for the tools' contracts and plumbing), each built once per
# session. Built in this process: a recipe model's environment matters only to its pretraining.
class TinyModels:
    """The tiny model of each kind, with random weights (``pretrain_steps=0``), built on first use under ``root``.

    The conformance tests check plumbing and contracts, not learning, so the seconds-long random-weight builds do
    (the pretrained models of the learning tests take minutes)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.built: dict[str, Path] = {}

    def __call__(self, kind: str | TinyModel) -> Path:
        """The directory of ``kind``'s model (a kind of :func:`~clova_train.quickstart.tiny_models.tiny_models`)."""
        model = kind if isinstance(kind, TinyModel) else tiny_model(kind)
        if model.kind not in self.built:
            self.built[model.kind] = model.build(self.root / model.kind, seed=0, pretrain_steps=0)
        return self.built[model.kind]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def tiny_sd_dir(tiny_models: TinyModels) -> Path:
    """A random-weight tiny inpainting pipeline."""
    return tiny_models("sd-inpaint")


@pytest.fixture(scope="session")
def tiny_owlvit_dir(tiny_models: TinyModels) -> Path:
    """A random-weight tiny OWL-ViT."""
    return tiny_models("owlvit")


@pytest.fixture(scope="session")
def tiny_maskformer_dir(tiny_models: TinyModels) -> Path:
    """A random-weight tiny MaskFormer."""
    return tiny_models("maskformer")


@pytest.fixture(scope="session")
def tiny_blip_dir(tiny_models: TinyModels) -> Path:
    """A random-weight tiny BLIP (the VQA quickstart's architecture): contracts, runs, exports and plumbing."""
    return tiny_models("blip")


@pytest.fixture(scope="session")
def pretrained_blip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The recipe's tiny BLIP pretrained as the VQA quickstart's (minutes on 2 cores), once per test run: for the
    learning tests."""
    return built_once(tmp_path_factory, "tiny-blip", lambda d: tiny_model("blip").build(d, seed=0, pretrain_steps=300))


# The data that several test modules (and the shipped configs' multi-device runs) use.
@pytest.fixture(scope="session")
def vqa_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """orange (4 records, the last with a wrong inferred answer), purple (2), red (2 marked correct)."""
    from clova_train.tools.vqa.synthetic import write_vqa_records

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


@pytest.fixture(scope="session")
def coco_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Synthetic COCO scenes of a purple circle and an orange square (8 images), for the grounding tools."""
    from clova_train.tools.grounding.synthetic import write_coco_scenes

    return write_coco_scenes(tmp_path_factory.mktemp("coco"), ["purple circle", "orange square"], 8, seed=0)


@pytest.fixture(scope="module")
def loc_scenes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers.grounding import scene_sets

    return scene_sets(tmp_path_factory.mktemp("loc-scenes"), ["purple circle", "orange square"], seeds=(1,))[0]


@pytest.fixture(scope="module")
def seg_scenes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers.grounding import scene_sets

    return scene_sets(tmp_path_factory.mktemp("seg-scenes"), ["purple circle", "red circle"], seeds=(1,))[0]


@pytest.fixture(scope="session")
def clip_export(tiny_clip_dir: Path, concept_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An export of a small CLIP prompt-tuning run (the served prompt tool of the HTTP tests)."""
    run_dir = tmp_path_factory.mktemp("clip-run")
    assert run_fit(*fit_args(tiny_clip_dir, concept_root, run_dir)) == 0
    out = run_dir.parent / f"{run_dir.name}-export"
    assert main(["export", str(run_dir), "-o", str(out)]) == 0
    return out

"""The HYDRA environment on benchmark task files (envs/tasks/source.py): episodes, Eq. 3 with the benchmark's metric,
grounding answers, the evaluation walk over the file, and bad input."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from clova_train.controller.evaluation import oracle_policy, planner_top_policy, run_episodes
from clova_train.core.errors import DataError
from clova_train.envs import ReasoningLoopConfig, ReasoningLoopEnv
from clova_train.envs.common.world import SceneTools, make_task
from clova_train.envs.tasks.formats import TaskFiles
from clova_train.envs.tasks.offline import write_offline_benchmark
from clova_train.envs.tasks.source import BenchmarkTasksConfig, as_benchmark_answer, benchmark_tasks, held_out_half
from clova_train.llm.backends import ChatBackend
from clova_train.sandbox import PatchRef
from clova_train.tools.depth.tiny import make_tiny_depth_anything
from clova_train.tools.image_patch import ImageToolsConfig
from clova_train.tools.tool_clients import CLASSIFY, LOC, VQA
from helpers.tool_exports import write_tiny_exports

TRAIN_IDS = [1, 2, 3, 4, 6, 7, 8, 9]
EVAL_IDS = [5, 10, 15, 20, 25, 30]


@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TaskFiles]:
    return write_offline_benchmark(tmp_path_factory.mktemp("bench"), TRAIN_IDS, EVAL_IDS, scale=2)


def scene_oracle(task) -> SceneTools:  # noqa: ANN001
    """The offline benchmark's images are the shapes world's scenes: its annotation tools answer for them."""
    return SceneTools(make_task(int(task.task_id)))


def benchmark_env(files: dict[str, TaskFiles], split: str = "test") -> ReasoningLoopEnv:
    config = ReasoningLoopConfig(split=split, tasks=BenchmarkTasksConfig(train=files["gqa-train"],
                                                                         test=files["okvqa-eval"]))
    return ReasoningLoopEnv(config, tools_factory=scene_oracle)


def test_training_draws_gqa_tasks_and_validation_and_test_walk_their_halves_of_the_okvqa_file_once(offline) -> None:
    envs = {split: benchmark_env(offline, split) for split in ("train", "val", "test")}
    try:
        drawn = {envs["train"].reset(seed=seed)[1]["task_id"] for seed in range(40)}
        assert drawn <= {str(i) for i in TRAIN_IDS} and len(drawn) > 3
        halves = {split: [str(i) for i in EVAL_IDS if held_out_half(str(i)) == split] for split in ("val", "test")}
        assert halves == {"val": ["5", "15", "20"], "test": ["10", "25", "30"]}  # no val files: the test file cut in two
        for split, ids in halves.items():  # seed s plays task s mod n of the half: every task once, in file order
            assert [envs[split].reset(seed=seed)[1]["task_id"] for seed in range(len(ids) + 1)] == [*ids, ids[0]]
        assert envs["val"].reset(options={"task_id": "15"})[1]["question"] == make_task(15).question
        with pytest.raises(DataError, match="not a task of the test half of tasks.test"):
            envs["test"].reset(options={"task_id": "15"})  # a validation task is not played at test
    finally:
        for env in envs.values():
            env.close()


def test_task_files_of_three_splits_eval_as_the_old_name_of_test_and_problems(offline, tmp_path: Path) -> None:
    train, held_out = offline["gqa-train"], offline["okvqa-eval"]
    own = BenchmarkTasksConfig(train=train, val=held_out, test=held_out)  # val files of its own: whole files
    assert len(own.split_tasks("val").tasks) == len(own.split_tasks("test").tasks) == len(EVAL_IDS)
    old = BenchmarkTasksConfig(train=train, eval=held_out)  # the old key is read as tasks.test
    assert (old.test, old.eval) == (held_out, None) and old.split_tasks("eval") == old.split_tasks("test")
    with pytest.raises(DataError, match="as tasks.test"):
        BenchmarkTasksConfig(test=held_out, eval=held_out)
    assert BenchmarkTasksConfig(train=train, test=held_out).problems("val") == []  # val: the test files' half
    assert BenchmarkTasksConfig(train=train).problems("val", "hydra.tasks") == [
        "hydra.tasks.test: give the task files of the test split (format, questions, images, ...)"]
    one = tmp_path / "one.json"  # one question: the val half is empty
    questions = json.loads(Path(held_out.questions).read_text())
    one.write_text(json.dumps({**questions, "questions": questions["questions"][:1]}))  # task 5: the val half
    with pytest.raises(DataError, match="no task falls in this half"):
        BenchmarkTasksConfig(test=replace(held_out, questions=str(one))).split_tasks("test")


def test_the_task_files_are_read_once_per_process(offline) -> None:
    before = benchmark_tasks.cache_info().misses
    for _ in range(3):
        benchmark_env(offline).close()
    assert benchmark_tasks.cache_info().misses <= before + 1


def test_oracle_choices_with_annotation_tools_score_full_vqa_accuracy(offline) -> None:
    env = benchmark_env(offline)
    try:
        oracle = run_episodes(env, oracle_policy, len(EVAL_IDS), 0)
        top = run_episodes(env, planner_top_policy, len(EVAL_IDS), 0)
    finally:
        env.close()
    # the offline benchmark's ten annotators agree, so a right answer scores 1 and a wrong one 0
    assert oracle["accuracy"] >= 5 / 6
    assert top["accuracy"] <= oracle["accuracy"]


def _write_okvqa(root: Path, answers: list[str]) -> TaskFiles:
    images = root / "images"
    images.mkdir(parents=True)
    Image.new("RGB", (40, 30), (90, 90, 90)).save(images / "COCO_val2014_000000000007.jpg")
    questions = {"data_subtype": "val2014", "questions": [
        {"image_id": 7, "question": "How many red circles are there?", "question_id": 70}]}
    annotations = {"annotations": [{"image_id": 7, "question_id": 70, "answer_type": "number",
                                    "answers": [{"answer": a, "answer_id": k + 1} for k, a in enumerate(answers)]}]}
    (root / "q.json").write_text(json.dumps(questions))
    (root / "a.json").write_text(json.dumps(annotations))
    return TaskFiles("okvqa", str(root / "q.json"), str(images), str(root / "a.json"))


class TwoCircles:
    """Tools that find two red circles anywhere (the answer a split panel of annotators half agrees with)."""

    def __init__(self, task) -> None:  # noqa: ANN001
        self.task = task

    def find(self, patch: PatchRef, name: str) -> list[tuple[int, int, int, int]]:
        return [(1, 1, 5, 5), (10, 10, 15, 15)]

    def exists(self, patch: PatchRef, name: str) -> bool:
        return True

    def verify_property(self, patch: PatchRef, name: str, attribute: str) -> bool:
        return False

    def simple_query(self, patch: PatchRef, question: str) -> str:
        return "many"

    def compute_depth(self, patch: PatchRef) -> float:
        return 1.0

    def llm_query(self, patch: PatchRef | None, question: str) -> str:
        return "unknown"


def test_eq3_gives_alpha_times_the_vqa_accuracy_of_a_partly_agreed_answer(tmp_path: Path) -> None:
    files = _write_okvqa(tmp_path, ["2", "2", "3", "3", "3", "3", "3", "3", "3", "3"])
    config = ReasoningLoopConfig(split="eval", tasks=BenchmarkTasksConfig(eval=files), r1=100.0, alpha=100.0)
    env = ReasoningLoopEnv(config, tools_factory=TwoCircles)
    try:
        env.reset(seed=0)
        _, reward, terminated, _, info = env.step(oracle_policy(None, env))
    finally:
        env.close()
    # two of ten annotators said "2": min(1, matches/3) averaged over the ten leave-one-out subsets = 0.6
    assert terminated and info["answer"] == "2" and info["score"] == pytest.approx(0.6)
    assert reward == pytest.approx(100.0 + 100.0 * 0.6)
    assert info["correct"] is False and info["gold"] == "3"


class GroundingLLM(ChatBackend):
    """A planner with one instruction and a coder that answers with the first patch LOC finds."""

    def chat(self, messages: list[dict]) -> str:
        if "Write Python code" in messages[-1]["content"]:
            return "```python\nfinal_answer = image_patch.find('red circle')[0]\n```"
        return "\n".join(f"{i}. [0.5] Find the referred object." for i in range(1, 6))

    def identity(self) -> dict:
        return {"kind": "grounding-test"}


def test_a_grounding_answer_patch_becomes_a_coco_box_scored_by_iou(offline) -> None:
    files = offline["refcoco-val"]
    task = next(task for task in benchmark_tasks(files)[0] if held_out_half(task.task_id) == "test")
    x, y, w, h = task.box
    height = task.image_size[1]

    class FindsTheTarget(TwoCircles):
        def find(self, patch: PatchRef, name: str) -> list[tuple[int, int, int, int]]:
            return [(int(x), int(height - y - h), int(x + w), int(height - y))]  # (left, lower, right, upper)

    config = ReasoningLoopConfig(split="test", tasks=BenchmarkTasksConfig(test=files))
    env = ReasoningLoopEnv(config, llm=GroundingLLM(), tools_factory=FindsTheTarget)
    try:
        env.reset(options={"task_id": task.task_id})
        _, reward, terminated, _, info = env.step(0)
    finally:
        env.close()
    assert terminated and info["score"] == pytest.approx(1.0) and info["correct"]
    assert reward == pytest.approx(config.r1 + config.alpha)
    # the box as ImagePatch coordinates (y from the bottom) and as a patch give the same COCO box
    assert as_benchmark_answer(PatchRef("i", 0, 10, 20, 30), task, 100) == (0.0, 70.0, 20.0, 20.0)
    assert as_benchmark_answer([0, 10, 20, 30], task, 100) == (0.0, 70.0, 20.0, 20.0)
    assert as_benchmark_answer("the red circle", task, 100) == "the red circle"


def test_a_text_answer_to_a_grounding_task_is_unrelated(offline) -> None:
    config = ReasoningLoopConfig(split="eval", tasks=BenchmarkTasksConfig(eval=offline["refcoco-val"]))
    env = ReasoningLoopEnv(config, tools_factory=TwoCircles)  # the scripted planner cannot parse "the red circle"
    try:
        env.reset(seed=0)
        _, reward, terminated, _, info = env.step(0)  # "guess the answer directly": simple_query's text
    finally:
        env.close()
    assert terminated and info["score"] == 0.0 and reward == pytest.approx(config.r1 - config.alpha)


def test_config_problems_name_missing_task_files_and_the_split_without_files(tmp_path: Path, offline) -> None:
    missing = TaskFiles("gqa", str(tmp_path / "nowhere.json"), str(tmp_path / "no-images"))
    config = ReasoningLoopConfig(split="eval", tasks={"train": missing})
    problems = " | ".join(config.problems("hydra"))
    assert "hydra.tasks.test: give the task files of the test split" in problems  # split eval: the old name of test
    config = ReasoningLoopConfig(split="train", tasks={"train": {"format": "gqa", "questions": missing.questions,
                                                                  "images": missing.images}})
    problems = " | ".join(config.problems("hydra"))
    assert f"hydra.tasks.train.questions = {missing.questions}: file not found" in problems
    assert "hydra.tasks.train.images" in problems


@pytest.mark.parametrize("settings, message", [
    ({"format": "coco-captions", "questions": "q.json", "images": "i"}, "unknown task format 'coco-captions'"),
    ({"format": "gqa", "questions": "q.json", "images": "i", "metric": "refcoco"}, "cannot score gqa tasks"),
    ({"format": "refcoco", "questions": "r.json", "images": "i", "annotations": "a.json", "metric": "gqa"},
     "cannot score refcoco tasks"),
    ({"format": "gqa", "questions": "q.json", "images": "i", "shots": 3}, "unexpected keyword argument 'shots'"),
])
def test_bad_task_settings_are_one_message_naming_the_split(settings: dict, message: str) -> None:
    with pytest.raises(DataError, match="tasks.train") as caught:
        ReasoningLoopConfig(tasks={"train": settings})
    assert message in str(caught.value)


def test_an_unknown_task_id_names_the_file(offline) -> None:
    env = benchmark_env(offline)
    try:
        with pytest.raises(DataError, match="task_id '999' is not a task of the test half of tasks.test"):
            env.reset(options={"task_id": 999})
    finally:
        env.close()


def test_the_shapes_world_still_reports_a_score_per_episode() -> None:
    env = ReasoningLoopEnv(ReasoningLoopConfig(split="eval"))
    try:
        result = run_episodes(env, oracle_policy, 10, 0)
    finally:
        env.close()
    assert result["accuracy"] == pytest.approx(float(np.mean(result["correct"])))


@pytest.fixture(scope="module")
def model_tools(tiny_models, tmp_path_factory: pytest.TempPathFactory) -> ImageToolsConfig:  # noqa: ANN001
    """The tiny tool exports (random weights) and a tiny depth model, loaded in-process."""
    root = tmp_path_factory.mktemp("tool-exports")
    exports = write_tiny_exports(tiny_models, root)
    depth = make_tiny_depth_anything(root / "depth")
    return ImageToolsConfig(loc=str(exports[LOC]), classify=str(exports[CLASSIFY]), vqa=str(exports[VQA]),
                            depth=str(depth))


class DepthAndQueries(ChatBackend):
    """A coder whose programs call every ImagePatch method the tools serve, then answer from them."""

    def chat(self, messages: list[dict]) -> str:
        if "Write Python code" in messages[-1]["content"]:
            return ("```python\nfound = image_patch.find('red circle')\nnear = image_patch.compute_depth()\n"
                    "shown = image_patch.verify_property('circle', 'red')\nthere = image_patch.exists('square')\n"
                    "crop = image_patch.crop(0, 0, 10, 10)\nreply = crop.simple_query('what colour?')\n"
                    "final_answer = str(len(found)) if near > -1e9 and isinstance(shown, bool) else reply\n```")
        return "\n".join(f"{i}. [0.5] Look and count." for i in range(1, 6))

    def identity(self) -> dict:
        return {"kind": "every-tool-test"}


def test_model_backed_tools_answer_every_imagepatch_call_of_an_episode(offline, model_tools) -> None:
    config = ReasoningLoopConfig(split="eval", max_iterations=2, sandbox_timeout_s=60.0,
                                 tasks=BenchmarkTasksConfig(train=offline["gqa-train"], eval=offline["okvqa-eval"],
                                                            tools=model_tools))
    assert config.problems("hydra") == []
    env = ReasoningLoopEnv(config, llm=DepthAndQueries())
    try:
        env.reset(seed=0)
        _, _, terminated, _, info = env.step(0)
        second = ReasoningLoopEnv(config, llm=DepthAndQueries())
        assert second.tools_factory(second.benchmark_tasks[0]).client is env.tools.client  # models loaded once
        second.close()
    finally:
        env.close()
    assert info["status"] == "ok" and terminated, info["error"]
    assert info["tool_calls"] >= 5 and info["answer"].isdigit()


def test_the_quickstart_benchmark_config_runs_on_what_its_preparation_writes(tmp_path: Path, tiny_models) -> None:  # noqa: ANN001
    """configs/quickstart/controller_hydra_benchmark.yaml's hydra section, re-rooted under tmp_path, on the files
    clova_train.quickstart.hydra_benchmark writes (the session's random-weight tiny models here, where
    make demo-hydra-benchmark pretrains them)."""
    import yaml

    from clova_train.quickstart import hydra_benchmark

    (tmp_path / "models").mkdir()
    for kind in ("owlvit", "clip", "blip"):
        (tmp_path / "models" / f"tiny-{kind}").symlink_to(tiny_models(kind), target_is_directory=True)
    written = hydra_benchmark.prepare(tmp_path / "data", tmp_path / "models", train_tasks=6, eval_tasks=4,
                                      pretrain_steps=0)
    assert set(written) == {"root", "loc", "classify", "vqa", "depth"}
    text = (Path(__file__).resolve().parents[2] / "configs/quickstart/controller_hydra_benchmark.yaml").read_text()
    text = text.replace(hydra_benchmark.DEFAULT_ROOT, str(tmp_path / "data"))
    text = text.replace(hydra_benchmark.DEFAULT_MODELS, str(tmp_path / "models"))
    section = yaml.safe_load(text)["hydra"]
    config = ReasoningLoopConfig(**{**section, "split": "eval", "cache_path": None, "sandbox_timeout_s": 60.0})
    assert config.problems("hydra") == []
    env = ReasoningLoopEnv(config)
    try:
        ids = [env.reset(seed=seed)[1]["task_id"] for seed in range(4)]
        _, _, terminated, truncated, info = env.step(0)
    finally:
        env.close()
    assert ids == ["10"] * 4 and info["status"] in ("ok", "error")  # the test half of 5, 10, 15, 20 (the rest: val)
    assert hydra_benchmark.prepare(tmp_path / "data", tmp_path / "models", train_tasks=6, eval_tasks=4,
                                   pretrain_steps=0) == written  # a rerun reuses what is there


# ---------------------------------------------------------------------- AVIS and HAMMR on the same task files
class AnnotatedImageTools:
    """ImagePatch tools that answer from the offline benchmark's scene annotations (its images are the shapes world's
    scenes at scale 2): what a perfect LOC / CLASSIFY would see, to check the environments' plumbing and scoring."""

    def __init__(self, task) -> None:  # noqa: ANN001
        self.scene = make_task(int(task.task_id))

    @property
    def size(self) -> tuple[int, int]:
        return (2 * 64, 2 * 64)

    def find(self, patch, name: str) -> list[tuple[int, int, int, int]]:  # noqa: ANN001
        words = name.split()
        return [tuple(2 * v for v in o.box) for o in self.scene.objects
                if o.shape == words[-1] and (len(words) == 1 or o.colour == words[0])]

    def label_of(self, patch) -> str:  # noqa: ANN001
        for o in self.scene.objects:
            if tuple(2 * v for v in o.box) == (patch.left, patch.lower, patch.right, patch.upper):
                return o.colour
        return "unknown"

    def simple_query(self, patch, question: str) -> str:  # noqa: ANN001
        return "yes"


def seeking_config(kind: str, files: dict[str, TaskFiles], tools: ImageToolsConfig | None = None, **extra):  # noqa: ANN003
    from clova_train.envs import AgentDispatchConfig, InformationSeekingConfig

    tasks = BenchmarkTasksConfig(train=files["gqa-train"], eval=files["okvqa-eval"],
                                 tools=tools or ImageToolsConfig())
    make = InformationSeekingConfig if kind == "avis" else AgentDispatchConfig
    return make(split="eval", tasks=tasks, **extra)


def seeking_env(kind: str, files: dict[str, TaskFiles], annotated: bool, tools: ImageToolsConfig | None = None):  # noqa: ANN201
    from clova_train.envs import AgentDispatchEnv, InformationSeekingEnv
    from clova_train.envs.avis import task_episodes

    config = seeking_config(kind, files, tools)
    if annotated:  # no tool models: the episodes' image tools answer from the annotations
        original = task_episodes.TaskFileEpisodes.__init__

        def without_models(self, tasks, split) -> None:  # noqa: ANN001
            self.config, self.split = tasks, split
            self.files = tasks.files(split)
            self.tasks, self.skipped = benchmark_tasks(self.files)
            self.client = None

        task_episodes.TaskFileEpisodes.__init__ = without_models
        try:
            env = (InformationSeekingEnv if kind == "avis" else AgentDispatchEnv)(config)
        finally:
            task_episodes.TaskFileEpisodes.__init__ = original
        env.episodes.image_tools = lambda task, llm=None: AnnotatedImageTools(task)
        return env
    return (InformationSeekingEnv if kind == "avis" else AgentDispatchEnv)(config)


def play(env, policy, seeds) -> list[dict]:  # noqa: ANN001
    infos = []
    for seed in seeds:
        obs, _ = env.reset(seed=seed)
        done, info = False, {}
        while not done:
            obs, _, terminated, truncated, info = env.step(policy(obs, env))
            done = terminated or truncated
        infos.append(info)
    return infos


@pytest.mark.parametrize("kind", ["avis", "hammr"])
def test_seeking_environments_play_the_eval_file_with_image_tools_and_the_benchmark_metric(offline, kind) -> None:
    env = seeking_env(kind, offline, annotated=True)
    try:
        planner = next(iter(env.reference_policies(0).values()))  # the LLM's own choice (planner / dispatcher)
        walked = [env.reset(seed=seed)[1]["task_id"] for seed in range(len(EVAL_IDS))]
        infos = play(env, planner, range(len(EVAL_IDS)))
    finally:
        env.close()
    assert walked == [str(i) for i in EVAL_IDS]
    for task_id, info in zip(EVAL_IDS, infos):
        task = make_task(task_id)
        assert info["task_id"] == str(task_id) and info["gold"] == task.answer
        assert info["question_kind"] == {"count": "number", "colour": "other"}.get(task.question_type, "yes/no")
        assert info["score"] == float(info["answer"] == task.answer)  # ten agreeing annotators: VQA accuracy 1 or 0
        if task.question_type in ("count", "exists", "colour"):  # a perfect detector and classifier answer these
            assert info["correct"], (task.question, info)


def test_avis_reads_the_detections_and_the_selection_of_the_image_tools(offline) -> None:
    env = seeking_env("avis", offline, annotated=True)
    try:
        colour_seed = next(s for s, i in enumerate(EVAL_IDS) if make_task(i).question_type == "colour")
        oracle = list(env.reference_policies(0).values())[-1]
        info = play(env, oracle, [colour_seed])[0]
    finally:
        env.close()
    lines = [event["output"] for event in info["path"]]
    assert [event["action"] for event in info["path"]] == ["detect", "select", "classify"], lines
    assert lines[0].startswith("detections: ") and lines[1].startswith("selected: ") and lines[2].startswith("label: ")
    assert info["correct"] and info["score"] == 1.0


@pytest.mark.parametrize("kind", ["avis", "hammr"])
def test_seeking_environments_run_on_the_tiny_tool_exports(offline, model_tools, kind) -> None:
    config = seeking_config(kind, offline, model_tools)
    assert config.problems(kind) == []
    env = seeking_env(kind, offline, annotated=False, tools=model_tools)
    try:
        planner = next(iter(env.reference_policies(0).values()))
        infos = play(env, planner, range(2))
    finally:
        env.close()
    for info in infos:  # random-weight models answer poorly, but every action ran and was scored
        assert 0.0 <= info["score"] <= 1.0 and not info["stopped"]
        if kind == "avis":
            assert all(not e.get("output", "").startswith("failed") for e in info["path"]), info["path"]


def test_seeking_configs_name_missing_task_files(tmp_path: Path) -> None:
    from clova_train.envs import InformationSeekingConfig

    files = TaskFiles("gqa", str(tmp_path / "missing.json"), str(tmp_path / "no-images"))
    config = InformationSeekingConfig(split="eval", tasks={"train": files})
    found = config.problems("avis")
    assert any(p.startswith("avis.tasks.test:") for p in found), found
    assert any("avis.tasks.train.questions" in p and "file not found" in p for p in found), found

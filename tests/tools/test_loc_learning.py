"""LOC learns on a pretrained tiny OWL-ViT: tuning fits a concept the detector misses (summed over scene sets and
prompt seeds, with a margin), the gate refuses a prompt tuned on another object's box, and an exported pool changes
detections in a fresh process."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from clova_train.tools.loc.tool import OwlVitLoc
from helpers.grounding import instances_of, outcomes, scene_sets, serve_accepted_in_fresh_process, tune

pytestmark = [pytest.mark.slow, pytest.mark.learning]


@pytest.fixture(scope="module")
def tool(pretrained_owlvit_dir: Path) -> OwlVitLoc:
    return OwlVitLoc(str(pretrained_owlvit_dir), num_prompt_tokens=64)


@pytest.fixture(scope="module")
def two_scene_sets(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return scene_sets(tmp_path_factory.mktemp("loc-scene-sets"), ["purple circle", "orange square"])


def test_tuning_fits_a_missed_concept_on_every_instance(tool: OwlVitLoc, two_scene_sets: list[Path]) -> None:
    # 48 tunings: 8 purple circles (a shade the detector was not trained on) x 2 scene sets x 3 prompt seeds. On
    # detectors built on three kernel sets (ATen's portable, AVX2 and AVX-512 kernels), at 1 and 2 threads, the loss
    # falls on every instance, by 53 to 62% of its sum. Whether the tuned prompts then pass the gate more often than
    # random prompts of their norms depends on the build (passes tuned / random: 13 / 1 on AVX-512, 5 / 1 portable,
    # 10 / 11 on AVX2), so it is not asserted: the tiny detector's gate effect is not a robust result (docs/tools/loc-seg.md).
    result = outcomes(tool, two_scene_sets, "purple circle")
    assert result.loss_fell == result.tunings == 48
    assert result.last_loss < 0.6 * result.first_loss, result


def test_the_gate_rejects_a_prompt_tuned_on_another_objects_box(tool: OwlVitLoc, two_scene_sets: list[Path]) -> None:
    for scenes in two_scene_sets:
        wrong = []
        for item in instances_of(scenes, "purple circle"):  # the concept's annotation holds the other object's box
            image = item.train
            boxes = image.boxes.clone()
            concept = image.objects_of(item.concept).tolist()
            other = [k for k in range(len(image.labels)) if k not in concept][0]
            boxes[concept] = image.boxes[other]
            wrong.append(dataclasses.replace(item, train=dataclasses.replace(image, boxes=boxes)))
        ctx, first, last, prompts = tune(tool, wrong)
        assert (last < first).all()  # it does learn the wrong box on its own image...
        with torch.no_grad():
            results = tool.gate(ctx, prompts)
        assert not any(result.passed for result in results)  # ...and the held-out images refuse it
        assert any(r.kind in {"not detected", "low IoU"} and "image" in r.detail
                   for res in results for r in res.rejections)


def test_an_exported_pool_changes_detections_in_a_fresh_process_without_lightning(
        tool: OwlVitLoc, two_scene_sets: list[Path], tmp_path: Path) -> None:
    scenes = two_scene_sets[0]
    served, plain = serve_accepted_in_fresh_process(tool, instances_of(scenes, "purple circle"), scenes,
                                                    tmp_path / "export")
    assert served["prompted"] is True and plain["prompted"] is False and served != plain

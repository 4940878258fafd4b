"""The prompted CLIP tool: unmodified without a prompt, per-image prompts, loading and identity."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from clova_train.core.errors import ModelError
from clova_train.tools.clip.tiny import make_tiny_clip
from clova_train.tools.clip.tool import PromptedClip


@pytest.fixture(scope="module")
def tool(tiny_clip_dir: Path) -> PromptedClip:
    return PromptedClip(f"local-dir:{tiny_clip_dir}", None, num_prompt_tokens=5, prompt_depth=2)


def test_no_prompt_is_the_unmodified_tool(tool: PromptedClip) -> None:
    images = torch.rand(3, 3, 32, 32)
    reference = F.normalize(tool.model.encode_image(tool.preprocess(images)), dim=-1)
    assert torch.equal(tool.encode_image(images), reference)


def test_each_image_sees_only_its_own_prompt(tool: PromptedClip) -> None:
    images = torch.rand(3, 3, 32, 32)
    prompts = (torch.randn(3, *tool.prompt_shape) * 0.5).requires_grad_()
    features = tool.encode_image(images, prompts)
    assert not torch.allclose(features, tool.encode_image(images))
    features[1].sum().backward()
    assert prompts.grad[1].abs().sum() > 0
    assert prompts.grad[0].abs().sum() == 0 and prompts.grad[2].abs().sum() == 0


def test_frozen_weights_get_no_gradients(tool: PromptedClip) -> None:
    assert not any(p.requires_grad for p in tool.parameters())
    assert not tool.model.training


def test_prompt_layout_is_checked(tool: PromptedClip, tiny_clip_dir: Path) -> None:
    with pytest.raises(ModelError, match=r"prompts have shape \(1, 2, 5, 64\), expected \(2, 2, 5, 64\)"):
        tool.encode_image(torch.rand(2, 3, 32, 32), torch.zeros(1, *tool.prompt_shape))
    with pytest.raises(ModelError, match="prompt_depth=9 but the CLIP image tower has 3 blocks"):
        PromptedClip(f"local-dir:{tiny_clip_dir}", None, 4, 9)


def test_loading_errors_name_the_directory(tiny_clip_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="CLIP model directory not found"):
        PromptedClip(f"local-dir:{tmp_path / 'missing'}", None)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(tiny_clip_dir / "open_clip_config.json", no_weights)
    with pytest.raises(ModelError, match=f"CLIP model directory {no_weights} has no weights"):
        PromptedClip(f"local-dir:{no_weights}", None)


def test_identity_follows_the_weights(tool: PromptedClip, tiny_clip_dir: Path, tmp_path: Path) -> None:
    same = PromptedClip(f"local-dir:{tiny_clip_dir}", None, 5, 2)
    other = PromptedClip(f"local-dir:{make_tiny_clip(tmp_path / 'other', seed=1, pretrain_steps=0)}", None)
    assert same.identity == tool.identity != other.identity
    description = tool.describe()
    description["identity"] = other.identity
    with pytest.raises(ModelError, match="but the prompts were trained on"):
        PromptedClip.from_description(description)


def test_prompted_forward_matches_plain_deep_vpt(tool: PromptedClip) -> None:
    """Against a direct implementation: insert the prompts, run every block in full, drop them, pool."""
    images = torch.rand(2, 3, 32, 32)
    prompts = torch.randn(2, *tool.prompt_shape) * 0.5
    x = tool.embed_patches(images)
    n = tool.num_prompt_tokens
    for index, block in enumerate(tool.model.visual.transformer.resblocks):
        if index < tool.prompt_depth:
            x = torch.cat([x[:, :1], prompts[:, index], x[:, 1 if index == 0 else 1 + n :]], dim=1)
        x = block(x)
    x = torch.cat([x[:, :1], x[:, 1 + n :]], dim=1)
    pooled, _ = tool.model.visual._pool(x)
    expected = F.normalize(pooled @ tool.model.visual.proj, dim=-1)
    assert tool._class_token_only  # the tiny CLIP pools the class token, so the shortcut is in use
    torch.testing.assert_close(tool.encode_image(images, prompts), expected, rtol=1e-5, atol=1e-6)


def test_clip_passes_check_tool(tool: PromptedClip, concept_root: Path) -> None:
    from clova_train.datamodules import ConceptFolderDataModule
    from clova_train.tools.check import check_tool

    dm = ConceptFolderDataModule(str(concept_root), image_size=32, val_per_concept=2, negatives_per_instance=2)
    dm.setup()
    report = check_tool(tool, [dm.instances[i] for i in (0, 5, 9)])
    assert report["max_cross_row_gradient"] == 0.0 and report["rebuilt"]


def test_check_tool_catches_a_loss_that_mixes_instances(tool: PromptedClip, concept_root: Path) -> None:
    """The checker is live: a tool whose losses are a batch mean (trap (a) of DESIGN.md) fails it."""
    from clova_train.datamodules import ConceptFolderDataModule
    from clova_train.tools.check import ToolCheckError, check_tool

    class MeanLossClip(PromptedClip):
        def instance_losses(self, ctx, prompts):
            losses = super().instance_losses(ctx, prompts)
            return losses.mean().expand_as(losses)

    broken = MeanLossClip.__new__(MeanLossClip)
    broken.__dict__.update(tool.__dict__)
    dm = ConceptFolderDataModule(str(concept_root), image_size=32, val_per_concept=2, negatives_per_instance=2)
    dm.setup()
    with pytest.raises(ToolCheckError, match="has a gradient on other instances' prompts"):
        check_tool(broken, [dm.instances[i] for i in (0, 5)], rebuild=False)


def test_token_embedding_adapter_matches_open_clip(tool: PromptedClip) -> None:
    """The one place that knows open_clip's ViT layout: equal to its private ``_embeds`` (where the installed
    version has it) and, through the blocks, to the tower's own forward."""
    from clova_train.tools.clip.tool import vit_token_embeddings

    visual = tool.model.visual
    pixels = torch.randn(3, 3, *tool.image_size)
    tokens = vit_token_embeddings(visual, pixels)
    if hasattr(visual, "_embeds"):
        torch.testing.assert_close(tokens, visual._embeds(pixels), rtol=0, atol=0)
    hidden = visual.transformer(tokens)
    pooled, _ = visual._global_pool(visual.ln_post(hidden)) if hasattr(visual, "_global_pool") else (visual.ln_post(hidden)[:, 0], None)
    if visual.proj is not None:
        pooled = pooled @ visual.proj
    torch.testing.assert_close(pooled, visual(pixels), rtol=1e-5, atol=1e-5)


def test_images_are_resized_and_centre_cropped_as_open_clip_does(tmp_path: Path) -> None:
    import numpy as np
    import open_clip
    from PIL import Image

    from clova_train.tools.images import load_image

    rng = np.random.default_rng(0)
    for shape in [(50, 80), (90, 40), (32, 32)]:
        Image.fromarray(rng.integers(0, 256, (*shape, 3), dtype=np.uint8)).save(tmp_path / "x.png")
        reference = open_clip.image_transform(32, is_train=False, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
        torch.testing.assert_close(load_image(tmp_path / "x.png", 32), reference(Image.open(tmp_path / "x.png")), rtol=0, atol=1e-6)


def test_gate_rules_have_known_answers(tiny_clip_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One orange instance; held out: two orange positives and a purple negative. With its prompt the purple
    image's prompted argmax is orange (0.50 vs purple 0.45), an error of the prompted rule; at serving the
    unmodified forward is surer of purple (0.60) than the prompt is of orange, so the served label stays purple.
    The first orange image is right by both rules; the second is orange by the prompted argmax (0.40) but the
    unmodified forward's top probability (yellow, 0.55) is higher, so serving keeps yellow: an error of the serving
    rule only. ``both`` collects both rules' errors; a margin makes the serving rule stricter."""
    from clova_train.tools.clip.tool import ClipChunk

    names = ["blue", "purple", "orange", "yellow"]
    prompted = torch.tensor([[0.05, 0.05, 0.85, 0.05], [0.05, 0.45, 0.50, 0.00], [0.30, 0.00, 0.40, 0.30]]).log()
    unprompted = torch.tensor([[0.10, 0.10, 0.70, 0.10], [0.20, 0.60, 0.20, 0.00], [0.05, 0.00, 0.40, 0.55]])
    ctx = ClipChunk(
        tokens=torch.zeros(1), images=torch.zeros(1), owner=torch.zeros(1, dtype=torch.long),
        labels=torch.zeros(1, dtype=torch.long), first_image=torch.zeros(1, dtype=torch.long),
        candidates=torch.ones(1, 4, dtype=torch.bool), text=torch.eye(4), names=names, concepts=["orange"],
        val_tokens=torch.zeros(3), val_owner=torch.zeros(3, dtype=torch.long), val_labels=torch.tensor([2, 1, 2]),
        val_files=["orange_000.png", "purple_000.png", "orange_001.png"], val_unprompted=unprompted,
    )
    results = {}
    for rule, margin in (("prompted", 0.0), ("serving", 0.0), ("both", 0.0), ("serving", 0.2)):
        clip = PromptedClip(f"local-dir:{tiny_clip_dir}", None, 4, 2, gate_decision=rule, classify_margin=margin)
        monkeypatch.setattr(clip, "_logits", lambda *args: prompted)
        (result,) = clip.gate(ctx, torch.zeros(1, *clip.prompt_shape))
        results[rule, margin] = [r.detail for r in result.rejections]
    assert results["prompted", 0.0] == ["purple_000.png (purple) classified as 'orange' (prompted)"]
    assert results["serving", 0.0] == ["orange_001.png classified as 'yellow' (serving)"]
    assert results["both", 0.0] == [*results["prompted", 0.0], *results["serving", 0.0]]
    # 0.85 is not above 0.70 + 0.2: with the margin the first orange image keeps its unmodified label, orange
    assert results["serving", 0.2] == results["serving", 0.0]
    with pytest.raises(ModelError, match="gate_decision must be 'both', 'serving' or 'prompted', got 'vote'"):
        PromptedClip(f"local-dir:{tiny_clip_dir}", None, 4, 2, gate_decision="vote")
    with pytest.raises(ModelError, match=r"classify_margin must be a number in \[0, 1\], got 1.5"):
        PromptedClip(f"local-dir:{tiny_clip_dir}", None, 4, 2, classify_margin=1.5)


def test_classify_decides_with_one_forward_per_image_and_a_zero_prompt_changes_nothing(
        tiny_clip_dir: Path, concept_root: Path) -> None:
    """CLASSIFY's decision: a label with prompts takes an image only where the forward with its prompts ranks it
    first and beats the unmodified top probability (plus the margin); labels without prompts keep the unmodified
    forward's verdict. So a pool of zero prompts is exactly the unmodified tool, and a prompt that lifts its own
    label's probability without winning its forward takes nothing."""
    from clova_train.core.pool import PromptPool
    from clova_train.tools.clip.margin import classify_forwards
    from clova_train.tools.images import list_images, load_image
    from clova_train.tools.prompt_server import PromptToolServer

    clip = PromptedClip(f"local-dir:{tiny_clip_dir}", None, 4, 2)
    names = sorted(p.name for p in concept_root.iterdir() if p.is_dir())
    images = torch.stack([load_image(f, 32) for c in names for f in list_images(concept_root / c)[:3]])
    pool = PromptPool(clip.pool_spec())
    with torch.no_grad():
        features = clip.encode_tokens(clip.embed_patches(images[:2]), None)
    pool.add(names[0], features, torch.zeros(2, *clip.prompt_shape), ["a", "b"])
    zero = PromptToolServer(clip, pool)
    with torch.no_grad():
        scores, base_logits = zero.score(images, names)
        forwards = classify_forwards(zero, images, names)
    torch.testing.assert_close(scores, base_logits.softmax(-1), rtol=0, atol=0)
    # by construction, not by luck: the zero ensemble's "prompted" forward is the unmodified one, at every margin
    torch.testing.assert_close(forwards.prompted[0], forwards.unprompted, rtol=0, atol=0)
    # a strong random prompt: wherever the label takes an image, its forward ranked it first above the unmodified top
    torch.manual_seed(0)
    strong = PromptPool(clip.pool_spec())
    strong.add(names[0], features, torch.randn(2, *clip.prompt_shape) * 3, ["a", "b"])
    server = PromptToolServer(clip, strong)
    with torch.no_grad():
        scores, base_logits = server.score(images, names)
        base = base_logits.softmax(-1)
        prompted = (clip.logit_scale * clip.encode_tokens(clip.embed_patches(images), server.prompts_for(
            names[0], clip.encode_tokens(clip.embed_patches(images), None))) @ clip.text_features(names).T).softmax(-1)
    taken = scores.argmax(-1) != base.argmax(-1)
    assert bool(((prompted.argmax(-1) == 0) & (prompted[:, 0] > base.max(-1).values))[taken].all())
    torch.testing.assert_close(scores[:, 1:], base[:, 1:])  # labels without prompts: the unmodified scores


def test_fewer_errors_gate_compares_with_the_unprompted_tool(tiny_clip_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Held out for one purple instance: three purple positives and a blue negative. Unprompted, two purple
    images are taken for blue (2 errors). Prompt A fixes one of them (1 error: fewer, kept, though the
    all-correct gate refuses it); prompt B fixes both but pulls the blue image to purple (1 error, kept);
    prompt C fixes nothing and pulls blue (3 errors by the prompted argmax; 2 by the serving rule, where blue
    stays blue: no fewer, so refused too, each rule's count named)."""
    from clova_train.tools.clip.tool import ClipChunk

    names = ["blue", "purple"]
    unprompted = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.2, 0.8], [0.9, 0.1]])
    prompted = {
        "A": torch.tensor([[0.3, 0.7], [0.7, 0.3], [0.2, 0.8], [0.9, 0.1]]),
        "B": torch.tensor([[0.3, 0.7], [0.2, 0.8], [0.1, 0.9], [0.4, 0.6]]),
        "C": torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.2, 0.8], [0.3, 0.7]]),
    }
    ctx = ClipChunk(
        tokens=torch.zeros(1), images=torch.zeros(1), owner=torch.zeros(1, dtype=torch.long),
        labels=torch.zeros(1, dtype=torch.long), first_image=torch.zeros(1, dtype=torch.long),
        candidates=torch.ones(1, 2, dtype=torch.bool), text=torch.eye(2), names=names, concepts=["purple"],
        val_tokens=torch.zeros(4), val_owner=torch.zeros(4, dtype=torch.long), val_labels=torch.tensor([1, 1, 1, 0]),
        val_files=["p0.png", "p1.png", "p2.png", "b0.png"], val_unprompted=unprompted,
    )
    verdicts = {}
    for criterion in ("all_correct", "fewer_errors"):
        clip = PromptedClip(f"local-dir:{tiny_clip_dir}", None, 4, 2, gate_criterion=criterion)
        for name, probabilities in prompted.items():
            monkeypatch.setattr(clip, "_logits", lambda *args, p=probabilities: p.log())
            (result,) = clip.gate(ctx, torch.zeros(1, *clip.prompt_shape))
            verdicts[criterion, name] = result
    assert [verdicts["all_correct", n].passed for n in "ABC"] == [False, False, False]
    assert [verdicts["fewer_errors", n].passed for n in "ABC"] == [True, True, False]
    details = [r.detail for r in verdicts["fewer_errors", "C"].rejections]
    assert len(details) == 2 and details[0].startswith("3 held-out errors with the prompt, 2 without (prompted)")
    assert details[1].startswith("2 held-out errors with the prompt, 2 without (serving)")
    with pytest.raises(ModelError, match="gate_criterion must be 'all_correct' or 'fewer_errors', got 'vote'"):
        PromptedClip(f"local-dir:{tiny_clip_dir}", None, 4, 2, gate_criterion="vote")


def test_choose_margin_keeps_labels_without_prompts_within_the_tolerance(tiny_clip_dir: Path, concept_root: Path) -> None:
    from clova_train.core.pool import PromptPool
    from clova_train.tools.clip.margin import (
        MARGINS, NEVER, choose_margin, classify_forwards, decide, images_needed, label_confidence, per_label_accuracy,
        taken_share_bound,
    )
    from clova_train.tools.images import list_images, load_image
    from clova_train.tools.prompt_server import PromptToolServer

    clip = PromptedClip(f"local-dir:{tiny_clip_dir}", None, 4, 2)
    names = sorted(p.name for p in concept_root.iterdir() if p.is_dir())
    files = [(f, k) for k, c in enumerate(names) for f in list_images(concept_root / c)]
    images, truth = torch.stack([load_image(f, 32) for f, _ in files]), torch.tensor([k for _, k in files])
    pool = PromptPool(clip.pool_spec())
    with torch.no_grad():
        features = clip.encode_tokens(clip.embed_patches(images[:2]), None)
    torch.manual_seed(1)
    pool.add(names[0], features, torch.randn(2, *clip.prompt_shape) * 3, ["a", "b"])  # a prompt that takes images
    server = PromptToolServer(clip, pool)
    margin, table = choose_margin(server, images, truth, names)
    assert margin in MARGINS and set(table) == {"unmodified", *MARGINS}
    clip.classify_margin = margin  # whatever it returns is a margin the tool takes (NEVER: 1)
    assert set(table[margin]["taken_bound"]) == set(names[1:])  # the labels without prompts
    # too few validation images to show a 2-point bound: prompts never override the unmodified tool
    assert len(images) // len(names) < images_needed() and margin == NEVER
    assert {k: v for k, v in table[NEVER].items() if k != "taken_bound"} == table["unmodified"]
    # with enough images (the bound loosened to what these show), the chosen margin keeps every label within it
    each = label_confidence(len(names) - 1)  # the per-label confidence of a joint 95% over the labels without prompts
    lenient = max(taken_share_bound(0, int((truth == k).sum()), each) for k in range(1, len(names)))
    margin, table = choose_margin(server, images, truth, names, tolerance=lenient)
    assert all(b <= lenient for b in table[margin]["taken_bound"].values())
    for name in names[1:]:
        assert table[margin][name] >= table["unmodified"][name]
    # decide() is what the served scores give, at any margin
    clip.classify_margin = margin
    with torch.no_grad():
        served, _ = server.score(images, names)
        forwards = classify_forwards(server, images, names)
    assert torch.equal(served.argmax(-1), decide(clip, forwards, margin))
    accuracies = {k: v for k, v in table[margin].items() if k != "taken_bound"}
    assert per_label_accuracy(decide(clip, forwards, margin), truth, names) == accuracies
    # with no tolerance to keep, the most accurate margin wins
    loose, table = choose_margin(server, images, truth, names, tolerance=1.0)
    assert table[loose]["all"] == max(table[m]["all"] for m in MARGINS)

"""The REPLACE tool (textual inversion on diffusers' inpainting pipeline) on a random-weight tiny pipeline:
the prompt-tool contract, where the token enters, latents computed once, noise that follows the instance (so a run
does not depend on its chunks or ranks), runs at chunk size 1 and 8, bad inputs, the diffusers export and serving
(with and without a pool entry, and in a fresh process without Lightning). DDP and resuming a killed run are the
engine's, tested once on CLIP (engine/test_multiprocess.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from clova_train.core.errors import DataError, ModelError
from clova_train.core.pool import PromptPool
from clova_train.tools.base import NoPrompt
from clova_train.tools.check import check_tool
from clova_train.tools.prompt_server import PromptToolServer
from clova_train.tools.replace.tool import InpaintTextualInversion, ensembled_token
from helpers.common import run_fit, serve_in_fresh_process
from helpers.grounding import assert_same_runs_at_chunk_sizes_1_and_8
from helpers.replace import fit_args, instances, masked_root


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return masked_root(tmp_path_factory.mktemp("masked"), ["orange_circle", "green_square"], images=12)


@pytest.fixture(scope="module")
def tool(tiny_sd_dir: Path) -> InpaintTextualInversion:
    return InpaintTextualInversion(str(tiny_sd_dir), resolution=16, gate_margin=0.0, gate_timesteps=4,
                                   num_inference_steps=4, guidance_scale=2.0)


def test_tool_keeps_the_prompt_tool_contract(tool: InpaintTextualInversion, data_root: Path) -> None:
    report = check_tool(tool, instances(data_root, "orange_circle", "orange_circle", count=3))
    assert report["prompt_shape"] == (1, 32) and report["max_cross_row_gradient"] == 0.0


def test_the_token_is_the_placeholder_row_of_the_embedding_table(tool: InpaintTextualInversion) -> None:
    """The hook gives the text states of the library forward with the token written into the table."""
    token = torch.randn(2, 1, tool.width)
    ids = tool.tokenize([tool.template.format(tool.placeholder_token)] * 2)
    with torch.no_grad():
        hooked = tool.text_states(ids, token)
        table = tool.text_encoder.get_input_embeddings().weight
        saved = table[tool.placeholder_id].clone()
        try:
            expected = []
            for row in range(2):
                table[tool.placeholder_id] = token[row, 0]
                expected.append(tool.text_encoder(ids[row : row + 1])[0])
        finally:
            table[tool.placeholder_id] = saved
    torch.testing.assert_close(hooked, torch.cat(expected), atol=1e-6, rtol=0)
    assert not any(p.requires_grad for p in tool.parameters())


def test_latents_are_computed_once_per_chunk(tool: InpaintTextualInversion, data_root: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    encode = tool.vae.encode
    monkeypatch.setattr(tool.vae, "encode", lambda x, *a, **k: calls.append(len(x)) or encode(x, *a, **k))
    items = instances(data_root, "orange_circle", "orange_circle", count=3)
    with torch.no_grad():
        ctx = tool.prepare(items)
    prepared = len(calls)
    assert prepared == 4  # training images and masked images, held-out images (shared by the 3) and masked
    tokens = tool.initial_prompts(items).float().requires_grad_()
    for _ in range(3):
        tool.instance_losses(ctx, tokens).sum().backward()
    with torch.no_grad():
        tool.gate(ctx, tokens.detach())
    assert len(calls) == prepared


def test_an_instance_draws_the_same_noise_alone_and_in_a_chunk(tool: InpaintTextualInversion, data_root: Path) -> None:
    items = instances(data_root, "orange_circle", "orange_circle", count=3)
    tokens = tool.initial_prompts(items).float()
    with torch.no_grad(), torch.random.fork_rng():
        chunk, alone = tool.prepare(items), tool.prepare(items[2:])
        for step in range(3):  # the third step of each
            # another global random state before each (what another rank or a resumed process has): unused
            torch.manual_seed(step)
            together = tool.instance_losses(chunk, tokens)
            torch.manual_seed(100 + step)
            single = tool.instance_losses(alone, tokens[2:])
    torch.testing.assert_close(together[2:], single, atol=1e-6, rtol=1e-5)
    assert len(set(together.tolist())) == 3


@pytest.mark.slow
def test_runs_do_not_depend_on_chunk_size(tiny_sd_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                                          tmp_path: Path) -> None:
    """8 instances through the CLI at chunk size 1 and 8; gate margin 0.0115 on the random network, so that some
    tokens pass and some do not and the verdicts compare."""
    root = masked_root(tmp_path_factory.mktemp("masked-runs"), ["orange_circle"], images=10)
    assert_same_runs_at_chunk_sizes_1_and_8(fit_args(tiny_sd_dir, root, tmp_path), tmp_path, instances=8)
    summary = json.loads((tmp_path / "chunk1" / "summary.json").read_text())
    assert summary["tried"] == 8 and 1 <= summary["accepted"] < 8  # the gate decides: some pass, some do not


@pytest.mark.parametrize("token", ["circle", "Circle", "<|endoftext|>", "a</w>", "two words", "", " <x>"])
def test_placeholder_tokens_the_tokenizer_knows_or_splits_are_refused(tiny_sd_dir: Path, token: str) -> None:
    with pytest.raises(ModelError, match="placeholder_token"):
        InpaintTextualInversion(str(tiny_sd_dir), placeholder_token=token, resolution=16)


def test_a_model_directory_that_is_not_an_inpainting_pipeline_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="model_index.json"):
        InpaintTextualInversion(str(tmp_path), resolution=16)


def _broken_copy(data_root: Path, tmp_path: Path, damage: str) -> tuple[Path, str]:
    root = tmp_path / "data"
    shutil.copytree(data_root / "orange_circle", root / "orange_circle")
    folder = root / "orange_circle"
    name = "orange_circle_005.png"
    if damage == "missing image":
        (folder / name).unlink()  # its mask stays: the image is missing
    elif damage == "unreadable image":
        (folder / name).write_bytes(b"not a png")
    elif damage == "mask of another size":
        Image.new("L", (8, 8), 255).save(folder / "masks" / name)
    elif damage == "empty mask":
        Image.new("L", (16, 16), 0).save(folder / "masks" / name)
    elif damage == "missing mask":
        (folder / "masks" / name).unlink()
    return root, name


@pytest.mark.parametrize("damage", ["missing image", "unreadable image", "mask of another size", "empty mask",
                                    "missing mask"])
def test_bad_inputs_stop_the_run_naming_the_file_and_write_no_pool(
    tiny_sd_dir: Path, data_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture, damage: str
) -> None:
    root, name = _broken_copy(data_root, tmp_path, damage)
    run_dir = tmp_path / "run"
    assert run_fit(*fit_args(tiny_sd_dir, root, run_dir)) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("clova-train: error:")]
    assert len(lines) == 1 and name in lines[0] and err.strip().splitlines()[-1] == lines[0], err[-2000:]
    assert not (run_dir / "pool.safetensors").exists()


def test_missing_masks_can_mean_the_full_image(tiny_sd_dir: Path, data_root: Path, tmp_path: Path) -> None:
    root, _ = _broken_copy(data_root, tmp_path, "missing mask")
    from clova_train.datamodules import MaskedConceptDataModule

    module = MaskedConceptDataModule(str(root), missing_mask="full", chunk_size=4)
    module.setup("fit")
    ids = module.instances.instance_ids
    full = [module.instances[i] for i in range(len(ids)) if ids[i].endswith("005.png")]
    assert len(full) == 1 and bool(full[0].train.mask.all())


@pytest.fixture(scope="module")
def exported(tiny_sd_dir: Path, data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from clova_train.export import export_run

    run_dir = tmp_path_factory.mktemp("replace-run")
    root = tmp_path_factory.mktemp("one-concept")
    shutil.copytree(data_root / "orange_circle", root / "orange_circle")
    assert run_fit(*fit_args(tiny_sd_dir, root, run_dir, "--data.init_args.chunk_size=8")) == 0
    assert PromptPool.load(run_dir / "pool.safetensors").concepts == ["orange_circle"]
    return export_run(run_dir, run_dir / "export")


def _request_images(tmp_path: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(3)
    image = Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8))
    mask = np.zeros((16, 16), dtype=np.uint8)
    mask[4:12, 4:12] = 255
    image.save(tmp_path / "image.png")
    Image.fromarray(mask).save(tmp_path / "mask.png")
    return tmp_path / "image.png", tmp_path / "mask.png"


def test_export_loads_with_plain_diffusers_and_serves_the_same_picture(exported: Path, tiny_sd_dir: Path,
                                                                         tmp_path: Path) -> None:
    from diffusers import StableDiffusionInpaintPipeline
    from safetensors.torch import load_file

    tokens = json.loads((exported / "textual_inversion" / "tokens.json").read_text())["concepts"]
    entry = tokens["orange_circle"]
    saved = load_file(exported / entry["path"] / "learned_embeds.safetensors")
    assert list(saved) == [entry["token"]] and saved[entry["token"]].shape == (1, 32)
    server = PromptToolServer.from_export(exported)
    torch.testing.assert_close(saved[entry["token"]], ensembled_token(server.pool.entry("orange_circle")[1]))

    plain = StableDiffusionInpaintPipeline.from_pretrained(tiny_sd_dir, safety_checker=None, requires_safety_checker=False)
    plain.load_textual_inversion(str(exported / entry["path"]), token=entry["token"])
    installed = plain.text_encoder.get_input_embeddings().weight[plain.tokenizer.convert_tokens_to_ids(entry["token"])]
    torch.testing.assert_close(installed, saved[entry["token"]][0], atol=0, rtol=0)

    image, mask = _request_images(tmp_path)
    served, prompted = server.inpaint(str(image), str(mask), "orange_circle", seed=7)
    assert prompted
    with torch.no_grad():
        theirs = plain(prompt=f"a photo of a {entry['token']}", image=Image.open(image), mask_image=Image.open(mask),
                       height=16, width=16, num_inference_steps=4, guidance_scale=2.0,
                       generator=torch.Generator().manual_seed(7)).images[0]
    difference = np.abs(np.asarray(served, dtype=int) - np.asarray(theirs, dtype=int)).max()
    assert difference <= 1


def test_without_a_pool_entry_the_output_is_the_unmodified_pipelines(exported: Path, tiny_sd_dir: Path,
                                                                       tmp_path: Path) -> None:
    from diffusers import StableDiffusionInpaintPipeline

    server = PromptToolServer.from_export(exported)
    image, mask = _request_images(tmp_path)
    served, prompted = server.inpaint(str(image), str(mask), "blue_square", seed=3)
    assert not prompted
    plain = StableDiffusionInpaintPipeline.from_pretrained(tiny_sd_dir, safety_checker=None, requires_safety_checker=False)
    with torch.no_grad():
        theirs = plain(prompt="a photo of a blue square", image=Image.open(image), mask_image=Image.open(mask),
                       height=16, width=16, num_inference_steps=4, guidance_scale=2.0,
                       generator=torch.Generator().manual_seed(3)).images[0]
    assert np.array_equal(np.asarray(served), np.asarray(theirs))
    words, _ = server.tool.inpaint(NoPrompt(), str(image), str(mask), "orange_circle", seed=3)
    token, _ = server.inpaint(str(image), str(mask), "orange_circle", seed=3)
    assert not np.array_equal(np.asarray(words), np.asarray(token))  # the token changes the picture


def test_a_picture_of_another_size_comes_back_at_its_own_size(exported: Path, tmp_path: Path) -> None:
    server = PromptToolServer.from_export(exported)
    rng = np.random.default_rng(4)
    image = Image.fromarray(rng.integers(0, 255, (20, 36, 3), dtype=np.uint8))  # 36 wide, 20 high; the tool works at 16
    mask = np.zeros((20, 36), dtype=np.uint8)
    mask[5:15, 8:28] = 255
    served, _ = server.inpaint(image, Image.fromarray(mask), "orange_circle", seed=2)
    assert served.size == (36, 20)
    image.save(tmp_path / "wide.png")
    Image.fromarray(mask).save(tmp_path / "wide-mask.png")
    reply = server.serve({"image": str(tmp_path / "wide.png"), "mask": str(tmp_path / "wide-mask.png"),
                          "concept": "orange_circle", "output": str(tmp_path / "edited.png"), "seed": 2})
    assert Image.open(reply["output"]).size == (36, 20)


def test_serving_in_a_fresh_process_writes_the_edited_image(exported: Path, tmp_path: Path) -> None:
    image, mask = _request_images(tmp_path)
    request = {"image": str(image), "mask": str(mask), "concept": "orange_circle", "output": str(tmp_path / "out.png"),
               "seed": 1}
    reply = serve_in_fresh_process(exported, request)
    assert reply == {"output": str(tmp_path / "out.png"), "prompted": True}
    assert Image.open(tmp_path / "out.png").size == (16, 16)


@pytest.mark.parametrize("bad", [{"mask": None}, {"concept": ""}, {"seed": "x"}, {"mask": "empty"}, {"mask": "small"},
                                 {"image": "missing"}])
def test_bad_requests_name_what_is_wrong(exported: Path, tmp_path: Path, bad: dict) -> None:
    image, mask = _request_images(tmp_path)
    request = {"image": str(image), "mask": str(mask), "concept": "orange_circle", "output": str(tmp_path / "o.png")}
    key, value = next(iter(bad.items()))
    if value == "empty":
        Image.new("L", (16, 16), 0).save(tmp_path / "empty.png")
        value = str(tmp_path / "empty.png")
    elif value == "small":
        Image.new("L", (8, 8), 255).save(tmp_path / "small.png")
        value = str(tmp_path / "small.png")
    elif value == "missing":
        value = str(tmp_path / "nothing.png")
    request[key] = value
    server = PromptToolServer.from_export(exported)
    with pytest.raises(DataError):
        server.serve(request)
    assert not (tmp_path / "o.png").exists()

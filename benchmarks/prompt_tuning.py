"""Per-instance prompt tuning (CLIP, BLIP VQA, OWL-ViT LOC, MaskFormer SEG, SD-inpainting REPLACE): our engine
against two sequential baselines, in one run.

Methods (same model, data, steps, learning rate, initial prompts and threads):

* ``engine``: clova-train's ``PromptTuning`` with the tool under a Lightning ``Trainer`` (chunks of
  instances in lockstep, frozen weights, prompt-independent work done once per instance, a checkpoint per
  chunk). CLIP: patch embeddings and text features once, only the class token through the last block.
  VQA: image and question encoders once per instance, only the answer decoder per step.
* ``reference``: the public CLOVA procedure. CLIP (its ``CLASSIFY.train_prompt``): one instance at a
  time, the frozen model's weights still require gradients (computed every step), the image tower in full
  (every token through every block), text features recomputed every step, and after every step the
  prompted tool run on the validation images. VQA (its BLIP prompt training): one instance at a time, the
  whole model (image encoder, question encoder, answer decoder) re-run every step with weights that still
  require gradients, and greedy generation of the answer after every step (the public code's early-stop
  check; here its result is ignored so that every method takes the same number of steps). LOC (its
  OWL-ViT prompt training): one image at a time, the whole detector (vision encoder from the pixels, text
  encoder for the queries) re-run every step with weights that require gradients, and the pass check after
  every step (ignored, as above). SEG (its MaskFormer prompt training): the same without the check (the
  public code had no validation). REPLACE (CLOVA's textual inversion, as diffusers' textual-inversion
  script does it): one image at a time, the VAE re-encoding the image and the masked image every step, and
  the UNet's and text encoder's weights requiring gradients (the public code never froze its tools; the
  token-embedding table is trained whole and its other rows restored after each step).
* ``sequential``: a fair sequential loop: one instance at a time, but with frozen weights, the
  prompt-independent work done once per instance and the same prompted forward as the engine.

All methods run in float32. Each is timed ``--repeats`` times (fresh process each time) and the best
run counts, which damps the noise of a shared machine.

Each method runs in its own spawned process so that its peak memory (RSS above the loaded model on the
CPU, ``max_memory_allocated`` on a GPU) is its own. The learned prompts of all methods are compared with
the engine's (max absolute difference). Results are appended to ``benchmarks/results/prompt_tuning.md``.

    python benchmarks/prompt_tuning.py                      # CLIP, CPU defaults
    python benchmarks/prompt_tuning.py --tool vqa           # BLIP VQA
    python benchmarks/prompt_tuning.py --tool loc           # OWL-ViT (LOC)
    python benchmarks/prompt_tuning.py --tool seg           # MaskFormer (SEG)
    python benchmarks/prompt_tuning.py --tool replace       # Stable Diffusion inpainting (REPLACE)
    python benchmarks/prompt_tuning.py --device cuda --chunk-size 32 --instances 64 --model ViT-B-16
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import machine, publish  # noqa: E402


# A small ViT-B-like CLIP that runs on a laptop CPU; --model picks a real open_clip architecture instead.
BENCH_CLIP_CONFIG = {
    "embed_dim": 256,
    "vision_cfg": {"image_size": 64, "layers": 6, "width": 256, "patch_size": 8, "head_width": 64},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 256, "heads": 4, "layers": 4},
}


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# A BLIP of the real architecture at a CPU-friendly size (random weights: the timing does not need answers).
BENCH_BLIP = {"image_size": 64, "hidden_size": 128, "layers": 4}


# OWL-ViT and MaskFormer of the real architectures at CPU-friendly sizes (random weights).
BENCH_OWLVIT = {"image_size": 64, "width": 128, "layers": 4}
BENCH_MASKFORMER = {"image_size": 64, "width": 64, "num_queries": 32}
GROUNDING_CONCEPT = "purple circle"
GROUNDING_VAL_IMAGES = 4
# A Stable Diffusion inpainting pipeline of the real architecture at a CPU-friendly size (random weights).
BENCH_SD = {"image_size": 32, "unet_width": 32, "vae_width": 16}
REPLACE_CONCEPT = "orange_circle"
REPLACE_VAL_IMAGES = 2


def _build(args: argparse.Namespace, workdir: Path) -> tuple[str, Path]:
    """The tool's model name (``--model-dir``, else a small model of the real architecture built here) and its data."""
    model_name = _model_dir_name(args) if args.model_dir is not None else _build_small_model(args, workdir)
    return model_name, _write_data(args, workdir)


def _build_small_model(args: argparse.Namespace, workdir: Path) -> str:
    """A small random model of the tool's real architecture saved under ``workdir``; its model name."""
    if args.tool == "replace":
        from clova_train.tools.replace.tiny import build_tiny_inpainting_pipeline

        build_tiny_inpainting_pipeline(workdir / "sd", seed=0, **BENCH_SD).save_pretrained(workdir / "sd")
        return str(workdir / "sd")
    if args.tool in ("loc", "seg", "vqa"):
        from clova_train.tools.vqa.tiny import build_tiny_blip
        from clova_train.tools.seg.tiny import build_tiny_maskformer
        from clova_train.tools.loc.tiny import build_tiny_owlvit

        build, sizes = {"loc": (build_tiny_owlvit, BENCH_OWLVIT), "seg": (build_tiny_maskformer, BENCH_MASKFORMER),
                        "vqa": (build_tiny_blip, BENCH_BLIP)}[args.tool]
        model, processor = build(seed=0, **sizes)
        directory = workdir / ("blip" if args.tool == "vqa" else args.tool)
        model.save_pretrained(directory)
        processor.save_pretrained(directory)
        return str(directory)
    from clova_train.tools.clip.tiny import make_tiny_clip

    config = None
    if args.model:
        import open_clip

        config = open_clip.get_model_config(args.model)
    make_tiny_clip(workdir / "model", seed=0, pretrain_steps=0, model_config=config or BENCH_CLIP_CONFIG)
    return f"local-dir:{workdir / 'model'}"


def _model_dir_name(args: argparse.Namespace) -> str:
    """The tool's model name for a saved model directory (``--model-dir``): open_clip's ``local-dir:`` for CLIP."""
    return f"local-dir:{args.model_dir}" if args.tool == "clip" else str(args.model_dir)


def _write_data(args: argparse.Namespace, workdir: Path) -> Path:
    """The benchmark's synthetic data for ``args.tool`` (the tool's processor resizes it to the model's input)."""
    if args.tool == "replace":
        from clova_train.tools.replace.synthetic import write_masked_concepts

        return write_masked_concepts(workdir / "data", [REPLACE_CONCEPT], args.instances + REPLACE_VAL_IMAGES,
                                     image_size=BENCH_SD["image_size"], seed=0)
    if args.tool in ("loc", "seg"):
        from clova_train.tools.grounding.synthetic import write_coco_scenes

        return write_coco_scenes(workdir / "data", [GROUNDING_CONCEPT], args.instances + GROUNDING_VAL_IMAGES,
                                 objects_per_image=2, image_size=64, seed=0)
    if args.tool == "vqa":
        from clova_train.tools.vqa.synthetic import write_vqa_records

        return write_vqa_records(workdir / "data", ["orange", "purple", "red", "green"], [],
                                 images_per_colour=args.instances // 4 + 1, wrong_answers=0, eval_per_colour=1,
                                 image_size=BENCH_BLIP["image_size"], seed=0)
    from clova_train.tools.clip.synthetic import write_concept_folders

    return write_concept_folders(workdir / "data", ["red", "green", "blue", "yellow"], args.instances // 4 + 2, 64,
                                 seed=0)


def _module(args: argparse.Namespace, model_name: str):
    from clova_train.models import PromptTuning

    if args.tool == "vqa":
        from clova_train.tools.vqa.tool import BlipVqa

        tool = BlipVqa(model_name, num_prompt_tokens=args.prompt_tokens, max_answer_tokens=4)
    elif args.tool == "loc":
        from clova_train.tools.loc.tool import OwlVitLoc

        tool = OwlVitLoc(model_name, num_prompt_tokens=args.prompt_tokens)
    elif args.tool == "seg":
        from clova_train.tools.seg.tool import MaskFormerSeg

        tool = MaskFormerSeg(model_name, num_prompt_tokens=args.prompt_tokens, object_threshold=0.0)
    elif args.tool == "replace":
        from clova_train.tools.replace.tool import InpaintTextualInversion

        tool = InpaintTextualInversion(model_name, resolution=BENCH_SD["image_size"])
    else:
        from clova_train.tools.clip.tool import PromptedClip

        tool = PromptedClip(model_name, None, num_prompt_tokens=args.prompt_tokens, prompt_depth=3)
    return PromptTuning(tool, lr=args.lr, steps=args.steps, keep_rejected_prompts=True, on_existing_pool="overwrite")


def _datamodule(args: argparse.Namespace, data: Path, chunk_size: int):
    if args.tool == "vqa":
        from clova_train.datamodules import VqaRecordDataModule

        dm = VqaRecordDataModule(str(data / "train.jsonl"), chunk_size=chunk_size)
    elif args.tool == "replace":
        from clova_train.datamodules import MaskedConceptDataModule

        dm = MaskedConceptDataModule(str(data), val_per_concept=REPLACE_VAL_IMAGES, chunk_size=chunk_size)
    elif args.tool in ("loc", "seg"):
        from clova_train.datamodules import GroundingDataModule

        dm = GroundingDataModule(str(data / "annotations.json"), GROUNDING_CONCEPT, max_images=args.instances,
                                 num_val_images=GROUNDING_VAL_IMAGES, chunk_size=chunk_size)
    else:
        from clova_train.datamodules import ConceptFolderDataModule

        dm = ConceptFolderDataModule(
            str(data), image_size=args.image_size, val_per_concept=1, negatives_per_instance=3, chunk_size=chunk_size
        )
    dm.setup()
    return dm


def _instances(dm, n: int) -> list[dict]:
    return [dm.instances[i] for i in range(n)]


def run_engine(args: argparse.Namespace, model_name: str, data: Path, out: Path) -> dict:
    from lightning import Trainer

    module = _module(args, model_name).to(args.device)
    dm = _datamodule(args, data, args.chunk_size)
    ids = dm.instances.instance_ids[: args.instances]
    if args.tool in ("loc", "seg"):
        pass  # the datamodule already holds exactly args.instances training images
    elif args.tool == "vqa":
        dm.instances.records = dm.instances.records[: args.instances]
        dm.instances.images = dm.instances.images[: args.instances]
    else:
        dm.instances.items = dm.instances.items[: args.instances]
    dm.instances.instance_ids = ids
    trainer = Trainer(
        accelerator="gpu" if args.device.startswith("cuda") else "cpu", devices=1, max_epochs=1, logger=False,
        limit_val_batches=0, num_sanity_val_steps=0,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out),
    )
    base = _peak_rss_mb()
    _reset_cuda(args)
    start = time.perf_counter()
    trainer.fit(module, dm)
    _sync(args)
    seconds = time.perf_counter() - start
    prompts = {i: module.records[i].prompt for i in ids}
    return _result(args, seconds, base, prompts)


def _fair_prompt(module, item: dict, device: str) -> torch.Tensor:
    tool = module.tool
    with torch.no_grad():
        tokens = tool.embed_patches(item.images.to(device))
        names = item.candidates
        text = tool.encode_text(names)
    labels = torch.tensor([names.index(c) for c in item.labels], device=device)
    prompt = module.start_prompts([item])[0].float().to(device)[None].requires_grad_()
    optimizer = torch.optim.Adam([prompt], lr=module.lr)
    for _ in range(module.steps):
        features = tool.encode_tokens(tokens, prompt.expand(len(tokens), *prompt.shape[1:]))
        loss = F.cross_entropy(tool.logit_scale * features @ text.T, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return prompt.detach()[0].cpu()


def _reference_prompt(module, item: dict, device: str) -> torch.Tensor:
    tool = module.tool
    tool.model.requires_grad_(True)  # the public code never froze the tool
    tool._class_token_only = False  # and ran every vision block in full for every token
    names = item.candidates
    labels = torch.tensor([names.index(c) for c in item.labels], device=device)
    texts = tool.tokenizer([tool.text_prompt(c) for c in names]).to(device)
    images = item.images.to(device)
    val_images = item.val_images.to(device)
    prompt = module.start_prompts([item])[0].float().to(device)[None].requires_grad_()
    optimizer = torch.optim.Adam([prompt], lr=module.lr)
    for _ in range(module.steps):
        text = F.normalize(tool.model.encode_text(texts), dim=-1)  # recomputed every step
        features = tool.encode_image(images, prompt.expand(len(images), *prompt.shape[1:]))
        loss = F.cross_entropy(tool.logit_scale * features @ text.T, labels)
        optimizer.zero_grad()
        tool.model.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():  # the per-step validation check
            val_features = tool.encode_image(val_images, prompt.expand(len(val_images), *prompt.shape[1:]))
            (val_features @ F.normalize(tool.model.encode_text(texts), dim=-1).T).argmax(-1)
    return prompt.detach()[0].cpu()


def _vqa_loss(tool, encoded, answers, prompt: torch.Tensor) -> torch.Tensor:
    return tool.instance_losses(SimpleNamespace(question=encoded, answers=answers), prompt).sum()


def _fair_vqa_prompt(module, item, device: str) -> torch.Tensor:
    tool = module.tool
    with torch.no_grad():
        ctx = tool.prepare([item])
    prompt = module.start_prompts([item])[0].float().to(device)[None].requires_grad_()
    optimizer = torch.optim.Adam([prompt], lr=module.lr)
    for _ in range(module.steps):
        loss = tool.instance_losses(ctx, prompt).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return prompt.detach()[0].cpu()


def _reference_vqa_prompt(module, item, device: str) -> torch.Tensor:
    tool = module.tool
    tool.model.requires_grad_(True)  # the public code never froze the tool
    pixels = tool.pixel_values([item.image])
    ids, mask = tool.tokenize_questions([item.question])
    answers = tool.encode_answers([item.answer])
    prompt = module.start_prompts([item])[0].float().to(device)[None].requires_grad_()
    optimizer = torch.optim.Adam([prompt], lr=module.lr)
    for _ in range(module.steps):
        encoded = tool.encode_questions(tool.image_embeddings(pixels), ids, mask)  # the whole model, every step
        loss = _vqa_loss(tool, encoded, answers, prompt)
        optimizer.zero_grad()
        tool.model.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():  # greedy answer after every step (its early-stop check), from the images again
            tool.greedy(tool.encode_questions(tool.image_embeddings(pixels), ids, mask), prompt)
    return prompt.detach()[0].cpu()


def _reference_grounding_prompt(module, item, device: str) -> torch.Tensor:
    tool = module.tool
    tool.model.requires_grad_(True)  # the public code never froze the tool
    prompt = module.start_prompts([item])[0].float().to(device)[None].requires_grad_()
    optimizer = torch.optim.Adam([prompt], lr=module.lr)
    for _ in range(module.steps):
        ctx = tool.prepare([item])  # the whole model from the pixels (and the query texts), every step
        loss = tool.instance_losses(ctx, prompt).sum()
        optimizer.zero_grad()
        tool.model.zero_grad()
        loss.backward()
        optimizer.step()
        if module.tool.name == "owlvit_loc":
            with torch.no_grad():  # the pass check after every step
                tool.gate(ctx, prompt)
    return prompt.detach()[0].cpu()


def _reference_replace_prompt(module, item, device: str) -> torch.Tensor:
    tool = module.tool
    tool.unet.requires_grad_(True)  # the public code never froze the tool: weight gradients every step
    tool.text_encoder.requires_grad_(True)  # the whole embedding table included (textual-inversion scripts)
    with torch.no_grad():
        ctx = tool.prepare([item])
    prompt = module.start_prompts([item])[0].float().to(device)[None].requires_grad_()
    optimizer = torch.optim.Adam([prompt], lr=module.lr)
    for _ in range(module.steps):
        with torch.no_grad():
            ctx.train = tool.encode([item.train])  # the VAE on the image and the masked image, every step
        loss = tool.instance_losses(ctx, prompt).sum()
        optimizer.zero_grad()
        tool.unet.zero_grad()
        tool.text_encoder.zero_grad()
        loss.backward()
        optimizer.step()
    tool.unet.requires_grad_(False)
    tool.text_encoder.requires_grad_(False)
    return prompt.detach()[0].cpu()


def run_loop(args: argparse.Namespace, model_name: str, data: Path, kind: str) -> dict:
    from lightning.pytorch.utilities import move_data_to_device

    module = _module(args, model_name).to(args.device)
    dm = _datamodule(args, data, 1)
    if args.tool == "replace":
        step = _reference_replace_prompt if kind == "reference" else _fair_vqa_prompt  # latents once, then tune
    elif args.tool in ("loc", "seg"):
        step = _reference_grounding_prompt if kind == "reference" else _fair_vqa_prompt  # prepare once, then tune
    elif args.tool == "vqa":
        step = _reference_vqa_prompt if kind == "reference" else _fair_vqa_prompt
    else:
        step = _reference_prompt if kind == "reference" else _fair_prompt
    base = _peak_rss_mb()
    _reset_cuda(args)
    start = time.perf_counter()
    prompts = {}
    for item in _instances(dm, args.instances):
        if args.tool == "replace":  # the loops do not gate: no held-out latents or word losses to prepare
            item = dataclasses.replace(item, val=[])
        # on the device as Lightning moves the engine's chunks (boxes, masks and targets too, not only the images)
        item = move_data_to_device(item, torch.device(args.device))
        prompts[item.instance_id] = step(module, item, args.device)
    _sync(args)
    return _result(args, time.perf_counter() - start, base, prompts)


def _reset_cuda(args: argparse.Namespace) -> None:
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _sync(args: argparse.Namespace) -> None:
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()


def _result(args: argparse.Namespace, seconds: float, base_rss: float, prompts: dict) -> dict:
    if args.device.startswith("cuda"):
        memory = torch.cuda.max_memory_allocated() / 2**20
    else:
        memory = _peak_rss_mb() - base_rss
    # numpy, not tensors: tensors cross processes as shared-memory handles that die with the child
    return {"seconds": seconds, "memory_mb": memory, "prompts": {k: v.numpy() for k, v in prompts.items()}}


def _child(kind: str, args: argparse.Namespace, model_name: str, data: str, out: str, queue: mp.Queue) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if kind == "engine":
        queue.put(run_engine(args, model_name, Path(data), Path(out)))
    else:
        queue.put(run_loop(args, model_name, Path(data), kind))


def measure(kind: str, args: argparse.Namespace, model_name: str, data: Path, workdir: Path) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(kind, args, model_name, str(data), str(workdir / kind), queue))
    proc.start()
    while True:  # a child that dies (out of memory, a crash) must not leave the parent waiting forever
        try:
            result = queue.get(timeout=5)
            break
        except Exception:
            if not proc.is_alive():
                raise SystemExit(f"the {kind} run died (exit code {proc.exitcode})")
    proc.join()
    result["prompts"] = {k: torch.from_numpy(v) for k, v in result["prompts"].items()}
    return result


def _model_label(model_dir: Path) -> str:
    """A saved model's name: its real-size build record's, else the directory's."""
    record = model_dir / "real_size.json"
    if record.is_file():
        import json

        described = json.loads(record.read_text())
        return (f"{model_dir.name}, {described.get('checkpoint', '?')}'s architecture at "
                f"{described.get('parameters', 0) / 1e6:,.1f} M parameters")
    return model_dir.name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool", choices=["clip", "vqa", "loc", "seg", "replace"], default="clip", help="which prompt tool to tune")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--instances", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=None, help="default: the paper's (CLIP 1e-2, VQA 1e-3, LOC 5e-4, SEG 1e-1, REPLACE 5e-3)")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=2, help="runs per method; the fastest counts")
    parser.add_argument("--model", default=None, help="open_clip architecture (random weights); default: a small ViT")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a saved model of the tool's architecture to tune on instead of the small benchmark one "
                             "(for example a real-size build of benchmarks/smoke_real.py); random weights do for timing")
    parser.add_argument("--methods", nargs="+", choices=["engine", "sequential", "reference"],
                        default=["engine", "sequential", "reference"], help="which methods to time (engine first)")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to the results file")
    args = parser.parse_args()
    if args.methods[0] != "engine":
        parser.error("--methods: the engine comes first (every other method is compared with it)")
    if args.lr is None:
        args.lr = {"vqa": 1e-3, "loc": 5e-4, "seg": 1e-1, "replace": 5e-3}.get(args.tool, 1e-2)

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_name, data = _build(args, workdir)
        results = {}
        for _ in range(args.repeats):
            for kind in args.methods:
                run = measure(kind, args, model_name, data, workdir)
                if kind not in results or run["seconds"] < results[kind]["seconds"]:
                    results[kind] = run

    engine = results["engine"]
    rows = []
    for kind in args.methods:
        r = results[kind]
        diff = max(float((r["prompts"][i] - engine["prompts"][i]).abs().max()) for i in engine["prompts"])
        rows.append(
            f"| {kind} | {args.instances / r['seconds']:.2f} | {r['seconds'] / engine['seconds']:.2f}x | "
            f"{r['memory_mb']:.0f} | {diff:.2e} |"
        )
    if args.model_dir is not None:
        what = (f"tool {args.tool}, model {_model_label(args.model_dir)} (random weights), {args.prompt_tokens} prompt "
                f"tokens{' x 3 blocks' if args.tool == 'clip' else ''}, {args.steps} steps, {args.instances} instances")
    elif args.tool == "vqa":
        b = BENCH_BLIP
        what = (f"tool BLIP VQA (BlipForQuestionAnswering, hidden {b['hidden_size']}, {b['layers']} layers per tower, "
                f"image {b['image_size']}px, patch 8), {args.prompt_tokens} prompt tokens, {args.steps} steps, "
                f"{args.instances} instances (one question each)")
    elif args.tool == "loc":
        b = BENCH_OWLVIT
        what = (f"tool OWL-ViT LOC (OwlViTForObjectDetection, width {b['width']}, {b['layers']} vision layers, "
                f"image {b['image_size']}px, patch 8), {args.prompt_tokens} prompt tokens, up to 15 queries per image, "
                f"{args.steps} steps, {args.instances} instances (+1 held-out image each)")
    elif args.tool == "seg":
        b = BENCH_MASKFORMER
        what = (f"tool MaskFormer SEG (MaskFormerForInstanceSegmentation, tiny Swin, decoder width {b['width']}, "
                f"{b['num_queries']} queries, image {b['image_size']}px), {args.prompt_tokens} prompt tokens, "
                f"{args.steps} steps, {args.instances} instances (+1 held-out image each)")
    elif args.tool == "replace":
        b = BENCH_SD
        what = (f"tool SD inpainting REPLACE (StableDiffusionInpaintPipeline: UNet width {b['unet_width']}, 9 input "
                f"channels, VAE width {b['vae_width']}, CLIP text encoder width 32, image {b['image_size']}px), one "
                f"32-d token, {args.steps} steps, {args.instances} instances ({REPLACE_VAL_IMAGES} held-out images "
                "shared; the engine's time includes its gate, the loops do not gate)")
    else:
        model = args.model or "small ViT (width 256, 6 blocks, patch 8)"
        what = (f"tool CLIP, model {model}, image {args.image_size}px, {args.prompt_tokens} prompt tokens x 3 blocks, "
                f"{args.steps} steps, {args.instances} instances (1 positive + 3 negative images each)")
    publish(
        "prompt_tuning", "Prompt-tuning benchmark results", f"{args.device}: {machine()}",
        f"{what}, engine chunk size {args.chunk_size}, {args.threads} threads, best of {args.repeats} runs per method"
        + ("" if args.device == "cpu" else f", peak memory: torch's max_memory_allocated"),
        ["method", "instances/s", "engine speed-up over it", "peak memory MB", "max abs prompt diff vs engine"],
        rows, record=not args.no_record,
    )

if __name__ == "__main__":
    sys.exit(main())

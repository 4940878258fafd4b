"""The ``clova-train`` command.

* ``clova-train fit|validate|test|predict --config <yaml> [--config <yaml> ...] [--a.b=value ...]`` is
  LightningCLI: the model and data are chosen by ``class_path`` (``ClipPromptTuning``,
  ``ConceptFolderDataModule``, ...), ``--print_config`` shows the resolved config, ``--help`` documents
  every argument, and fits resume with ``--ckpt_path last``.
* ``clova-train export`` writes a self-describing serving directory from a finished run or a checkpoint.
* ``clova-train serve EXPORT --request '{...}'`` answers JSON requests with any exported prompt tool and its
  prompt ensemble (one reply per line; requests also from stdin), without Lightning.
* ``clova-train controller fit|evaluate|export --config <yaml>`` trains HYDRA's DQN controller on the
  reasoning-loop environment (stable-baselines3), evaluates it against the planner's top sample and a random
  one, and exports it (SB3 zip, TorchScript Q-network, JSON description). Reruns of ``fit`` resume.
* ``clova-train tiny-model clip <dir>`` writes a tiny random-weight model of a real architecture (for
  quickstarts and tests on machines without a model hub).

Errors about user input (bad config, missing file, mismatched pool, ...) print one line naming the culprit
and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from clova_train.core.errors import ClovaTrainError

EXTRA_COMMANDS = ("export", "serve", "controller", "tiny-model")


def run_lightning(args: Sequence[str] | None) -> None:
    from lightning import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    import clova_train.datamodules  # noqa: F401  (registers the data classes for class_path short names)
    import clova_train.models  # noqa: F401  (registers the model classes for class_path short names)

    LightningCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        auto_configure_optimizers=False,
        save_config_kwargs={"overwrite": True},
        args=None if args is None else list(args),
        parser_kwargs={
            "description": "clova-train: train tool prompts, tool-using LLMs and controllers. Also: "
            + ", ".join(f"'clova-train {c} --help'" for c in EXTRA_COMMANDS),
        },
    )


def run_export(args: Sequence[str]) -> None:
    from clova_train.export.runs import export_run

    parser = argparse.ArgumentParser(
        prog="clova-train export",
        description="Write a serving directory from a finished run directory or a Lightning checkpoint: "
        "for tool prompts the pool, tool description, config and versions; for a LoRA run the PEFT adapter "
        "(and with --merged the merged model) with its tokenizer, prompt template and stop strings.",
    )
    parser.add_argument("source", help="run directory (pool.safetensors or adapter/) or a .ckpt checkpoint")
    parser.add_argument("--output", "-o", required=True, help="export directory to write (replaced atomically)")
    parser.add_argument("--merged", action="store_true", help="LoRA runs: also write the merged model")
    parsed = parser.parse_args(list(args))
    out = export_run(parsed.source, parsed.output, parsed.merged)
    print(f"exported to {out}")


def run_serve(args: Sequence[str]) -> None:
    import json

    from clova_train.tools.serving import PromptToolServer

    parser = argparse.ArgumentParser(
        prog="clova-train serve",
        description="Answer JSON requests with an exported prompt tool and its prompt ensemble (no Lightning). "
        "CLIP: {\"images\": [paths], \"labels\": [...]} or {\"images\": [...], \"concept\": c}; "
        "BLIP VQA: {\"image\": path, \"question\": text}. One JSON reply per line.",
    )
    parser.add_argument("export", help="directory written by clova-train export (or a finished run directory)")
    parser.add_argument("--request", action="append", default=[], help="a JSON request (repeatable); "
                        "without any, requests are read from stdin, one per line")
    parser.add_argument("--top-k", type=int, default=None, help="ensemble the k most similar stored prompts")
    parser.add_argument("--device", default="cpu", help="torch device")
    parsed = parser.parse_args(list(args))
    server = PromptToolServer.from_export(parsed.export, top_k=parsed.top_k, device=parsed.device)
    lines = parsed.request or (line for line in sys.stdin if line.strip())
    for number, line in enumerate(lines, 1):
        try:
            request = json.loads(line)
        except json.JSONDecodeError as err:
            raise ClovaTrainError(f"request {number} is not valid JSON: {err.msg}") from err
        if not isinstance(request, dict):
            raise ClovaTrainError(f"request {number} must be a JSON object")
        print(json.dumps(server.serve(request)), flush=True)


def run_tiny_model(args: Sequence[str]) -> None:
    from clova_train.tiny_models import (
        make_tiny_blip, make_tiny_clip, make_tiny_llama, make_tiny_maskformer, make_tiny_owlvit, tool_corpus,
    )

    parser = argparse.ArgumentParser(
        prog="clova-train tiny-model",
        description="Write a tiny random-weight model of a real architecture, loadable by the normal loading code.",
    )
    parser.add_argument("tool", choices=["clip", "blip", "owlvit", "maskformer", "llama", "sd-inpaint"],
                        help="CLIP (open_clip), BLIP VQA, OWL-ViT detection, MaskFormer segmentation, Llama (transformers) "
                             "or a Stable Diffusion inpainting pipeline (diffusers)")
    parser.add_argument("output", help="directory to write")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation and pretraining seed")
    parser.add_argument(
        "--pretrain-steps", type=int, default=None,
        help="pretraining steps (default: each model's own, enough for its quickstart; CLIP: contrastive, on synthetic shapes; BLIP: answers to questions about "
        "synthetic shapes; OWL-ViT: detecting named shapes; MaskFormer: segmenting shapes of four colours; Llama: next-token, on tool prompts without responses; "
        "sd-inpaint: UNet and text encoder steps inpainting captioned shapes, after the VAE's own); 0 keeps random weights",
    )
    parsed = parser.parse_args(list(args))
    steps = {} if parsed.pretrain_steps is None else {"pretrain_steps": parsed.pretrain_steps}
    if parsed.tool == "clip":
        out = make_tiny_clip(parsed.output, seed=parsed.seed, **steps)
    elif parsed.tool == "blip":
        out = make_tiny_blip(parsed.output, seed=parsed.seed, **steps)
    elif parsed.tool == "owlvit":
        out = make_tiny_owlvit(parsed.output, seed=parsed.seed, **steps)
    elif parsed.tool == "maskformer":
        out = make_tiny_maskformer(parsed.output, seed=parsed.seed, **steps)
    elif parsed.tool == "sd-inpaint":
        from clova_train.tiny_inpainting import make_tiny_inpainting

        out = make_tiny_inpainting(parsed.output, seed=parsed.seed, **steps)
    else:
        texts, prompts = tool_corpus(parsed.seed)
        out = make_tiny_llama(parsed.output, texts, prompts, steps.get("pretrain_steps", 200), seed=parsed.seed)
    print(f"tiny {parsed.tool} model written to {out}")


def run_controller(args: Sequence[str]) -> None:
    from jsonargparse import ActionConfigFile, ArgumentParser

    from clova_train.controller.trainer import ControllerConfig, evaluate, fit, format_table, validate

    parser = ArgumentParser(prog="clova-train controller",
                            description="Train, evaluate and export HYDRA's DQN controller.")
    subcommands = parser.add_subcommands(dest="command")
    for name, help_text in (
        ("fit", "train (or resume from <output_dir>/checkpoints) and evaluate on held-out tasks"),
        ("evaluate", "compare a trained controller with the planner's top sample and a random one"),
        ("export", "write the SB3 zip, a TorchScript Q-network and controller.json"),
    ):
        sub = ArgumentParser(description=help_text)
        sub.add_argument("--config", action=ActionConfigFile, help="YAML config (env, dqn, train)")
        sub.add_class_arguments(ControllerConfig, fail_untyped=True, sub_configs=True)
        if name != "fit":
            sub.add_argument("--checkpoint", type=str, default="",
                             help="controller .zip (default: <train.output_dir>/controller.zip)")
        if name == "fit":
            sub.add_argument("--force", action="store_true",
                             help="start afresh: delete this output_dir's run (not its LLM call cache) first")
        if name == "evaluate":
            sub.add_argument("--episodes", type=int, default=0, help="held-out tasks (default: train.eval_episodes)")
        if name == "export":
            sub.add_argument("--output", type=str, required=True, help="export directory")
        subcommands.add_subcommand(name, sub, help=help_text)
    parsed = parser.parse_args(list(args))
    command = parsed.command
    options = parsed[command]
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.49
    config = instantiate(parsed)[command]
    run = ControllerConfig(env=config.env, dqn=config.dqn, train=config.train)
    validate(run)
    if command == "fit":
        model, results = fit(run, force=options.force)
        if model is not None and results is not None:
            print(format_table(results))
            print(f"Controller: {Path(run.train.output_dir) / 'controller.zip'}")
        return
    checkpoint = options.checkpoint or str(Path(run.train.output_dir) / "controller.zip")
    if command == "evaluate":
        from stable_baselines3 import DQN

        if not Path(checkpoint).is_file():
            raise ClovaTrainError(f"controller checkpoint {checkpoint} does not exist")
        print(format_table(evaluate(run, DQN.load(checkpoint, device="cpu"), options.episodes or None)))
    else:
        from clova_train.controller.export import export_controller

        print(f"exported to {export_controller(checkpoint, options.output, run)}")


def user_error(exc: BaseException) -> ClovaTrainError | None:
    """The clova-train error behind ``exc``, if any (jsonargparse wraps errors raised in constructors)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ClovaTrainError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args and args[0] == "export":
            run_export(args[1:])
        elif args and args[0] == "serve":
            run_serve(args[1:])
        elif args and args[0] == "controller":
            run_controller(args[1:])
        elif args and args[0] == "tiny-model":
            run_tiny_model(args[1:])
        else:
            run_lightning(None if argv is None else args)  # None: LightningCLI reads sys.argv itself
    except Exception as exc:
        err = user_error(exc)
        if err is None:
            raise
        print(f"clova-train: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``clova-train`` command: one umbrella parser, each subcommand importing only what it needs.

* ``clova-train fit|validate|test --config <yaml> [--config <yaml> ...] [--a.b=value ...]`` is LightningCLI:
  the model and data are chosen by ``class_path`` (``ClipPromptTuning``, ``ConceptFolderDataModule``, ...),
  ``--print_config`` shows the resolved config, ``--help`` documents every argument, and fits resume with
  ``--ckpt_path last``.
* ``clova-train predict EXPORT --inputs DIR|FILE.jsonl --output FILE.jsonl`` runs an exported prompt tool with
  its prompt pool over a folder of images or a JSONL of requests.
* ``clova-train export`` writes a portable serving directory from a finished run or a checkpoint.
* ``clova-train serve EXPORT [EXPORT ...]`` serves exports over HTTP (LitServe): one endpoint per prompt tool
  and an OpenAI-compatible chat endpoint for a LoRA export; ``--request``/``--stdin`` answer JSON lines instead.
* ``clova-train controller fit|evaluate|export --config <yaml>`` trains a DQN controller on a reasoning-loop
  environment (HYDRA, AVIS or HAMMR; stable-baselines3), evaluates it and exports it. Reruns of ``fit`` resume.
* ``clova-train loop --config <yaml>`` runs CLOVA's closed loop over a task file: test stage, training stage
  (reflection, data collection, a ``clova-train fit`` per tool and concept), test stage; reruns resume.
* ``clova-train tiny-model KIND DIR`` writes a tiny model of a real architecture (for quickstarts and tests on
  machines without a model hub).

Errors about user input (bad config, missing file, mismatched pool, ...) print one line naming the culprit
and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from clova_train.core.command_line import CommandParser, suggesting
from clova_train.core.atomic import disk_full, storage_error
from clova_train.core.errors import ClovaTrainError

PROG = "clova-train"
LIGHTNING_COMMANDS = {
    "fit": "train a prompt tool, a tool-using LLM (LoRA) or any LightningModule from a YAML config",
    "validate": "evaluate a model on the validation split (LightningCLI)",
    "test": "evaluate a model on the test split (LightningCLI)",
}
COMMANDS = {
    **LIGHTNING_COMMANDS,
    "predict": "run an exported prompt tool with its prompt pool over a folder of images or a JSONL of requests",
    "export": "write a portable serving directory from a finished run or a checkpoint",
    "serve": "serve exports over HTTP (prompt-tool endpoints, OpenAI-compatible chat) or answer JSON lines",
    "controller": "train, evaluate and export HYDRA's DQN controller (stable-baselines3)",
    "loop": "run CLOVA's closed loop (inference, reflection, data collection, prompt tuning) over a task file",
    "tiny-model": "write a tiny model of a real architecture (offline quickstarts and tests)",
    "report": "turn a run directory into pictures and a markdown page (learning curves, gate, metrics, controls)",
}


CONFIG_MODE = "clova_safe_yaml"


def safe_config_mode() -> str:
    """Register with jsonargparse a YAML loader that checks every config text (files and command-line values)
    with :func:`~clova_train.core.safe_files.check_yaml` first: duplicate keys, too deep nesting and alias bombs
    end in one error instead of a silent overwrite, a ``RecursionError`` or minutes of memory growth. Returns the
    ``parser_mode`` naming it."""
    from jsonargparse import get_loader, set_loader

    from clova_train.core.safe_files import CONFIG_LIMITS, check_yaml

    try:
        get_loader(CONFIG_MODE)
    except KeyError:
        import yaml

        plain = get_loader("yaml")

        def load(value: str) -> object:
            check_yaml(value, "config", CONFIG_LIMITS)
            try:
                return plain(value)
            except (ValueError, TypeError, OverflowError) as err:  # e.g. an integer of 5,000 digits
                raise ClovaTrainError(f"config value {value[:60]!r}: {err}") from None

        set_loader(CONFIG_MODE, load, exceptions=(yaml.YAMLError,))
    return CONFIG_MODE


def check_config_files(args: Sequence[str]) -> None:
    """Read every ``--config FILE`` with the safe reader first, so that a bad file is named in the error (and a FIFO
    or an oversized file is refused before jsonargparse reads it)."""
    import yaml

    from clova_train.core.safe_files import CONFIG_LIMITS, check_yaml, printable, read_text

    for index, arg in enumerate(args):
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg == "--config" and index + 1 < len(args):
            path = args[index + 1]
        else:
            continue
        if "\n" not in path and Path(path).exists():  # else an inline YAML text, or missing: jsonargparse says so
            where = f"config file {printable(path)}"
            try:  # structure only: values are constructed by jsonargparse's own loader (dates stay text there)
                check_yaml(read_text(path, "config file", CONFIG_LIMITS.max_bytes), where, CONFIG_LIMITS)
            except yaml.YAMLError as err:
                raise ClovaTrainError(f"{where} is not valid YAML: {yaml_problem(err)}") from None


def yaml_problem(err: Exception) -> str:
    """A YAML syntax error in one line: what is wrong and where (line and column from 1), with a word on tabs."""
    problem = getattr(err, "problem", None) or getattr(err, "context", None) or " ".join(str(err).split())
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    tabs = "; YAML indents with spaces, never tabs" if "'\\t'" in str(problem) else ""  # PyYAML shows the character escaped
    return f"{problem}{where}{tabs}"


def umbrella_parser() -> argparse.ArgumentParser:
    """The top-level parser: lists every subcommand (each has its own ``--help``)."""
    parser = CommandParser(
        prog=PROG,
        description="clova-train: train tool prompts (CLOVA), tool-using LLMs (GPT4Tools LoRA) and controllers "
        "(HYDRA), and export and serve them. 'clova-train COMMAND --help' documents each command.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {package_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, help_text in COMMANDS.items():
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


def package_version() -> str:
    """The installed distribution's version (``unknown`` when run from a source tree that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("clova-train")
    except PackageNotFoundError:
        return "unknown"


def run_lightning(args: Sequence[str] | None) -> None:
    import contextvars

    from lightning import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

    import clova_train.datamodules  # noqa: F401  (registers the data classes for class_path short names)
    import clova_train.models  # noqa: F401  (registers the model classes for class_path short names)

    class PromptAwareCLI(LightningCLI):
        @staticmethod
        def subcommands() -> dict[str, set[str]]:  # 'predict' is clova-train's own command (an export over inputs)
            return {k: v for k, v in LightningCLI.subcommands().items() if k in LIGHTNING_COMMANDS}

        def _guard_checkpoints(self) -> None:  # every --ckpt_path: no URL, files weights-only, sharded dirs checked
            from clova_train.export.distributed_checkpoint import guard_checkpoint_loading

            guard_checkpoint_loading(self.trainer.strategy)

        def before_fit(self) -> None:
            self._guard_checkpoints()
            from clova_train.models.progress_lines import ProgressLines

            if self.trainer.progress_bar_callback is not None and not any(
                    isinstance(c, ProgressLines) for c in self.trainer.callbacks):
                self.trainer.callbacks.append(ProgressLines())  # lines where the bar cannot draw (a log file)
            if self.trainer.is_global_zero:
                write_fit_manifest(self.trainer.default_root_dir, self.model,
                                   self._parser(self.subcommand).dump(self.config[self.subcommand]))

        before_validate = before_test = _guard_checkpoints

        def before_instantiate_classes(self) -> None:
            config = self.config[self.subcommand] if self.subcommand else self.config
            follow_root_dir(config.trainer)

    # In a context of its own: jsonargparse sets a context variable to its parser (subclass_arg_parser) and never
    # resets it, which would keep the parser, this CLI, its Trainer and a sharded strategy's DeviceMesh, and with it
    # the mesh's process groups and their gloo threads, alive until the interpreter exits (see end_distributed).
    contextvars.copy_context().run(
        PromptAwareCLI,
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        auto_configure_optimizers=False,
        save_config_kwargs={"overwrite": True},
        args=None if args is None else list(args),
        parser_class=suggesting(LightningArgumentParser),
        parser_kwargs={
            "prog": PROG,
            "parser_mode": safe_config_mode(),
            "description": "clova-train: train tool prompts, tool-using LLMs and controllers. Other commands: "
            + ", ".join(f"'{PROG} {c} --help'" for c in COMMANDS if c not in LIGHTNING_COMMANDS),
        },
    )


ROOT_DIR_PLACEHOLDER = "{default_root_dir}"


def follow_root_dir(trainer: Any) -> None:
    """A logger whose ``save_dir`` is ``{default_root_dir}`` (the shipped configs') writes under the run's
    ``trainer.default_root_dir``, whatever the command line set it to; a path given anywhere else is kept."""
    loggers = trainer.logger if isinstance(trainer.logger, list) else [trainer.logger]
    for logger in loggers:
        init_args = getattr(logger, "init_args", None)
        if init_args is not None and getattr(init_args, "save_dir", None) == ROOT_DIR_PLACEHOLDER:
            init_args.save_dir = trainer.default_root_dir or "."


def write_fit_manifest(run_dir: str, model: object, config_text: str) -> None:
    """``run.json`` of a ``fit``: the learner's kind (a module's ``run_kind``, else ``lightning``), its tool, the
    resolved config's digest."""
    from clova_train.core.run_manifest import write_run_manifest

    cls = type(model)
    write_run_manifest(run_dir, getattr(model, "run_kind", "lightning"), getattr(getattr(model, "tool", None), "name", None),
                       f"{cls.__module__}.{cls.__qualname__}", config_text)


def run_export(args: Sequence[str]) -> None:
    parser = CommandParser(
        prog=f"{PROG} export",
        description="Write a serving directory from a finished run directory or a Lightning checkpoint: "
        "for tool prompts the pool, tool description, config and versions; for a LoRA run the PEFT adapter "
        "(and with --merged the merged model) with its tokenizer, chat template, prompt template and stop "
        "strings. Model paths inside are absolute (a LoRA base may be named by hub id instead, --base-model-id); "
        "--copy-base makes the export self-contained.",
    )
    parser.add_argument("source", help="run directory (pool.safetensors or adapter/) or a .ckpt checkpoint")
    parser.add_argument("--output", "-o", required=True, help="export directory to write (replaced atomically)")
    parser.add_argument("--merged", action="store_true", help="LoRA runs: also write the merged model")
    parser.add_argument("--copy-base", action="store_true",
                        help="copy the frozen base model into the export (base/), so it loads with nothing outside it")
    parser.add_argument("--base-model-id", default=None, metavar="HUB_ID",
                        help="LoRA runs: the hub id the adapter names as its base (adapter_config.json and the model "
                        "card) when it was trained from a local copy of that model")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="LoRA runs with --merged: the merged model's dtype (merged in float32 first)")
    parsed = parser.parse_args(list(args))
    from clova_train.export import export_run
    from clova_train.export.lora import adapter_base_note

    out = export_run(parsed.source, parsed.output, parsed.merged, parsed.copy_base, parsed.base_model_id, parsed.dtype)
    print(f"exported to {out}")
    note = adapter_base_note(out)
    if note:
        print(note, file=sys.stderr)


API_KEY_ENV = "CLOVA_TRAIN_API_KEY"


def run_serve(args: Sequence[str]) -> int | None:
    from clova_train.serving.guard import RequestLimits

    parser = CommandParser(
        prog=f"{PROG} serve",
        description="Serve exports over HTTP with LitServe: POST /v1/<tool> for each prompt-tool export (the tool's "
        "JSON request; CLIP: {\"images\": [paths], \"labels\": [...]} or {\"images\": [...], \"concept\": c}), "
        "POST /v1/chat/completions (OpenAI-compatible) for a LoRA export, GET /health. With --request or --stdin, "
        "answer JSON requests with one prompt-tool export instead (one JSON reply per line), no server: a bad line is "
        "answered with an error line in its place (and named on stderr), the others still are, and the exit status is "
        "1 when any failed.",
    )
    parser.add_argument("exports", nargs="+", help="directories written by clova-train export (or finished run directories)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1)")
    parser.add_argument("--top-k", type=int, default=None, help="prompt tools: ensemble the k most similar stored prompts")
    parser.add_argument("--classify-margin", type=float, default=None, metavar="M",
                        help="CLIP exports: serve at this classify_margin (0..1) instead of the one the export carries "
                             "(the margin its calibration chose)")
    parser.add_argument("--answer-margin", type=float, default=None, metavar="M",
                        help="BLIP VQA exports: serve at this answer_margin (0..1) instead of the one the export "
                             "carries")
    parser.add_argument("--detection-margin", type=float, default=None, metavar="M",
                        help="OWL-ViT LOC exports: serve at this detection_margin (0..1) instead of the one the export "
                             "carries")
    parser.add_argument("--base-model", default=None, help="directory of the frozen base model, overriding the export's")
    parser.add_argument("--max-batch-size", type=int, default=4, help="chat: requests generated together")
    parser.add_argument("--batch-timeout", type=float, default=0.02, help="chat: seconds to wait for a batch to fill")
    parser.add_argument("--output-dir", default="served_outputs",
                        help="directory that files written by tools (REPLACE's 'output') go under: a request's "
                             "'output' must be a relative path inside it (HTTP, --request and --stdin alike)")
    parser.add_argument("--api-key-file", default=None, metavar="FILE",
                        help="HTTP: require 'Authorization: Bearer KEY' on /v1/..., KEY being this file's first line "
                             "(default: the CLOVA_TRAIN_API_KEY environment variable; no key when neither is set). "
                             "/health stays open")
    parser.add_argument("--api-key", default=None,
                        help="HTTP: the key itself; every local user can read it in the process list, so prefer "
                             "--api-key-file or CLOVA_TRAIN_API_KEY")
    parser.add_argument("--max-body-bytes", type=int, default=RequestLimits.max_body_bytes,
                        help="HTTP: largest request body, counted after gzip/deflate decompression (413 beyond)")
    parser.add_argument("--max-list-items", type=int, default=RequestLimits.max_list_items,
                        help="HTTP: longest list in one request (images, labels, messages, ...)")
    parser.add_argument("--max-image-pixels", type=int, default=RequestLimits.max_image_pixels,
                        help="largest image decoded (width x height, read from its header first)")
    parser.add_argument("--max-request-pixels", type=int, default=RequestLimits.max_request_pixels,
                        help="HTTP: most pixels of one request's images together (read from their headers first; 413 "
                             "beyond)")
    parser.add_argument("--served-model-name", default=None,
                        help="chat: the model name clients send as 'model' and /v1/models lists (default: the export "
                             "path as given)")
    add_http_resource_flags(parser)
    parser.add_argument("--request", action="append", default=[], help="a JSON request to answer and exit (repeatable)")
    parser.add_argument("--stdin", action="store_true", help="answer JSON requests read from stdin, one per line")
    parsed = parser.parse_args(list(args))
    try:
        limits = RequestLimits(max_body_bytes=parsed.max_body_bytes, max_list_items=parsed.max_list_items,
                               max_image_pixels=parsed.max_image_pixels,
                               max_request_pixels=parsed.max_request_pixels,
                               max_inflight_body_bytes=parsed.max_inflight_body_bytes)
        connections = http_connection_limits(parsed)
    except ValueError as err:
        raise ClovaTrainError(f"serve: {err}") from None
    if parsed.top_k is not None and parsed.top_k < 1:
        raise ClovaTrainError(f"--top-k must be >= 1, got {parsed.top_k}")
    margins = {"classify_margin": parsed.classify_margin, "answer_margin": parsed.answer_margin,
               "detection_margin": parsed.detection_margin}
    for name, value in margins.items():
        if value is not None and not 0.0 <= value <= 1.0:
            raise ClovaTrainError(f"--{name.replace('_', '-')} must be within 0 and 1, got {value}")
    if parsed.max_batch_size < 1 or parsed.batch_timeout < 0:
        raise ClovaTrainError("--max-batch-size must be >= 1 and --batch-timeout >= 0")
    if parsed.request or parsed.stdin:
        if len(parsed.exports) != 1:
            raise ClovaTrainError("--request/--stdin answer with one prompt-tool export; give exactly one")
        _refuse_a_chat_export(Path(parsed.exports[0]))
        from PIL import Image

        Image.MAX_IMAGE_PIXELS = limits.max_image_pixels
        lines = enumerate(parsed.request, 1) if parsed.request else None  # None: stdin's lines
        return answer_json_lines(parsed.exports[0], lines, parsed.top_k, parsed.device, parsed.base_model,
                                 Path(parsed.output_dir), margins)
    from clova_train.serving.http import serve_http

    api_key = served_api_key(parsed.api_key, parsed.api_key_file)
    serve_http(parsed.exports, parsed.host, parsed.port, parsed.device, parsed.top_k, parsed.base_model,
               parsed.max_batch_size, parsed.batch_timeout, output_dir=parsed.output_dir, api_key=api_key,
               limits=limits, served_model_name=parsed.served_model_name, image_root=parsed.image_root,
               connections=connections, margins=margins)


def add_http_resource_flags(parser: argparse.ArgumentParser) -> None:
    """``serve``'s HTTP flags for the server files clients may name and the resources one client may hold."""
    from clova_train.serving.connections import ConnectionLimits
    from clova_train.serving.guard import RequestLimits

    parser.add_argument("--image-root", default=None, metavar="DIR",
                        help="HTTP: clients may name image files under DIR (symlinks resolved; relative names are "
                             "taken from DIR); default: none, clients send images as data: URLs or uploads and no "
                             "server file is read for them")
    parser.add_argument("--max-connections", type=int, default=ConnectionLimits.max_connections,
                        help="HTTP: most client connections held at once (kept below the open-file limit); beyond it "
                             "the connection that waited longest for its request is closed")
    parser.add_argument("--header-timeout", type=float, default=ConnectionLimits.header_timeout_s, metavar="SECONDS",
                        help="HTTP: seconds a request's headers may take to arrive (the connection is closed after)")
    parser.add_argument("--body-timeout", type=float, default=ConnectionLimits.body_timeout_s, metavar="SECONDS",
                        help="HTTP: seconds a request's body may take to arrive after its headers")
    parser.add_argument("--max-inflight-body-bytes", type=int, default=RequestLimits.max_inflight_body_bytes,
                        help="HTTP: most bytes of request bodies held at once over all requests (503 beyond)")


def http_connection_limits(parsed: argparse.Namespace) -> "ConnectionLimits":
    """The :class:`ConnectionLimits` of ``serve``'s flags (a ``ValueError`` naming a bad one)."""
    from clova_train.serving.connections import ConnectionLimits

    return ConnectionLimits(parsed.max_connections, parsed.header_timeout, parsed.body_timeout)


def served_api_key(given: str | None, key_file: str | None) -> str | None:
    """The server's API key: ``--api-key``, else the first line of ``--api-key-file``, else ``CLOVA_TRAIN_API_KEY``;
    None when none is set. A key file that is missing, unreadable, empty or not one line of text is an error."""
    if given is not None and key_file is not None:
        raise ClovaTrainError("give --api-key or --api-key-file, not both")
    if key_file is not None:
        from clova_train.core.safe_files import read_text

        lines = read_text(key_file, "API key file", max_bytes=4096).splitlines()
        key = lines[0].strip() if lines else ""
        if not key or any(line.strip() for line in lines[1:]) or not key.isprintable():
            raise ClovaTrainError(f"API key file {key_file}: expected one line holding the key")
        return key
    return given if given is not None else os.environ.get(API_KEY_ENV) or None


def _refuse_a_chat_export(export: Path) -> None:
    """``--request``/``--stdin`` answer prompt-tool requests; a LoRA export is named as such (its missing
    ``tool.json`` would say less)."""
    from clova_train.core.errors import DataError
    from clova_train.core.run_manifest import read_run_manifest

    try:
        kind = read_run_manifest(export).kind if export.is_dir() else None
    except DataError:
        return  # not a run or export at all: the prompt-tool loader names what is missing
    if kind == "lora":
        raise ClovaTrainError(f"--request/--stdin answer prompt-tool requests, and {export} is a LoRA (chat) export: "
                              "serve it without them (POST /v1/chat/completions, OpenAI-compatible)")


def answer_json_lines(export: str, lines: Iterable[tuple[int, Any]] | None, top_k: int | None, device: str,
                      base_model: str | None, output_dir: Path, margins: dict[str, float | None] | None = None) -> int:
    """Answer numbered JSON request lines (``None``: stdin's, read as bytes one line at a time) with one prompt-tool
    export (``margins``: served margins overriding the export's): one JSON line on stdout per request, the reply or an
    error in its place (also named on stderr); returns the exit status, 1 when any request failed
    (:mod:`clova_train.serving.predict`)."""
    import json

    from clova_train.serving.predict import answer_lines, error_line, numbered_lines
    from clova_train.tools.prompt_server import PromptToolServer

    server = PromptToolServer.from_export(export, top_k=top_k, device=device, base_model=base_model,
                                          **{k: v for k, v in (margins or {}).items() if v is not None})
    if lines is None:  # bytes, one line at a time (a text stdin, as an embedding program may set, is read as text)
        stdin = getattr(sys.stdin, "buffer", None)
        lines = numbered_lines(stdin, "request line") if stdin is not None else enumerate(sys.stdin, 1)
        label = "request line"
    else:
        label = "--request"
    answered, failed = 0, []
    for answer in answer_lines(server.serve, lines, output_dir, label):
        if answer.error is None:
            answered += 1
            print(json.dumps(answer.reply), flush=True)
        else:
            failed.append(answer.number)
            print(json.dumps(error_line(answer)), flush=True)
            print(f"{PROG}: error: {label} {answer.number}: {_printable(answer.error)}", file=sys.stderr,
                  flush=True)
    if not failed:
        return 0
    shown = ", ".join(map(str, failed[:20])) + (", ..." if len(failed) > 20 else "")
    print(f"{PROG}: error: {len(failed)} of {answered + len(failed)} requests failed ({label} {shown}); the others "
          "were answered", file=sys.stderr)
    return 1


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def run_predict(args: Sequence[str]) -> int:
    parser = CommandParser(
        prog=f"{PROG} predict",
        description="Run an exported prompt tool with its prompt pool over inputs and write one JSON line per input "
        "({\"input\": ..., \"output\": ...} or {\"input\": ..., \"error\": ...}). Inputs: a folder of images (each "
        "becomes the tool's image field, with the --field values added) or a JSONL file of the tool's requests "
        "(relative image paths are relative to the file).",
    )
    parser.add_argument("export", help="directory written by clova-train export")
    parser.add_argument("--inputs", required=True, help="a folder of images or a .jsonl file of requests")
    parser.add_argument("--output", "-o", required=True, help="JSONL file to write (replaced atomically)")
    parser.add_argument("--field", action="append", default=[], metavar="NAME=VALUE",
                        help="request field for folder inputs, JSON or plain text (labels='[\"red\",\"blue\"]', "
                        "question='what colour is it?', concept=dog); repeatable")
    parser.add_argument("--top-k", type=int, default=None, help="ensemble the k most similar stored prompts")
    parser.add_argument("--device", default="cpu", help="torch device")
    parser.add_argument("--base-model", default=None, help="directory of the frozen base model, overriding the export's")
    parser.add_argument("--output-dir", default=None,
                        help="directory that files written by the tool (REPLACE's 'output') go under: a request's "
                             "'output' must be a relative path inside it (default: the folder of --output)")
    parsed = parser.parse_args(list(args))
    from clova_train.serving.predict import predict_to_file

    written, failed = predict_to_file(parsed.export, parsed.inputs, parsed.output, parsed.field, parsed.top_k,
                                      parsed.device, parsed.base_model, parsed.output_dir)
    print(f"{written - len(failed)} predictions written to {parsed.output}")
    if not failed:
        return 0
    for failure in failed[:10]:
        print(f"{PROG}: error: {_printable(failure)}", file=sys.stderr)
    if len(failed) > 10:
        print(f"{PROG}: error: ... and {len(failed) - 10} more", file=sys.stderr)
    hint = " (folder inputs take the rest of the request from --field NAME=VALUE)" if Path(parsed.inputs).is_dir() else ""
    every = "every input" if len(failed) == written else f"{len(failed)} of {written} inputs"
    print(f"{PROG}: error: {every} failed, each with its 'error' line in {parsed.output}; the first: "
          f"{_printable(failed[0])}{hint}", file=sys.stderr)
    return 1


def run_tiny_model(args: Sequence[str]) -> None:
    from clova_train.quickstart.tiny_models import tiny_model, tiny_models

    models = tiny_models()

    parser = CommandParser(
        prog=f"{PROG} tiny-model",
        description="Write a tiny model of a real architecture, pretrained briefly on synthetic data and loadable by the "
                    "normal loading code. Kinds: " + "; ".join(f"{m.kind}: {m.summary}" for m in models.values()),
    )
    parser.add_argument("tool", choices=list(models), help="which model (the tool recipes' tiny models and the Llama)")
    parser.add_argument("output", help="directory to write")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation and pretraining seed")
    parser.add_argument("--pretrain-steps", type=int, default=None,
                        help="pretraining steps (default: each model's own, enough for its quickstart); 0 keeps random weights")
    parsed = parser.parse_args(list(args))
    print(f"building a tiny {parsed.tool} model in {parsed.output} (pretraining on CPU can take minutes)", flush=True)
    out = tiny_model(parsed.tool).build(parsed.output, seed=parsed.seed, pretrain_steps=parsed.pretrain_steps)
    print(f"tiny {parsed.tool} model written to {out}")


def run_loop(args: Sequence[str]) -> None:
    from dataclasses import fields

    from jsonargparse import ActionConfigFile
    from jsonargparse import ArgumentParser as JsonArgumentParser

    from clova_train.closedloop.runner import LoopConfig, format_results, run

    ArgumentParser = suggesting(JsonArgumentParser)
    parser = ArgumentParser(prog=f"{PROG} loop", parser_mode=safe_config_mode(), description="CLOVA's closed loop: the test stage, the training stage "
                            "(inference, reflection, data collection, prompt tuning per tool and concept) and the test "
                            "stage again. Rerunning the same command resumes the run directory.")
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config")
    parser.add_class_arguments(LoopConfig, fail_untyped=True, sub_configs=True)
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.49
    parsed = instantiate(parser.parse_args(list(args)))
    config = LoopConfig(**{f.name: parsed[f.name] for f in fields(LoopConfig)})
    print(format_results(run(config)))


def run_controller(args: Sequence[str]) -> None:
    from dataclasses import fields

    from jsonargparse import ActionConfigFile
    from jsonargparse import ArgumentParser as JsonArgumentParser

    from clova_train.controller.trainer import ControllerConfig, evaluate, fit, format_table, validate

    ArgumentParser = suggesting(JsonArgumentParser)
    parser = ArgumentParser(prog=f"{PROG} controller", parser_mode=safe_config_mode(),
                            description="Train, evaluate and export a DQN controller on the reasoning-loop environments: "
                                        "HYDRA (environment: hydra), AVIS (avis) or HAMMR (hammr).")
    subcommands = parser.add_subcommands(dest="command")
    for name, help_text in (
        ("fit", "train (or resume from <output_dir>/checkpoints) and evaluate on held-out tasks"),
        ("evaluate", "compare a trained controller with every rule without training and the controls fitted on logs"),
        ("export", "write the SB3 zip, a TorchScript Q-network, controller.json, a standalone observation.py and a README"),
    ):
        sub = ArgumentParser(description=help_text, parser_mode=safe_config_mode())
        sub.add_argument("--config", action=ActionConfigFile, help="YAML config (environment; hydra, avis or hammr; dqn; train)")
        sub.add_class_arguments(ControllerConfig, fail_untyped=True, sub_configs=True)
        if name != "fit":
            sub.add_argument("--checkpoint", type=str, default="",
                             help="controller .zip (default: <train.output_dir>/controller.zip)")
        if name == "fit":
            sub.add_argument("--force", action="store_true",
                             help="start afresh: delete this output_dir's run (not its LLM call cache) first")
        if name == "evaluate":
            sub.add_argument("--episodes", type=int, default=0, help="tasks played (default: train.eval_episodes)")
            sub.add_argument("--split", type=Literal["test", "val", "train"], default="test",
                             help="which tasks: test (default; what a run reports), val (what it chose on) or train")
        if name == "export":
            sub.add_argument("--output", type=str, required=True, help="export directory")
        subcommands.add_subcommand(name, sub, help=help_text)
    parsed = parser.parse_args(list(args))
    command = parsed.command
    options = parsed[command]
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.49
    config = instantiate(parsed)[command]
    run = ControllerConfig(**{f.name: config[f.name] for f in fields(ControllerConfig)})
    validate(run)
    if command == "fit":
        model, results = fit(run, force=options.force)
        if model is not None and results is not None:
            print(format_table(results))
            print(f"Controller: {Path(run.train.output_dir) / 'controller.zip'}")
        return
    checkpoint = options.checkpoint or str(Path(run.train.output_dir) / "controller.zip")
    if command == "evaluate":
        from clova_train.controller.trainer import load_controller

        if not Path(checkpoint).is_file():
            raise ClovaTrainError(f"controller checkpoint {checkpoint} does not exist")
        print(format_table(evaluate(run, load_controller(checkpoint, run), options.episodes or None, options.split)))
    else:
        from clova_train.export.controller import export_controller

        print(f"exported to {export_controller(checkpoint, options.output, run)}")


def run_report(args: Sequence[str]) -> None:
    parser = CommandParser(
        prog=f"{PROG} report",
        description="Turn a run directory into pictures (matplotlib) and a markdown page, report.md: for a prompt-tuning "
        "run each instance's learning curve, the validation gate per concept and the evaluation per concept with its "
        "controls; for a LoRA run the training loss and the success rates per group; for a controller run the reward "
        "and evaluation curves and the trained controller beside every control.",
    )
    parser.add_argument("run", help="run directory (a prompt-tuning, LoRA or controller run's output directory)")
    parser.add_argument("--output", "-o", default=None,
                        help="directory to write (replaced atomically; default: <run>/report)")
    parsed = parser.parse_args(list(args))
    from clova_train.report import write_report

    print(f"report: {write_report(parsed.run, parsed.output)}")


def user_error(exc: BaseException) -> ClovaTrainError | None:
    """The clova-train error behind ``exc``, if any (jsonargparse wraps errors raised in constructors)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ClovaTrainError):
            return current
        if type(current).__name__ == "MisconfigurationException":  # Lightning's: bad trainer options
            return ClovaTrainError(f"trainer configuration: {current}")
        if disk_full(current):  # a write outside the atomic helpers (they name their target themselves)
            return storage_error(Path(current.filename or "a file"), current, intact=False)
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def user_error_message(exc: BaseException) -> str | None:
    """The one line :func:`main` prints for ``exc``, or None when ``exc`` is no user error."""
    err = user_error(exc)
    # file names need not be UTF-8
    return None if err is None else str(err).encode("utf-8", "backslashreplace").decode("utf-8")


SUBCOMMANDS = {
    "predict": run_predict, "export": run_export, "serve": run_serve,
    "controller": run_controller, "tiny-model": run_tiny_model, "loop": run_loop, "report": run_report,
}


def distributed_initialized() -> bool:
    """Whether a torch.distributed default process group exists (torch is not imported to find out)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def end_distributed() -> None:
    """Destroy the torch.distributed process groups a command started, while the interpreter is still whole.

    A fit on several processes (DDP or ModelParallelStrategy, gloo on CPU) leaves its process groups alive: Lightning
    destroys them at exit for NCCL only. A gloo worker thread that drops the last C++ reference to a collective's
    tensors takes the GIL to release their Python objects; doing that once Python has begun finalising ends the thread
    with ``pthread_exit``, whose unwinding through the work's (noexcept) destructor calls ``std::terminate``: the
    process dies by SIGABRT ("terminate called without an active exception") after printing its message, typically
    when the other rank exits at that moment. Here ``destroy_process_group`` forgets the groups, and the collection
    frees the ones a sharded strategy's DeviceMesh still holds, which joins their threads. That needs the Trainer
    unreachable by then: :func:`run_lightning` runs the CLI in a context of its own, and :func:`main` keeps an error's
    message, not the error (whose traceback reaches the model and its mesh)."""
    import gc

    import torch.distributed as dist

    try:
        dist.destroy_process_group()
    except Exception as err:  # the command's own outcome and message stand; the exit is merely less clean
        print(f"{PROG}: warning: could not shut torch.distributed down: {type(err).__name__}: {err}", file=sys.stderr)
    gc.collect()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[0] if args else None
    distributed_before = distributed_initialized()  # a caller's own process group is the caller's to end
    try:
        if command in SUBCOMMANDS or command in LIGHTNING_COMMANDS:
            check_config_files(args[1:])
        if command in SUBCOMMANDS:
            return SUBCOMMANDS[command](args[1:]) or 0  # a subcommand returns its exit code, or None for success
        elif command in LIGHTNING_COMMANDS:
            run_lightning(None if argv is None else args)  # None: LightningCLI reads sys.argv itself
        elif command is None or command in ("-h", "--help"):
            umbrella_parser().print_help()
            return 0 if command else 2
        elif command == "--version":
            umbrella_parser().parse_args(["--version"])
        else:
            umbrella_parser().error(f"unknown command {command!r} (choose from {', '.join(COMMANDS)})")
    except Exception as exc:
        message = user_error_message(exc)  # only the text stays here: the error's traceback holds the run's objects
        if message is None:
            raise
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2
    finally:
        if not distributed_before and distributed_initialized():  # after the message: it comes first, whatever
            end_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())

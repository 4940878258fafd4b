"""The prompt-tool base class: everything tool-specific about per-instance prompt tuning, in one class.

A tool is ``T_{theta,P}(x) = theta([x, P])``: a frozen network theta and a learned prompt P. A concrete tool
(one file in ``clova_train/tools/``) subclasses :class:`PromptTool` and says:

* how the frozen network is built from its arguments, and its identity (architecture + weights);
* the prompt shape, the retrieval-feature size, the paper's learning rate and step count;
* ``prepare``: the prompt-independent work for a chunk of instances, done once (no gradients);
* ``instance_losses``: one loss per instance, entry i depending on prompt row i only;
* ``gate`` (and optionally a cheaper ``quick_gate`` used while early stopping): the validation gate;
* ``pool_features``: the unprompted features the pool retrieves by;
* ``unmodified_outputs`` / ``prompted_outputs``: the tool's outputs through its library's own forward and
  through the prompted path (``check_tool`` asserts they agree with no prompt);
* serving: the operations a server offers (``served_operations``, methods taking a :class:`PromptLookup`
  first) and ``serve_request`` for JSON requests;
* optionally, ``checkpoint_blocks``: the repeated blocks ``instance_losses`` runs the prompt through, which the
  engine's ``activation_checkpointing`` recomputes in the backward pass, and ``keep_float32``: what stays float32
  when the engine stores the network in the training precision's dtype (``store_weights_in``).

The engine (``clova_train.models.PromptTuning``), the pool, export, serving and the CLI only use this
interface. ``describe()`` / ``from_description()`` make a tool rebuildable from JSON (``tool.json``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from clova_train.core.errors import ModelError
from clova_train.core.pool import PoolSpec
from clova_train.tools.contracts import GateResult, TrainingInstance
from clova_train.tools.pretrained import absolute_model_name


class PromptLookup(Protocol):
    """Where a serving tool gets its ensembled prompts (a :class:`~clova_train.tools.prompt_server.PromptToolServer`)."""

    def prompts_for(self, concept: str | None, features: torch.Tensor) -> torch.Tensor | None:
        """``[q, *prompt_shape]`` ensembled prompts for queries with ``features`` ``[q, d]``, or ``None``."""
        ...

    def candidates(self, concept: str | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every stored ``(features [n, d], prompts [n, *prompt_shape])`` of ``concept``, or ``None``
        (for tools that choose among the candidates themselves, like LOC)."""
        ...


class NoPrompt:
    """The lookup that never gives a prompt: serving through it is the unmodified tool."""

    def prompts_for(self, concept: str | None, features: torch.Tensor) -> None:
        return None

    def candidates(self, concept: str | None) -> None:
        return None


class PromptTool(nn.Module, ABC):
    """A frozen visual tool that takes learned prompts. Subclass it once per tool (see module docstring).

    Class attributes a subclass sets:
        name: short tool name written into pools and ``tool.json`` (``"clip"``, ``"blip_vqa"``).
        has_concepts: ``False`` for tools whose pool is one set of prompts for everything (VQA).
        default_lr / default_steps: the paper's Adam learning rate and steps per instance.
        default_top_k: ensemble only the k most similar stored prompts when serving (``None``: all); a
            tool may make it an argument by overriding ``serving_top_k``.
        evaluation_metrics: names of the per-sample values ``evaluate`` returns (validate / test).
        served_operations: names of serving methods ``method(lookup, ...)`` a server exposes.
        request_image_field: the JSON request field holding the input image (``"images"``: a list of paths).
        request_path_fields: request fields holding file paths (``predict`` resolves them against a JSONL's folder).
        serving_rule: how serving turns the pool into a query's prompt, when it is not the pool's cosine-weighted
            ensemble over the ``serving_top_k`` most similar stored prompts (the export's README says it).
        keep_float32: names of parameters, buffers or submodules (their whole subtree) that
            :meth:`store_weights_in` leaves in float32 (say, preprocessing constants applied before the network).
    """

    name: ClassVar[str]
    has_concepts: ClassVar[bool] = True
    default_lr: ClassVar[float]
    default_steps: ClassVar[int]
    default_top_k: ClassVar[int | None] = None
    serving_rule: ClassVar[str | None] = None
    evaluation_metrics: ClassVar[tuple[str, ...]] = ()
    served_operations: ClassVar[tuple[str, ...]] = ()
    request_image_field: ClassVar[str] = "image"
    request_path_fields: ClassVar[tuple[str, ...]] = ("image", "images", "mask", "output")
    keep_float32: ClassVar[tuple[str, ...]] = ()

    identity: str

    # ------------------------------------------------------------------ description
    @property
    @abstractmethod
    def prompt_shape(self) -> tuple[int, ...]:
        """Shape of one instance's prompt."""

    @property
    @abstractmethod
    def feature_dim(self) -> int:
        """Size of the retrieval feature of an instance or a query."""

    @abstractmethod
    def init_args(self) -> dict[str, Any]:
        """JSON-serialisable constructor arguments that rebuild this tool."""

    def init_scale(self) -> float:
        """Prompts start uniform in ``(-s, s)`` with this ``s`` (added to :meth:`initial_prompts` when given)."""
        return 1.0

    def initial_prompts(self, instances: Sequence[TrainingInstance]) -> torch.Tensor | None:
        """``[n, *prompt_shape]`` values prompts start from before the seeded noise is added, or ``None`` (zero).

        Textual inversion starts a token from a word's embedding; most tools start from zero.
        """
        return None

    @property
    def serving_top_k(self) -> int | None:
        """How many of the most similar stored prompts a query ensembles (``None``: all of its concept's)."""
        return self.default_top_k

    def describe(self) -> dict[str, Any]:
        """JSON description (``tool.json``): how to rebuild the tool, its identity and its shapes."""
        cls = type(self)
        init_args = self.init_args()
        if isinstance(init_args.get("model_name"), str):
            init_args["model_name"] = absolute_model_name(init_args["model_name"])
        return {
            "tool": cls.name,
            "class_path": f"{cls.__module__}.{cls.__qualname__}",
            "init_args": init_args,
            "identity": self.identity,
            "prompt_shape": list(self.prompt_shape),
            "feature_dim": int(self.feature_dim),
            "has_concepts": cls.has_concepts,
        }

    def pool_spec(self) -> PoolSpec:
        return PoolSpec.from_tool_description(self.describe())

    @classmethod
    def from_description(cls, description: dict[str, Any]) -> PromptTool:
        """Rebuild a tool from :meth:`describe` output and check it is the network the prompts were made for."""
        tool_cls = tool_class(description)
        if not issubclass(tool_cls, cls):
            raise ModelError(f"tool.json describes {tool_cls.__name__}, which is not a {cls.__name__}")
        tool = tool_cls(**described_init_args(tool_cls, description))
        expected = description.get("identity")
        if expected and expected != tool.identity:
            raise ModelError(
                f"the {tool_cls.name} weights loaded from {description.get('init_args')} have identity "
                f"{tool.identity}, but the prompts were trained on {expected}"
            )
        return tool

    # ------------------------------------------------------------------ training
    def check_instance(self, instance: TrainingInstance) -> None:
        """Raise :class:`~clova_train.core.errors.DataError` naming the instance if it cannot be trained on.

        The engine calls it for every instance before training starts (tools that can say more than the
        datamodule, such as answer lengths in tokens, override it).
        """

    @abstractmethod
    def prepare(self, instances: Sequence[TrainingInstance]) -> Any:
        """Prompt-independent work for a chunk (run once per chunk, without gradients)."""

    @abstractmethod
    def instance_losses(self, context: Any, prompts: torch.Tensor) -> torch.Tensor:
        """``[n]`` losses; entry i may depend only on ``prompts[i]`` (sums, never means over instances)."""

    @abstractmethod
    def gate(self, context: Any, prompts: torch.Tensor) -> list[GateResult]:
        """Validate each instance with its own prompt on its held-out data."""

    def quick_gate(self, context: Any, prompts: torch.Tensor) -> list[GateResult]:
        """The gate as checked while early stopping; override with a cheaper test that gives the same verdict."""
        return self.gate(context, prompts)

    @abstractmethod
    def pool_features(self, context: Any) -> torch.Tensor:
        """``[n, feature_dim]`` retrieval features of the instances, computed without prompts."""

    # ------------------------------------------------------------------ checked by check_tool
    @abstractmethod
    def unmodified_outputs(self, context: Any) -> torch.Tensor:
        """The instances' outputs through the frozen network's own library forward (no prompt machinery)."""

    @abstractmethod
    def prompted_outputs(self, context: Any, prompts: torch.Tensor | None) -> torch.Tensor:
        """The same outputs through the prompted path serving uses; ``None`` means no prompt."""

    # ------------------------------------------------------------------ validate / test and serving
    def evaluate(self, lookup: PromptLookup, batch: Any) -> dict[str, torch.Tensor]:
        """Per-sample values of ``evaluation_metrics`` for an evaluation batch (the datamodule's format)."""
        raise NotImplementedError(f"{type(self).__name__} defines no evaluation")

    def evaluation_samples(self, batch: Any) -> list[tuple[str, str]] | None:
        """``(sample key, concept)`` of each sample of an evaluation batch, for per-concept reports; ``None``
        when the batch does not say (the key identifies a sample across ranks: a file path, a record id)."""
        return None

    def serve_request(self, lookup: PromptLookup, request: dict[str, Any]) -> dict[str, Any]:
        """Answer one JSON request (file paths for images) with the prompt ensemble."""
        raise NotImplementedError(f"{type(self).__name__} does not serve JSON requests")

    # ------------------------------------------------------------------ export
    @classmethod
    def write_export_files(cls, pool: Any, description: dict[str, Any], directory: Any) -> None:
        """Write tool-specific serving formats into an export ``directory`` (``clova-train export`` calls it
        with the pool and ``tool.json``, without loading the network). Default: nothing beyond the pool."""

    # ------------------------------------------------------------------ frozen network
    def freeze(self, network: nn.Module) -> nn.Module:
        """Eval mode and no gradients for a frozen part (called by subclasses on what they load)."""
        return network.eval().requires_grad_(False)

    def train(self, mode: bool = True) -> PromptTool:
        # The frozen network stays in eval mode (dropout off) whatever Lightning asks.
        return super().train(False)

    def store_weights_in(self, dtype: torch.dtype) -> PromptTool:
        """Store the frozen network's floating parameters and buffers in ``dtype`` (those named in
        :attr:`keep_float32` stay float32), in place: the engine calls it once with the training precision's dtype,
        so that autocast finds the weights already in its dtype instead of casting them at every step.

        Prompts never live here: they stay float32 with their optimizer, and the tool casts them to its activations'
        dtype where they enter the network. Under autocast, a tool computes what decides a loss or a gate (logits
        against stored features, matching, thresholds) in float32, inside :meth:`full_precision`.
        """

        def kept(name: str) -> bool:
            return any(name == k or name.startswith(k + ".") for k in self.keep_float32)

        with torch.no_grad():
            for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
                target = torch.float32 if kept(name) else dtype
                if tensor.is_floating_point() and tensor.dtype != target:
                    tensor.data = tensor.data.to(target)  # in place: modules that share the tensor see the change
        return self

    def full_precision(self) -> contextlib.AbstractContextManager:
        """Autocast off on the tool's device: for the float32 parts of a loss or a decision computed from
        low-precision activations (the caller casts its inputs with ``.float()``); a no-op without autocast."""
        return torch.autocast(self.device.type, enabled=False)

    # ------------------------------------------------------------------ activation checkpointing
    def checkpoint_blocks(self) -> list[nn.Module]:
        """The repeated blocks of the frozen network that :meth:`instance_losses` runs the prompt through, whose
        activations :meth:`set_activation_checkpointing` recomputes in the backward pass instead of keeping them.
        None by default (a tool that declares none trains as it is)."""
        return []

    def set_activation_checkpointing(self, enabled: bool) -> int:
        """Switch activation checkpointing through :meth:`checkpoint_blocks` on or off; returns how many blocks.

        While on, a block called with gradients enabled runs under ``torch.utils.checkpoint`` (non-reentrant): only
        its inputs are kept for the backward pass, which runs the block again. Without gradients (gates, serving) it
        runs its own forward. The hooks of the transformers and diffusers models (``gradient_checkpointing_enable``)
        act only in training mode, and a frozen tool stays in eval mode, so the blocks' ``forward`` is wrapped here.
        """
        blocks = self.checkpoint_blocks()
        for block in blocks:
            wrapped = isinstance(vars(block).get("forward"), CheckpointedForward)
            if enabled and not wrapped:
                block.forward = CheckpointedForward(block)
            elif not enabled and wrapped:
                del block.forward
        return len(blocks)

    @property
    def device(self) -> torch.device:
        for tensor in (*self.parameters(), *self.buffers()):
            return tensor.device
        return torch.device("cpu")


class CheckpointedForward:
    """A block's own ``forward`` that, with gradients enabled, runs under non-reentrant ``torch.utils.checkpoint``
    (see :meth:`PromptTool.set_activation_checkpointing`). A plain object holding the block, so that a tool that
    uses it still deep-copies and pickles."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = functools.partial(type(self.block).forward, self.block)
        if torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)


# The tools this package ships are the PromptTool subclasses of modules inside this package (each tool folder's
# ``tool`` module, imported only when a description names one of its classes); nothing outside it is imported by name.
TOOLS_PACKAGE = __name__.rpartition(".")[0]
ENTRY_POINT_GROUP = "clova_train.prompt_tools"


def class_path_of(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def registered_tool(class_path: str) -> type[PromptTool] | None:
    """The prompt tool registered under ``class_path``, or ``None``: a tool this package ships, a subclass of
    :class:`PromptTool` already imported by the program (a user's own tool, imported by its config), or one an
    installed package declares under the ``clova_train.prompt_tools`` entry point group or names in a tool recipe
    (``clova_train.tool_recipes``, :mod:`clova_train.tools.recipes`). Nothing else is imported: a file that names a module never gets it run."""
    shipped = _shipped_module(class_path)
    if shipped is not None:
        importlib.import_module(shipped)
    known = {class_path_of(cls): cls for cls in _subclasses(PromptTool)}
    if class_path in known:
        return known[class_path]
    from importlib.metadata import entry_points

    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.value.replace(":", ".") == class_path:
            return entry.load()
    from clova_train.tools.recipes import recipe_for_tool_class

    recipe = recipe_for_tool_class(class_path)  # a tool whose installed package declares its recipe
    return recipe.tool_class() if recipe is not None else None


def _shipped_module(class_path: str) -> str | None:
    """The module of ``class_path`` when it is one of this package's tool modules (``clova_train.tools.<name>.tool``,
    or any module inside this package)."""
    module = class_path.rpartition(".")[0]
    if not module.startswith(TOOLS_PACKAGE + ".") or not all(part.isidentifier() for part in module.split(".")):
        return None
    try:
        return module if importlib.util.find_spec(module) is not None else None
    except ModuleNotFoundError:  # a parent that is not a package
        return None


def _subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


def described_init_args(tool_cls: type[PromptTool], description: dict[str, Any]) -> dict[str, Any]:
    """The ``init_args`` of a ``tool.json``, checked against what ``tool_cls`` takes (a :class:`ModelError` naming
    a key it does not take, or one it needs and the file lacks)."""
    init_args = description.get("init_args", {})
    if not isinstance(init_args, dict):
        raise ModelError(f"tool.json's init_args must be an object, got {type(init_args).__name__}")
    parameters = inspect.signature(tool_cls).parameters
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return init_args
    unknown = sorted(set(init_args) - set(parameters))
    if unknown:
        raise ModelError(f"tool.json's init_args has the key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown))}, which {tool_cls.__name__} does not take (it takes "
                         f"{', '.join(parameters)})")
    missing = [name for name, p in parameters.items()
               if p.default is p.empty and p.kind is not p.VAR_POSITIONAL and name not in init_args]
    if missing:
        raise ModelError(f"tool.json's init_args lacks {', '.join(map(repr, missing))}, which {tool_cls.__name__} "
                         "needs")
    return init_args


def tool_class(description: dict[str, Any]) -> type[PromptTool]:
    """The :class:`PromptTool` subclass a ``tool.json`` names by ``class_path`` (a registered one only: see
    :func:`registered_tool`)."""
    class_path = description.get("class_path")
    if not isinstance(class_path, str) or "." not in class_path:
        raise ModelError(f"tool description has no class_path (keys: {sorted(description)})")
    tool_cls = registered_tool(class_path)
    if tool_cls is None:
        raise ModelError(
            f"tool class {class_path!r} is not a registered prompt tool (this package's live in {TOOLS_PACKAGE}); "
            f"a tool of your own is found once your program has imported it, or when its package declares it under "
            f"the {ENTRY_POINT_GROUP!r} entry point group (a file never gets a module imported)"
        )
    if not (isinstance(tool_cls, type) and issubclass(tool_cls, PromptTool)):
        raise ModelError(f"{class_path!r} is not a PromptTool subclass")
    return tool_cls

"""``check_tool``: does a prompt tool keep the contract the engine relies on? (Like SB3's ``check_env``.)

Run it on a tiny instance of your tool and a few training instances before training with it::

    from clova_train.tools.check import check_tool
    report = check_tool(MyTool(...), instances)   # raises ToolCheckError naming the broken rule

What it checks:

1. shapes: ``prompt_shape`` and ``feature_dim`` are positive, ``pool_features`` is ``[n, feature_dim]``
   and finite, ``instance_losses`` is ``[n]`` and finite, ``gate`` gives one result per instance;
2. independence: loss row i depends only on prompt row i (the gradient of loss i is zero on every other
   row and not zero on row i), and an instance's loss is the same in a chunk as alone;
3. the frozen network gets no gradients (its parameters have ``requires_grad=False``);
4. no prompt is the unmodified tool: ``prompted_outputs(ctx, None)`` equals ``unmodified_outputs(ctx)``
   (the library's own forward), and a served query with an empty pool uses no prompt;
5. ``describe()`` is JSON and ``from_description(describe())`` rebuilds a tool with the same identity,
   losses and features.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from clova_train.core.errors import ClovaTrainError
from clova_train.core.pool import PromptPool
from clova_train.tools.base import PromptTool
from clova_train.tools.contracts import GateResult, TrainingInstance
from clova_train.tools.prompt_server import PromptToolServer


class ToolCheckError(ClovaTrainError):
    """A prompt tool breaks a rule of the prompt-tool contract."""


def _fail(tool: PromptTool, rule: str) -> None:
    raise ToolCheckError(f"{type(tool).__name__} fails check_tool: {rule}")


def _random_prompts(tool: PromptTool, n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    scale = tool.init_scale()
    prompts = (torch.rand(n, *tool.prompt_shape, generator=generator) * 2 - 1) * scale
    return prompts.to(tool.device)


def check_tool(
    tool: PromptTool, instances: Sequence[TrainingInstance], atol: float = 1e-5, rebuild: bool = True
) -> dict[str, Any]:
    """Check ``tool`` against the prompt-tool contract on ``instances`` (2 or more; a few suffice).

    Args:
        tool: the tool, as built for training (frozen network loaded).
        instances: training instances of the tool's own type.
        atol: tolerance of the numerical comparisons (float32 on CPU needs about 1e-5).
        rebuild: also rebuild the tool from its description (loads the network a second time).

    Returns:
        a report of what was checked (shapes, the largest cross-row gradient, ...).

    Raises:
        ToolCheckError: naming the first rule the tool breaks.
    """
    if len(instances) < 2:
        raise ValueError("check_tool needs at least 2 instances (it checks that they do not interact)")
    instances = [item for item in instances if not item.keep_unchanged]
    n = len(instances)
    report: dict[str, Any] = {"tool": tool.name, "instances": n}

    shape = tuple(tool.prompt_shape)
    if not shape or any(not isinstance(s, int) or s < 1 for s in shape):
        _fail(tool, f"prompt_shape must be a tuple of positive ints, got {shape}")
    if not isinstance(tool.feature_dim, int) or tool.feature_dim < 1:
        _fail(tool, f"feature_dim must be a positive int, got {tool.feature_dim!r}")
    trainable = [name for name, p in tool.named_parameters() if p.requires_grad]
    if trainable:
        _fail(tool, f"the frozen network has parameters that require gradients: {trainable[:5]}")
    report["prompt_shape"], report["feature_dim"] = shape, tool.feature_dim

    with torch.no_grad():
        context = tool.prepare(instances)
        features = tool.pool_features(context)
    if tuple(features.shape) != (n, tool.feature_dim):
        _fail(tool, f"pool_features gave shape {tuple(features.shape)}, expected {(n, tool.feature_dim)}")
    if not torch.isfinite(features).all():
        _fail(tool, "pool_features are not finite")

    # 2. loss row i depends only on prompt row i
    prompts = _random_prompts(tool, n, seed=0).requires_grad_()
    losses = tool.instance_losses(context, prompts)
    if tuple(losses.shape) != (n,):
        _fail(tool, f"instance_losses gave shape {tuple(losses.shape)}, expected ({n},)")
    if not torch.isfinite(losses).all():
        _fail(tool, f"instance_losses are not finite: {losses.tolist()}")
    worst_cross = 0.0
    for i in range(n):
        (grad,) = torch.autograd.grad(losses[i], prompts, retain_graph=i < n - 1)
        others = torch.cat([grad[:i], grad[i + 1 :]])
        worst_cross = max(worst_cross, float(others.abs().max()))
        if float(others.abs().max()) != 0.0:
            _fail(tool, f"the loss of instance {i} has a gradient on other instances' prompts "
                        f"(max {float(others.abs().max()):.3e}): losses must be per instance, summed, never mixed")
        if float(grad[i].abs().max()) == 0.0:
            _fail(tool, f"the loss of instance {i} does not depend on its own prompt")
    report["max_cross_row_gradient"] = worst_cross
    if tool.has_concepts is False and any(item.concept is not None for item in instances):
        _fail(tool, "a tool without concepts got instances with a concept")

    with torch.no_grad():
        for i in (0, n - 1):
            alone = tool.instance_losses(tool.prepare([instances[i]]), prompts[i : i + 1].detach())
            if not torch.allclose(alone[0], losses[i].detach(), atol=atol, rtol=1e-4):
                _fail(tool, f"instance {i}'s loss is {float(losses[i]):.6f} in a chunk but {float(alone[0]):.6f} "
                            "alone: the chunk must not change an instance's loss")

        # gate
        results = tool.gate(context, prompts.detach())
        if len(results) != n or not all(isinstance(r, GateResult) for r in results):
            _fail(tool, f"gate must return {n} GateResult, got {results!r}")
        quick = tool.quick_gate(context, prompts.detach())
        if [r.passed for r in quick] != [r.passed for r in results]:
            _fail(tool, "quick_gate and gate disagree on the same prompts")

        # 4. no prompt is the unmodified tool
        reference = tool.unmodified_outputs(context)
        unprompted = tool.prompted_outputs(context, None)
        if reference.shape != unprompted.shape or not torch.allclose(reference, unprompted, atol=atol, rtol=1e-4):
            _fail(tool, "with no prompt, the prompted path does not reproduce the unmodified network's outputs")
        tool.prompted_outputs(context, prompts.detach())  # runs with prompts (their effect: the gradient check)
        server = PromptToolServer(tool, PromptPool(tool.pool_spec()))
        if server.prompts_for(instances[0].concept, features[:1]) is not None:
            _fail(tool, "a server with an empty pool returned a prompt")
        report["unmodified_max_difference"] = float((reference - unprompted).abs().max())

    # 5. description round trip
    description = tool.describe()
    try:
        json.dumps(description)
    except TypeError as err:
        _fail(tool, f"describe() is not JSON-serialisable: {err}")
    if rebuild:
        rebuilt = type(tool).from_description(json.loads(json.dumps(description))).to(tool.device)
        if rebuilt.identity != tool.identity:
            _fail(tool, f"the rebuilt tool has identity {rebuilt.identity}, not {tool.identity}")
        with torch.no_grad():
            again = rebuilt.prepare(instances)
            same_losses = rebuilt.instance_losses(again, prompts.detach())
            same_features = rebuilt.pool_features(again)
        if not (torch.allclose(same_losses, losses.detach(), atol=atol, rtol=1e-4)
                and torch.allclose(same_features, features, atol=atol, rtol=1e-4)):
            _fail(tool, "the tool rebuilt from describe() gives other losses or features")
    report["rebuilt"] = rebuild
    return report

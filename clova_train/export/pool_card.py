"""The ``README.md`` of a prompt-tool export: what the pool holds, the supported route (``clova-train serve``), and
how to read the pool and ensemble its prompts with safetensors and numpy alone (the code block is run by a test
with clova-train blocked from import)."""

from __future__ import annotations

import inspect
import sys
from typing import Any

from clova_train.core.pool import PromptPool

READ_POOL_CODE = '''\
import json
import numpy as np
from safetensors.numpy import load_file
from safetensors import safe_open

with safe_open("pool.safetensors", framework="numpy") as handle:
    meta = json.loads(handle.metadata()["clova_train.pool"])
tensors = load_file("pool.safetensors")
pool = {c["name"]: (tensors[f"concept.{j}.features"], tensors[f"concept.{j}.prompts"])
        for j, c in enumerate(meta["concepts"])}   # a tool without concepts (VQA) stores its prompts under ""


def ensemble(concept, query, top_k=SERVED_TOP_K):
    """The prompt for one query feature [feature_dim], or None: run the tool unprompted."""
    if concept not in pool:
        return None
    features, prompts = pool[concept]
    unit = lambda x: x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
    weights = unit(features) @ unit(np.asarray(query, dtype=np.float32))      # cosine similarities [n]
    flat = prompts.reshape(len(prompts), -1)
    if top_k is not None and top_k < len(weights):
        keep = np.argsort(-weights, kind="stable")[:top_k]     # ties: the earlier stored prompt first
        weights, flat = weights[keep], flat[keep]
    total = weights.sum()
    mixed = weights @ flat / total if total > 1e-6 else flat.mean(0)          # plain mean if dissimilar to all
    return mixed.reshape(meta["prompt_shape"])
'''


def pool_card(pool: PromptPool, tool: dict[str, Any]) -> str:
    """``README.md`` for the export of ``pool`` made for the tool ``tool`` (its ``tool.json``)."""
    from clova_train.tools.base import tool_class

    name = str(tool.get("tool"))
    top_k, rule = (tool.get("init_args") or {}).get("top_k"), None
    try:
        cls = tool_class(tool)
        how = inspect.getdoc(sys.modules[cls.__module__]) or ""
        top_k = top_k if "top_k" in (tool.get("init_args") or {}) else cls.default_top_k
        rule = cls.serving_rule
    except Exception:  # a description this package cannot resolve still gets the rest of its card
        how = "(see the tool's module in clova-train)"
    served = (f"**How this tool serves it:** {rule}" if rule else
              f"**How this tool serves it:** exactly this ensemble, over the {top_k} most similar stored prompts "
              f"(`top_k`; `clova-train serve --top-k` overrides it)." if top_k else
              "**How this tool serves it:** exactly this ensemble, over all the concept's stored prompts.")
    concepts = "\n".join(f"| {c or '(all: the tool has no concepts)'} | {pool.num_prompts(c if c else None)} |"
                         for c in pool.concepts)
    model = (tool.get("init_args") or {}).get("model_name", "(see tool.json)")
    return f"""# Prompt pool for the {name} tool (CLOVA visual prompts)

Exported by clova-train. The frozen tool ({tool.get("class_path", name)}, model `{model}`, identity
`{pool.spec.model_identity}`) takes learned visual prompts of shape `{list(pool.spec.prompt_shape)}`; this pool
holds, per visual concept, the prompts that passed validation and the retrieval feature (size
{pool.spec.feature_dim}) of the training instance each was learned on.

| concept | prompts |
| --- | --- |
{concepts}

## Serving it (the supported route)

```
clova-train serve <this directory>            # POST /v1/{name}; see docs/http-api.md for the request fields
clova-train predict <this directory> --inputs images/ --output predictions.jsonl
```

The server checks that the frozen weights are the ones the prompts were learned on, retrieves and ensembles the
prompts per request, and falls back to the unmodified tool for a concept without prompts.

## Reading the pool without clova-train

`pool.safetensors` holds `concept.<j>.features` `[n, {pool.spec.feature_dim}]` and `concept.<j>.prompts`
`[n, {", ".join(map(str, pool.spec.prompt_shape))}]` per concept `j`, and its header's `clova_train.pool` entry
the JSON metadata (tool, model identity, shapes, concept names and instance ids). The prompt for a query is
the cosine-weighted mean of the concept's prompts (CLOVA's prompt ensemble), over the `top_k` most similar
instances when set:

```python
SERVED_TOP_K = {top_k!r}
{READ_POOL_CODE}```

{served}

## How the prompts enter the tool

From the tool's module documentation (`{tool.get("class_path", name)}`):

{how}

A query's retrieval feature is what the frozen tool computes for it without prompts (its `pool_features`), as for
the training instances; `clova-train serve` computes it per request.
"""

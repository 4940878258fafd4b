"""The prompt pool of a tool and its prompt-ensemble retrieval (CLOVA Sec. 3.4).

A pool holds, per visual concept, the features ``f_1..f_n`` of the training instances whose prompts passed
validation and the prompts ``p_1..p_n`` themselves:  ``P = {concept: ([f_1..f_n], [p_1..p_n])}``.

Retrieval for a query feature ``f_x`` (the prompt ensemble):

* a tool without concepts (VQA) stores every prompt under the concept ``None``;
* concept not in the pool -> ``None``: the caller runs the unmodified tool (no prompt tokens at all);
* otherwise ``p' = sum_i w_i p_i / sum_i w_i`` with ``w_i = cos(f_x, f_i)``, over all stored prompts of
  the concept, or over the ``top_k`` most similar ones when ``top_k`` is set;
* if the weights sum to zero or less (the query is dissimilar to every stored instance) the ensemble is
  undefined and the plain mean of the candidate prompts is returned instead.

Over all prompts the ensemble is linear in the normalised query, so the pool precomputes, per concept,
``M = F^T P`` and ``s = F^T 1`` (``F``: normalised features) when that is cheaper than touching every
prompt; one query then costs ``O(d * prompt_size)`` whatever the number of stored prompts.

On disk a pool is a single safetensors file whose header carries the JSON metadata (format version,
tool, model identity, prompt shape, feature dim, concepts and instance ids). Writes are atomic; loading
checks the file and, when given the expected spec, the tool, model identity and shapes. Runs that share a
pool file merge into it with :func:`merge_into_file`, under a lock, so two runs that finish together both
keep their prompts.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from filelock import FileLock
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from clova_train.core.atomic import write_atomic
from clova_train.core.errors import DataError, PoolError
from clova_train.core.safe_files import ReadLimits, parse_json

POOL_FORMAT_VERSION = 1
_METADATA_KEY = "clova_train.pool"
# What a pool's metadata holds: the spec and, per concept, its name and instance ids (a pool of 100,000 prompts is
# about 5 MB); numbers are finite and texts (an id, a name, a model identity) at most 4,096 characters.
_METADATA_LIMITS = ReadLimits(max_bytes=16 << 20, max_depth=8, max_values=4_000_000, max_text=4_096, finite_only=True)


@dataclass(frozen=True)
class PoolSpec:
    """What a pool's prompts fit: the tool, the exact frozen model, and the tensor shapes.

    Args:
        tool: tool name, e.g. ``"clip"``.
        model_identity: a string that identifies the frozen network (architecture and weights).
        prompt_shape: shape of one prompt, e.g. ``(3, 100, 768)`` for CLIP deep VPT.
        feature_dim: dimension of the per-instance retrieval feature.
    """

    tool: str
    model_identity: str
    prompt_shape: tuple[int, ...]
    feature_dim: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_shape", tuple(int(s) for s in self.prompt_shape))
        object.__setattr__(self, "feature_dim", int(self.feature_dim))

    @classmethod
    def from_tool_description(cls, description: dict) -> PoolSpec:
        """The spec of a tool's ``describe()`` output (keys tool, identity, prompt_shape, feature_dim)."""
        try:
            return cls(
                description["tool"], description["identity"], tuple(description["prompt_shape"]),
                description["feature_dim"],
            )
        except KeyError as err:
            raise PoolError(f"tool description lacks {err}") from err

    def mismatches(self, other: PoolSpec) -> list[str]:
        """Human-readable differences between this spec (found) and ``other`` (expected)."""
        problems = []
        for name in ("tool", "model_identity", "prompt_shape", "feature_dim"):
            found, expected = getattr(self, name), getattr(other, name)
            if found != expected:
                problems.append(f"{name} is {found!r} in the pool but {expected!r} for this model")
        return problems


def ensemble_prompt(query: torch.Tensor, features: torch.Tensor, prompts: torch.Tensor) -> torch.Tensor:
    """``sum_i w_i p_i / sum_i w_i`` with ``w_i = cos(query, f_i)`` (plain mean if the weights sum to <= 0).

    For callers that choose the candidates themselves (the LOC tool keeps those it detects with).
    """
    weights = F.normalize(features.float(), dim=-1) @ F.normalize(query.float(), dim=-1)
    flat = prompts.float().reshape(len(prompts), -1)
    total = weights.sum()
    result = (weights @ flat) / total if float(total) > 1e-6 else flat.mean(0)
    return result.reshape(prompts.shape[1:])


def random_prompts_like(prompts: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random prompts of the same shape and per-prompt norm as ``prompts`` ``[n, ...]``: the control that a
    learned prompt has to beat (same structure, same size, nothing learned)."""
    noise = torch.randn(prompts.shape, generator=generator)
    norms = prompts.flatten(1).norm(dim=1) / noise.flatten(1).norm(dim=1)
    return (noise * norms.view(-1, *[1] * (prompts.ndim - 1))).to(prompts)


def control_pool(pool: PromptPool, kind: Literal["zero", "random"], seed: int = 0) -> PromptPool:
    """A control of the same structure as ``pool`` (entries, features, ids, so the same retrieval and the same
    prompted forward) with nothing learned: every prompt replaced by zeros, or by a random prompt of equal norm."""
    control = PromptPool(pool.spec)
    generator = torch.Generator().manual_seed(seed)
    for concept in pool.concepts:
        features, prompts, ids = pool.entry(concept)
        replaced = torch.zeros_like(prompts) if kind == "zero" else random_prompts_like(prompts, generator)
        control.add(concept, features, replaced, ids)
    return control


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _spec_from_metadata(meta: dict, path: Path) -> PoolSpec:
    """The pool's spec from its metadata, or a :class:`PoolError` naming the missing or malformed field."""
    missing = [k for k in ("tool", "model_identity", "prompt_shape", "feature_dim", "concepts") if k not in meta]
    if missing:
        raise PoolError(f"prompt pool {path} has incomplete metadata: missing {', '.join(repr(k) for k in missing)}")
    for name in ("tool", "model_identity"):
        if not isinstance(meta[name], str) or not meta[name]:
            raise PoolError(f"prompt pool {path}: metadata field {name!r} must be a non-empty string, got {meta[name]!r}")
    shape = meta["prompt_shape"]
    if not isinstance(shape, list) or not shape or not all(_is_count(x) for x in shape):
        raise PoolError(f"prompt pool {path}: metadata field 'prompt_shape' must be a list of positive integers, got {shape!r}")
    if not _is_count(meta["feature_dim"]):
        raise PoolError(f"prompt pool {path}: metadata field 'feature_dim' must be a positive integer, got {meta['feature_dim']!r}")
    return PoolSpec(meta["tool"], meta["model_identity"], tuple(shape), meta["feature_dim"])


def _concepts_from_metadata(meta: dict, path: Path) -> list[dict]:
    """The metadata's concept list, each entry checked (name, unique string instance ids)."""
    concepts = meta["concepts"]
    if not isinstance(concepts, list):
        raise PoolError(f"prompt pool {path}: metadata field 'concepts' must be a list, got {type(concepts).__name__}")
    names: set[str] = set()
    for j, info in enumerate(concepts):
        if not isinstance(info, dict) or not isinstance(info.get("name"), str):
            raise PoolError(f"prompt pool {path}: concepts[{j}] must be an object with a string 'name'")
        ids = info.get("instance_ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise PoolError(f"prompt pool {path}: concept {info['name']!r} needs 'instance_ids', a list of strings")
        if len(set(ids)) != len(ids):
            raise PoolError(f"prompt pool {path}: concept {info['name']!r} lists an instance id twice")
        if info["name"] in names:
            raise PoolError(f"prompt pool {path}: concept {info['name']!r} appears twice")
        names.add(info["name"])
    return concepts


def _key(concept: object) -> object:
    """Pools of tools without concepts keep their prompts under ``None``, stored as the empty name."""
    return "" if concept is None else concept


@dataclass
class _ConceptEntry:
    features: torch.Tensor  # [n, d]
    prompts: torch.Tensor  # [n, *prompt_shape]
    instance_ids: list[str]
    _normalised: torch.Tensor | None = field(default=None, repr=False)
    _factored: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def normalised_features(self) -> torch.Tensor:
        if self._normalised is None:
            self._normalised = F.normalize(self.features, dim=-1)
        return self._normalised

    def factored(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(F^T P [d, numel], F^T 1 [d], mean prompt [numel]) for the all-prompts ensemble."""
        if self._factored is None:
            feats = self.normalised_features()
            flat = self.prompts.reshape(len(self.prompts), -1)
            self._factored = (feats.T @ flat, feats.sum(0), flat.mean(0))
        return self._factored


class PromptPool:
    """Per-concept store of (feature, prompt) pairs for one tool, with prompt-ensemble retrieval.

    Args:
        spec: the tool, model identity and shapes every stored prompt must match.
    """

    def __init__(self, spec: PoolSpec) -> None:
        self.spec = spec
        self._entries: dict[str, _ConceptEntry] = {}

    # ------------------------------------------------------------------ contents
    @property
    def concepts(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, concept: object) -> bool:
        return _key(concept) in self._entries

    def __len__(self) -> int:
        return sum(len(e.instance_ids) for e in self._entries.values())

    def num_prompts(self, concept: str | None) -> int:
        entry = self._entries.get(_key(concept))
        return 0 if entry is None else len(entry.instance_ids)

    def entry(self, concept: str | None) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """(features [n, d], prompts [n, *shape], instance ids) stored for ``concept``."""
        e = self._entries[_key(concept)]
        return e.features, e.prompts, list(e.instance_ids)

    def add(
        self,
        concept: str | None,
        features: torch.Tensor,
        prompts: torch.Tensor,
        instance_ids: list[str] | None = None,
    ) -> int:
        """Add prompts for ``concept``; instances already stored (same id) are skipped.

        Returns the number of prompts actually added.
        """
        concept = _key(concept)
        features = torch.as_tensor(features).detach().to("cpu", torch.float32)
        prompts = torch.as_tensor(prompts).detach().to("cpu", torch.float32)
        if features.ndim == 1:
            features, prompts = features[None], prompts[None]
        n = features.shape[0]
        if features.shape != (n, self.spec.feature_dim):
            raise PoolError(
                f"features for concept {concept!r} have shape {tuple(features.shape)}, "
                f"expected (n, {self.spec.feature_dim})"
            )
        if tuple(prompts.shape) != (n, *self.spec.prompt_shape):
            raise PoolError(
                f"prompts for concept {concept!r} have shape {tuple(prompts.shape)}, "
                f"expected ({n}, {', '.join(map(str, self.spec.prompt_shape))})"
            )
        for what, values in (("features", features), ("prompts", prompts)):
            if not bool(torch.isfinite(values).all()):
                bad = int((~torch.isfinite(values.reshape(n, -1))).any(1).nonzero()[0])
                raise PoolError(f"{what} of concept {concept!r} hold NaN or infinite values (entry {bad})")
        if instance_ids is None:
            start = self.num_prompts(concept)
            instance_ids = [f"{concept}#{start + i}" for i in range(n)]
        if len(instance_ids) != n:
            raise PoolError(f"{len(instance_ids)} instance ids given for {n} prompts of concept {concept!r}")

        old = self._entries.get(concept)
        seen = set(old.instance_ids) if old else set()
        keep = []
        for i, iid in enumerate(instance_ids):
            if iid not in seen:
                seen.add(iid)
                keep.append(i)
        if not keep:
            return 0
        index = torch.tensor(keep)
        new_ids = [instance_ids[i] for i in keep]
        if old is None:
            self._entries[concept] = _ConceptEntry(features[index].clone(), prompts[index].clone(), new_ids)
        else:
            self._entries[concept] = _ConceptEntry(
                torch.cat([old.features, features[index]]),
                torch.cat([old.prompts, prompts[index]]),
                old.instance_ids + new_ids,
            )
        return len(keep)

    def merge(self, other: PromptPool) -> int:
        """Add every prompt of ``other`` (a pool of the same spec, e.g. from another run).

        Returns the number of prompts added; instances both pools hold are kept once.
        """
        problems = other.spec.mismatches(self.spec)
        if problems:
            raise PoolError("cannot merge pools: " + "; ".join(problems))
        added = 0
        for concept in other.concepts:
            feats, prompts, ids = other.entry(concept)
            added += self.add(concept, feats, prompts, ids)
        return added

    # ------------------------------------------------------------------ retrieval
    def retrieve(
        self, concept: str | None, query_features: torch.Tensor, top_k: int | None = None
    ) -> torch.Tensor | None:
        """Ensembled prompt for each query, or ``None`` when ``concept`` has no prompts.

        Args:
            concept: the visual concept the tool is asked about.
            query_features: ``[d]`` or ``[q, d]`` features of the query inputs.
            top_k: ensemble only the ``top_k`` most similar stored instances (all when ``None``).

        Returns:
            ``[*prompt_shape]`` (or ``[q, *prompt_shape]`` for batched queries) on the query's device,
            or ``None`` (use the unmodified tool).
        """
        entry = self._entries.get(_key(concept))
        if entry is None:
            return None
        single = query_features.ndim == 1
        query = query_features[None] if single else query_features
        if query.shape[-1] != self.spec.feature_dim:
            raise PoolError(
                f"query feature dim {query.shape[-1]} does not match the pool's {self.spec.feature_dim}"
            )
        query = F.normalize(query.detach().to("cpu", torch.float32), dim=-1)
        n = len(entry.instance_ids)
        numel = entry.prompts[0].numel()
        if top_k is not None and top_k < n:
            weights = query @ entry.normalised_features().T  # [q, n]
            # A stable sort: among equal similarities the earlier stored prompt wins (topk leaves ties unordered).
            weights, index = weights.sort(dim=-1, descending=True, stable=True)
            weights, index = weights[:, :top_k], index[:, :top_k]
            candidates = entry.prompts.reshape(n, numel)[index]  # [q, k, numel]
            numer = torch.einsum("qk,qkp->qp", weights, candidates)
            fallback = candidates.mean(1)
        elif n > entry.features.shape[1]:
            weighted_sum, weight_sum_vector, mean = entry.factored()
            numer = query @ weighted_sum
            weights = (query @ weight_sum_vector)[:, None]
            fallback = mean.expand_as(numer)
        else:
            weights = query @ entry.normalised_features().T
            flat = entry.prompts.reshape(n, numel)
            numer = weights @ flat
            fallback = flat.mean(0).expand_as(numer)
        denom = weights.sum(-1, keepdim=True)
        positive = denom > 1e-6
        result = torch.where(positive, numer / denom.clamp_min(1e-6), fallback)
        result = result.reshape(len(query), *self.spec.prompt_shape).to(query_features.device)
        return result[0] if single else result

    # ------------------------------------------------------------------ persistence
    def metadata(self) -> dict:
        return {
            "format_version": POOL_FORMAT_VERSION,
            **asdict(self.spec),
            "prompt_shape": list(self.spec.prompt_shape),
            "concepts": [
                {"name": c, "num_prompts": self.num_prompts(c), "instance_ids": self._entries[c].instance_ids}
                for c in self.concepts
            ],
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the pool to ``path`` (a ``.safetensors`` file) atomically."""
        path = Path(path)
        tensors: dict[str, torch.Tensor] = {}
        for j, concept in enumerate(self.concepts):
            e = self._entries[concept]
            tensors[f"concept.{j}.features"] = e.features.contiguous()
            tensors[f"concept.{j}.prompts"] = e.prompts.contiguous()
        header = {_METADATA_KEY: json.dumps(self.metadata())}
        write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=header))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str], expected: PoolSpec | None = None) -> PromptPool:
        """Read a pool written by :meth:`save`.

        Raises:
            PoolError: the file is missing, not a pool, corrupted, or (with ``expected``) made for another
                tool, model or prompt shape; the message names the file and what differs.
        """
        path = Path(path)
        if not path.is_file():
            raise PoolError(f"prompt pool file not found: {path}")
        try:
            with safe_open(str(path), framework="pt") as handle:
                header = handle.metadata() or {}
                if _METADATA_KEY not in header:
                    raise PoolError(f"{path} is a safetensors file but not a clova-train prompt pool")
                meta = parse_json(header[_METADATA_KEY], f"the metadata of {path}", _METADATA_LIMITS)
                tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        except (SafetensorError, OSError, ValueError, RuntimeError, DataError) as err:
            raise PoolError(f"prompt pool file {path} is corrupted or unreadable: {err}") from err
        if not isinstance(meta, dict):
            raise PoolError(f"prompt pool {path} has malformed metadata: not a JSON object")
        if meta.get("format_version") != POOL_FORMAT_VERSION:
            raise PoolError(
                f"prompt pool {path} has format version {meta.get('format_version')!r}; "
                f"this clova-train reads version {POOL_FORMAT_VERSION}"
            )
        spec = _spec_from_metadata(meta, path)
        concepts = _concepts_from_metadata(meta, path)
        if expected is not None:
            problems = spec.mismatches(expected)
            if problems:
                raise PoolError(f"prompt pool {path} does not fit this model: " + "; ".join(problems))
        pool = cls(spec)
        for j, info in enumerate(concepts):
            try:
                feats, prompts = tensors[f"concept.{j}.features"], tensors[f"concept.{j}.prompts"]
            except KeyError as err:
                raise PoolError(f"prompt pool {path} is missing tensor {err} of concept {info['name']!r}") from err
            try:
                pool.add(info["name"], feats, prompts, info["instance_ids"])
            except PoolError as err:
                raise PoolError(f"prompt pool {path}: {err}") from err
        return pool


def pool_lock(path: str | os.PathLike[str]) -> FileLock:
    """The exclusive lock of the pool file ``path`` (``.<name>.lock`` beside it), held for a read-merge-write."""
    path = Path(path)
    return FileLock(path.with_name(f".{path.name}.lock"))


def merge_into_file(path: str | os.PathLike[str], pool: PromptPool, overwrite: bool = False) -> int:
    """Merge ``pool`` into the pool file at ``path`` (created if missing; replaced by ``pool`` with ``overwrite``)
    while holding its lock, so that concurrent merges into one file lose nothing. Returns the prompts added."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with pool_lock(path):
        if overwrite or not path.exists():
            pool.save(path)
            return len(pool)
        existing = PromptPool.load(path, expected=pool.spec)
        added = existing.merge(pool)
        existing.save(path)
        return added

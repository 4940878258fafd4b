"""Serving loader for exported CLIP prompts: SELECT and CLASSIFY with the prompt ensemble. No Lightning.

>>> server = ClipPromptServer.from_export("checkpoints/quickstart_clip/export")
>>> labels, scores = server.classify(images, ["purple", "red", "green"])
>>> index, scores = server.select(crops, "purple")

How queries use the pool (CLOVA Sec. 3.4): for a concept with prompts, each query image retrieves the
ensembled prompt ``sum_i w_i p_i / sum_i w_i`` (``w_i``: cosine between the image's unprompted CLIP
feature and the stored instance features; ``top_k`` restricts it to the most similar instances); for a
concept without prompts the unmodified CLIP is used.

* CLASSIFY scores label ``l`` of image ``x`` as ``softmax_l(scale * f(x; p_l) . t)`` over the candidate
  labels' text features ``t``, where ``f(x; p_l)`` is the image encoded with label ``l``'s ensembled
  prompt (unprompted if ``l`` has none); the label with the highest score wins.
* SELECT encodes each crop with the described concept's ensembled prompt and returns the crop most
  similar to the concept's text.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from clova_train.core.errors import ExportError
from clova_train.core.pool import PoolSpec, PromptPool
from clova_train.tools.clip import PromptedClip


def clip_pool_spec(tool: PromptedClip) -> PoolSpec:
    """The pool spec prompts for ``tool`` must have."""
    return PoolSpec.from_tool_description(tool.describe())


class ClipPromptServer:
    """A frozen CLIP with its prompt pool, answering SELECT and CLASSIFY queries.

    Args:
        tool: the prompted CLIP.
        pool: prompts learned for it.
        top_k: ensemble only the ``top_k`` most similar stored instances (``None``: all of the concept's).
    """

    def __init__(self, tool: PromptedClip, pool: PromptPool, top_k: int | None = None) -> None:
        problems = pool.spec.mismatches(clip_pool_spec(tool))
        if problems:
            raise ExportError("prompt pool does not fit this CLIP: " + "; ".join(problems))
        self.tool = tool.eval()
        self.pool = pool
        self.top_k = top_k

    @classmethod
    def from_export(
        cls, directory: str | os.PathLike[str], top_k: int | None = None, device: str | torch.device = "cpu"
    ) -> ClipPromptServer:
        """Load an export written by ``clova-train export``."""
        directory = Path(directory)
        tool_file, pool_file = directory / "tool.json", directory / "pool.safetensors"
        for path in (tool_file, pool_file):
            if not path.is_file():
                raise ExportError(f"export directory {directory} is incomplete: {path.name} missing")
        description = json.loads(tool_file.read_text())
        if description.get("tool") != "clip":
            raise ExportError(f"export {directory} is for tool {description.get('tool')!r}, not 'clip'")
        tool = PromptedClip.from_description(description).to(device)
        return cls(tool, PromptPool.load(pool_file, expected=clip_pool_spec(tool)), top_k)

    def _ensembled(self, concept: str, base: torch.Tensor) -> torch.Tensor | None:
        """Ensembled prompts for images whose unprompted features are ``base``, or ``None``."""
        if concept not in self.pool:
            return None
        return self.pool.retrieve(concept, base, top_k=self.top_k).to(base.device)

    @torch.no_grad()
    def prompts_for(self, concept: str, tokens: torch.Tensor) -> torch.Tensor | None:
        """Ensembled prompts ``[N, *prompt_shape]`` for images given as patch tokens, or ``None``."""
        if concept not in self.pool:
            return None
        return self._ensembled(concept, self.tool.encode_tokens(tokens, None))

    @torch.no_grad()
    def score(self, images: torch.Tensor, labels: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """CLASSIFY scores with the pool, and the unmodified tool's logits, both ``[N, len(labels)]``.

        The unprompted forward runs once: it gives the retrieval features, the unmodified logits, and the
        scores of labels without prompts.
        """
        if not labels:
            raise ValueError("classify needs at least one label")
        tokens = self.tool.embed_patches(images.to(self.tool.mean.device))
        text = self.tool.encode_text(labels)
        base = self.tool.encode_tokens(tokens, None)
        base_logits = self.tool.logit_scale * base @ text.T
        scores = torch.empty(len(images), len(labels), device=tokens.device)
        for k, label in enumerate(labels):
            prompts = self._ensembled(label, base)
            if prompts is None:
                logits = base_logits
            else:
                logits = self.tool.logit_scale * self.tool.encode_tokens(tokens, prompts) @ text.T
            scores[:, k] = logits.softmax(-1)[:, k]
        return scores, base_logits

    def classify(self, images: torch.Tensor, labels: list[str]) -> tuple[list[str], torch.Tensor]:
        """Label each of ``images`` (``[N, 3, H, W]`` in [0, 1]) with one of ``labels``.

        Returns the predicted labels and the ``[N, len(labels)]`` scores.
        """
        scores, _ = self.score(images, labels)
        return [labels[i] for i in scores.argmax(-1).tolist()], scores.cpu()

    @torch.no_grad()
    def select(self, crops: torch.Tensor, concept: str) -> tuple[int, torch.Tensor]:
        """Index of the crop (``[M, 3, H, W]`` in [0, 1]) that best matches ``concept``, and all scores."""
        tokens = self.tool.embed_patches(crops.to(self.tool.mean.device))
        features = self.tool.encode_tokens(tokens, self.prompts_for(concept, tokens))
        scores = features @ self.tool.encode_text([concept])[0]
        return int(scores.argmax()), scores.cpu()

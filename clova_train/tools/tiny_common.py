"""Shared pieces of the tiny-model builders: progress over pretraining steps, thread pinning, the detectors' schedule and
CLIP's byte-level BPE tokenizer built from the vocabulary open_clip ships.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from clova_train.core.progress import progress_over


def pretraining_steps(steps: int, model: str) -> Iterable[int]:
    """``range(steps)`` with a progress bar (total and ETA) on a terminal and, when stderr is not one (a log file, a
    CI job), a line every 30 seconds and one at the end: pretraining takes minutes on a CPU."""
    return progress_over(range(steps), f"pretraining tiny {model}", "steps")


@contextmanager
def single_thread() -> Iterator[None]:
    """Run torch on one thread inside the block.

    DETR-style set training (OWL-ViT, MaskFormer) is sensitive to the last bits of its arithmetic, and the
    order of a multi-threaded sum depends on the thread count: on one thread the tiny detectors come out
    the same on every machine of an architecture, so the quickstarts and tests see the model they were
    checked against. The two can then also be built side by side, one per core.
    """
    with torch_threads(1):
        yield


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run torch on ``count`` threads inside the block (the previous count is restored after it)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup`` steps, then cosine decay to zero at ``steps`` (the detectors' pretraining)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps)))


# ---------------------------------------------------------------------- OWL-ViT (LOC)
def clip_bpe_tokenizer(directory: str | Path, max_length: int = 16) -> object:
    """CLIP's own byte-level BPE tokenizer (``CLIPTokenizerFast``), built from the vocabulary open_clip ships.

    CLIP's ``vocab.json`` is the 256 byte symbols, the same with ``</w>``, one token per merge of the BPE
    merges file, then ``<|startoftext|>`` and ``<|endoftext|>``; written to ``directory`` and loaded back.
    """
    import gzip
    import json

    from open_clip.tokenizer import bytes_to_unicode, default_bpe
    from transformers import CLIPTokenizerFast

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    merges = gzip.open(default_bpe()).read().decode("utf-8").split("\n")[1 : 49152 - 256 - 2 + 1]
    symbols = list(bytes_to_unicode().values())
    vocab = symbols + [s + "</w>" for s in symbols] + ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    (directory / "vocab.json").write_text(json.dumps({token: i for i, token in enumerate(vocab)}), encoding="utf-8")
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    return CLIPTokenizerFast(
        vocab=str(directory / "vocab.json"), merges=str(directory / "merges.txt"),
        bos_token="<|startoftext|>", eos_token="<|endoftext|>", pad_token="!", unk_token="<|endoftext|>",
        model_max_length=max_length,
    )

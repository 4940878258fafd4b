"""The tiny Llama (transformers) of the tool-using LLM quickstart: a BPE tokenizer built locally and next-token
pretraining on tool prompts and generic lookup and copy documents.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from clova_train.tools.tiny_common import pretraining_steps

if TYPE_CHECKING:
    from clova_train.datamodules.tool_llm.tool_conversations import Templates


TINY_LLAMA_CONFIG: dict = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}


# The quickstart's tiny Llama (``clova-train tiny-model llama``): tied input and output embeddings (a copied
# token's logit then follows from attending to it) and a key-value head per query head.
QUICKSTART_LLAMA_CONFIG: dict = {**TINY_LLAMA_CONFIG, "num_key_value_heads": 4, "tie_word_embeddings": True}


# Its pretraining curriculum: copy documents alone first (copying emerges between 1000 and 2000 steps and not
# at all when they are mixed with the other documents from the start), then every kind of skill document
# with tool prompts. About 8 minutes on a 2-core CPU.
QUICKSTART_LLAMA_COPY_STEPS = 2000


QUICKSTART_LLAMA_PRETRAIN_STEPS = 1000


QUICKSTART_LLAMA_DOCUMENTS = 20000


def tool_llama_tokens() -> list[str]:
    """Strings the quickstart Llama's tokenizer keeps whole: every tool name and every synthetic file name.

    A real LLM copies a multi-token name from its prompt with induction heads; the tiny one does not form
    them reliably in minutes of CPU pretraining, so names are single tokens and copying one is a one-token copy.
    """
    from clova_train.datamodules.tool_llm.tool_conversations import ALL_TOOLS
    from clova_train.synthetic.file_names import FILE_NAMES

    return [*ALL_TOOLS, *FILE_NAMES]


def tiny_bpe_tokenizer(corpus: list[str], vocab_size: int = 1024, whole_tokens: list[str] | None = None) -> object:
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``corpus``, plus ``whole_tokens`` kept whole."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    if whole_tokens:
        tokenizer.add_tokens(list(whole_tokens))
    return tokenizer


def _packed_rows(token_lists: list[list[int]], separator: int, width: int, generator: torch.Generator) -> Iterator[list[int]]:
    """Endless rows of ``width`` tokens: random documents joined by ``separator``."""
    while True:
        row: list[int] = []
        while len(row) < width:
            row += token_lists[int(torch.randint(len(token_lists), (1,), generator=generator))] + [separator]
        yield row[:width]


def _windows(token_lists: list[list[int]], width: int, generator: torch.Generator) -> Iterator[list[int]]:
    """Endless random windows of at most ``width`` tokens of random texts."""
    while True:
        ids = token_lists[int(torch.randint(len(token_lists), (1,), generator=generator))]
        start = int(torch.randint(max(1, len(ids) - width), (1,), generator=generator))
        yield ids[start : start + width]


def pretrain_causal_lm(model: torch.nn.Module, tokenizer: object, texts: list[str], steps: int, seed: int = 0) -> None:
    """Full-model next-token training on ``texts`` (random 256-token windows, batch 8)."""
    generator = torch.Generator().manual_seed(seed)
    ids = [torch.tensor(tokenizer(t)["input_ids"]) for t in texts]
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    model.train()
    for _ in pretraining_steps(steps, "Llama"):
        rows = []
        for k in torch.randint(len(ids), (8,), generator=generator).tolist():
            start = int(torch.randint(max(1, len(ids[k]) - 256), (1,), generator=generator))
            rows.append(ids[k][start : start + 256])
        width = min(len(r) for r in rows)
        batch = torch.stack([r[:width] for r in rows])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def pretrain_with_curriculum(
    model: torch.nn.Module, tokenizer: object, copy_documents: list[str], documents: list[str], texts: list[str],
    copy_steps: int, steps: int, seed: int = 0, batch_size: int = 16, width: int = 256, lr: float = 1e-3,
) -> None:
    """Copy first, then the rest: ``copy_steps`` batches of packed ``copy_documents``, then ``steps`` batches
    in which one row in four is a window of ``texts`` (padding masked) and the others packed ``documents``.
    AdamW at a constant ``lr``, gradients clipped to norm 1."""
    generator = torch.Generator().manual_seed(seed)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    copies = _packed_rows([tokenizer(d)["input_ids"] for d in copy_documents], eos, width, generator)
    mixed = _packed_rows([tokenizer(d)["input_ids"] for d in documents], eos, width, generator)
    windows = _windows([tokenizer(t)["input_ids"] for t in texts], width, generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in pretraining_steps(copy_steps + steps, "Llama"):
        if step < copy_steps:
            rows = [next(copies) for _ in range(batch_size)]
        else:
            rows = [next(windows) if k % 4 == 0 else next(mixed) for k in range(batch_size)]
        batch = torch.tensor([(row + [pad] * width)[:width] for row in rows])
        loss = model(input_ids=batch, labels=batch.masked_fill(batch == pad, -100)).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.eval()


def make_tiny_llama(
    directory: str | Path,
    corpus: list[str],
    pretrain_texts: list[str] | None = None,
    pretrain_steps: int = 0,
    vocab_size: int = 1024,
    seed: int = 0,
    copy_steps: int = 0,
    skill_documents: int = 0,
    model_config: dict | None = None,
) -> Path:
    """Write a tiny Llama and a byte-level BPE tokenizer trained on ``corpus`` to ``directory``.

    With ``pretrain_steps`` the model is first trained on ``pretrain_texts`` (a stand-in for the
    pretraining of a real LLM). With ``skill_documents`` it is the quickstart's: tool and file names are
    single tokens (:func:`tool_llama_tokens`) and it is pretrained by :func:`pretrain_with_curriculum` on
    generic copy and lookup documents (:mod:`clova_train.synthetic.skill_documents`) and ``pretrain_texts``.
    Both load with ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained``.

    Args:
        copy_steps: pretraining steps on copy documents alone, before the ``pretrain_steps`` mixed ones.
        skill_documents: how many copy documents, and how many other skill documents, to draw (0: the
            plain tokenizer and :func:`pretrain_causal_lm` on ``pretrain_texts``).
        model_config: ``LlamaConfig`` sizes (default :data:`TINY_LLAMA_CONFIG`).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from clova_train.datamodules.tool_llm.tool_conversations import ALL_TOOLS
    from clova_train.synthetic import skill_documents as skills

    directory = Path(directory)
    names = tuple(ALL_TOOLS)
    copies = documents = []
    if skill_documents:
        rng = random.Random(seed)
        copies = [skills.copy_document(rng, names) for _ in range(skill_documents)]
        documents = skills.skill_documents(skill_documents, seed + 1, names) + copies[: skill_documents // 4]
    tokenizer = tiny_bpe_tokenizer(
        list(corpus) + documents[:3000] + copies[:1000], vocab_size, tool_llama_tokens() if skill_documents else None
    )
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **(model_config or TINY_LLAMA_CONFIG),
    )
    model = LlamaForCausalLM(config)
    if skill_documents and (copy_steps or pretrain_steps):
        pretrain_with_curriculum(model, tokenizer, copies, documents, list(pretrain_texts or corpus), copy_steps,
                                 pretrain_steps, seed)
    elif pretrain_steps and pretrain_texts:
        pretrain_causal_lm(model, tokenizer, pretrain_texts, pretrain_steps, seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# Chit-chat of the pretraining prompts: questions no data split asks (the splits' exchanges are
# ``tool_conversations.CHAT``); the pretraining corpus holds prompts only, so the answers are never read.
PRETRAINING_CHAT: tuple[tuple[str, str], ...] = (
    ("Say something nice.", ""), ("Which month comes after May?", ""), ("Do you like music?", ""),
    ("How tall is a giraffe?", ""), ("Name a fruit.", ""), ("What is the opposite of cold?", ""),
)


def pretraining_templates() -> Templates:
    """The request templates of the pretraining prompts, in a wording no data split uses.

    The data module splits requests by template (``datamodules.tool_llm.template_split``: each seed holds some out
    for validation and test), so a model pretrained on prompts written from every template would have read the
    held-out requests. Pretraining requests instead name the tool outright (``Use <tool> on the red circle``), chains
    name their condition (``Use <condition> and a red circle``), chit-chat asks :data:`PRETRAINING_CHAT`: the model
    learns the prompt's format and its tools, and none of the request wordings any split is written from.
    """
    from clova_train.datamodules.tool_llm.tool_conversations import ALL_TOOLS, COMMANDS, Request, Templates

    commands = {tool: [Request(f"Use {tool} on the {{obj}}",
                               "the {obj}" if any(r.arguments for r in COMMANDS.get(tool, ())) else "")]
                for tool in ALL_TOOLS}
    return Templates(commands, ["Use {condition} and a {obj}"], list(PRETRAINING_CHAT))


def tool_corpus(seed: int = 0) -> tuple[list[str], list[str]]:
    """Synthetic GPT4Tools text over all 31 tools: (prompt + response texts, prompts only).

    The first trains the tiny tokenizer: requests written from every template of the data (a real model's
    tokenizer covers the words of any request; token merges carry no request-to-tool mapping). The second
    pretrains the tiny model: prompts only, their requests from :func:`pretraining_templates`, so that neither the
    held-out request wordings nor any answer is pretrained on (fine-tuning, not pretraining, is what teaches it to
    answer in the ReAct format).
    """
    from clova_train.datamodules.tool_llm.tool_conversations import (
        ALL_TOOLS, generate_dataset, records_from_conversation,
    )
    from clova_train.tooluse.prompt_template import PromptTemplate

    template = PromptTemplate()

    def records(templates: Templates | None) -> list[dict[str, str]]:
        extra = {} if templates is None else {"templates": templates}
        conversations, negatives = generate_dataset(list(ALL_TOOLS), 3, 20, 8, seed, **extra)
        return [r for c in conversations for r in records_from_conversation(c)] + negatives

    texts = [template.prompt(r["instruction"], r["input"]) + r["output"] for r in records(None)]
    prompts = [template.prompt(r["instruction"], r["input"]) for r in records(pretraining_templates())]
    return texts, prompts


def build_quickstart_llama(directory: str | Path, seed: int = 0,
                           pretrain_steps: int = QUICKSTART_LLAMA_PRETRAIN_STEPS) -> Path:
    """The quickstart's tiny Llama (``clova-train tiny-model llama``): tokenizer and pretraining on the synthetic
    tool corpus, after :data:`QUICKSTART_LLAMA_COPY_STEPS` on copy documents (none when ``pretrain_steps`` is 0:
    random weights)."""
    texts, prompts = tool_corpus(seed)
    return make_tiny_llama(directory, texts, prompts, pretrain_steps, seed=seed,
                           copy_steps=QUICKSTART_LLAMA_COPY_STEPS if pretrain_steps else 0,
                           skill_documents=QUICKSTART_LLAMA_DOCUMENTS, model_config=QUICKSTART_LLAMA_CONFIG)

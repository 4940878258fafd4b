"""Tiny models of the real architectures, for quickstarts and tests on machines without a model hub.

They are saved in the same on-disk layout as real checkpoints and loaded back through the normal loading
code (``local-dir:`` for open_clip). A random CLIP cannot tell images apart well enough for a prompt to
steer it, so the tiny CLIP is first pretrained contrastively for a few hundred steps on rendered shapes
with captions ("a photo of a red circle."), leaving some colours out or, as ``clova-train tiny-model clip``
builds it for the quickstart, mostly misnamed (:data:`CLIP_MISCONCEPTIONS`): like a real pretrained tool,
it knows some concepts and must learn the others through prompts.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import open_clip
import torch

from clova_train.synthetic.shapes import SHAPES, render_scene
from clova_train.tools.clip import save_open_clip

TINY_CLIP_CONFIG: dict = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": 32, "layers": 3, "width": 64, "patch_size": 8, "head_width": 32},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
PRETRAIN_COLOURS = ("red", "green", "blue", "yellow")
# The quickstart's tiny CLIP (``clova-train tiny-model clip``) also sees purple and orange shapes, captioned
# "blue" and "yellow" 70% of the time: it learns the words (their text features are distinct, unlike those of
# words it never reads, which all land in one place) but mostly takes the looks for their neighbours', so the
# quickstart's prompts have a misconception to correct (issue 13: without the words, no image prompt could
# separate purple from orange).
CLIP_MISCONCEPTIONS = {"purple": "blue", "orange": "yellow"}
CLIP_MISCONCEPTION_RATE = 0.7



def pretraining_steps(steps: int, model: str) -> Iterable[int]:
    """``range(steps)`` with a progress bar (total and ETA) on a terminal: pretraining takes minutes on a CPU."""
    from tqdm import tqdm

    return tqdm(range(steps), desc=f"pretraining tiny {model}", unit="step", disable=None, leave=False)

def _caption_batch(
    rng: np.random.Generator, size: int, image_size: int, colours: tuple[str, ...], tokenizer: object,
    confusions: dict[str, str] | None = None, confusion_rate: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    images, captions = [], []
    confusions = confusions or {}
    every = colours + tuple(c for c in confusions if c not in colours)
    for _ in range(size):
        colour, shape = every[rng.integers(len(every))], SHAPES[rng.integers(len(SHAPES))]
        scene = render_scene([(colour, shape)], size=image_size, rng=rng)
        images.append(torch.from_numpy(scene.image).permute(2, 0, 1).float() / 255.0)
        named = confusions[colour] if colour in confusions and rng.random() < confusion_rate else colour
        captions.append(f"a photo of a {named} {shape}.")
    return torch.stack(images), tokenizer(captions)


def pretrain_clip(
    model: torch.nn.Module,
    steps: int,
    colours: tuple[str, ...] = PRETRAIN_COLOURS,
    batch_size: int = 64,
    seed: int = 0,
    confusions: dict[str, str] | None = None,
    confusion_rate: float = 0.0,
) -> None:
    """Contrastive (CLIP loss) training of ``model`` on captioned synthetic shapes. Shapes of a colour in
    ``confusions`` are captioned with the colour it maps to ``confusion_rate`` of the time (a misconception:
    the word is learned, the look is mostly taken for another colour's)."""
    rng = np.random.default_rng(seed)
    tokenizer = open_clip.get_tokenizer("ViT-B-32", context_length=model.context_length)
    mean = torch.tensor(open_clip.OPENAI_DATASET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(open_clip.OPENAI_DATASET_STD).view(1, 3, 1, 1)
    image_size = model.visual.image_size
    image_size = image_size[0] if isinstance(image_size, (tuple, list)) else image_size
    loss_fn = open_clip.ClipLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    model.train()
    for _ in pretraining_steps(steps, "CLIP"):
        images, texts = _caption_batch(rng, batch_size, image_size, colours, tokenizer, confusions, confusion_rate)
        image_features, text_features, scale = model((images - mean) / std, texts)
        loss = loss_fn(image_features, text_features, scale)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def make_tiny_clip(
    directory: str | Path,
    seed: int = 0,
    pretrain_steps: int = 200,
    model_config: dict | None = None,
    colours: tuple[str, ...] = PRETRAIN_COLOURS,
    confusions: dict[str, str] | None = None,
    confusion_rate: float = 0.0,
) -> Path:
    """Write a tiny open_clip CLIP to ``directory`` (load it with ``model_name="local-dir:<directory>"``).

    Args:
        directory: output directory (open_clip's ``open_clip_config.json`` + safetensors layout).
        seed: weight initialisation and pretraining seed.
        pretrain_steps: contrastive steps on synthetic shapes of ``colours`` (0: random weights).
        colours: colours shown and named in pretraining.
        confusions: colours also shown, named as the colour they map to ``confusion_rate`` of the time.
        confusion_rate: how often a ``confusions`` colour is misnamed.
        model_config: open_clip model config (default :data:`TINY_CLIP_CONFIG`).
    """
    config = dict(model_config or TINY_CLIP_CONFIG)
    torch.manual_seed(seed)
    model = open_clip.CLIP(**config)
    model.visual.image_mean = open_clip.OPENAI_DATASET_MEAN
    model.visual.image_std = open_clip.OPENAI_DATASET_STD
    if pretrain_steps:
        pretrain_clip(model, pretrain_steps, colours, seed=seed, confusions=confusions, confusion_rate=confusion_rate)
    return save_open_clip(model, config, directory)


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
    from clova_train.datamodules.tool_conversations import ALL_TOOLS
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

    from clova_train.datamodules.tool_conversations import ALL_TOOLS
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


def tool_corpus(seed: int = 0) -> tuple[list[str], list[str]]:
    """Synthetic GPT4Tools text over all 31 tools: (prompt + response texts, prompts only).

    The first trains the tiny tokenizer, the second pretrains the tiny model (so fine-tuning, not
    pretraining, is what teaches it to answer in the ReAct format).
    """
    from clova_train.datamodules.tool_conversations import (
        ALL_TOOLS, generate_dataset, records_from_conversation,
    )
    from clova_train.tooluse.prompt_template import PromptTemplate

    template = PromptTemplate()
    conversations, negatives = generate_dataset(list(ALL_TOOLS), 3, 20, 8, seed)
    records = [r for c in conversations for r in records_from_conversation(c)] + negatives
    prompts = [template.prompt(r["instruction"], r["input"]) for r in records]
    return [p + r["output"] for p, r in zip(prompts, records)], prompts


# ---------------------------------------------------------------------- BLIP VQA
VQA_QUESTION_WORDS = ("what colour is the", "what shape is the", "object", "how many shapes are there", "yes", "no")


def vqa_vocabulary() -> list[str]:
    """Every word the synthetic shape questions and answers use (the tiny tokenizer's vocabulary)."""
    from clova_train.synthetic.shapes import COLOURS, SHAPES

    return [*VQA_QUESTION_WORDS, *COLOURS, *SHAPES, "?"]


def build_tiny_blip(image_size: int = 32, seed: int = 0, hidden_size: int = 32, layers: int = 2) -> tuple:
    """A random-weight ``BlipForQuestionAnswering`` of the real architecture and its ``BlipProcessor``.

    The processor pairs a ``BlipImageProcessor`` with a BERT word-piece tokenizer over
    :func:`vqa_vocabulary` (special tokens as in BLIP: [PAD] [UNK] [CLS] [SEP] [MASK], bos [DEC], [ENC]).
    """
    from transformers import BertTokenizerFast, BlipConfig, BlipForQuestionAnswering, BlipImageProcessor, BlipProcessor

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = sorted({w for text in vqa_vocabulary() for w in text.lower().replace("?", " ? ").split()} | set("?.,0123456789"))
    tokens = specials + [w for w in words if w not in specials]
    tokenizer = BertTokenizerFast(vocab={t: i for i, t in enumerate(tokens)}, do_lower_case=True, model_max_length=64)
    tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
    torch.manual_seed(seed)
    config = BlipConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": hidden_size, "num_hidden_layers": layers,
            "num_attention_heads": 2, "intermediate_size": hidden_size * 2, "max_position_embeddings": 64,
            "bos_token_id": tokenizer.bos_token_id, "sep_token_id": tokenizer.sep_token_id,
            "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.sep_token_id,
        },
        vision_config={
            "hidden_size": hidden_size, "image_size": image_size, "patch_size": 8, "num_hidden_layers": layers,
            "num_attention_heads": 2, "intermediate_size": hidden_size * 2,
        },
    )
    processor = BlipProcessor(image_processor=BlipImageProcessor(size={"height": image_size, "width": image_size}),
                              tokenizer=tokenizer)
    return BlipForQuestionAnswering(config).eval(), processor


# What the tiny BLIP is pretrained on: (answer, RGB) shades. It learns "orange" from a darker shade than the
# synthetic tasks render and sees a light orange labelled "yellow" (a domain shift plus a misconception): it
# knows the word but firmly calls the task's orange "yellow", as a real tool misreads an unfamiliar look of
# a known concept; a prompt must be learned to change that. Purple it never sees.
VQA_PRETRAIN_SHADES: tuple[tuple[str, tuple[int, int, int]], ...] = (
    ("red", (220, 30, 30)), ("green", (30, 180, 40)), ("blue", (30, 60, 220)),
    ("yellow", (235, 215, 30)), ("yellow", (245, 150, 25)), ("orange", (150, 70, 25)),
)


def pretrain_blip_vqa(model: torch.nn.Module, processor: object, steps: int,
                      shades: tuple[tuple[str, tuple[int, int, int]], ...] = VQA_PRETRAIN_SHADES,
                      batch_size: int = 48, seed: int = 0) -> None:
    """Train every weight on questions about rendered shapes in ``shades`` (answer LM loss, BLIP decoding).

    The answers use the convention the VQA tool decodes with: decoder input ``[DEC] answer``, targets
    ``answer [SEP]``. With :data:`VQA_PRETRAIN_SHADES` the tiny model, like a real pretrained one, answers
    some questions about the synthetic tasks wrong, and prompts have something to fix.
    """
    from clova_train.synthetic.shapes import SHAPES, render_scene
    from clova_train.synthetic.vqa import VQA_OBJECT_SIZE

    from clova_train.tools.blip_vqa import honour_cross_attention_masks

    honour_cross_attention_masks(model)  # padded questions must not be attended to (see the VQA tool)
    rng = np.random.default_rng(seed)
    tokenizer = processor.tokenizer
    text = model.config.text_config
    image_size = model.config.vision_config.image_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    model.train()
    for _ in pretraining_steps(steps, "BLIP"):
        images, questions, answers = [], [], []
        for _ in range(batch_size):
            colour, rgb = shades[rng.integers(len(shades))]
            shape = SHAPES[rng.integers(len(SHAPES))]
            scene = render_scene([(colour, shape)], size=image_size, rng=rng, palette={colour: rgb},
                                 object_size=VQA_OBJECT_SIZE)
            question, answer = scene.qa_pairs[int(rng.integers(2))]
            images.append(scene.image)
            questions.append(question)
            answers.append(answer)
        pixels = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
        q = tokenizer(questions, padding=True, return_tensors="pt")
        a = [tokenizer(x, add_special_tokens=False)["input_ids"] for x in answers]
        width = max(len(r) for r in a) + 1
        inputs = torch.full((batch_size, width), text.pad_token_id)
        targets = torch.full((batch_size, width), -100)
        for i, row in enumerate(a):
            inputs[i, : len(row) + 1] = torch.tensor([text.bos_token_id, *row])
            targets[i, : len(row) + 1] = torch.tensor([*row, text.sep_token_id])
        image_embeds = model.vision_model(pixel_values=pixels).last_hidden_state
        states = model.text_encoder(
            input_ids=q["input_ids"], attention_mask=q["attention_mask"], encoder_hidden_states=image_embeds,
            encoder_attention_mask=torch.ones(image_embeds.shape[:-1], dtype=torch.long),
        ).last_hidden_state
        logits = model.text_decoder(
            input_ids=inputs, attention_mask=(targets != -100).long(), encoder_hidden_states=states,
            encoder_attention_mask=q["attention_mask"],
        ).logits
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def make_tiny_blip(directory: str | Path, seed: int = 0, pretrain_steps: int = 300, image_size: int = 32) -> Path:
    """Write a tiny BLIP VQA model and processor to ``directory`` (load with ``from_pretrained``).

    With ``pretrain_steps`` it first learns to answer colour and shape questions about rendered shapes of
    :data:`PRETRAIN_COLOURS` (purple and orange stay unknown).
    """
    directory = Path(directory)
    model, processor = build_tiny_blip(image_size=image_size, seed=seed)
    if pretrain_steps:
        pretrain_blip_vqa(model, processor, pretrain_steps, seed=seed)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


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


def build_tiny_owlvit(image_size: int = 64, seed: int = 0, width: int = 64, layers: int = 3) -> tuple:
    """A random-weight ``OwlViTForObjectDetection`` of the real architecture and its ``OwlViTProcessor``.

    ViT with ``patch_size`` 8 (``(image_size / 8)^2`` box predictions), text transformer with CLIP's BPE
    vocabulary and 16 positions (the processor pads queries to 16, as the real one does).
    """
    import tempfile

    from transformers import OwlViTConfig, OwlViTForObjectDetection, OwlViTImageProcessor, OwlViTProcessor

    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = clip_bpe_tokenizer(scratch)
    torch.manual_seed(seed)
    config = OwlViTConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": width, "intermediate_size": width * 2,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 16,
                     "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
                     "eos_token_id": tokenizer.eos_token_id},
        vision_config={"hidden_size": width, "intermediate_size": width * 2, "num_hidden_layers": layers,
                       "num_attention_heads": 2, "image_size": image_size, "patch_size": 8},
        projection_dim=width,
    )
    image_processor = OwlViTImageProcessor(size={"height": image_size, "width": image_size},
                                           crop_size={"height": image_size, "width": image_size})
    model = OwlViTForObjectDetection(config)
    # transformers initialises the detection heads with unit-variance weights (real checkpoints overwrite
    # them): from there the box head saturates at once. Small weights start every box at its patch.
    for head in (model.class_head, model.box_head):
        for layer in head.modules():
            if isinstance(layer, torch.nn.Linear):
                torch.nn.init.normal_(layer.weight, std=0.02)
                torch.nn.init.zeros_(layer.bias)
    return model.eval(), OwlViTProcessor(image_processor=image_processor, tokenizer=tokenizer)


# The tiny detectors learn every colour name, but purple and orange only from other shades than the ones
# the synthetic tasks render (a lavender purple, a brown orange): like a real detector facing an unfamiliar
# look of a concept it knows by name, they miss the task's purple and orange, and a prompt has something
# to teach.
GROUNDING_PRETRAIN_COLOURS = ("red", "green", "blue", "yellow", "purple", "orange")
GROUNDING_PRETRAIN_PALETTE = {"purple": (205, 160, 240), "orange": (140, 80, 35)}


def _grounding_batch(rng: np.random.Generator, size: int, image_size: int) -> list:
    from clova_train.synthetic.grounding import random_scene

    return [random_scene(rng, image_size, None, list(GROUNDING_PRETRAIN_COLOURS), int(rng.integers(1, 3)),
                         palette=GROUNDING_PRETRAIN_PALETTE) for _ in range(size)]


def pretrain_owlvit(model: torch.nn.Module, processor: object, steps: int, batch_size: int = 32, seed: int = 0,
                    lr: float = 1e-3, log_every: int = 0) -> None:
    """Train every weight to detect the shapes of :data:`GROUNDING_PRETRAIN_COLOURS` by name (OWL-ViT losses,
    AdamW with warm-up and cosine decay). The query texts are embedded once per step, not once per image.
    Runs on one thread (see :func:`single_thread`)."""
    from clova_train.synthetic.grounding import category_name

    rng = np.random.default_rng(seed)
    names = [category_name(c, s) for c in GROUNDING_PRETRAIN_COLOURS for s in SHAPES]
    image_size = model.config.vision_config.image_size
    text = processor.tokenizer(names, padding="max_length", max_length=16, return_tensors="pt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = warmup_cosine(optimizer, warmup=50, steps=steps)
    query_mask = torch.ones(batch_size, len(names), dtype=torch.bool)
    with single_thread():
        model.train()
        for step in pretraining_steps(steps, "OWL-ViT"):
            loss = _owlvit_step(model, processor, optimizer, schedule, rng, names, text, query_mask, batch_size,
                                image_size)
            if log_every and step % log_every == 0:
                print(f"owlvit pretrain step {step}: loss {loss:.3f}")
    model.eval()


def _owlvit_step(model: torch.nn.Module, processor: object, optimizer: torch.optim.Optimizer, schedule: object,
                 rng: np.random.Generator, names: list[str], text: dict, query_mask: torch.Tensor, batch_size: int,
                 image_size: int) -> float:
    from clova_train.synthetic.grounding import scene_targets
    from torchvision.ops import box_convert

    from clova_train.tools.detection_losses import BoxTargets, detection_losses

    scenes = _grounding_batch(rng, batch_size, image_size)
    pixels = processor.image_processor(images=[s.image for s in scenes], return_tensors="pt")["pixel_values"]
    targets = []
    for scene in scenes:
        labels, boxes, _ = scene_targets(scene, names)
        cxcywh = box_convert(torch.from_numpy(boxes) / image_size, "xyxy", "cxcywh")
        targets.append(BoxTargets(torch.tensor(labels, dtype=torch.long), cxcywh))
    queries = model.owlvit.get_text_features(**text).pooler_output
    feature_map = model.image_embedder(pixel_values=pixels)[0]
    features = feature_map.reshape(batch_size, -1, feature_map.shape[-1])
    logits = model.class_predictor(features, queries[None].expand(batch_size, -1, -1), query_mask)[0]
    loss = detection_losses(logits, model.box_predictor(features, feature_map), query_mask, targets).mean()
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    return loss.detach().item()


def make_tiny_owlvit(directory: str | Path, seed: int = 0, pretrain_steps: int = 1500, image_size: int = 64) -> Path:
    """Write a tiny OWL-ViT detector and processor to ``directory`` (load with ``from_pretrained``)."""
    directory = Path(directory)
    model, processor = build_tiny_owlvit(image_size=image_size, seed=seed)
    if pretrain_steps:
        pretrain_owlvit(model, processor, pretrain_steps, seed=seed)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


# ---------------------------------------------------------------------- MaskFormer (SEG)
# The tiny segmenter is pretrained on scenes in which shapes of two colours also appear but are never
# annotated: like a closed-vocabulary segmenter facing an LVIS-only category, it learned to leave them in
# the background (a mask-only prompt cannot undo that: the gate rejects those prompts). It segments the
# shapes of the annotated colours, not always well: a prompt has something to fix there.
# Six queries for scenes of one to three objects. With sixteen, most queries were idle and painted arbitrary
# masks; a random prompt scrambled them into new masks, and the best of those matched the object as often as
# a learned prompt's did. A random-prompt control could not tell learning apart from noise. With six queries,
# a random prompt loses objects and a learned pool gains where the model is weak (the SEG quickstart, 80
# held-out images: red circles 0.70 segmented unprompted, 0.69 with random prompts, 0.84 with the pool).
SEGMENTATION_PRETRAIN_COLOURS = ("red", "green", "blue", "yellow")
SEGMENTATION_UNANNOTATED_COLOURS = ("purple", "orange")
def build_tiny_maskformer(image_size: int = 64, seed: int = 0, width: int = 32, num_queries: int = 6) -> tuple:
    """A random-weight ``MaskFormerForInstanceSegmentation`` (tiny Swin backbone) and its image processor.

    Classes are the ``"<colour> <shape>"`` names of :data:`SEGMENTATION_PRETRAIN_COLOURS`; the decoder is
    ``width`` wide (the real model: 256), masks come out at stride 4 like the real model's.
    """
    from transformers import DetrConfig, MaskFormerConfig, MaskFormerForInstanceSegmentation, MaskFormerImageProcessor, SwinConfig

    from clova_train.synthetic.grounding import category_name

    names = [category_name(c, s) for c in SEGMENTATION_PRETRAIN_COLOURS for s in SHAPES]
    torch.manual_seed(seed)
    config = MaskFormerConfig(
        backbone_config=SwinConfig(image_size=image_size, patch_size=4, embed_dim=24, depths=[1, 1, 1, 1],
                                   num_heads=[1, 2, 2, 4], window_size=4,
                                   out_features=["stage1", "stage2", "stage3", "stage4"]),
        decoder_config=DetrConfig(d_model=width, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
                                  decoder_attention_heads=2, encoder_ffn_dim=2 * width, decoder_ffn_dim=2 * width,
                                  num_queries=num_queries),
        fpn_feature_size=width, mask_feature_size=width, num_labels=len(names),
        id2label=dict(enumerate(names)), label2id={name: i for i, name in enumerate(names)},
    )
    processor = MaskFormerImageProcessor(size={"height": image_size, "width": image_size}, size_divisor=32)
    model = MaskFormerForInstanceSegmentation(config)
    # transformers draws the query embeddings with std 0.02 (real checkpoints overwrite them): near-identical
    # queries then learn one and the same mask. DETR's unit-variance queries start them apart.
    torch.nn.init.normal_(model.model.transformer_module.queries_embedder.weight, std=1.0)
    return model.eval(), processor


def pretrain_maskformer(model: torch.nn.Module, processor: object, steps: int, batch_size: int = 16, seed: int = 0,
                        lr: float = 3e-4, log_every: int = 0) -> None:
    """Train every weight on shape scenes with MaskFormer's own loss: the shapes of
    :data:`SEGMENTATION_PRETRAIN_COLOURS` are annotated, those of :data:`SEGMENTATION_UNANNOTATED_COLOURS` are not.

    Runs on one thread (see :func:`single_thread`).
    """
    from clova_train.synthetic.grounding import category_name

    rng = np.random.default_rng(seed)
    names = [category_name(c, s) for c in SEGMENTATION_PRETRAIN_COLOURS for s in SHAPES]
    colours = list(SEGMENTATION_PRETRAIN_COLOURS + SEGMENTATION_UNANNOTATED_COLOURS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = warmup_cosine(optimizer, warmup=30, steps=steps)
    with single_thread():
        model.train()
        _maskformer_steps(model, processor, optimizer, schedule, rng, names, colours, steps, batch_size, log_every)
    model.eval()


def _maskformer_steps(model: torch.nn.Module, processor: object, optimizer: torch.optim.Optimizer, schedule: object,
                      rng: np.random.Generator, names: list[str], colours: list[str], steps: int, batch_size: int,
                      log_every: int) -> None:
    from clova_train.synthetic.grounding import random_scene, scene_targets

    image_size = int(model.config.backbone_config.image_size)
    for step in pretraining_steps(steps, "MaskFormer"):
        scenes = [random_scene(rng, image_size, None, colours, int(rng.integers(1, 4))) for _ in range(batch_size)]
        pixels = processor(images=[s.image for s in scenes], return_tensors="pt")["pixel_values"]
        labels, masks = [], []
        for scene in scenes:
            label, _, mask = scene_targets(scene, names)
            labels.append(torch.tensor(label, dtype=torch.long))
            masks.append(torch.from_numpy(mask).float())
        loss = model(pixel_values=pixels, mask_labels=masks, class_labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if log_every and step % log_every == 0:
            print(f"maskformer pretrain step {step}: loss {loss.item():.3f}")


def make_tiny_maskformer(directory: str | Path, seed: int = 0, pretrain_steps: int = 2000, image_size: int = 64) -> Path:
    """Write a tiny MaskFormer and its image processor to ``directory`` (load with ``from_pretrained``)."""
    directory = Path(directory)
    model, processor = build_tiny_maskformer(image_size=image_size, seed=seed)
    if pretrain_steps:
        pretrain_maskformer(model, processor, pretrain_steps, seed=seed)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory

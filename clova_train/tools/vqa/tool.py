"""BLIP VQA (transformers' ``BlipForQuestionAnswering``) as a prompt tool (CLOVA supp. 9.1).

Where the prompt enters: ``num_prompt_tokens`` vectors (paper: 16 x 768, the text hidden size) are
appended to the question encoder's output states, which the answer decoder cross-attends to, and the
attention mask is extended by one per prompt token. A prompt token that is exactly zero is masked out, so
a zero prompt (what the pool stores for examples the tool already answers right) and an ensemble of zero
prompts leave the tool exactly as it is, and no prompt is the unmodified tool.

Decoding follows BLIP's own ``generate``: the decoder starts from ``bos_token_id`` ([DEC]) and stops at
``sep_token_id`` ([SEP]). Training uses the same convention: decoder input ``[DEC] a_1 .. a_k``, targets
``a_1 .. a_k [SEP]``.

Loss: the answer decoder's cross-entropy (with the model's ``label_smoothing``) on the target answer,
summed over its tokens, one value per instance. The image and question encoders run once per instance.

Gate: the greedy answer to the validation question (by default the question itself, with its gold
answer), with the instance's prompt, must equal the validation answer token for token. ``quick_gate`` is
the same test in one teacher-forced pass: the argmax at every answer position, [SEP] included, equals the
target. Greedy decoding produces the target exactly when that holds, so both give the same verdict.

Pool: no concepts (paper: all learned prompts are stored together); feature: the average-pooled image
embedding (vision hidden size); serving ensembles the top-20 by cosine.

Serving rule (``answer_margin``): applying any prompt can change answers the unmodified tool gives right (a yellow
image that retrieves orange's prompts, or any random prompt, answered "orange"). With ``answer_margin`` set, the
prompted answer replaces the unmodified one only where its confidence (the product of its greedy tokens'
probabilities, [SEP] included) beats the unmodified answer's by more than the margin, as CLASSIFY's
``classify_margin`` does for labels; ``clova_train.tools.vqa.margin`` chooses it on validation records by the same
fixed rule (``clova_train.tools.operating_point``) and writes it into the export. ``None`` (the default): the
prompted answer always (the paper's rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from clova_train.core.errors import DataError, ModelError
from clova_train.tools.base import NoPrompt, PromptLookup, PromptTool
from clova_train.tools.contracts import GateResult, Rejection, TrainingInstance
from clova_train.tools.operating_point import check_margin
from clova_train.tools.pretrained import load_pretrained, processed_pixels, weights_fingerprint

DEFAULT_MODEL = "Salesforce/blip-vqa-capfilt-large"


@dataclass(kw_only=True)
class VqaInstance(TrainingInstance):
    """A VQA training instance: a question about an image and the answer the prompt should produce.

    Args:
        image: ``[3, H, W]`` uint8 image.
        question: the question asked of the image.
        answer: the target answer (in CLOVA, inferred by the closed loop's reflection).
        val_question: the question the prompt must fix (default: ``question``).
        val_answer: its gold answer (default: ``answer``).
        source: where the instance came from (file and record), named in errors.
    """

    image: torch.Tensor
    question: str
    answer: str
    val_question: str
    val_answer: str
    source: str = ""


def normalise_answer(text: str) -> str:
    return " ".join(text.lower().strip().rstrip(".").split())


@dataclass
class _Encoded:
    states: torch.Tensor  # [n, L, H] question-encoder output
    mask: torch.Tensor  # [n, L]


@dataclass
class _Answers:
    inputs: torch.Tensor  # [n, A] decoder input ids ([DEC] a_1 .. a_k, then padding)
    targets: torch.Tensor  # [n, A] a_1 .. a_k [SEP], -100 on padding
    mask: torch.Tensor  # [n, A]


@dataclass
class VqaChunk:
    """Prompt-independent tensors of one chunk."""

    features: torch.Tensor  # [n, Hv] average-pooled image embeddings
    question: _Encoded
    answers: _Answers
    val_question: _Encoded
    val_answers: _Answers
    pixel_values: torch.Tensor
    question_ids: torch.Tensor
    question_mask: torch.Tensor
    val_texts: list[str]


class BlipVqa(PromptTool):
    """A frozen BLIP VQA model whose answer decoder also attends to a learned prompt (VQA tool).

    Args:
        model_name: a hub id (``Salesforce/blip-vqa-capfilt-large``) or a local directory with a
            ``BlipForQuestionAnswering`` checkpoint and its processor, loaded with ``from_pretrained``.
        num_prompt_tokens: prompt vectors appended to the question encoder's output (paper: 16).
        max_answer_tokens: longest answer, in tokens with the closing [SEP], that training accepts and
            greedy decoding produces.
        top_k: serving ensembles the ``top_k`` stored prompts most similar to the query image (paper: 20;
            a small pool needs fewer, or one query mixes the prompts of unrelated images).
        answer_margin: the serving rule (module docstring): ``None``, the prompted answer always; a number in
            [0, 1], the prompted answer only where its confidence beats the unmodified answer's by more than it
            (1: never).
    """

    name: ClassVar[str] = "blip_vqa"
    has_concepts: ClassVar[bool] = False
    default_lr: ClassVar[float] = 1e-3
    default_steps: ClassVar[int] = 100
    evaluation_metrics: ClassVar[tuple[str, ...]] = ("accuracy_no_prompt", "accuracy_pool")
    served_operations: ClassVar[tuple[str, ...]] = ("answer",)

    def __init__(
        self, model_name: str = DEFAULT_MODEL, num_prompt_tokens: int = 16, max_answer_tokens: int = 10, top_k: int = 20,
        answer_margin: float | None = None,
    ) -> None:
        super().__init__()
        self.answer_margin = check_margin("answer_margin", answer_margin, optional=True)
        from transformers import BlipForQuestionAnswering, BlipProcessor

        if num_prompt_tokens < 1:
            raise ModelError(f"num_prompt_tokens must be >= 1, got {num_prompt_tokens}")
        if max_answer_tokens < 2:
            raise ModelError(f"max_answer_tokens must be >= 2 (an answer and [SEP]), got {max_answer_tokens}")
        if top_k < 1:
            raise ModelError(f"top_k must be >= 1, got {top_k}")
        self.model_name, self.num_prompt_tokens, self.max_answer_tokens = model_name, num_prompt_tokens, max_answer_tokens
        self.top_k = top_k
        model, self.processor = load_pretrained(BlipForQuestionAnswering, BlipProcessor, model_name, "BLIP VQA")
        self.model = self.freeze(model)
        text = model.config.text_config
        if text.encoder_hidden_size != text.hidden_size:
            # transformers sizes the answer decoder's cross-attention by the vision width; it reads the question encoding
            raise ModelError(
                f"BLIP VQA model {model_name!r}: its answer decoder cross-attends to {text.encoder_hidden_size}-wide "
                f"states (the vision width), but the question encoder gives {text.hidden_size}-wide ones; "
                "BlipForQuestionAnswering needs the vision and text widths equal (BLIP's VQA checkpoints use ViT-B)")
        honour_cross_attention_masks(self.model)
        self.bos_id, self.sep_id, self.pad_id = text.bos_token_id, text.sep_token_id, text.pad_token_id
        self.hidden_size = int(text.hidden_size)
        self.max_positions = int(text.max_position_embeddings)
        if max_answer_tokens + 1 > self.max_positions:
            raise ModelError(f"max_answer_tokens={max_answer_tokens} exceeds the decoder's "
                             f"{self.max_positions} positions")
        self._feature_dim = int(model.config.vision_config.hidden_size)
        self.label_smoothing = float(getattr(model.text_decoder, "label_smoothing", 0.0))
        self.identity = self._fingerprint()

    # ------------------------------------------------------------------ description
    @property
    def prompt_shape(self) -> tuple[int, int]:
        return (self.num_prompt_tokens, self.hidden_size)

    @property
    def feature_dim(self) -> int:
        return self._feature_dim

    def init_args(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "num_prompt_tokens": self.num_prompt_tokens,
                "max_answer_tokens": self.max_answer_tokens, "top_k": self.top_k, "answer_margin": self.answer_margin}

    @property
    def serving_top_k(self) -> int:
        return self.top_k

    def init_scale(self) -> float:
        """Prompts start near zero (uniform in +-0.02, BERT's init scale): close to the unmodified tool, so a
        prompt is what was learned, and the ensemble's average of prompts averages that, not initial noise."""
        return 0.02

    def checkpoint_blocks(self) -> list[nn.Module]:
        """The answer decoder's layers: the prompt enters through their cross-attention (the question encoder runs
        once per chunk, without gradients)."""
        return list(self.model.text_decoder.bert.encoder.layer)

    def _fingerprint(self) -> str:
        probes = ("vision_model.embeddings.class_embedding", "vision_model.post_layernorm.weight",
                  "text_decoder.cls.predictions.bias", "text_encoder.embeddings.LayerNorm.weight")
        return weights_fingerprint("blip_vqa", self.model, probes, len(self.processor.tokenizer))

    # ------------------------------------------------------------------ encoders (prompt-independent)
    def pixel_values(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        return processed_pixels(self.processor.image_processor, images, self.device)

    def image_embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model.vision_model(pixel_values=pixel_values).last_hidden_state

    def tokenize_questions(self, questions: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.processor.tokenizer(list(questions), padding=True, return_tensors="pt")
        return tokens["input_ids"].to(self.device), tokens["attention_mask"].to(self.device)

    def encode_questions(self, image_embeds: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> _Encoded:
        image_mask = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
        states = self.model.text_encoder(
            input_ids=ids, attention_mask=mask, encoder_hidden_states=image_embeds,
            encoder_attention_mask=image_mask, return_dict=True,
        ).last_hidden_state
        return _Encoded(states, mask)

    def answer_ids(self, answer: str) -> list[int]:
        """Token ids of ``answer`` without special tokens."""
        return self.processor.tokenizer(answer, add_special_tokens=False)["input_ids"]

    def encode_answers(self, answers: Sequence[str]) -> _Answers:
        rows = [self.answer_ids(a) for a in answers]
        width = max(len(r) for r in rows) + 1
        inputs = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        targets = torch.full((len(rows), width), -100, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            inputs[i, : len(row) + 1] = torch.tensor([self.bos_id, *row])
            targets[i, : len(row) + 1] = torch.tensor([*row, self.sep_id])
            mask[i, : len(row) + 1] = 1
        return _Answers(inputs.to(self.device), targets.to(self.device), mask.to(self.device))

    def check_instance(self, instance: VqaInstance) -> None:
        """Raise :class:`DataError` naming the record if its texts cannot be trained on."""
        where = instance.source or instance.instance_id
        for field in ("question", "answer", "val_question", "val_answer"):
            if not getattr(instance, field).strip():
                raise DataError(f"{where}: empty {field}")
        for field in ("answer", "val_answer"):
            length = len(self.answer_ids(getattr(instance, field))) + 1
            if length > self.max_answer_tokens:
                raise DataError(f"{where}: {field} {getattr(instance, field)!r} is {length} tokens with [SEP]; "
                                f"the tool decodes at most max_answer_tokens={self.max_answer_tokens}")
        for field in ("question", "val_question"):
            length = len(self.processor.tokenizer(getattr(instance, field))["input_ids"])
            if length > self.max_positions:
                raise DataError(f"{where}: {field} is {length} tokens; the question encoder takes {self.max_positions}")

    # ------------------------------------------------------------------ the prompted decoder
    def _with_prompts(self, encoded: _Encoded, prompts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if prompts is None:
            return encoded.states, encoded.mask
        expected = (encoded.states.shape[0], *self.prompt_shape)
        if tuple(prompts.shape) != expected:
            raise ModelError(f"prompts have shape {tuple(prompts.shape)}, expected {expected}")
        prompts = prompts.to(encoded.states.dtype)
        prompt_mask = (prompts != 0).any(-1).to(encoded.mask.dtype)  # an all-zero token is no token
        return torch.cat([encoded.states, prompts], 1), torch.cat([encoded.mask, prompt_mask], 1)

    def decoder_logits(self, encoded: _Encoded, answers: _Answers, prompts: torch.Tensor | None) -> torch.Tensor:
        states, mask = self._with_prompts(encoded, prompts)
        # no cache: a checkpointed layer runs twice, and would append its keys to a cache twice
        return self.model.text_decoder(
            input_ids=answers.inputs, attention_mask=answers.mask, encoder_hidden_states=states,
            encoder_attention_mask=mask, use_cache=False, return_dict=True,
        ).logits

    @torch.no_grad()
    def greedy(self, encoded: _Encoded, prompts: torch.Tensor | None) -> torch.Tensor:
        """Greedy answers ``[n, <= max_answer_tokens + 1]`` ([DEC] first; ``pad_id`` after [SEP]).

        A plain loop over the decoder's forward (answers are a few tokens), so the cross-attention mask is
        exactly the one training used; BLIP's ``generate`` is the reference it is checked against.
        """
        return self.greedy_with_confidence(encoded, prompts)[0]

    @torch.no_grad()
    def greedy_with_confidence(self, encoded: _Encoded, prompts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`greedy`'s answers and each one's confidence ``[n]``: the product of its tokens' probabilities
        ([SEP] included; an answer cut at ``max_answer_tokens`` counts the tokens it has)."""
        states, mask = self._with_prompts(encoded, prompts)
        n = states.shape[0]
        ids = torch.full((n, 1), self.bos_id, dtype=torch.long, device=states.device)
        done = torch.zeros(n, dtype=torch.bool, device=states.device)
        log_confidence = torch.zeros(n, dtype=torch.float32, device=states.device)
        for _ in range(self.max_answer_tokens):
            logits = self.model.text_decoder(
                input_ids=ids, encoder_hidden_states=states, encoder_attention_mask=mask, use_cache=False,
                return_dict=True,
            ).logits[:, -1]
            log_probs = logits.float().log_softmax(-1)
            best, chosen = log_probs.max(-1)
            log_confidence += torch.where(done, torch.zeros_like(best), best)
            token = torch.where(done, torch.full_like(done, self.pad_id, dtype=torch.long), chosen)
            ids = torch.cat([ids, token[:, None]], 1)
            done |= token == self.sep_id
            if bool(done.all()):
                break
        return ids, log_confidence.exp()

    def _matches(self, generated: torch.Tensor, answers: _Answers) -> list[bool]:
        result = []
        for i in range(generated.shape[0]):
            target = answers.targets[i][answers.targets[i] != -100].tolist()
            result.append(generated[i, 1 : 1 + len(target)].tolist() == target)
        return result

    def decode(self, generated: torch.Tensor) -> list[str]:
        return [normalise_answer(t) for t in self.processor.tokenizer.batch_decode(generated, skip_special_tokens=True)]

    # ------------------------------------------------------------------ training hooks
    def prepare(self, instances: Sequence[VqaInstance]) -> VqaChunk:
        pixel_values = self.pixel_values([item.image for item in instances])
        image_embeds = self.image_embeddings(pixel_values)
        ids, mask = self.tokenize_questions([item.question for item in instances])
        question = self.encode_questions(image_embeds, ids, mask)
        if all(item.val_question == item.question for item in instances):
            val_question = question
        else:
            val_question = self.encode_questions(image_embeds, *self.tokenize_questions([x.val_question for x in instances]))
        return VqaChunk(
            image_embeds.mean(1), question, self.encode_answers([item.answer for item in instances]), val_question,
            self.encode_answers([item.val_answer for item in instances]), pixel_values, ids, mask,
            [item.val_answer for item in instances],
        )

    def instance_losses(self, ctx: VqaChunk, prompts: torch.Tensor) -> torch.Tensor:
        logits = self.decoder_logits(ctx.question, ctx.answers, prompts)
        per_token = F.cross_entropy(
            logits.float().transpose(1, 2), ctx.answers.targets, ignore_index=-100, reduction="none",
            label_smoothing=self.label_smoothing,
        )
        return per_token.sum(1)

    def gate(self, ctx: VqaChunk, prompts: torch.Tensor) -> list[GateResult]:
        generated = self.greedy(ctx.val_question, prompts)
        said = self.decode(generated)
        return [
            GateResult() if ok else GateResult((Rejection("wrong answer", f"answered {said[i]!r}, expected "
                                                                         f"{normalise_answer(ctx.val_texts[i])!r}"),))
            for i, ok in enumerate(self._matches(generated, ctx.val_answers))
        ]

    def quick_gate(self, ctx: VqaChunk, prompts: torch.Tensor) -> list[GateResult]:
        predicted = self.decoder_logits(ctx.val_question, ctx.val_answers, prompts).argmax(-1)
        targets = ctx.val_answers.targets
        correct = ((predicted == targets) | (targets == -100)).all(1).tolist()
        return [GateResult() if ok else GateResult.failed("wrong answer", "teacher-forced") for ok in correct]

    def pool_features(self, ctx: VqaChunk) -> torch.Tensor:
        return ctx.features

    def unmodified_outputs(self, ctx: VqaChunk) -> torch.Tensor:
        """BLIP's own ``generate``, one instance at a time (it takes no question padding mask)."""
        rows = []
        for i in range(ctx.pixel_values.shape[0]):
            length = int(ctx.question_mask[i].sum())
            rows.append(self.model.generate(
                pixel_values=ctx.pixel_values[i : i + 1], input_ids=ctx.question_ids[i : i + 1, :length],
                max_new_tokens=self.max_answer_tokens, do_sample=False, num_beams=1,
            )[0])
        return _pad_rows(rows, self.pad_id)

    def prompted_outputs(self, ctx: VqaChunk, prompts: torch.Tensor | None) -> torch.Tensor:
        generated = self.greedy(ctx.question, prompts)
        return _pad_rows(list(generated), self.pad_id)

    # ------------------------------------------------------------------ serving
    def answer(self, lookup: PromptLookup, images: Sequence[torch.Tensor], questions: Sequence[str]) -> list[str]:
        """Answer ``questions[i]`` about ``images[i]`` (``[3, H, W]`` uint8) with the pool's ensembled prompt."""
        if len(images) != len(questions) or not questions:
            raise DataError(f"answer needs one question per image, got {len(images)} images and {len(questions)} questions")
        image_embeds = self.image_embeddings(self.pixel_values(images))
        encoded = self.encode_questions(image_embeds, *self.tokenize_questions(questions))
        prompts = lookup.prompts_for(None, image_embeds.mean(1))
        if prompts is None or self.answer_margin is None:
            return self.decode(self.greedy(encoded, prompts))
        return served_answers(*self.both_answers(encoded, prompts), self.answer_margin)

    def both_answers(self, encoded: _Encoded, prompts: torch.Tensor
                     ) -> tuple[list[str], torch.Tensor, list[str], torch.Tensor]:
        """The unmodified answers and their confidences, then the prompted ones and theirs (``answer_margin``
        decides between them)."""
        plain, plain_confidence = self.greedy_with_confidence(encoded, None)
        prompted, prompted_confidence = self.greedy_with_confidence(encoded, prompts)
        return self.decode(plain), plain_confidence, self.decode(prompted), prompted_confidence

    def evaluate(self, lookup: PromptLookup, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Exact-match accuracy (normalised text) of the answers, without prompts and with the pool."""
        gold = [normalise_answer(a) for a in batch["answers"]]
        no_prompt = self.answer(NoPrompt(), batch["images"], batch["questions"])
        pooled = self.answer(lookup, batch["images"], batch["questions"])
        return {
            "accuracy_no_prompt": torch.tensor([a == g for a, g in zip(no_prompt, gold)], dtype=torch.float),
            "accuracy_pool": torch.tensor([a == g for a, g in zip(pooled, gold)], dtype=torch.float),
        }

    def serve_request(self, lookup: PromptLookup, request: dict[str, Any]) -> dict[str, Any]:
        """``{"image": path, "question": text}`` -> ``{"answer": text}``."""
        from clova_train.tools.images import load_image_uint8

        image, question = request.get("image"), request.get("question")
        if not isinstance(image, str) or not image:
            raise DataError("a VQA request needs 'image': a path")
        if not isinstance(question, str) or not question.strip():
            raise DataError("a VQA request needs 'question': a non-empty string")
        return {"answer": self.answer(lookup, [load_image_uint8(Path(image))], [question])[0]}


def prompted_answer_wins(plain_confidence: torch.Tensor, prompted_confidence: torch.Tensor, margin: float
                         ) -> torch.Tensor:
    """Booleans ``[n]``: where the prompted answer is served (its confidence beats the unmodified one's by more than
    ``margin``)."""
    return prompted_confidence > plain_confidence + margin


def served_answers(plain: Sequence[str], plain_confidence: torch.Tensor, prompted: Sequence[str],
                   prompted_confidence: torch.Tensor, margin: float) -> list[str]:
    """The answers served at ``margin``: each question's prompted answer where it wins
    (:func:`prompted_answer_wins`), else the unmodified one."""
    wins = prompted_answer_wins(plain_confidence, prompted_confidence, margin).tolist()
    return [p if win else a for a, p, win in zip(plain, prompted, wins)]


def honour_cross_attention_masks(model: nn.Module) -> int:
    """Make BLIP's text cross-attention apply its attention mask, if this transformers version drops it.

    In transformers 5.x ``BlipTextSelfAttention`` reads the cross-attention mask from an
    ``encoder_attention_mask`` argument that its caller never passes, so padded question tokens and masked
    prompt tokens are attended to. A probe detects that; then a forward pre-hook on each cross-attention
    module of *this* model hands it the mask it was given. Returns the number of modules hooked (0 when
    the library applies the mask itself).
    """
    cross = [layer.crossattention.self for layer in model.modules() if hasattr(layer, "crossattention")]
    if not cross or _mask_applied(model):
        return 0

    def pass_mask(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("encoder_hidden_states") is not None and kwargs.get("encoder_attention_mask") is None:
            kwargs["encoder_attention_mask"] = kwargs.get("attention_mask")
        return args, kwargs

    for module in cross:
        module.register_forward_pre_hook(pass_mask, with_kwargs=True)
    if not _mask_applied(model):
        raise ModelError("BLIP's text decoder ignores its cross-attention mask and it could not be fixed; "
                         "batched questions and masked prompt tokens would change the answers")
    return len(cross)


@torch.no_grad()
def _mask_applied(model: nn.Module) -> bool:
    """Does a masked extra encoder token leave the decoder's logits unchanged?"""
    text = model.config.text_config
    decoder = model.text_decoder
    generator = torch.Generator().manual_seed(0)
    device = next(decoder.parameters()).device
    states = torch.randn(2, 3, text.hidden_size, generator=generator).to(device)
    extra = torch.cat([states, torch.randn(2, 2, text.hidden_size, generator=generator).to(device)], 1)
    ids = torch.full((2, 2), text.bos_token_id, device=device)
    plain = decoder(input_ids=ids, encoder_hidden_states=states, encoder_attention_mask=torch.ones(2, 3, device=device),
                    use_cache=False).logits
    masked = decoder(input_ids=ids, encoder_hidden_states=extra, use_cache=False,
                     encoder_attention_mask=torch.tensor([[1, 1, 1, 0, 0]] * 2, device=device)).logits
    return torch.allclose(plain, masked, atol=1e-5)


def _pad_rows(rows: list[torch.Tensor], pad: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row.cpu()
    return out

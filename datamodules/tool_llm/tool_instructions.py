"""GPT4Tools instruction data for LoRA fine-tuning: loading, checking, tokenising, batching.

* Files are a JSON list of ``{"instruction", "input", "output"}`` records, or JSONL (one per line).
  A malformed record (bad JSON, missing key, wrong type, empty output) is an error naming the file and
  the record index, or, with ``skip_invalid``, is skipped and counted.
* One :class:`~clova_train.tooluse.prompt_template.PromptTemplate` formats training, evaluation and serving.
* The loss covers exactly the response tokens: the prompt and response are tokenised together, and a
  token is a label when its character offsets lie in the response. A sample with a token that spans the
  boundary (mis-tokenised) or longer than ``max_length`` is never truncated: it is left out and reported.
* Batches are padded to their longest sample; ``group_by_length`` groups samples of similar length (the
  sampler shuffles mega-batches of 50 global batches and sorts each by length).
* On N ranks each step's N batches together are the one-device batch of ``batch_size x N`` samples, each
  evaluation sample is scored on exactly one rank, and a checkpoint taken inside an epoch resumes at the next
  batch (:mod:`clova_train.datamodules.tool_llm.sharding`).

The data report (:attr:`ToolInstructionDataModule.report`) counts kept, too long, mis-tokenised and
invalid samples per split, lists their indices, and is written to ``<default_root_dir>/data_report.json``; for the
synthetic data it also holds the template split (``template_split``: the rule, the seed, each split's templates).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from clova_train.core.distributed import data_parallel
from clova_train.core.errors import DataError
from clova_train.core.safe_files import ReadLimits, parse_json, read_text
from clova_train.datamodules.tool_llm.sharding import (
    IGNORE_INDEX, GlobalBatchSampler, ShardedEvalSampler, WeightlessPadding,
)
from clova_train.tooluse.prompt_template import PromptTemplate

RECORD_KEYS = ("instruction", "input", "output")
RECORD_FILE_LIMITS = ReadLimits(max_depth=16)  # records are flat objects of strings


def load_records(path: str | Path, skip_invalid: bool = False) -> tuple[list[dict[str, str]], list[tuple[int, str]]]:
    """Records of a JSON or JSONL file, and the (index, reason) of the invalid ones that were skipped."""
    path = Path(path)
    text = read_text(path, "instruction file")
    raw: list[Any] = []
    if text.lstrip().startswith("["):
        raw = parse_json(text, f"instruction file {path}", RECORD_FILE_LIMITS)
        if not isinstance(raw, list):
            raise DataError(f"instruction file {path}: expected a JSON list of records")
    else:
        for line_no, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                raw.append(parse_json(line, f"{path}: record {len(raw)} (line {line_no})", RECORD_FILE_LIMITS))
            except DataError as err:
                if not skip_invalid:
                    raise
                raw.append(err)
    records, skipped = [], []
    for index, record in enumerate(raw):
        problem = _record_problem(record)
        if problem is None:
            records.append({k: record.get(k, "") for k in RECORD_KEYS})
        elif skip_invalid:
            skipped.append((index, problem))
        else:
            raise DataError(f"{path}: record {index}: {problem}")
    return records, skipped


def _record_problem(record: Any) -> str | None:
    if isinstance(record, Exception):
        return f"not valid JSON ({record})"
    if not isinstance(record, dict):
        return f"expected an object with keys {list(RECORD_KEYS)}, got {type(record).__name__}"
    for key in ("instruction", "output"):
        if key not in record:
            return f"missing key {key!r}"
    for key in RECORD_KEYS:
        if key in record and not isinstance(record[key], str):
            return f"{key!r} must be a string, got {type(record[key]).__name__}"
        if key in record:
            try:
                record[key].encode("utf-8")
            except UnicodeEncodeError as err:
                return f"{key!r} holds a lone surrogate ({record[key][err.start]!r} at character {err.start}), which no tokenizer can encode"
    if not record["output"].strip():
        return "empty 'output'"
    return None


@dataclass
class EncodedSample:
    input_ids: list[int]
    labels: list[int]


def max_characters(tokenizer: Any, max_length: int) -> int:
    """A text longer than this many characters cannot fit in ``max_length`` tokens of ``tokenizer``: no token covers
    more characters than its longest vocabulary entry, and a factor of 4 covers normalisers that fold several
    characters into one (Unicode compositions). Records are measured against it before they are tokenised, so a
    record of hundreds of megabytes is reported as too long instead of taking the tokenizer down."""
    vocabulary = tokenizer.get_vocab()
    longest = max((len(token) for token in vocabulary), default=1)
    return 4 * max(longest, 1) * max_length


def encode_record(
    tokenizer: Any, template: PromptTemplate, record: dict[str, str], max_length: int, max_chars: int | None = None
) -> EncodedSample | str:
    """Token ids and labels (response tokens only, then EOS), or the reason the sample is left out.

    ``max_chars`` (see :func:`max_characters`): a longer text is left out as too long without being tokenised."""
    prompt = template.prompt(record["instruction"], record["input"])
    if max_chars is not None and len(prompt) + len(record["output"]) > max_chars:
        return (f"too long: {len(prompt) + len(record['output']):,} characters, more than {max_length} tokens can "
                f"hold ({max_chars:,})")
    encoded = tokenizer(prompt + record["output"], return_offsets_mapping=True)
    boundary = len(prompt)
    labels = []
    for token, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"]):
        if end <= boundary or start == end:  # prompt tokens and special tokens (empty span)
            labels.append(IGNORE_INDEX)
        elif start >= boundary:
            labels.append(token)
        else:
            return f"mis-tokenised: token {token} spans the prompt/response boundary (characters {start}-{end})"
    ids = list(encoded["input_ids"])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
        labels.append(tokenizer.eos_token_id)
    if len(ids) > max_length:
        return f"too long: {len(ids)} tokens > max_length {max_length}"
    if all(label == IGNORE_INDEX for label in labels):
        return "mis-tokenised: no response tokens"
    return EncodedSample(ids, labels)


@dataclass
class SplitReport:
    """What happened to each record of one split."""

    file: str
    records: int = 0
    kept: int = 0
    too_long: list[int] = field(default_factory=list)
    mis_tokenised: list[int] = field(default_factory=list)
    invalid: list[tuple[int, str]] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.file}: {self.kept} of {self.records} samples kept; {len(self.too_long)} too long, "
            f"{len(self.mis_tokenised)} mis-tokenised, {len(self.invalid)} invalid (skipped)"
        )

    def left_out(self, shown: int = 10) -> str:
        """The records left out by reason, the first ``shown`` of each by their index in the file."""
        parts = []
        for reason, indices in (("too long", self.too_long), ("mis-tokenised", self.mis_tokenised),
                                ("invalid", [index for index, _ in self.invalid])):
            if indices:
                listed = ", ".join(map(str, indices[:shown])) + (", ..." if len(indices) > shown else "")
                parts.append(f"{reason}: record {listed}")
        return "; ".join(parts)


def report_split(report: SplitReport) -> None:
    """The split's counts in the log: a warning naming the records left out when there are any."""
    if report.kept < report.records:
        rank_zero_warn(f"data: {report.summary()}; {report.left_out()} (every one, with its reason, in "
                       "data_report.json)")
    else:
        rank_zero_info(f"data: {report.summary()}")


class EncodedInstructions(torch.utils.data.Dataset):
    """Tokenised samples of one split, with their source records (for evaluation)."""

    def __init__(
        self, path: str | Path, tokenizer: Any, template: PromptTemplate, max_length: int, skip_invalid: bool
    ) -> None:
        records, invalid = load_records(path, skip_invalid)
        self.report = SplitReport(str(path), records=len(records) + len(invalid), invalid=invalid)
        self.samples: list[EncodedSample] = []
        self.records: list[dict[str, str]] = []
        max_chars = max_characters(tokenizer, max_length)
        skipped = {index for index, _ in invalid}
        indices = [index for index in range(self.report.records) if index not in skipped]  # in the file, as invalid's
        for index, record in zip(indices, records):
            result = encode_record(tokenizer, template, record, max_length, max_chars)
            if isinstance(result, str):
                (self.report.too_long if result.startswith("too long") else self.report.mis_tokenised).append(index)
            else:
                self.samples.append(result)
                self.records.append(record)
        self.report.kept = len(self.samples)
        if not self.samples:
            raise DataError(f"{path}: no usable samples ({self.report.summary()})")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"index": index, "input_ids": self.samples[index].input_ids, "labels": self.samples[index].labels}

    @property
    def lengths(self) -> list[int]:
        return [len(s.input_ids) for s in self.samples]


class PadToLongest:
    """Collate training samples, padding to the longest in the batch (labels padded with -100)."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(item["input_ids"]) for item in items)
        ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(items), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, item in enumerate(items):
            n = len(item["input_ids"])
            ids[row, :n] = torch.tensor(item["input_ids"])
            labels[row, :n] = torch.tensor(item["labels"])
            mask[row, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class PromptsForGeneration:
    """Collate evaluation samples: left-padded prompts, and the reference responses as text."""

    def __init__(self, tokenizer: Any, template: PromptTemplate, records: list[dict[str, str]]) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.records = records

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        records = [self.records[item["index"]] for item in items]
        references = [None if item.get("padding") else r["output"] for item, r in zip(items, records)]
        prompts = [self.template.prompt(r["instruction"], r["input"]) for r in records]
        encoded = [self.tokenizer(p)["input_ids"] for p in prompts]
        width = max(len(e) for e in encoded)
        pad = self.tokenizer.pad_token_id
        ids = torch.full((len(items), width), pad, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, e in enumerate(encoded):
            ids[row, width - len(e):] = torch.tensor(e)
            mask[row, width - len(e):] = 1
        return {"input_ids": ids, "attention_mask": mask, "references": references}


class ToolInstructionDataModule(LightningDataModule):
    """GPT4Tools-format instruction files -> batches for LoRA fine-tuning and SR evaluation.

    Args:
        train_file: training records (JSON list or JSONL).
        tokenizer: tokenizer directory or hub id (usually the model's).
        val_file: validation records (generation + SR metrics in ``validate`` and after each epoch).
        test_file: test records (e.g. unseen tools) for ``test``.
        template: the prompt template (shared with evaluation and the export).
        max_length: samples longer than this are left out and reported, never truncated.
        batch_size: training samples per batch (per device).
        eval_batch_size: prompts per generation batch.
        group_by_length: batch samples of similar length together (less padding).
        skip_invalid: skip and count malformed records instead of failing on the first one.
        num_workers: DataLoader worker processes.
        seed: shuffling seed.
    """

    def __init__(
        self,
        train_file: str,
        tokenizer: str,
        val_file: str | None = None,
        test_file: str | None = None,
        template: PromptTemplate = PromptTemplate(),
        max_length: int = 2048,
        batch_size: int = 4,
        eval_batch_size: int = 8,
        group_by_length: bool = True,
        skip_invalid: bool = False,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.train_file, self.val_file, self.test_file = train_file, val_file, test_file
        self.tokenizer_name = tokenizer
        self.template = template
        self.max_length = max_length
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.group_by_length = group_by_length
        self.skip_invalid = skip_invalid
        self.num_workers = num_workers
        self.seed = seed
        self.tokenizer: Any = None
        self.splits: dict[str, EncodedInstructions] = {}
        self._resume: tuple[int, int] | None = None  # (epoch, batches consumed) of the checkpoint resumed from
        self._train_sampler: GlobalBatchSampler | None = None

    def load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_name)
        except (OSError, ValueError) as err:
            raise DataError(f"cannot load tokenizer {self.tokenizer_name!r}: {err}") from err
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
        return tokenizer

    def setup(self, stage: str | None = None) -> None:
        if self.tokenizer is None:
            self.tokenizer = self.load_tokenizer()
        files = {"train": self.train_file, "val": self.val_file, "test": self.test_file}
        for split, path in files.items():
            if path and split not in self.splits:
                self.splits[split] = EncodedInstructions(path, self.tokenizer, self.template, self.max_length, self.skip_invalid)
                report_split(self.splits[split].report)
        self._write_report()

    @property
    def report(self) -> dict[str, SplitReport]:
        return {split: data.report for split, data in self.splits.items()}

    @property
    def seen_tools(self) -> list[str]:
        """Tools called in the training data (the ``seen`` group of the SR metrics)."""
        from clova_train.tooluse.react import parse_react

        if "train" not in self.splits:
            return []
        return sorted({s.action for r in self.splits["train"].records for s in parse_react(r["output"]).tool_steps})

    def _write_report(self) -> None:
        if self.trainer is None or not self.trainer.is_global_zero:
            return
        from dataclasses import asdict

        from clova_train.core.atomic import write_json_atomic

        write_json_atomic(Path(self.trainer.default_root_dir) / "data_report.json",
                          {**{k: asdict(v) for k, v in self.report.items()}, **self.report_extras()})

    def report_extras(self) -> dict[str, Any]:
        """What the data report holds beside the per-split counts (the synthetic data's template split)."""
        return {}

    def state_dict(self) -> dict[str, int]:
        """Where training is inside its epoch (saved in checkpoints; a resumed run continues from there)."""
        trainer = self.trainer
        if trainer is None or not trainer.training:
            return {}
        return {"epoch": trainer.current_epoch, "batches_consumed": trainer.fit_loop.epoch_loop.batch_progress.current.processed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state:
            self._resume = (int(state["epoch"]), int(state["batches_consumed"]))
            if self._train_sampler is not None:  # built already (sharded strategies restore after set-up)
                self._train_sampler.skip(*self._resume)

    def train_dataloader(self) -> DataLoader:
        data = self.splits["train"]
        world, rank = data_parallel(self.trainer)
        sampler = GlobalBatchSampler(data.lengths, self.batch_size, world, rank, self.seed, self.group_by_length)
        if self._resume is not None:
            sampler.skip(*self._resume)
        self._train_sampler = sampler
        return DataLoader(
            WeightlessPadding(data), batch_size=self.batch_size, sampler=sampler,
            collate_fn=PadToLongest(self.tokenizer.pad_token_id), num_workers=self.num_workers,
        )

    def _eval_loader(self, split: str) -> DataLoader:
        if split not in self.splits:
            raise DataError(f"no {split}_file configured for this data module")
        data = self.splits[split]
        collate = PromptsForGeneration(self.tokenizer, self.template, data.records)
        world, rank = data_parallel(self.trainer)
        return DataLoader(WeightlessPadding(data), batch_size=self.eval_batch_size,
                          sampler=ShardedEvalSampler(len(data), world, rank), collate_fn=collate,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        return self._eval_loader("val") if self.val_file else []

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")


class SyntheticToolDataModule(ToolInstructionDataModule):
    """:class:`ToolInstructionDataModule` over synthetic GPT4Tools data, written to ``root`` if missing.

    The three files are split by request template, and by tool for the unseen tools
    (:mod:`~clova_train.datamodules.tool_llm.template_split`, seeded with ``render_seed``): no validation or test
    request is written from a template any training request is written from.

    * ``train.json``: seen tools (training templates): positive, context and negative samples;
    * ``val.json``: seen tools (validation templates), the validation share of the unseen tools (GPT4Tools Table 6)
      and negatives (validation chit-chat): what a run is checked and chosen on;
    * ``test.json``: seen tools (test templates), the other unseen tools and negatives (test chit-chat): reported
      once, after every choice was made;
    * ``template_split.json``: the rule, the seed and each split's templates and unseen tools (also in the run's
      ``data_report.json``).

    Args:
        root: folder of the generated files.
        tokenizer: tokenizer directory or hub id.
        conversations_per_tool: training conversations per seen tool.
        eval_conversations_per_tool: validation / test conversations per tool.
        negatives: no-tool samples in the training set (a quarter as many in validation and in test).
        tools_per_prompt: tools listed in each prompt (GPT4Tools lists all of them; fewer keeps prompts short).
        render_seed: seed of the generator and of the template split.
        **kwargs: the other arguments of :class:`ToolInstructionDataModule`.
    """

    SPLIT_LAYOUT = "by request template and unseen tool, train/val/test (template_split.py, v1)"

    def __init__(
        self,
        root: str = "checkpoints/data/synthetic_tools",
        tokenizer: str = "checkpoints/models/tiny-llama",
        conversations_per_tool: int = 8,
        eval_conversations_per_tool: int = 1,
        negatives: int = 40,
        tools_per_prompt: int = 4,
        render_seed: int = 0,
        **kwargs: Any,
    ) -> None:
        root_path = Path(root)
        # The CLI passes None for unset arguments, so None means "use the generated file" here.
        kwargs["val_file"] = kwargs.get("val_file") or str(root_path / "val.json")
        kwargs["test_file"] = kwargs.get("test_file") or str(root_path / "test.json")
        super().__init__(train_file=str(root_path / "train.json"), tokenizer=tokenizer, **kwargs)
        self.root = root_path
        self.generation = {
            "conversations_per_tool": conversations_per_tool,
            "eval_conversations_per_tool": eval_conversations_per_tool,
            "negatives": negatives,
            "tools_per_prompt": tools_per_prompt,
            "render_seed": render_seed,
            "split": self.SPLIT_LAYOUT,  # data written under another layout is refused, not silently reused
        }

    def prepare_data(self) -> None:
        from clova_train.core.atomic import write_json_atomic
        from clova_train.datamodules.tool_llm.template_split import split_templates
        from clova_train.datamodules.tool_llm.tool_conversations import SEEN_TOOLS, synthetic_records, write_records
        from clova_train.synthetic.shapes import generated_before, record_generation

        if generated_before(self.root, self.generation):
            return
        g = self.generation
        seed, seen, per_tool, per_prompt = g["render_seed"], list(SEEN_TOOLS), g["eval_conversations_per_tool"], g["tools_per_prompt"]
        split = split_templates(seed)
        write_records(self.root / "train.json", synthetic_records(
            seen, g["conversations_per_tool"], g["negatives"], per_prompt, seed, templates=split.templates["train"]))
        for offset, name in ((1, "val"), (2, "test")):
            records = synthetic_records(seen, per_tool, max(1, g["negatives"] // 4), per_prompt, seed + offset,
                                        templates=split.templates[name])
            records += synthetic_records(split.unseen_tools[name], per_tool, 0, per_prompt, seed + 2 + offset,
                                         templates=split.templates[name])
            write_records(self.root / f"{name}.json", records)
        write_json_atomic(self.root / "template_split.json", split.describe())
        record_generation(self.root, self.generation)

    def report_extras(self) -> dict[str, Any]:
        split = self.root / "template_split.json"
        if not split.is_file():
            return {}
        from clova_train.core.safe_files import read_json

        return {"template_split": read_json(split, "template split record")}

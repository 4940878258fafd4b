"""LoRA fine-tuning of a tool-using LLM: data checks, label masking, training, SR, export (several processes:
test_lora_distributed.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clova_train.datamodules import SyntheticToolDataModule, ToolInstructionDataModule
from clova_train.datamodules.tool_llm.tool_instructions import IGNORE_INDEX, encode_record, load_records
from clova_train.core.errors import DataError, ModelError
from helpers.common import REPO


def data_module(root: Path, tokenizer: Path, **kwargs) -> SyntheticToolDataModule:
    return SyntheticToolDataModule(str(root), str(tokenizer), conversations_per_tool=8, negatives=40,
                                   max_length=1024, batch_size=8, eval_batch_size=16, **kwargs)


def test_labels_cover_exactly_the_response(tool_data_root: Path, tiny_llama_dir: Path) -> None:
    dm = data_module(tool_data_root, tiny_llama_dir)
    dm.setup()
    template = dm.template
    for record in dm.splits["train"].records[:20]:
        prompt = template.prompt(record["instruction"], record["input"])
        sample = encode_record(dm.tokenizer, template, record, 4096)
        encoded = dm.tokenizer(prompt + record["output"], return_offsets_mapping=True)
        for k, (token, (start, end)) in enumerate(zip(encoded["input_ids"], encoded["offset_mapping"])):
            in_response = start >= len(prompt) and end > start
            assert sample.labels[k] == (token if in_response else IGNORE_INDEX), (k, start, end)
        assert sample.labels[-1] == sample.input_ids[-1] == dm.tokenizer.eos_token_id
        response = [t for t, label in zip(sample.input_ids, sample.labels) if label != IGNORE_INDEX]
        assert dm.tokenizer.decode(response[:-1]) == record["output"]


def test_over_length_samples_are_reported_not_truncated(tool_data_root: Path, tiny_llama_dir: Path) -> None:
    dm = ToolInstructionDataModule(str(tool_data_root / "train.json"), str(tiny_llama_dir), max_length=420)
    dm.setup()
    report = dm.report["train"]
    assert report.too_long, "the fixture needs samples over 420 tokens"
    assert report.kept + len(report.too_long) + len(report.mis_tokenised) == report.records
    assert max(dm.splits["train"].lengths) <= 420
    assert "too long" in report.summary()


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('[{"instruction": "a", "output": "b"}, {"instruction": "a"}]', "record 1: missing key 'output'"),
        ('[{"instruction": "a", "input": 3, "output": "b"}]', "record 0: 'input' must be a string, got int"),
        ('[{"instruction": "a", "output": "  "}]', "record 0: empty 'output'"),
        ('["just text"]', "record 0: expected an object"),
        ('[{"instruction": "a", "output": "b"},', "not valid JSON"),
        ('{"instruction": "a", "output": "b"}\n{"instruction": oops}\n', "record 1 (line 2) is not valid JSON"),
    ],
)
def test_malformed_records_name_file_and_index(tmp_path: Path, content: str, message: str) -> None:
    path = write(tmp_path / "data.jsonl", content)
    with pytest.raises(DataError, match=f"{path.name}.*{message}".replace("(", r"\(").replace(")", r"\)")):
        load_records(path)


def test_skip_invalid_counts_instead_of_failing(tmp_path: Path) -> None:
    path = write(tmp_path / "data.json", '[{"instruction": "a", "output": "b"}, {"instruction": "a"}, {"output": "c"}]')
    records, skipped = load_records(path, skip_invalid=True)
    assert len(records) == 1 and [i for i, _ in skipped] == [1, 2]
    assert "missing key 'instruction'" in skipped[1][1]


def test_records_left_out_are_counted_and_named_by_their_index_in_the_file(tmp_path: Path) -> None:
    from clova_train.datamodules.tool_llm.tool_instructions import EncodedInstructions, report_split
    from clova_train.tools.tiny_common import clip_bpe_tokenizer
    from clova_train.tooluse.prompt_template import PromptTemplate

    lines = [json.dumps({"instruction": "a", "output": "b"}), "{oops",
             json.dumps({"instruction": "x " * 500, "output": "c"}), json.dumps({"instruction": "d", "output": "e"})]
    path = write(tmp_path / "data.jsonl", "\n".join(lines))
    tokenizer = clip_bpe_tokenizer(tmp_path / "tokenizer", max_length=4096)
    data = EncodedInstructions(path, tokenizer, PromptTemplate(), max_length=200, skip_invalid=True)
    assert (data.report.kept, data.report.too_long, [i for i, _ in data.report.invalid]) == (2, [2], [1])
    with pytest.warns(UserWarning, match=r"data.jsonl: 2 of 4 samples kept; 1 too long, 0 mis-tokenised, 1 invalid "
                                         r"\(skipped\); too long: record 2; invalid: record 1"):
        report_split(data.report)


def test_lora_targets_are_checked(tiny_llama_dir: Path) -> None:
    from clova_train.models.lora_tool_llm import check_lora_targets, load_causal_lm

    model = load_causal_lm(str(tiny_llama_dir))
    check_lora_targets(model, ["q_proj", "k_proj", "v_proj", "o_proj"])
    with pytest.raises(ModelError, match=r"\['query_key_value'\] not found in LlamaForCausalLM; its linear layers are: \[.*'q_proj'"):
        check_lora_targets(model, ["q_proj", "query_key_value"])


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_response_loss_equals_the_models_own_loss(tool_data_root: Path, tiny_llama_dir: Path, padding_side: str) -> None:
    """The response-logits shortcut gives the loss and LoRA gradients of ``model(labels=...)``."""
    from clova_train.models import LoraToolLLM
    from clova_train.models.lora_tool_llm import is_right_padded

    dm = data_module(tool_data_root, tiny_llama_dir)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert (batch["attention_mask"] == 0).any(), "the batch needs padding"
    if padding_side == "left":  # rolled so the padding comes first: the mask must then be kept
        shifts = (batch["attention_mask"] == 0).sum(1)
        batch = {k: torch.stack([row.roll(int(n)) for row, n in zip(v, shifts)]) for k, v in batch.items()}
    assert is_right_padded(batch["attention_mask"]) == (padding_side == "right")
    module = LoraToolLLM(str(tiny_llama_dir), lora_dropout=0.0)
    module.configure_model()
    torch.manual_seed(0)
    for p in module.model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)  # LoRA B starts at 0: give both factors a gradient
    results = []
    for shortcut in (True, False):
        module.hparams.response_logits_only = shortcut
        module.model.zero_grad()
        loss = module.response_loss(batch) if shortcut else module.model(**batch, use_cache=False).loss
        loss.backward()
        grads = [p.grad.clone() for p in module.model.parameters() if p.requires_grad]
        results.append((loss.detach(), grads))
    (fast, fast_grads), (full, full_grads) = results
    torch.testing.assert_close(fast, full, rtol=1e-5, atol=1e-6)
    for a, b in zip(fast_grads, full_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _trainer(run_dir: Path):
    from lightning import Trainer

    return Trainer(accelerator="cpu", max_epochs=6, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, check_val_every_n_epoch=100,
                   default_root_dir=str(run_dir))


def _module(tiny_llama_dir: Path):
    from lightning import seed_everything

    from clova_train.models import LoraToolLLM

    seed_everything(0)
    return LoraToolLLM(str(tiny_llama_dir), lr=0.01, warmup_steps=10, max_new_tokens=48)


@pytest.fixture(scope="module")
def trained(tool_data_root: Path, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A short LoRA fine-tune (six epochs, no validation: the learning test below measures before and after)."""
    run_dir = tmp_path_factory.mktemp("lora-run")
    module = _module(tiny_llama_dir)
    dm = data_module(tool_data_root, tiny_llama_dir)
    _trainer(run_dir).fit(module, dm)
    return module, dm, run_dir


@pytest.mark.learning
def test_short_fine_tune_raises_success_rate(trained, tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The untrained adapter (LoRA's B starts at zero: the base model) against the fine-tuned one, same seed."""
    module, dm, _ = trained
    (before,) = _trainer(tmp_path).validate(_module(tiny_llama_dir), dm)
    (after,) = _trainer(tmp_path).validate(module, dm)
    assert after["val/all/SR"] > before["val/all/SR"] + 0.2
    assert after["val/all/SR_t"] > before["val/all/SR_t"]


def test_run_writes_adapter_and_data_report(trained) -> None:
    _, _, run_dir = trained
    adapter = run_dir / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors", "prompt_template.json", "tokenizer.json"} <= {
        p.name for p in adapter.iterdir()
    }
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (16, 16, 0.05)
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    report = json.loads((run_dir / "data_report.json").read_text())
    assert report["train"]["kept"] == report["train"]["records"]


def test_export_loads_with_plain_transformers_and_matches_module(trained, tmp_path: Path, tiny_llama_dir: Path) -> None:
    from clova_train.cli import main

    module, dm, run_dir = trained
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "-o", str(out), "--merged", "--dtype=float32"]) == 0  # exact comparison
    record = dm.splits["val"].records[0]
    prompt = dm.template.prompt(record["instruction"], record["input"])
    encoded = dm.tokenizer(prompt, return_tensors="pt")
    module.eval()
    expected = module.generate_responses(encoded["input_ids"], encoded["attention_mask"])[0]
    code = f"""
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
from peft import PeftModel
out, base, prompt = {str(out)!r}, {str(tiny_llama_dir)!r}, {prompt!r}
tok = AutoTokenizer.from_pretrained(out + "/merged")
enc = tok(prompt, return_tensors="pt")
texts = []
for model in (AutoModelForCausalLM.from_pretrained(out + "/merged"),
              PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out + "/adapter")):
    ids = model.generate(**enc, max_new_tokens=48, do_sample=False, stop_strings=["Observation:"], tokenizer=tok)
    text = tok.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    texts.append(text[: text.find("Observation:") + len("Observation:")] if "Observation:" in text else text)
assert "clova_train" not in sys.modules
print(json.dumps(texts))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    merged_text, adapter_text = json.loads(result.stdout.strip().splitlines()[-1])
    assert merged_text == adapter_text == expected


def test_export_from_checkpoint_matches_run_adapter(trained, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from clova_train.cli import main

    _, _, run_dir = trained
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    assert main(["export", str(ckpt), "-o", str(tmp_path / "from_ckpt")]) == 0
    a = load_file(str(tmp_path / "from_ckpt" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_chat_template_renders_the_training_prompt_token_for_token(trained, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from clova_train.cli import main

    _, dm, run_dir = trained
    assert main(["export", str(run_dir), "-o", str(tmp_path / "export")]) == 0
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "export" / "adapter"))
    records = dm.splits["val"].records[:5] + [{"instruction": "Describe it.", "input": "image/a.png", "output": "x"}]
    for record in records:
        message = dm.template.user_message(record["instruction"], record["input"])
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True)
        assert rendered == dm.template.prompt(record["instruction"], record["input"])
        ids = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert list(ids) == dm.tokenizer(rendered)["input_ids"]
    system = tokenizer.apply_chat_template(
        [{"role": "system", "content": "SYS"}, {"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert system == dm.template.prompt("hi").replace(dm.template.system, "SYS")
    serving = json.loads((tmp_path / "export" / "adapter" / "serving.json").read_text())
    assert serving["stop"] == ["Observation:"] and serving["temperature"] == 0.0


def test_merged_model_generates_with_plain_transformers_and_stops_at_the_step(trained, tmp_path: Path) -> None:
    """``generate()`` and ``pipeline("text-generation")`` with no extra arguments, in a process without clova_train."""
    from clova_train.cli import main

    module, dm, run_dir = trained
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "-o", str(out), "--merged", "--dtype=float32"]) == 0  # exact comparison
    generation = json.loads((out / "merged" / "generation_config.json").read_text())
    assert "stop_strings" not in generation or generation["stop_strings"] is None
    tool_records = [r for r in dm.splits["val"].records if r["output"].endswith("Observation:")][:4]
    assert tool_records, "the validation split needs tool steps"
    prompts = [dm.template.prompt(r["instruction"], r["input"]) for r in tool_records]
    module.eval()
    expected = []
    for prompt in prompts:
        encoded = dm.tokenizer(prompt, return_tensors="pt")
        expected.append(module.generate_responses(encoded["input_ids"], encoded["attention_mask"])[0])
    code = f"""
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
merged, prompts = {str(out / "merged")!r}, {prompts!r}
tok = AutoTokenizer.from_pretrained(merged)
model = AutoModelForCausalLM.from_pretrained(merged)
texts, piped = [], []
for prompt in prompts:
    enc = tok(prompt, return_tensors="pt")
    ids = model.generate(**enc)
    texts.append(tok.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
generator = pipeline("text-generation", model=merged)
for prompt in prompts:
    piped.append(generator(prompt, return_full_text=False)[0]["generated_text"])
assert "clova_train" not in sys.modules
print(json.dumps([texts, piped]))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    texts, piped = json.loads(result.stdout.strip().splitlines()[-1])
    assert texts == piped == expected
    # generation stops right after the step's "Observation:" (what the model chooses to do is the SR tests' job)
    assert any(text.endswith("Observation:") for text in texts), texts
    assert all(text.endswith("Observation:") for text in texts if "Observation:" in text), texts


def test_exports_stand_alone_named_by_hub_id_or_carrying_their_base(trained, tmp_path: Path, capsys) -> None:
    """The default export: a bf16 merged model with a real context length and filled model cards; the adapter names
    a hub id when given one and else warns; with --copy-base, a moved export loads with clova-train blocked."""
    import shutil

    from clova_train.cli import main
    from helpers.standalone import run_without_package

    module, _, run_dir = trained
    context = module.model.config.max_position_embeddings
    assert main(["export", str(run_dir), "-o", str(tmp_path / "local")]) == 0
    assert "names its base by the local path" in capsys.readouterr().err
    assert main(["export", str(run_dir), "-o", str(tmp_path / "hub"), "--base-model-id", "lmsys/vicuna-13b-v1.5"]) == 0
    assert "local path" not in capsys.readouterr().err
    hub = tmp_path / "hub" / "adapter"
    assert json.loads((hub / "adapter_config.json").read_text())["base_model_name_or_path"] == "lmsys/vicuna-13b-v1.5"
    card = (hub / "README.md").read_text()
    assert card.startswith("---\n") and "base_model: lmsys/vicuna-13b-v1.5" in card and "library_name: peft" in card
    assert '"r": 16' in card and '"target_modules"' in card and "PeftModel.from_pretrained" in card
    assert "No validation metrics were logged" in card  # this fixture's trainer has no logger (see test_model_card)

    out = tmp_path / "export"
    assert main(["export", str(run_dir), "-o", str(out), "--merged", "--copy-base"]) == 0
    assert "local path" not in capsys.readouterr().err
    moved = tmp_path / "elsewhere" / "export"
    shutil.move(str(out), moved)
    merged_card = (moved / "merged" / "README.md").read_text()
    assert "bfloat16" in merged_card and "library_name: transformers" in merged_card
    assert "base/" in (moved / "adapter" / "README.md").read_text()
    got = run_without_package("""
import json, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
merged = AutoModelForCausalLM.from_pretrained("export/merged")
adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("export/base"), "export/adapter")
tokenizer = AutoTokenizer.from_pretrained("export/merged")
ids = tokenizer("Human: hello", return_tensors="pt")["input_ids"]
with torch.no_grad():
    a, b = merged(ids).logits.float(), adapter(ids).logits.float()
same, top = a.argmax(-1) == b.argmax(-1), b.topk(2, -1).values
print(json.dumps({"dtype": str(merged.dtype), "config_dtype": str(merged.config.dtype),
                  "max_length": tokenizer.model_max_length, "adapter_max_length":
                  AutoTokenizer.from_pretrained("export/adapter").model_max_length,
                  "agree": same.float().mean().item(),
                  "agree_clear": (same | (top[..., 0] - top[..., 1] < 0.25)).float().mean().item()}))
""", cwd=moved.parent)
    assert got["dtype"] == "torch.bfloat16" and "bfloat16" in got["config_dtype"]
    assert 0 < got["max_length"] <= context and 0 < got["adapter_max_length"] <= context
    # bf16 rounding may flip a near tie (top-2 logits within 0.25), never a clear choice of the model
    assert got["agree_clear"] == 1.0 and got["agree"] >= 0.6, got


def test_served_llm_from_moved_export_with_copied_base(trained, tmp_path: Path, tiny_llama_dir: Path) -> None:
    import shutil

    from clova_train.cli import main
    from clova_train.tooluse.served_llm import ChatRequest, ServedToolLLM

    module, dm, run_dir = trained
    assert main(["export", str(run_dir), "-o", str(tmp_path / "export"), "--copy-base"]) == 0
    config = json.loads((tmp_path / "export" / "adapter" / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]).is_absolute()
    moved = tmp_path / "moved"
    shutil.move(str(tmp_path / "export"), moved)
    record = next(r for r in dm.splits["val"].records if r["output"].endswith("Observation:"))
    encoded = dm.tokenizer(dm.template.prompt(record["instruction"], record["input"]), return_tensors="pt")
    module.eval()
    expected = module.generate_responses(encoded["input_ids"], encoded["attention_mask"])[0]
    llm = ServedToolLLM.from_export(moved)
    message = [{"role": "user", "content": dm.template.user_message(record["instruction"], record["input"])}]
    short = [{"role": "user", "content": "Hello"}]
    replies = llm.chat_batch([ChatRequest(message, max_tokens=48), ChatRequest(short, max_tokens=5)])
    # as OpenAI and vLLM answer, the stop string ends the reply without being part of it
    assert replies[0].text == expected.removesuffix("Observation:") and replies[0].finish_reason == "stop"
    assert replies[1].completion_tokens <= 5
    # the padded batch answers each request as it would be answered alone
    assert llm.chat_batch([ChatRequest(short, max_tokens=5)])[0].text == replies[1].text


def test_quickstart_llama_keeps_names_whole_and_loads(tmp_path: Path) -> None:
    """The quickstart's recipe (curriculum cut to a few steps): every tool name and synthetic file name is
    one token, embeddings are tied, and model and tokenizer load with plain transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clova_train.datamodules.tool_llm.tool_conversations import ALL_TOOLS
    from clova_train.synthetic.file_names import FILE_NAMES
    from clova_train.quickstart.tiny_llama import QUICKSTART_LLAMA_CONFIG, make_tiny_llama, tool_corpus

    texts, prompts = tool_corpus(0)
    directory = make_tiny_llama(tmp_path / "llama", texts[:20], prompts[:20], pretrain_steps=2, copy_steps=2,
                                skill_documents=40, model_config=QUICKSTART_LLAMA_CONFIG)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory)
    for name in [*ALL_TOOLS, FILE_NAMES[0], FILE_NAMES[-1]]:
        assert len(tokenizer(name, add_special_tokens=False)["input_ids"]) == 1, name
    step = f"Action: {next(iter(ALL_TOOLS))}\nAction Input: {FILE_NAMES[3]}, a red circle"
    assert tokenizer.decode(tokenizer(step, add_special_tokens=False)["input_ids"]) == step
    assert model.config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_quickstart_llama_pretrains_on_no_request_wording_of_any_split() -> None:
    """The tiny Llama's pretraining prompts ask in a wording none of the data's request templates (train, validation
    or test of any seed) or chit-chat questions uses, so held-out requests were never pretrained on."""
    import re

    from clova_train.datamodules.tool_llm.template_split import _pattern, record_template
    from clova_train.datamodules.tool_llm.tool_conversations import CHAIN_COMMANDS, CHAT, COMMANDS
    from clova_train.quickstart.tiny_llama import tool_corpus

    texts, prompts = tool_corpus(0)
    requests = [re.findall(r"^New input: (.*)$", prompt, re.MULTILINE)[-1] for prompt in prompts]
    templates = [r.text for rs in COMMANDS.values() for r in rs] + CHAIN_COMMANDS + [q for q, _ in CHAT]
    patterns = [_pattern(t) for t in templates]
    assert len(set(requests)) > 50
    for request in requests:
        assert not any(p.fullmatch(request) for p in patterns), request
    # every prompt still has a request, tools, steps and chit-chat; the tokenizer's texts are the data's own wordings
    assert any("Action:" in p for p in prompts) and "Name a fruit." in requests
    assert sum(record_template({"instruction": t})[0] is not None for t in texts) == len(texts)


def test_skill_documents_answer_from_their_own_text() -> None:
    """Each lookup document's answers are written earlier in it; copy documents repeat their sequence."""
    import random

    from clova_train.datamodules.tool_llm.tool_conversations import ALL_TOOLS
    from clova_train.synthetic import skill_documents as skills

    rng = random.Random(0)
    for _ in range(50):
        files = skills.files_document(rng).splitlines()
        listed = dict(line.removeprefix("the ").split(" is in ") for line in files[1:] if " is in " in line)
        for line in (line for line in files if line.startswith("Where is the ")):
            thing, path = line.removeprefix("Where is the ").split("? ")
            assert listed[thing] == path
        catalogue = skills.catalogue_document(rng, tuple(ALL_TOOLS)).splitlines()
        entries = {line[2:].split(": Useful to ")[0]: line.split(": Useful to ")[1] for line in catalogue if line.startswith("> ")}
        for request, answer in zip(catalogue[1:], catalogue[2:]):
            if request.startswith("Request: "):
                verb = entries[answer.removeprefix("Entry: ")].split()[0]
                assert verb in request.lower(), (request, answer)
        copy = skills.copy_document(rng, ("Detect Face",)).split("\nAgain: ")
        assert copy[0].removeprefix("Copy: ") == copy[1]
        assert len(listed) == sum(" is in " in line for line in files)


def test_a_model_that_fails_to_load_gets_one_message_naming_it_and_the_cause(tiny_llama_dir: Path, tmp_path: Path,
                                                                             capsys) -> None:
    import shutil

    from clova_train.cli import main
    from clova_train.models.lora_tool_llm import load_causal_lm

    broken = tmp_path / "llama"
    shutil.copytree(tiny_llama_dir, broken)
    weights = broken / "model.safetensors"
    with weights.open("r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)
    with pytest.raises(ModelError, match=rf"cannot load the causal LM from '{broken}': SafetensorError: .*incomplete"):
        load_causal_lm(str(broken))
    code = main(["fit", "--config", str(REPO / "configs/quickstart/tool_llm_lora.yaml"),
                 f"--model.init_args.model_name_or_path={broken}", f"--data.init_args.tokenizer={tiny_llama_dir}",
                 f"--trainer.default_root_dir={tmp_path / 'run'}", "--trainer.logger=false",
                 "--trainer.enable_progress_bar=false", "--data.init_args.root=" + str(tmp_path / "data")])
    err = capsys.readouterr().err
    assert code == 2 and "cannot load the causal LM from" in err and "SafetensorError" in err and "Traceback" not in err


def test_the_frozen_base_is_stored_in_the_training_precision(tool_data_root: Path, tiny_llama_dir: Path,
                                                              tmp_path: Path) -> None:
    """Under bf16-mixed the frozen weights are bfloat16 once (not float32, not a float16 checkpoint's dtype re-cast
    by autocast every step); the LoRA weights stay float32 for the optimizer."""
    from lightning import Trainer

    from clova_train.models import LoraToolLLM

    module = LoraToolLLM(str(tiny_llama_dir), max_new_tokens=8)
    trainer = Trainer(accelerator="cpu", precision="bf16-mixed", max_steps=2, limit_val_batches=0, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path))
    trainer.fit(module, data_module(tool_data_root, tiny_llama_dir))
    frozen = {p.dtype for p in module.model.parameters() if not p.requires_grad}
    trained = {p.dtype for p in module.model.parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16} and trained == {torch.float32}


def test_gradient_checkpointing_acts_in_a_lightning_fit(tool_data_root: Path, tiny_llama_dir: Path,
                                                        tmp_path: Path) -> None:
    """transformers checkpoints a decoder layer only in training mode, and from_pretrained leaves the base in eval mode
    (which Lightning keeps through fit): the activations a training step keeps, measured in the forward pass, must
    shrink with gradient_checkpointing, on the same batch, and the loss must not change."""
    from lightning import Trainer

    from clova_train.models import LoraToolLLM
    from real_size.probe import StepProbe

    kept, losses = {}, {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        module = LoraToolLLM(str(tiny_llama_dir), max_new_tokens=8, lora_dropout=0.0,
                             gradient_checkpointing=checkpointing)
        probe = StepProbe(str(tmp_path / f"probe-{checkpointing}.json"), measure_activations=True)
        trainer = Trainer(accelerator="cpu", max_steps=1, limit_val_batches=0, logger=False, enable_progress_bar=False,
                          enable_checkpointing=False, enable_model_summary=False, callbacks=[probe],
                          default_root_dir=str(tmp_path))
        trainer.fit(module, data_module(tool_data_root, tiny_llama_dir))
        kept[checkpointing] = probe.activation_bytes
        losses[checkpointing] = float(trainer.callback_metrics["train/loss"])
    assert kept[True] < 0.5 * kept[False], kept
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)

"""The LoRA export's model card: front matter, base, data, last validation metrics, how to load."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from clova_train.export.model_card import last_validation_metrics, lora_model_card, run_directory


def fake_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    (run / "logs" / "version_0").mkdir(parents=True)
    (run / "logs" / "version_0" / "metrics.csv").write_text(
        "epoch,step,train/loss,val/all/SR,val/seen/SR_act\n0,9,1.5,,\n0,9,,0.25,0.5\n1,19,0.9,,\n1,19,,0.75,oops\n")
    (run / "logs" / "version_0" / "config.yaml").write_text(yaml.safe_dump({
        "data": {"class_path": "clova_train.datamodules.ToolInstructionDataModule",
                 "init_args": {"train_file": "data/train.json", "tokenizer": "x"}}}))
    (run / "data_report.json").write_text(json.dumps({"train": {"records": 10, "kept": 9, "too_long": [4], "invalid": []}}))
    return run


def test_card_reports_data_metrics_and_a_hub_base(tmp_path: Path) -> None:
    run = fake_run(tmp_path)
    assert run_directory(run / "checkpoints" / "last.ckpt") == run and run_directory(run) == run
    assert last_validation_metrics(run) == {"val/all/SR": 0.75, "val/seen/SR_act": 0.5}  # last value, bad cells skipped
    card = lora_model_card(kind="adapter", base_name="lmsys/vicuna-13b-v1.5", base_copied=False, source=run,
                           hparams={"lr": 3e-4}, adapter_config={"r": 16, "target_modules": ["q_proj"]})
    front = yaml.safe_load(card.split("---")[1])
    assert front["base_model"] == "lmsys/vicuna-13b-v1.5" and front["library_name"] == "peft"
    assert "| `val/all/SR` | 0.750 |" in card and "| `val/seen/SR_act` | 0.500 |" in card
    assert "ToolInstructionDataModule" in card and "data/train.json" in card and "9 of 10 records kept; left out: 1 too long (" in card
    assert '"r": 16' in card and '"lr": 0.0003' in card
    assert 'from_pretrained("lmsys/vicuna-13b-v1.5")' in card


def test_card_of_a_local_base_says_how_to_make_it_portable(tmp_path: Path) -> None:
    base = tmp_path / "my-llama"
    base.mkdir()
    card = lora_model_card(kind="merged", base_name=str(base), base_copied=False, source=tmp_path, hparams={},
                           adapter_config={}, dtype="bfloat16")
    assert "base_model" not in yaml.safe_load(card.split("---")[1])  # the hub validates it: only hub ids go there
    assert "--base-model-id" in card and "No validation metrics were logged" in card and "bfloat16" in card
    copied = lora_model_card(kind="adapter", base_name=str(base), base_copied=True, source=tmp_path, hparams={},
                             adapter_config={})
    assert 'from_pretrained("base/")' in copied


def _tiny_merged(export: Path) -> None:
    """A random-weight one-layer Llama with a byte-level tokenizer (no merges: what ``stop_strings`` needs) and the
    exported chat template, as ``merged/``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from clova_train.tooluse.prompt_template import PromptTemplate

    words = ["<unk>", "<s>", "</s>", *pre_tokenizers.ByteLevel.alphabet()]
    backend = Tokenizer(models.BPE({w: i for i, w in enumerate(words)}, [], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = PromptTemplate().chat_template(bos_token=True)
    tokenizer.save_pretrained(str(export / "merged"))
    config = LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(str(export / "merged"))


def test_the_cards_generate_example_runs_on_a_merged_export(tmp_path: Path, monkeypatch) -> None:
    """The card's load and generate blocks, run as written in the export directory; then the generate block again
    with a model that writes a call, so that the tool round trip (call given back, tool reply, next step) runs."""
    import torch

    from helpers.docs import code_blocks

    _tiny_merged(tmp_path)
    card = tmp_path / "merged" / "README.md"
    card.write_text(lora_model_card(kind="merged", base_name="example/base", base_copied=False, source=tmp_path,
                                    hparams={}, adapter_config={}, dtype="float32"))
    load, generate = code_blocks(card, ("python",))
    assert "apply_chat_template" in generate and "tools=tools" in generate and "stop_strings" in generate
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"print": lambda *args: None}
    quick = generate.replace("max_new_tokens=128", "max_new_tokens=4")  # the random model's text is not the point
    assert quick != generate
    exec(load + quick, namespace)  # noqa: S102 (the card's own example)
    assert namespace["messages"][0]["role"] == "user"

    steps = iter(["hello", "Thought: Do I need to use a tool? Yes\nAction: Detect the Given Object\n"
                  "Action Input: image/cat.png, cat\nObservation:", "Thought: Do I need to use a tool? No\nAI: a cat"])
    prompts = []

    class ScriptedModel:
        def generate(self, input_ids: torch.Tensor, **kwargs: object) -> torch.Tensor:
            return torch.cat([input_ids, input_ids[:, :1]], dim=1)

    class ScriptedTokenizer:
        def __init__(self, real: object) -> None:
            self.real = real

        def apply_chat_template(self, messages: list, **kwargs: object) -> object:
            prompts.append(self.real.apply_chat_template(messages, tokenize=False, tools=kwargs.get("tools"),
                                                         add_generation_prompt=True))
            return self.real.apply_chat_template(messages, **kwargs)

        def decode(self, ids: object, **kwargs: object) -> str:
            return next(steps, "")

    printed = []
    scripted = {"model": ScriptedModel(), "tokenizer": ScriptedTokenizer(namespace["tokenizer"]),
                "print": printed.append}
    exec(generate, scripted)  # noqa: S102
    assert printed == ["hello", "a cat"]
    assert scripted["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"image": "image/cat.png",
                                                                                "object": "cat"}
    assert "Action Input: image/cat.png, cat\nObservation: a cat at [12, 30, 200, 180]\n" in prompts[-1]

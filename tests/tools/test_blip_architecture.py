"""A BLIP whose answer decoder cannot read its question encoding is refused when the tool is built, in one message.

transformers sizes every text cross-attention of ``BlipForQuestionAnswering`` by the vision width, and the answer
decoder reads the question encoder's output, as wide as the text: a BLIP with a wider ViT than its text (a ViT-L
BLIP) fails at its first answer with a shape error deep in the decoder. The real VQA checkpoints use ViT-B (768 and
768); the real-size smoke check (benchmarks/smoke_real.py) first met this.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def test_blip_with_vision_wider_than_text_is_refused_naming_both_widths(tmp_path: Path) -> None:
    from transformers import BlipConfig, BlipForQuestionAnswering

    from clova_train.core.errors import ModelError
    from clova_train.tools.vqa.tiny import build_tiny_blip
    from clova_train.tools.vqa.tool import BlipVqa

    model, processor = build_tiny_blip()
    config = BlipConfig(text_config=model.config.text_config.to_dict(),
                        vision_config={**model.config.vision_config.to_dict(), "hidden_size": 48})
    BlipForQuestionAnswering(config).save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="cross-attends to 48-wide states .* 32-wide"):
        BlipVqa(model_name=str(tmp_path))

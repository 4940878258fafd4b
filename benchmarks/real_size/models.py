"""Random-weight models at the paper configs' real architectures and sizes, saved in the hub checkpoints' layouts
(benchmark scaffolding: not shipped in the wheel).

``make smoke-real`` runs every ``configs/paper/*`` config on these: the real checkpoints cannot be downloaded here,
but shape and key errors, memory and time per step depend on the architecture and its sizes, not on the weight
values. Each builder writes what the real checkpoint directory holds (``config.json`` + safetensors and the
processor or tokenizer files; open_clip's ``local-dir:`` layout for CLIP; the diffusers pipeline folders for
Stable Diffusion), so the tools load them through the same ``from_pretrained`` path as the real ones.

The sizes are those of the checkpoints the configs name (:data:`REAL_SIZES` gives the parameter counts they must
reach). Tokenizers are stand-ins of the real vocabulary size (CLIP's own BPE; BERT word pieces padded with
``[unused]`` entries), since the real vocabularies are not on this machine. The LLM is the one stated exception:
a 0.9B Llama in Vicuna's layout (vocabulary 32,000, head size 128, float16 on disk) instead of the 13B, whose
per-layer figures scale by the width (docs/tool-llm.md measures the 13B layer on a GPU).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

if not __package__:  # run as a script (one build in its own process): real_size is a package of benchmarks/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clova_train.core.errors import ModelError  # noqa: E402
from clova_train.tools.tiny_common import clip_bpe_tokenizer  # noqa: E402
from real_size import model_folder  # noqa: E402


@dataclass(frozen=True)
class RealSize:
    """A real checkpoint's architecture as this module builds it.

    Args:
        name: the model folder's name under the smoke run's model directory.
        checkpoint: the hub checkpoint the paper config names.
        parameters: its parameter count (millions), which the built model must match within 1%.
        builder: the function that writes it, ``(directory) -> directory``.
        stand_in: what differs from the real checkpoint, if anything (printed in the table).
    """

    name: str
    checkpoint: str
    parameters: float
    builder: Callable[[Path], Path]
    stand_in: str = ""


def _fresh(directory: str | Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def open_clip_vit_l14_config() -> dict:
    """open_clip's own ``ViT-L-14`` model config (OpenAI's CLIP ViT-L/14: 24 x 1024 vision, 12 x 768 text)."""
    import open_clip

    return open_clip.get_model_config("ViT-L-14")


def build_clip_vit_l14(directory: str | Path) -> Path:
    """CLIP ViT-L/14 in open_clip's ``local-dir:`` layout (the paper config: ``model_name: ViT-L-14``)."""
    import open_clip

    from clova_train.tools.clip.tool import save_open_clip

    config = open_clip_vit_l14_config()
    torch.manual_seed(0)
    model = open_clip.CLIP(**config)
    model.visual.image_mean, model.visual.image_std = open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD
    return save_open_clip(model.eval(), config, _fresh(directory))


def blip_vqa_large_config(vocab_size: int = 30524) -> object:
    """``Salesforce/blip-vqa-capfilt-large``: BLIP's ViT-B/16 VQA model fine-tuned after CapFilt-L bootstrapping
    (``model_base_vqa_capfilt_large.pth``; "large" names the captioner that filtered its data, not the ViT) at 384
    pixels, BERT-base question encoder and answer decoder. (A ViT-L here would not run: transformers sizes the answer
    decoder's cross-attention by the vision width, and the decoder reads the 768-wide question encoding.)"""
    from transformers import BlipConfig

    return BlipConfig(
        vision_config={"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                       "image_size": 384, "patch_size": 16, "layer_norm_eps": 1e-5},
        text_config={"vocab_size": vocab_size, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                     "num_attention_heads": 12, "max_position_embeddings": 512, "bos_token_id": 30522,
                     "sep_token_id": 102, "pad_token_id": 0, "eos_token_id": 102},
    )


def bert_word_pieces(size: int = 30522) -> list[str]:
    """A BERT vocabulary of ``size`` entries: the special tokens at BERT's ids (0 [PAD], 100 [UNK], 101 [CLS],
    102 [SEP], 103 [MASK]), the synthetic tasks' words and ``[unused]`` fillers (a stand-in for BERT's own)."""
    from clova_train.tools.vqa.tiny import vqa_vocabulary

    words = sorted({w for text in vqa_vocabulary() for w in text.lower().replace("?", " ? ").split()} | set("?.,0123456789"))
    tokens = ["[PAD]", *(f"[unused{i}]" for i in range(99)), "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    return tokens + [f"[unused{i}]" for i in range(99, 99 + size - len(tokens))]


def build_blip_vqa_large(directory: str | Path) -> Path:
    """BLIP VQA (capfilt-large sizes) with a ``BlipProcessor`` at 384 pixels and a 30,524-entry tokenizer."""
    from transformers import BertTokenizerFast, BlipForQuestionAnswering, BlipImageProcessor, BlipProcessor

    directory = _fresh(directory)
    tokens = bert_word_pieces()
    tokenizer = BertTokenizerFast(vocab={t: i for i, t in enumerate(tokens)}, do_lower_case=True, model_max_length=512)
    tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
    torch.manual_seed(0)
    model = BlipForQuestionAnswering(blip_vqa_large_config(len(tokenizer)))
    processor = BlipProcessor(image_processor=BlipImageProcessor(size={"height": 384, "width": 384}), tokenizer=tokenizer)
    model.eval().save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def owlvit_b32_config(vocab_size: int = 49408) -> object:
    """``google/owlvit-base-patch32``: ViT-B/32 at 768 pixels (576 box predictions), 12 x 512 text transformer."""
    from transformers import OwlViTConfig

    return OwlViTConfig(
        text_config={"vocab_size": vocab_size, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12,
                     "num_attention_heads": 8, "max_position_embeddings": 16},
        vision_config={"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                       "image_size": 768, "patch_size": 32},
        projection_dim=512,
    )


def build_owlvit_b32(directory: str | Path) -> Path:
    """OWL-ViT B/32 with its 768-pixel processor and CLIP's BPE tokenizer (16 positions, as the real one pads)."""
    from transformers import OwlViTForObjectDetection, OwlViTImageProcessor, OwlViTProcessor

    from clova_train.tools.loc.tiny import small_detection_heads

    directory = _fresh(directory)
    tokenizer = clip_bpe_tokenizer(directory / "tokenizer-build", max_length=16)
    torch.manual_seed(0)
    config = owlvit_b32_config(len(tokenizer))
    config.text_config.pad_token_id, config.text_config.bos_token_id = tokenizer.pad_token_id, tokenizer.bos_token_id
    config.text_config.eos_token_id = tokenizer.eos_token_id
    model = small_detection_heads(OwlViTForObjectDetection(config))  # as a trained head's scale: boxes in range
    size = {"height": 768, "width": 768}
    processor = OwlViTProcessor(image_processor=OwlViTImageProcessor(size=size, crop_size=size), tokenizer=tokenizer)
    model.eval().save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


COCO_PANOPTIC_CLASSES = 133


def maskformer_swin_b_config(names: list[str]) -> object:
    """``facebook/maskformer-swin-base-coco``: Swin-B (window 12, 384 pretraining) backbone, 256-wide pixel decoder
    and 6-layer DETR decoder with 100 queries, 133 COCO panoptic classes."""
    from transformers import DetrConfig, MaskFormerConfig, SwinConfig

    return MaskFormerConfig(
        backbone_config=SwinConfig(image_size=384, patch_size=4, embed_dim=128, depths=[2, 2, 18, 2],
                                   num_heads=[4, 8, 16, 32], window_size=12, drop_path_rate=0.3,
                                   out_features=["stage1", "stage2", "stage3", "stage4"]),
        decoder_config=DetrConfig(d_model=256, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                                  decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
                                  num_queries=100),
        fpn_feature_size=256, mask_feature_size=256, num_labels=len(names),
        id2label=dict(enumerate(names)), label2id={name: i for i, name in enumerate(names)},
    )


def build_maskformer_swin_b(directory: str | Path) -> Path:
    """MaskFormer Swin-B with COCO's image processor (shortest edge 800, longest 1333, size divisor 32); the 133
    class names are the synthetic scenes' categories and numbered stand-ins."""
    from transformers import MaskFormerForInstanceSegmentation, MaskFormerImageProcessor

    from clova_train.tools.grounding.synthetic import category_name
    from clova_train.synthetic.shapes import COLOURS, SHAPES

    directory = _fresh(directory)
    names = [category_name(c, s) for c in COLOURS for s in SHAPES]
    names += [f"class {i}" for i in range(len(names), COCO_PANOPTIC_CLASSES)]
    torch.manual_seed(0)
    model = MaskFormerForInstanceSegmentation(maskformer_swin_b_config(names))
    processor = MaskFormerImageProcessor(size={"shortest_edge": 800, "longest_edge": 1333}, size_divisor=32)
    model.eval().save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def sd15_inpainting_parts(tokenizer_length: int = 77) -> dict:
    """``runwayml/stable-diffusion-inpainting``'s parts: the 9-channel UNet (320-640-1280-1280, cross-attention 768),
    the KL VAE (128-256-512-512) and CLIP ViT-L/14's text encoder (12 x 768, 77 positions)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    unet = UNet2DConditionModel(sample_size=64, in_channels=9, out_channels=4, layers_per_block=2,
                                block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768, attention_head_dim=8)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512),
                        layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, sample_size=512)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        max_position_embeddings=tokenizer_length, projection_dim=768, hidden_act="quick_gelu",
        bos_token_id=49406, eos_token_id=49407, pad_token_id=49407,
    ))
    return {"unet": unet, "vae": vae, "text_encoder": text_encoder}


def build_sd15_inpainting(directory: str | Path) -> Path:
    """The Stable Diffusion 1.5 inpainting pipeline (PNDM scheduler as shipped, no safety checker) saved with
    ``save_pretrained``."""
    from diffusers import PNDMScheduler, StableDiffusionInpaintPipeline

    directory = _fresh(directory)
    tokenizer = clip_bpe_tokenizer(directory / "tokenizer-build", max_length=77)
    torch.manual_seed(0)
    parts = sd15_inpainting_parts()
    scheduler = PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", skip_prk_steps=True,
                              steps_offset=1, num_train_timesteps=1000)
    pipeline = StableDiffusionInpaintPipeline(
        vae=parts["vae"].eval(), text_encoder=parts["text_encoder"].eval(), tokenizer=tokenizer, unet=parts["unet"].eval(),
        scheduler=scheduler, safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipeline.save_pretrained(directory, safe_serialization=True)
    return directory


VICUNA_STAND_IN: dict = {
    "hidden_size": 2048, "intermediate_size": 5504, "num_hidden_layers": 16, "num_attention_heads": 16,
    "num_key_value_heads": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "vocab_size": 32000,
    "tie_word_embeddings": False,
}
"""The LLM stand-in: Vicuna-13B's layout (Llama, vocabulary 32,000, head size 128, untied output layer, 4,096
positions) at 2,048 wide and 16 layers instead of 5,120 and 40 (0.9B parameters instead of 13B)."""


def build_vicuna_stand_in(directory: str | Path) -> Path:
    """The Llama stand-in (:data:`VICUNA_STAND_IN`) saved in float16, as Vicuna's checkpoint is, with a byte-level
    BPE tokenizer trained on the synthetic tool corpus (the model's 32,000 rows cover its ids)."""
    return _build_llama(directory, VICUNA_STAND_IN)


VICUNA_13B: dict = {
    "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40, "num_attention_heads": 40,
    "num_key_value_heads": 40, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "vocab_size": 32000,
    "tie_word_embeddings": False,
}
"""Vicuna-13B v1.5's own sizes (``make gpu-check`` builds it on the GPU, where it fits)."""


def build_vicuna_13b(directory: str | Path) -> Path:
    """A random Llama of Vicuna-13B's sizes in float16 (26 GB), initialised on the GPU when there is one."""
    return _build_llama(directory, VICUNA_13B)


def _build_llama(directory: str | Path, sizes: dict) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from clova_train.quickstart.tiny_llama import tiny_bpe_tokenizer, tool_corpus

    directory = _fresh(directory)
    texts, _ = tool_corpus(0)
    tokenizer = tiny_bpe_tokenizer(texts, vocab_size=8000)
    torch.manual_seed(0)
    config = LlamaConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **sizes)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(directory)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(directory)
    return directory


REAL_SIZES: dict[str, RealSize] = {
    size.name: size
    for size in (
        RealSize("clip-vit-l14", "openai ViT-L-14 (open_clip)", 427.6, build_clip_vit_l14),
        RealSize("blip-vqa-capfilt-large", "Salesforce/blip-vqa-capfilt-large", 361.2, build_blip_vqa_large,
                 "BERT word pieces padded to 30,524"),
        RealSize("owlvit-base-patch32", "google/owlvit-base-patch32", 153.2, build_owlvit_b32),
        RealSize("maskformer-swin-base-coco", "facebook/maskformer-swin-base-coco", 101.8, build_maskformer_swin_b),
        RealSize("sd-inpainting", "runwayml/stable-diffusion-inpainting", 1066.2, build_sd15_inpainting),
        RealSize("vicuna-stand-in", "lmsys/vicuna-13b-v1.5", 940.6, build_vicuna_stand_in,
                 "0.9B Llama in Vicuna's layout (2048 x 16 layers, not 5120 x 40)"),
        RealSize("vicuna-13b", "lmsys/vicuna-13b-v1.5", 13015.9, build_vicuna_13b),
    )
}


def saved_parameters(directory: str | Path) -> int:
    """Parameters stored in a model directory's safetensors files (every part of a pipeline, headers only)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(directory).rglob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for key in handle.keys():
                shape = handle.get_slice(key).get_shape()
                count = 1
                for size in shape:
                    count *= size
                total += count
    return total


MARKER = "real_size.json"


def build_real_size(model: str, models_dir: str | Path) -> Path:
    """``models_dir/<folder>``, built unless a finished build is there (its marker file is written last). ``model`` is
    a :data:`REAL_SIZES` name, or a plug-in tool's ``"module:function"`` taking the directory to write (its smoke-real
    case names it); the folder is :func:`~real_size.model_folder`'s."""
    directory = Path(models_dir) / model_folder(model)
    marker = directory / MARKER
    if marker.is_file():
        return directory
    if model in REAL_SIZES:
        record = _build_listed(REAL_SIZES[model], directory)
    elif ":" in model:
        record = _build_plug_in(model, directory)
    else:
        raise ModelError(f"unknown real-size model {model!r}: neither one of {', '.join(REAL_SIZES)} nor a "
                         "'module:function' builder")
    marker.write_text(json.dumps(record), encoding="utf-8")
    return directory


def _build_listed(size: RealSize, directory: Path) -> dict:
    """Build a :data:`REAL_SIZES` model and check its parameter count against the real checkpoint's."""
    size.builder(directory)
    parameters = saved_parameters(directory)
    if abs(parameters / 1e6 - size.parameters) > 0.01 * size.parameters:
        raise ModelError(f"the real-size {size.name} built in {directory} has {parameters / 1e6:,.1f} M parameters, "
                         f"not the {size.parameters:,.1f} M of {size.checkpoint}")
    return {"checkpoint": size.checkpoint, "parameters": parameters}


def _build_plug_in(builder: str, directory: Path) -> dict:
    """Build a plug-in tool's real-size model with its own builder (no published count to check it against)."""
    from clova_train.tools.recipes import resolve

    resolve(builder)(_fresh(directory))
    return {"checkpoint": builder, "parameters": saved_parameters(directory)}


if __name__ == "__main__":  # python benchmarks/real_size/models.py MODEL MODELS_DIR: one build in its own process
    build_real_size(sys.argv[1], sys.argv[2])

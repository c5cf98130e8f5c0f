"""A mid-size random LLaVA 1.5 checkpoint for the image-input benchmarks (issue 45), built once
and cached: big enough that the vision encoder and the prefill cost real time on a CPU (a CLIP
ViT-B/14-like tower at 336 pixels = LLaVA 1.5's 576 image tokens, and a text model the shape of
SmolLM2-135M), saved with transformers' own LLaVA processor and SmolLM2's tokenizer plus
`<image>`, so `LLM(model=folder)` and `AutoProcessor` load it offline. Random weights: the
figures are about time, not answers.

    python -m benchmarks.mm_checkpoint            # prints the folder (builds it if missing)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

# SmolLM2-135M's text shapes (its GGUF's config); untied LM head as the tests' LLaVA fixture.
TEXT = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
IMAGE_TOKEN = "<image>"
WEIGHT_STD = 0.02


def vision_shape(image_size: int = 336, hidden: int = 768, layers: int = 12, patch: int = 14) -> dict[str, Any]:
    if image_size % patch:
        raise ValueError(f"image size {image_size} is not a multiple of the patch size {patch}")
    if hidden % 64:
        raise ValueError(f"vision hidden size {hidden} is not a multiple of 64 (the head size)")
    return dict(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                num_attention_heads=hidden // 64, image_size=image_size, patch_size=patch, projection_dim=512)


def _tokenizer(path: Path):
    """SmolLM2's tokenizer (from pagedllm's default GGUF) with `<image>` as a special token."""
    from transformers import AutoTokenizer

    from pagedllm.model_source import default_model_path
    from tests.smollm2 import hf_tokenizer

    hf_tokenizer(str(default_model_path())).save_pretrained(path)  # the cached one is shared: never change it
    tok = AutoTokenizer.from_pretrained(path, extra_special_tokens={"image_token": IMAGE_TOKEN})
    if IMAGE_TOKEN not in tok.get_vocab():
        tok.add_special_tokens({"extra_special_tokens": [IMAGE_TOKEN]}, replace_extra_special_tokens=False)
    if len(tok.encode(IMAGE_TOKEN, add_special_tokens=False)) != 1:
        raise ValueError(f"{IMAGE_TOKEN!r} does not encode to one token id")
    return tok


def _randomize(model, seed: int) -> None:
    """Every parameter drawn (built under no_init_weights, so nothing else set them): norms 1,
    biases 0, matrices and embeddings N(0, WEIGHT_STD)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if ("norm" in name and name.endswith("weight")) else 0.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * WEIGHT_STD)


def build(path: Path, vision: dict[str, Any], seed: int = 0) -> Path:
    """Save the checkpoint and its processor into `path` (built in a sibling folder, then moved)."""
    import torch
    import transformers as tf
    from transformers.initialization import no_init_weights

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = _tokenizer(tmp)
    image_size, patch = vision["image_size"], vision["patch_size"]
    text = tf.LlamaConfig(**TEXT, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
    config = tf.LlavaConfig(vision_config=tf.CLIPVisionConfig(**vision), text_config=text,
                            image_token_index=tok.image_token_id, image_seq_length=(image_size // patch) ** 2,
                            vision_feature_layer=-2, vision_feature_select_strategy="default")
    with no_init_weights():
        model = tf.LlavaForConditionalGeneration(config)
    model = model.to(torch.float32).eval()
    _randomize(model, seed)
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(tmp, safe_serialization=True)
    image_processor = tf.LlavaImageProcessorPil(size={"shortest_edge": image_size},
                                                crop_size={"height": image_size, "width": image_size})
    tf.LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=patch,
                      vision_feature_select_strategy="default", num_additional_image_tokens=1).save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def checkpoint(vision: dict[str, Any] | None = None, root: Path | None = None, rebuild: bool = False) -> Path:
    """The cached folder for `vision` (built on first use): `$PAGEDLLM_CACHE_DIR/bench/llava-mid-<key>`."""
    from pagedllm.model_source import cache_dir

    vision = vision or vision_shape()
    key = hashlib.sha256(json.dumps([vision, TEXT, WEIGHT_STD], sort_keys=True).encode()).hexdigest()[:10]
    path = Path(root or Path(cache_dir()) / "bench") / f"llava-mid-{vision['image_size']}px-{key}"
    if rebuild or not (path / "model.safetensors").exists():
        build(path, vision)
    return path


def parameter_counts(path: Path) -> dict[str, int]:
    """Parameters of the vision tower + projector and of the language model, from the safetensors header."""
    import struct

    with open(path / "model.safetensors", "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    counts = {"vision": 0, "text": 0}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        n = 1
        for d in meta["shape"]:
            n *= d
        counts["text" if "language_model" in name or name.startswith("lm_head") else "vision"] += n
    return counts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--image-size", type=int, default=336)
    p.add_argument("--vision-hidden", type=int, default=768)
    p.add_argument("--vision-layers", type=int, default=12)
    p.add_argument("--rebuild", action="store_true")
    args = p.parse_args(argv)
    path = checkpoint(vision_shape(args.image_size, args.vision_hidden, args.vision_layers), rebuild=args.rebuild)
    print(path, parameter_counts(path))


if __name__ == "__main__":
    main()

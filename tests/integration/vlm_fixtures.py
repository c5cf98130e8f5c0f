"""Tiny random vision-language checkpoints made by transformers' own classes, and transformers'
float32 reference for them (issue 45, image inputs).

`make_tiny_vlm(arch, path)` saves a checkpoint (safetensors, config, generation config) with its
processor (image processor, SmolLM2's tokenizer plus the arch's special tokens, chat template), so
that `AutoProcessor` (`load_processor` for the Qwen processors where torchvision is missing) and
the arch's model class load it offline. Sizes are tiny (a fixture builds
in about a second) and weights are drawn wide enough that greedy choices are not near-ties and
that what is generated depends on the image: an engine that ignored the image fails parity.
`hf_greedy` / `hf_prompt_ids` / `chat_prompt` give transformers' own answers for such a folder;
`stored_greedy` gives `hf_greedy`'s answers from the reference store (tests/references.py), keyed by
the folder's bytes, the prompts, the images' pixels and the processor kwargs, so that a run loads
no transformers model (the processor still renders prompts and expands images)."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from tests.integration import vlm_templates

ARCHS = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "gemma3", "idefics3", "smolvlm")
# Gemma3's pan-and-scan is a per-call processor option in transformers 5.25 (Gemma3Processor.images_kwargs
# overrides the image processor's saved values): pass these as `processor_kwargs` to crop images whose
# aspect ratio is >= 1.2 into 2-3 crops of at least 16 pixels, each its own 16 image tokens.
PAN_AND_SCAN = dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=16, pan_and_scan_max_num_crops=3,
                    pan_and_scan_min_ratio_to_activate=1.2)
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6)
WEIGHT_STD = 0.2  # as model_fixtures.save_tiny_llama: logits std ~1.6, greedy top-2 gaps >= 0.01 seen


def _tokenizer(smollm2_gguf: str, path: Path, named: dict[str, str], extra: list[str] = ()):
    """A private copy of SmolLM2's tokenizer with the arch's special tokens added: `named` become
    attributes (`tok.image_token`, `tok.image_token_id`), `extra` are plain added special tokens."""
    from transformers import AutoTokenizer

    from tests.smollm2 import hf_tokenizer

    hf_tokenizer(smollm2_gguf).save_pretrained(path)  # the cached one is shared: never change it
    tok = AutoTokenizer.from_pretrained(path, extra_special_tokens=dict(named))
    vocab = tok.get_vocab()  # a fresh dict of 49k entries each call
    missing = [t for t in list(named.values()) + list(extra) if t not in vocab]
    if missing:
        tok.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)
    for t in list(named.values()) + list(extra):
        ids = tok.encode(t, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"special token {t!r} encodes to {ids}, not one id")
    return tok


def _text_ids(tok) -> dict[str, Any]:
    return dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)


def _clip_vision(image_size: int = 32, patch_size: int = 8):
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            image_size=image_size, patch_size=patch_size, projection_dim=32)


def _llava(tok) -> tuple[Any, Any]:
    import transformers as tf

    config = tf.LlavaConfig(vision_config=_clip_vision(), text_config=tf.LlamaConfig(**TEXT, **_text_ids(tok)),
                            image_token_index=tok.image_token_id, image_seq_length=16,
                            vision_feature_layer=-2, vision_feature_select_strategy="default")
    image_processor = tf.LlavaImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = tf.LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=8,
                                  vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                  chat_template=vlm_templates.LLAVA)
    return tf.LlavaForConditionalGeneration(config), processor


def _llava_next(tok) -> tuple[Any, Any]:
    import transformers as tf

    pinpoints = [[32, 64], [64, 32], [64, 64]]
    config = tf.LlavaNextConfig(vision_config=_clip_vision(), text_config=tf.LlamaConfig(**TEXT, **_text_ids(tok)),
                                image_token_index=tok.image_token_id, image_grid_pinpoints=pinpoints,
                                vision_feature_layer=-2, vision_feature_select_strategy="default")
    image_processor = tf.LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                                    image_grid_pinpoints=pinpoints)
    processor = tf.LlavaNextProcessor(image_processor=image_processor, tokenizer=tok, patch_size=8,
                                      vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                      chat_template=vlm_templates.LLAVA_NEXT)
    return tf.LlavaNextForConditionalGeneration(config), processor


def _qwen_text(tok) -> dict[str, Any]:
    # head_dim 16: M-RoPE's sections (temporal, height, width) split its 8 frequencies.
    return dict(**TEXT, **_text_ids(tok), rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                           "mrope_section": [2, 3, 3]})


def image_only(cls):
    """`cls` (a processor class) without its video processor. transformers 5.25 builds and loads
    Qwen2-VL's processor only with one, and its video processors need torchvision, which this
    project does not install; images and text never touch it. The subclass keeps `cls`'s name, so
    what it saves names `cls` and loads with `AutoProcessor` wherever torchvision is present."""
    attrs = [a for a in cls.get_attributes() if a != "video_processor"]
    return type(cls.__name__, (cls,), {"get_attributes": classmethod(lambda _: list(attrs)),
                                       "__module__": cls.__module__, "__doc__": cls.__doc__})


def load_processor(path: str | Path):
    """`AutoProcessor.from_pretrained(path)`, or where the processor needs a video processor and
    torchvision is missing, its `image_only` class's `from_pretrained`."""
    import transformers as tf
    from transformers.utils import is_torchvision_available

    config = json.loads((Path(path) / "processor_config.json").read_text())
    cls = getattr(tf, config.get("processor_class", ""), None)
    if cls is not None and "video_processor" in cls.get_attributes() and not is_torchvision_available():
        return image_only(cls).from_pretrained(path)
    return tf.AutoProcessor.from_pretrained(path)


def _qwen_processor(cls, tok):
    import transformers as tf

    # patch 8, merge 2: 16-pixel units; 32*32 to 96*96 pixels = 4 to 36 image tokens.
    image_processor = tf.Qwen2VLImageProcessorPil(size={"shortest_edge": 32 * 32, "longest_edge": 96 * 96},
                                                  patch_size=8, temporal_patch_size=2, merge_size=2)
    return image_only(cls)(image_processor=image_processor, tokenizer=tok, chat_template=vlm_templates.QWEN2_VL)


def _qwen_ids(tok) -> dict[str, int]:
    ids = tok.convert_tokens_to_ids
    return dict(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))


def _qwen2_vl(tok) -> tuple[Any, Any]:
    import transformers as tf

    vision = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=4, patch_size=8,
                  spatial_merge_size=2, temporal_patch_size=2)
    config = tf.Qwen2VLConfig(text_config=_qwen_text(tok), vision_config=vision, **_qwen_ids(tok))
    return tf.Qwen2VLForConditionalGeneration(config), _qwen_processor(tf.Qwen2VLProcessor, tok)


def _qwen2_5_vl(tok) -> tuple[Any, Any]:
    import transformers as tf

    # window 32 pixels = 2x2 merged units per window: block 0 attends in windows, block 1 fully.
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64, patch_size=8,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=32, fullatt_block_indexes=[1])
    config = tf.Qwen2_5_VLConfig(text_config=_qwen_text(tok), vision_config=vision, **_qwen_ids(tok))
    return tf.Qwen2_5_VLForConditionalGeneration(config), _qwen_processor(tf.Qwen2_5_VLProcessor, tok)


def _gemma3(tok) -> tuple[Any, Any]:
    import transformers as tf

    text = tf.Gemma3TextConfig(**{**TEXT, "max_position_embeddings": 4096}, **_text_ids(tok), head_dim=16,
                               query_pre_attn_scalar=16, sliding_window=512,
                               layer_types=["sliding_attention", "full_attention"])
    # SigLIP 32x32 / patch 4 = 8x8 patches, average-pooled to 4x4 = 16 tokens per image (or crop).
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   image_size=32, patch_size=4, vision_use_head=False)  # as Gemma3's
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16,
                             boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id,
                             image_token_index=tok.image_token_id)
    image_processor = tf.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = tf.Gemma3Processor(image_processor=image_processor, tokenizer=tok, image_seq_length=16,
                                   chat_template=vlm_templates.GEMMA3)
    return tf.Gemma3ForConditionalGeneration(config), processor


def _idefics3(tok) -> tuple[Any, Any]:
    import transformers as tf

    # 32x32 crops / patch 8 = 4x4 patches, pixel-shuffled by 2 = 4 tokens per crop; images are
    # resized to a longest edge of 64 and split into up to 2x2 crops plus the global image.
    vision = tf.Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, image_size=32, patch_size=8)
    config = tf.Idefics3Config(vision_config=vision, text_config=tf.LlamaConfig(**TEXT, **_text_ids(tok)),
                               image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2)
    image_processor = tf.Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                                   do_image_splitting=True)
    processor = tf.Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=4,
                                     chat_template=vlm_templates.IDEFICS3)
    return tf.Idefics3ForConditionalGeneration(config), processor


def _smolvlm(tok) -> tuple[Any, Any]:
    import transformers as tf

    # SmolVLM's model (its own classes, Idefics3's layout) with Idefics3's processor: SmolVLMProcessor
    # needs torchvision (its video processor) and num2words, which this project does not install; for
    # images both expand `<image>` into the same crop runs (transformers' processing_smolvlm.py).
    model, processor = _idefics3(tok)
    vision = tf.SmolVLMVisionConfig(**{k: getattr(model.config.vision_config, k) for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size", "patch_size")})
    config = tf.SmolVLMConfig(vision_config=vision, text_config=model.config.text_config,
                              image_token_id=model.config.image_token_id, scale_factor=2)
    return tf.SmolVLMForConditionalGeneration(config), processor


_QWEN_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|video_pad|>", "<|vision_end|>"]
# arch: (builder, the tokenizer's named special tokens, its other added special tokens)
_BUILDERS: dict[str, tuple[Callable, dict[str, str], list[str]]] = {
    "llava": (_llava, {"image_token": "<image>"}, []),
    "llava_next": (_llava_next, {"image_token": "<image>"}, []),
    "qwen2_vl": (_qwen2_vl, {}, _QWEN_TOKENS),
    "qwen2_5_vl": (_qwen2_5_vl, {}, _QWEN_TOKENS),
    "gemma3": (_gemma3, {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                         "eoi_token": "<end_of_image>"}, ["<start_of_turn>", "<end_of_turn>"]),
    "idefics3": (_idefics3, {}, ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
                 + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]),
}
_BUILDERS["smolvlm"] = (_smolvlm, *_BUILDERS["idefics3"][1:])


def _perturb(model, seed: int) -> None:
    """Weights N(0, WEIGHT_STD), norm weights 1 + N(0, 0.1), biases N(0, 0.1): transformers' own
    init (std 0.02, unit norms, zero biases) gives near-uniform logits and leaves loading bugs
    in norms and biases invisible."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if "norm" in name and name.endswith(".weight"):
                # Gemma's RMSNorm scales by (1 + w) and is initialised to zeros: perturb around either.
                p.add_(noise * 0.1)
            elif name.endswith(".bias"):
                p.copy_(noise * 0.1)
            elif p.dim() > 1:
                p.copy_(noise * WEIGHT_STD)


def _gemma_scales(model) -> None:
    """Gemma multiplies input embeddings by sqrt(hidden) and ties the LM head to them: with
    N(0, WEIGHT_STD) embeddings the current token's own row dominates the last hidden state and
    greedy decoding repeats it. Shrink the embeddings by that factor (inputs as wide as every
    other arch's), grow the final norm by it (logits as wide), and triple what each layer adds
    (its post-norms) so that two layers move the state away from the input token."""
    lm = model.model.language_model
    scale = lm.config.hidden_size ** 0.5
    with torch.no_grad():  # Gemma's RMSNorm multiplies by (1 + weight)
        lm.embed_tokens.weight.div_(scale)
        lm.norm.weight.add_(scale - 1.0)
        for layer in lm.layers:
            layer.post_attention_layernorm.weight.add_(2.0)
            layer.post_feedforward_layernorm.weight.add_(2.0)


def make_tiny_vlm(arch: str, path: Path | str, smollm2_gguf: str | None = None, seed: int = 0) -> Path:
    """Save a tiny random `arch` checkpoint with its processor to `path` (made if missing).

    `arch` is one of ARCHS (for Gemma3's pan-and-scan, call its processor with PAN_AND_SCAN).
    `smollm2_gguf` is SmolLM2's GGUF (the tokenizer's source), by default pagedllm's default model."""
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny VLM arch {arch!r}; known: {', '.join(ARCHS)}")
    if smollm2_gguf is None:
        from pagedllm.model_source import default_model_path

        smollm2_gguf = str(default_model_path())
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build, named, extra = _BUILDERS[arch]
    tok = _tokenizer(smollm2_gguf, path, named, extra)
    torch.manual_seed(seed)
    model, processor = build(tok)
    model = model.to(torch.float32).eval()
    _perturb(model, seed)
    if arch == "gemma3":
        _gemma_scales(model)
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    gen.do_sample = False
    model.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    return path


def sample_images(n: int, seed: int = 0, size: tuple[int, int] = (48, 40)) -> list:
    """`n` deterministic RGB images of `size` (width, height): a random-direction colour gradient
    under a few random solid blocks, so that resizing and cropping keep them distinct."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    images = []
    for _ in range(n):
        a, b = rng.normal(size=2)
        ramp = (a * xx / max(w, 1) + b * yy / max(h, 1))[..., None]
        img = np.clip(rng.uniform(0, 255, 3) + 120 * ramp * rng.uniform(-1, 1, 3), 0, 255)
        for _ in range(int(rng.integers(3, 7))):
            x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
            x1, y1 = x0 + int(rng.integers(2, max(3, w // 2))), y0 + int(rng.integers(2, max(3, h // 2)))
            img[y0:y1, x0:x1] = rng.uniform(0, 255, 3)
        images.append(Image.fromarray(img.astype(np.uint8), "RGB"))
    return images


# ---- transformers' float32 reference --------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def cached_processor(path: str):
    """`load_processor(path)`, once per process: prompts and image expansion need no model."""
    return load_processor(path)


@functools.lru_cache(maxsize=None)
def load_reference(path: str):
    """(processor, model) of a tiny VLM folder, loaded once per process (float32, eval)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return cached_processor(path), model


def image_token_id(path: str | Path) -> int:
    """The image placeholder's token id of a tiny VLM folder (its config, without the model)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path))
    found = getattr(config, "image_token_id", None)
    return found if found is not None else config.image_token_index


def processor_inputs(path: str | Path, prompt: str, images: list, processor_kwargs: dict | None = None):
    """The processor's tensors for one prompt (the image markers in `prompt` expanded);
    `processor_kwargs` go to the processor call (e.g. PAN_AND_SCAN)."""
    processor = cached_processor(str(path))
    return processor(text=prompt, images=list(images) or None, return_tensors="pt", **(processor_kwargs or {}))


def hf_prompt_ids(path: str | Path, prompt: str, images: list, processor_kwargs: dict | None = None) -> list[int]:
    """The processor's expanded input ids: what the engine's prompt must be token for token."""
    return processor_inputs(path, prompt, images, processor_kwargs)["input_ids"][0].tolist()


@torch.no_grad()
def hf_greedy(path: str | Path, prompt: str, images: list, max_new_tokens: int,
              processor_kwargs: dict | None = None) -> list[int]:
    """transformers' float32 greedy continuation of `prompt` with `images`: the new token ids only
    (fewer than `max_new_tokens` where it ends at the EOS token)."""
    _, model = load_reference(str(path))
    inputs = processor_inputs(path, prompt, images, processor_kwargs)
    out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def image_key(image) -> dict:
    """What a reference depends on of a PIL image: its mode, size and the SHA-256 of its pixels."""
    return {"mode": image.mode, "size": list(image.size), "sha256": hashlib.sha256(image.tobytes()).hexdigest()}


def case_inputs(cases: list[tuple[str, list]], processor_kwargs: dict | None = None, **params) -> dict:
    """A reference's `inputs` for `cases` [(prompt, images)]: each prompt's text and its images'
    pixels, the processor kwargs and whatever else the computation takes (`params`)."""
    return {"cases": [{"prompt": p, "images": [image_key(im) for im in images]} for p, images in cases],
            "processor_kwargs": processor_kwargs or {}, **params}


def stored_greedy(name: str, path: str | Path, cases: list[tuple[str, list]], max_new_tokens: int,
                  processor_kwargs: dict | None = None, live: bool = False) -> list[list[int]]:
    """`hf_greedy` of each (prompt, images) in `cases`, from the reference store under `name`
    (tests/references.py: computed only when writing, or every run with `live`), keyed by the
    folder's bytes (checkpoint and processor), the prompts, the images' pixels, `max_new_tokens`
    and `processor_kwargs`."""
    from tests.references import reference

    return reference(name, lambda: [hf_greedy(path, p, images, max_new_tokens, processor_kwargs)
                                    for p, images in cases],
                     sources=[path], inputs=case_inputs(cases, processor_kwargs, max_new_tokens=max_new_tokens),
                     live=live)


def chat_prompt(path: str | Path, messages: list[dict]) -> str:
    """`messages` (content lists of {"type": "image"} / {"type": "text", "text": ...}) rendered by
    the processor's chat template with the generation prompt, as text for `processor(text=...)`."""
    processor = cached_processor(str(path))
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def user_turn(text: str, num_images: int = 1) -> list[dict]:
    """One user message with `num_images` images before `text`, as chat templates take it."""
    return [{"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": text}]}]


# ---- pytest plumbing -------------------------------------------------------------------------------

_FOLDERS: dict[str, str] = {}


def tiny_vlm_folder(tmp_path_factory, smollm2_gguf: str, arch: str) -> str:
    """The run's one folder of `arch` (built on first use; tests must not write into it)."""
    if arch not in _FOLDERS:
        path = tmp_path_factory.mktemp(f"tiny-vlm-{arch}")
        _FOLDERS[arch] = str(make_tiny_vlm(arch, path, smollm2_gguf))
    return _FOLDERS[arch]

"""Building standard Hugging Face VLM checkpoint directories offline.

Nothing here downloads anything: the tokenizer is trained in-process with `tokenizers`, the model is a real
Hugging Face Qwen2.5-VL / Qwen2-VL / Qwen3-VL (dense) class built from a config, and the directory written by
:func:`save_target` (config.json, model.safetensors, tokenizer files, preprocessor config, chat template)
loads with ``transformers`` offline and in SGLang.

Used by the tests (tiny random targets) and by the demo recipe (the bundled demo VLM).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Iterable, Literal

import torch
from transformers import PreTrainedTokenizerFast

Arch = Literal["qwen2_5_vl", "qwen2_vl", "qwen3_vl"]
ARCHS: tuple[str, ...] = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl")


def patch_size(arch: str) -> int:
    """The vision patch size (pixels) of ``arch``: 16 for Qwen3-VL, 14 for Qwen2.5-VL / Qwen2-VL."""
    return 16 if arch == "qwen3_vl" else 14

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|mask|>",
]
MASK_TOKEN = "<|mask|>"

# Qwen-VL style chat template. Content is a string or a list of parts; a part of type "image" (or carrying an
# "image" / "image_url" key) becomes one vision block that the processor expands to the image's tokens.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] }}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}"
    "{{ part['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- endif -%}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` and wrap it with the Qwen-VL special tokens.

    ``vocab_size`` counts every token, the special ones included.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")],
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def random_corpus(n_sentences: int = 400, seed: int = 0) -> list[str]:
    """A small English-like corpus for tokenizers of test checkpoints."""
    rng = random.Random(seed)
    words = (
        "the a red blue green yellow circle square triangle is on left right top bottom of image there are two "
        "three four five shapes chart value bar line text reads says story once upon time cat dog bird sky big "
        "small next to above below and with what how many which colour color describe picture answer question"
    ).split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))) for _ in range(n_sentences)]


def tiny_target_config(
    arch: Arch,
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    vision_hidden: int = 64,
    vision_depth: int = 2,
    initializer_range: float = 0.02,
    max_position_embeddings: int = 4096,
):
    """A small config of the real Qwen2.5-VL / Qwen2-VL / Qwen3-VL class, with token ids taken from ``tokenizer``.

    Qwen3-VL: ``head_dim`` = hidden / heads, M-RoPE sections interleaved (``mrope_interleaved``), deepstack
    features from the first vision blocks (at most 3), added after LLM layers 0, 1, 2."""
    head_dim = hidden_size // num_heads
    quarter = head_dim // 2 // 4  # mrope_section sums to head_dim / 2: [t, h, w] = [1/4, 3/8, 3/8]
    mrope_section = [quarter, (head_dim // 2 - quarter) // 2, head_dim // 2 - quarter - (head_dim // 2 - quarter) // 2]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        initializer_range=initializer_range,
    )
    common = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    if arch == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        vision = dict(
            depth=vision_depth,
            hidden_size=vision_hidden,
            intermediate_size=vision_hidden * 2,
            num_heads=2,
            out_hidden_size=hidden_size,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[vision_depth - 1],
            initializer_range=initializer_range,
        )
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)
    if arch == "qwen2_vl":
        from transformers import Qwen2VLConfig

        vision = dict(
            depth=vision_depth,
            embed_dim=vision_hidden,
            hidden_size=hidden_size,
            mlp_ratio=2,
            num_heads=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            initializer_range=initializer_range,
        )
        return Qwen2VLConfig(text_config=text, vision_config=vision, **common)
    if arch == "qwen3_vl":
        from transformers import Qwen3VLConfig

        half = head_dim // 2  # Qwen3-VL's [24, 20, 20] of 64 scaled: t gets the remainder
        hw = (half * 20) // 64
        text.update(head_dim=head_dim, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [half - 2 * hw, hw, hw],
            "mrope_interleaved": True})
        vision = dict(
            depth=vision_depth,
            hidden_size=vision_hidden,
            intermediate_size=vision_hidden * 2,
            num_heads=2,
            out_hidden_size=hidden_size,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=64,
            deepstack_visual_indexes=list(range(min(vision_depth, 3))),
            initializer_range=initializer_range,
        )
        return Qwen3VLConfig(text_config=text, vision_config=vision, **common)
    raise ValueError(f"unknown target architecture {arch!r}; expected one of {ARCHS}")


def model_class(arch: Arch):
    """The Hugging Face class for ``arch``."""
    if arch == "qwen2_5_vl":
        from transformers import Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLForConditionalGeneration
    if arch == "qwen3_vl":
        from transformers import Qwen3VLForConditionalGeneration

        return Qwen3VLForConditionalGeneration
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration


def image_processor(min_pixels: int = 56 * 56, max_pixels: int = 448 * 448, patch: int = 14):
    """The Qwen-VL image processor (PIL backend: no torchvision needed) with small pixel bounds; ``patch``: the
    vision patch size (:func:`patch_size`)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch, merge_size=2, temporal_patch_size=2
    )


def save_target(model, tokenizer: PreTrainedTokenizerFast, out_dir: str | Path, max_pixels: int = 448 * 448) -> Path:
    """Write ``model`` + tokenizer + image processor + chat template as one Hugging Face directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    patch = patch_size(getattr(model.config, "model_type", ""))
    image_processor(min_pixels=(4 * patch) ** 2, max_pixels=max_pixels, patch=patch).save_pretrained(out)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out


def build_random_target(
    out_dir: str | Path,
    arch: Arch = "qwen2_5_vl",
    seed: int = 0,
    vocab_size: int = 384,
    initializer_range: float = 0.02,
    **config_overrides,
) -> Path:
    """Build and save a tiny randomly initialised Qwen-VL target (fp32) with its own trained tokenizer."""
    tokenizer = train_tokenizer(random_corpus(seed=seed), vocab_size=vocab_size)
    config = tiny_target_config(arch, tokenizer, initializer_range=initializer_range, **config_overrides)
    torch.manual_seed(seed)
    model = model_class(arch)(config).to(torch.float32).eval()
    return save_target(model, tokenizer, out_dir)


def build_random_pair(out_dir: str | Path, arch: Arch = "qwen2_5_vl", seed: int = 0,
                      **drafter_overrides) -> tuple[Path, Path]:
    """A tiny random target (``OUT/target``) and a random GLANCE drafter for it (``OUT/drafter``): a smoke-test
    pair whose answers are noise. ``drafter_overrides`` go to ``GlanceConfig.for_target``."""
    from transformers import AutoConfig, AutoTokenizer

    from .drafter import GlanceDrafter

    out = Path(out_dir)
    target = build_random_target(out / "target", arch=arch, seed=seed)
    mask_id = AutoTokenizer.from_pretrained(target).convert_tokens_to_ids(MASK_TOKEN)
    text_config = AutoConfig.from_pretrained(target).get_text_config()
    drafter = GlanceDrafter.for_target(text_config, mask_id, seed=seed, **drafter_overrides)
    return target, drafter.save_pretrained(out / "drafter")

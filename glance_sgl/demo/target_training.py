"""Training the demo VLM (a real Hugging Face Qwen2.5-VL, tiny) from scratch on the synthetic task family.

The recipe: a BPE tokenizer trained on the task corpus, a small Qwen2.5-VL config (``arch``: or Qwen2-VL /
Qwen3-VL), answer-only cross-entropy
on a task mix, AdamW with warmup and cosine decay, fixed seeds. The result is a standard Hugging Face
directory (config, safetensors, tokenizer, preprocessor config, chat template) that loads offline.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoints import ARCHS, model_class, save_target, tiny_target_config, train_tokenizer
from .tasks import GROUNDED, TASKS, Example, eval_set, train_example

STATE_FILE = "trainer_state.pt"
TASK_WEIGHTS = {"caption": 1.0, "text": 1.5, "chart": 1.5, "document": 1.7, "open": 0.8}


@dataclass
class TargetRecipe:
    vocab_size: int = 1024
    hidden_size: int = 192
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vision_hidden: int = 128
    vision_depth: int = 3
    steps: int = 8000
    batch_size: int = 16
    lr: float = 2e-3
    warmup: int = 200
    weight_decay: float = 0.01
    seed: int = 0
    max_pixels: int = 168 * 168
    arch: str = "qwen2_5_vl"  # the target architecture: qwen2_5_vl, qwen2_vl or qwen3_vl

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown target architecture {self.arch!r}; expected one of {ARCHS}")


def build_demo_tokenizer(recipe: TargetRecipe):
    from .tasks import corpus

    return train_tokenizer(corpus(), vocab_size=recipe.vocab_size)


def sample_task(rng: random.Random) -> str:
    tasks = list(TASK_WEIGHTS)
    return rng.choices(tasks, weights=[TASK_WEIGHTS[t] for t in tasks])[0]


def collate(processor: Any, examples: list[Example]) -> dict[str, torch.Tensor]:
    """Tokenise full conversations (prompt + answer) and mask everything but the answer and its end token."""
    tok = processor.tokenizer
    texts = []
    for ex in examples:
        convo = ex.messages()
        convo[0]["content"][0] = {"type": "image"}
        convo.append({"role": "assistant", "content": ex.answer})
        texts.append(processor.apply_chat_template(convo, tokenize=False))
    batch = processor(text=texts, images=[ex.image for ex in examples], padding=True, return_tensors="pt")
    ids = batch["input_ids"]
    im_start, im_end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    header = len(tok("assistant\n", add_special_tokens=False)["input_ids"])
    labels = torch.full_like(ids, -100)
    for b in range(ids.shape[0]):
        row = ids[b].tolist()
        start = max(i for i, t in enumerate(row) if t == im_start) + 1 + header
        end = max(i for i, t in enumerate(row) if t == im_end)
        labels[b, start : end + 1] = ids[b, start : end + 1]
    batch["labels"] = labels
    return dict(batch)


def image_token_similarity(merged: torch.Tensor, grid_thw: torch.Tensor, merge: int) -> float:
    """Mean pairwise cosine similarity of the merged image tokens within each image of a batch.

    ``merged``: [sum of tokens, hidden] (the vision tower's output, images one after another); ``grid_thw``:
    [images, 3] patch grids; ``merge``: patches per merged token. Near 1.0 the vision tower has collapsed (it
    says the same thing about every part of the image) and the VLM cannot read anything.
    """
    sims, start = [], 0
    for t, h, w in grid_thw.tolist():
        n = t * h * w // merge
        x = torch.nn.functional.normalize(merged[start : start + n].detach().float(), dim=-1)
        sims.append(((x @ x.T).sum() - n) / max(n * (n - 1), 1))
        start += n
    return float(torch.stack(sims).mean())


def lr_at(step: int, recipe: TargetRecipe) -> float:
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    progress = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_target(out_dir: str | Path, recipe: TargetRecipe | None = None, progress: bool = True,
                 log_every: int = 50, checkpoint_every: int = 200) -> Path:
    """Train the demo VLM and save it to ``out_dir``; checkpoints in ``out_dir/checkpoint`` every
    ``checkpoint_every`` steps, and a rerun resumes from the last one. Returns the directory."""
    from tqdm import tqdm
    from transformers import AutoProcessor

    recipe = recipe or TargetRecipe()
    out = Path(out_dir)
    ckpt = out / "checkpoint"
    torch.manual_seed(recipe.seed)
    tokenizer = build_demo_tokenizer(recipe)
    model_cls = model_class(recipe.arch)
    config = tiny_target_config(
        recipe.arch, tokenizer, hidden_size=recipe.hidden_size, num_layers=recipe.num_layers,
        num_heads=recipe.num_heads, num_kv_heads=recipe.num_kv_heads, intermediate_size=recipe.intermediate_size,
        vision_hidden=recipe.vision_hidden, vision_depth=recipe.vision_depth, max_position_embeddings=2048,
    )
    resume = (ckpt / STATE_FILE).is_file()
    if resume:  # through from_pretrained: the saved key layout is not the in-memory one
        model = model_cls.from_pretrained(ckpt, dtype=torch.float32).train()
    else:
        model = model_cls(config).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay, betas=(0.9, 0.98))
    rng = random.Random(f"target:{recipe.seed}")
    counters = {t: 0 for t in TASKS}
    start = 0
    if resume:
        state = torch.load(ckpt / STATE_FILE, weights_only=False)
        opt.load_state_dict(state["optimizer"])
        rng.setstate(state["rng"])
        counters, start = state["counters"], int(state["step"])
        torch.set_rng_state(state["torch_rng"])
    else:
        save_target(model, tokenizer, out, max_pixels=recipe.max_pixels)  # writes the processor files too
    processor = AutoProcessor.from_pretrained(out)
    bar = tqdm(range(start, recipe.steps), initial=start, total=recipe.steps, desc="train demo VLM",
               disable=not progress, dynamic_ncols=True)
    vision_out: dict[str, torch.Tensor] = {}
    model.model.visual.register_forward_hook(lambda _m, _i, out: vision_out.__setitem__("merged", out.pooler_output))
    ema, img_cos, t0 = None, float("nan"), time.time()
    for step in bar:
        examples = []
        for _ in range(recipe.batch_size):
            task = sample_task(rng)
            examples.append(train_example(task, counters[task]))
            counters[task] += 1
        batch = collate(processor, examples)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe)
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % log_every == 0:
            img_cos = image_token_similarity(vision_out["merged"], batch["image_grid_thw"],
                                             merge=config.vision_config.spatial_merge_size ** 2)
        bar.set_postfix(loss=f"{ema:.3f}", img_cos=f"{img_cos:.2f}")
        if not progress and step % log_every == 0:
            print(f"step {step} loss {ema:.3f} image-token cosine {img_cos:.2f} ({time.time() - t0:.0f}s)", flush=True)
        if checkpoint_every and (step + 1) % checkpoint_every == 0 and step + 1 < recipe.steps:
            save_target(model, tokenizer, ckpt, max_pixels=recipe.max_pixels)
            torch.save({"optimizer": opt.state_dict(), "rng": rng.getstate(), "counters": counters,
                        "step": step + 1, "torch_rng": torch.get_rng_state()}, ckpt / STATE_FILE)
    model.eval()
    save_target(model, tokenizer, out, max_pixels=recipe.max_pixels)
    return out


@torch.no_grad()
def target_accuracy(engine, n_per_task: int = 20, tasks: tuple[str, ...] = TASKS) -> dict[str, float]:
    """Exact-match accuracy of the target's greedy answers on the evaluation sets (grounded tasks)."""
    from ..engine import SamplingParams

    acc = {}
    for task in tasks:
        if not GROUNDED[task]:
            continue
        hits = 0
        examples = eval_set(task)[:n_per_task]
        for ex in examples:
            got = engine.generate(ex.messages(), SamplingParams(max_tokens=64), mode="ar").text
            hits += got.strip() == ex.answer
        acc[task] = hits / len(examples)
    return acc

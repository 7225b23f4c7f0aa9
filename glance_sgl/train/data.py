"""Self-distillation data: the target's own answers and its tap-layer features, cached on disk.

For each (image(s), prompt) the target answers (the engine's AR path: greedy, or sampled at ``temperature`` with
a per-request seed); then one pass over prompt + answer captures the tap-layer outputs of every token.

Why sample: where the target's next token is nearly a coin toss (stories, chat), its greedy pick is decided by
small logit gaps that a drafter trained on greedy answers learns to copy from the prompt. Trained on samples, the
drafter learns the target's distribution instead, so its confidence follows the target's entropy; where the
target is sure (reading, counting) samples and greedy answers agree. Shards are safetensors files:
``ids`` (int32, all sequences concatenated), ``taps`` (float16, [sum T, L*H]), ``offsets`` [N+1],
``answer_starts`` [N]; a ``shard_XXXX.json`` sidecar names each sequence's task.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from ..engine import GlanceEngine, SamplingParams
from ..target import PreparedPrompt, TargetAdapter

META = "distill.json"


@dataclass
class DistillSequence:
    """One training sequence: ``ids`` [T] long, ``taps`` [T, L*H] float32, the answer's first index, task."""

    ids: torch.Tensor
    taps: torch.Tensor
    answer_start: int
    task: str


def with_answer(prompt: PreparedPrompt, answer_ids: list[int]) -> PreparedPrompt:
    """The prompt's model inputs extended by answer tokens (text tokens: mm_token_type_ids 0)."""
    inputs = dict(prompt.inputs)
    extra = torch.tensor([answer_ids], dtype=inputs["input_ids"].dtype, device=inputs["input_ids"].device)
    inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], dim=1)
    inputs["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(extra)], dim=1)
    if "mm_token_type_ids" in inputs:
        inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(extra)], dim=1)
    return PreparedPrompt(inputs=inputs, num_images=prompt.num_images)


def _before_vision_placeholders(answer: list[int], target: TargetAdapter) -> list[int]:
    """The answer up to its first image / video placeholder token (a sampled answer can contain one): fed back
    through the processor's prefill, such a token would be taken for an image slot without image features."""
    cfg = target.model.config
    placeholders = {t for t in (getattr(cfg, "image_token_id", None), getattr(cfg, "video_token_id", None))
                    if t is not None}
    cut = next((i for i, t in enumerate(answer) if t in placeholders), len(answer))
    return answer[:cut]


@torch.no_grad()
def distill_one(engine: GlanceEngine, messages: list[dict[str, Any]], taps: list[int],
                max_new_tokens: int, temperature: float,
                seed: int | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(ids [T], taps [T, L*H], answer_start) for one request answered by the target (greedy at temperature 0)."""
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed)
    target: TargetAdapter = engine.target
    answer = _before_vision_placeholders(engine.generate(messages, params, mode="ar").token_ids, target)
    prompt = target.prepare(messages)
    full = with_answer(prompt, answer)
    _, rows = target.prefill(full, taps=taps)
    return full.input_ids[0].cpu(), rows.taps.cpu(), prompt.num_tokens


def build_distill_data(
    engine: GlanceEngine,
    requests: Iterable[tuple[str, list[dict[str, Any]]]],
    out_dir: str | Path,
    taps: list[int],
    max_new_tokens: int = 96,
    shard_size: int = 256,
    total: int | None = None,
    progress: bool = True,
    temperature: float = 1.0,
    seed: int = 0,
) -> Path:
    """Answer ``requests`` ((task, messages) pairs) with the target and write shards to ``out_dir``.

    ``temperature`` > 0 samples each answer with seed ``seed + index`` (reproducible); 0 answers greedily.
    Raises :class:`~glance_sgl.engine.RequestError` (a ValueError) for a temperature the engine refuses.
    """
    SamplingParams(max_tokens=max_new_tokens, temperature=temperature).validate()
    from safetensors.torch import save_file
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    buf: list[tuple[torch.Tensor, torch.Tensor, int, str]] = []
    shards = 0

    def flush() -> None:
        nonlocal shards, buf
        if not buf:
            return
        lengths = [len(b[0]) for b in buf]
        offsets = torch.tensor([0] + lengths).cumsum(0)
        save_file({
            "ids": torch.cat([b[0] for b in buf]).to(torch.int32),
            "taps": torch.cat([b[1] for b in buf]).to(torch.float16),
            "offsets": offsets,
            "answer_starts": torch.tensor([b[2] for b in buf]),
        }, str(out / f"shard_{shards:04d}.safetensors"))
        (out / f"shard_{shards:04d}.json").write_text(json.dumps([b[3] for b in buf]))
        shards += 1
        buf = []

    count = 0
    for task, messages in tqdm(requests, total=total, desc="self-distillation", disable=not progress,
                               dynamic_ncols=True):
        ids, feats, start = distill_one(engine, messages, taps, max_new_tokens, temperature, seed + count)
        buf.append((ids, feats, start, task))
        count += 1
        if len(buf) >= shard_size:
            flush()
    flush()
    (out / META).write_text(json.dumps({"sequences": count, "shards": shards, "tap_layers": taps,
                                        "max_new_tokens": max_new_tokens, "temperature": temperature,
                                        "seed": seed}, indent=2))
    return out


class DistillDataset:
    """All sequences of a distillation directory, in memory (taps kept as float16)."""

    def __init__(self, directory: str | Path) -> None:
        from safetensors.torch import load_file

        d = Path(directory)
        meta_path = d / META
        if not meta_path.is_file():
            raise FileNotFoundError(f"no self-distillation data at {d} ({META} missing)")
        self.meta = json.loads(meta_path.read_text())
        self.sequences: list[tuple[torch.Tensor, torch.Tensor, int, str]] = []
        for shard in sorted(d.glob("shard_*.safetensors")):
            data = load_file(str(shard))
            tasks = json.loads(shard.with_suffix(".json").read_text())
            off = data["offsets"].tolist()
            for i, task in enumerate(tasks):
                a, b = off[i], off[i + 1]
                self.sequences.append((data["ids"][a:b].long(), data["taps"][a:b], int(data["answer_starts"][i]), task))

    @property
    def tap_layers(self) -> list[int]:
        return list(self.meta["tap_layers"])

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> DistillSequence:
        ids, taps, start, task = self.sequences[i]
        return DistillSequence(ids=ids, taps=taps.float(), answer_start=start, task=task)

    def __iter__(self) -> Iterator[DistillSequence]:
        return (self[i] for i in range(len(self)))

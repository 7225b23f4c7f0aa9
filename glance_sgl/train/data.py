"""Self-distillation data: the target's own answers and (optionally) its tap-layer features, on disk.

For each (image(s), prompt) the target answers: through the embedded engine's AR path (one request at a time,
:class:`EmbeddedAnswerer`) or an SGLang server (:class:`glance_sgl.train.sglang_distill.SGLangAnswerer`, many in
flight); greedy, or sampled at ``temperature`` with a per-request seed. Then, for the cached mode, one pass over
prompt + answer captures the tap-layer outputs of every token; the online mode stores the answers only and the
trainer recomputes the features in each step (:class:`DistillDataset` with ``online=True``).

Why sample: where the target's next token is nearly a coin toss (stories, chat), its greedy pick is decided by
small logit gaps that a drafter trained on greedy answers learns to copy from the prompt. Trained on samples, the
drafter learns the target's distribution instead, so its confidence follows the target's entropy; where the
target is sure (reading, counting) samples and greedy answers agree.

A directory holds ``distill.json`` (counts, tap layers, ``features``, backend, sampling, the skipped rows),
``answers.jsonl`` (per sequence: task, seed, prompt tokens, answer ids and the request with its image paths,
null for in-memory requests) and safetensors shards: ``ids`` (int32, all sequences concatenated), ``offsets``
[N+1], ``answer_starts`` [N] and, in the cached mode, ``taps`` (float16, [sum T, L*H]); a ``shard_XXXX.json``
sidecar names each sequence's task.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from ..engine import GlanceEngine, SamplingParams
from ..special_tokens import SpecialTokenGuard, special_token_message
from ..target import PreparedPrompt, TargetAdapter, TargetError
from .formats import RequestSpec, SkipLog

META = "distill.json"
ANSWERS = "answers.jsonl"


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


def _before_vision_placeholders(answer: list[int], target: Any) -> list[int]:
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


class PromptOnlyTarget:
    """The target's processor without its weights: prompts and token counts for the online mode behind an SGLang
    server (no features are computed at distillation, so the Hugging Face model is not loaded).
    ``prepare`` is :meth:`TargetAdapter.prepare` itself, so prompts are built exactly as the target builds them."""

    prepare = TargetAdapter.prepare
    context_length = TargetAdapter.context_length

    def __init__(self, model_dir: str | Path) -> None:
        from types import SimpleNamespace

        from transformers import AutoConfig, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.tokenizer = self.processor.tokenizer
        config = AutoConfig.from_pretrained(model_dir)
        self.text_config = config.get_text_config()
        self.model = SimpleNamespace(config=config, dtype=torch.float32)
        self.device = torch.device("cpu")


@dataclass
class AnswerJob:
    """One request to answer: its messages, prompt token count, token budget and sampling seed."""

    index: int
    task: str
    messages: list[dict[str, Any]]
    prompt: PreparedPrompt
    max_tokens: int
    seed: int | None
    spec: RequestSpec | None = None


class EmbeddedAnswerer:
    """Answers through the embedded engine's AR path, one request at a time (the CPU path)."""

    name = "embedded"

    def __init__(self, engine: GlanceEngine) -> None:
        self.engine = engine

    def margin(self) -> int:
        """Tokens the engine reserves beyond prompt + max_tokens (its tree budget + 1)."""
        return int(getattr(self.engine, "budget", 0)) + 1

    def answer(self, jobs: list[AnswerJob], temperature: float) -> Iterator[list[int]]:
        for job in jobs:
            params = SamplingParams(max_tokens=job.max_tokens, temperature=temperature, seed=job.seed)
            yield self.engine.generate(job.messages, params, mode="ar").token_ids


def _items(requests: Iterable[Any]) -> Iterator[tuple[str, RequestSpec | None, Any]]:
    for r in requests:
        if isinstance(r, RequestSpec):
            yield r.task, r, None
        else:
            task, messages = r
            yield task, None, messages


def build_distill_data(
    engine: GlanceEngine | None,
    requests: Iterable[Any],
    out_dir: str | Path,
    taps: list[int],
    max_new_tokens: int = 96,
    shard_size: int = 256,
    total: int | None = None,
    progress: bool = True,
    temperature: float = 1.0,
    seed: int = 0,
    *,
    answerer: Any = None,
    target: TargetAdapter | PromptOnlyTarget | None = None,
    features: bool = True,
    skips: SkipLog | None = None,
    max_length: int | None = None,
    chunk: int = 64,
) -> Path:
    """Answer ``requests`` with the target and write shards to ``out_dir``.

    ``requests``: :class:`~glance_sgl.train.formats.RequestSpec` rows (from :func:`read_dataset`) or
    (task, messages) pairs. ``answerer``: who answers (default: the embedded ``engine``;
    :class:`glance_sgl.train.sglang_distill.SGLangAnswerer` sends ``chunk`` requests at a time to an SGLang
    server, many in flight). ``temperature`` > 0 samples each answer with seed ``seed + i`` (i: the request's
    0-based row in its file, else its index in ``requests``; reproducible); 0 answers greedily. ``features``: also cache the tap features (float16; else answers only, for online
    training, which needs ``RequestSpec`` rows to reopen the images). A request whose prompt does not fit the
    context (``max_length``, default the target's context length) leaves no room for one answer token, whose
    text holds a special-token string (``<|image_pad|>``, ``<|im_start|>``, ...: it would become a control or
    image token), or whose images or messages the processor refuses, is skipped through ``skips`` (``strict``
    raises).
    Raises :class:`~glance_sgl.engine.RequestError` (a ValueError) for a temperature the engine refuses.
    """
    SamplingParams(max_tokens=max_new_tokens, temperature=temperature).validate()
    from safetensors.torch import save_file
    from tqdm import tqdm

    target = target if target is not None else engine.target
    answerer = answerer if answerer is not None else EmbeddedAnswerer(engine)
    skips = skips if skips is not None else SkipLog()
    max_length = int(max_length or target.context_length)
    if features and not isinstance(target, TargetAdapter):
        raise ValueError("cached features need the target's weights (a TargetAdapter)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    buf: list[tuple[torch.Tensor, torch.Tensor | None, int, str]] = []
    shards = 0
    answers_file = (out / ANSWERS).open("w")

    def flush() -> None:
        nonlocal shards, buf
        if not buf:
            return
        lengths = [len(b[0]) for b in buf]
        tensors = {
            "ids": torch.cat([b[0] for b in buf]).to(torch.int32),
            "offsets": torch.tensor([0] + lengths).cumsum(0),
            "answer_starts": torch.tensor([b[2] for b in buf]),
        }
        if features:
            tensors["taps"] = torch.cat([b[1] for b in buf]).to(torch.float16)
        save_file(tensors, str(out / f"shard_{shards:04d}.safetensors"))
        (out / f"shard_{shards:04d}.json").write_text(json.dumps([b[3] for b in buf]))
        shards += 1
        buf = []

    count = 0
    bar = tqdm(total=total, desc=f"self-distillation ({answerer.name})", disable=not progress, dynamic_ncols=True)

    def run(jobs: list[AnswerJob]) -> None:
        nonlocal count
        for job, answer in zip(jobs, answerer.answer(jobs, temperature)):
            bar.update(1)
            if isinstance(answer, Exception):  # the server refused this request
                src = job.spec
                skips.skip(src.source if src else "<requests>", src.row if src else job.index + 1,
                           src.text_field if src else "messages", f"not answered: {answer}")
                continue
            answer = _before_vision_placeholders(list(answer), target)
            full = with_answer(job.prompt, answer)
            feats = None
            if features:
                with torch.no_grad():
                    _, rows = target.prefill(full, taps=taps)
                feats = rows.taps.cpu()
            buf.append((full.input_ids[0].cpu(), feats, job.prompt.num_tokens, job.task))
            answers_file.write(json.dumps({"task": job.task, "seed": job.seed, "prompt_tokens": job.prompt.num_tokens,
                                           "answer_ids": answer,
                                           "request": job.spec.to_json() if job.spec else None}) + "\n")
            count += 1
            if len(buf) >= shard_size:
                flush()

    jobs: list[AnswerJob] = []
    margin = answerer.margin()
    guard = SpecialTokenGuard(target.tokenizer)
    for index, (task, spec, messages) in enumerate(_items(requests)):
        where = (spec.source, spec.row) if spec else ("<requests>", index + 1)
        fld = spec.text_field if spec else "messages"
        try:
            messages = messages if spec is None else spec.messages()
        except OSError as exc:
            bar.update(1)
            skips.skip(*where, "image", f"could not open an image: {exc}")
            continue
        if (hit := guard.check_messages(messages)) is not None:  # user text is text: no image slots from it
            bar.update(1)
            skips.skip(*where, fld, special_token_message(*hit))
            continue
        try:
            prompt = target.prepare(messages)
        except TargetError as exc:
            bar.update(1)
            skips.skip(*where, fld, str(exc))
            continue
        room = max_length - prompt.num_tokens - margin
        if room < 1:
            bar.update(1)
            skips.skip(*where, fld, f"too long for the context: {prompt.num_tokens} prompt tokens, context "
                       f"{max_length}")
            continue
        nth = spec.row - 1 if spec is not None else index  # a row keeps its seed whatever rows are skipped
        jobs.append(AnswerJob(index, task, messages, prompt, min(max_new_tokens, room),
                              seed + nth if temperature > 0 else None, spec))
        if len(jobs) >= chunk:
            run(jobs)
            jobs = []
    run(jobs)
    flush()
    bar.close()
    answers_file.close()
    (out / META).write_text(json.dumps({"sequences": count, "shards": shards, "tap_layers": taps,
                                        "features": features, "backend": answerer.name,
                                        "max_new_tokens": max_new_tokens, "temperature": temperature,
                                        "seed": seed, **skips.to_dict()}, indent=2))
    if progress or skips.skips:
        print(f"self-distillation: {count} answers; {skips.summary()}", file=sys.stderr, flush=True)
    return out


class DistillDataset:
    """The sequences of a distillation directory: token ids in memory, and per sequence its tap features.

    Cached mode (the directory holds features, default): the float16 features in memory. Online mode
    (``online=True``, or a directory written without features; needs ``target``): the frozen target computes a
    sequence's features when it is read (one no-grad pass over prompt + answer, on the target's device), from the
    request stored in ``answers.jsonl``; ``round_to`` (e.g. ``torch.float16``) rounds them as the cache would.
    """

    def __init__(self, directory: str | Path, target: TargetAdapter | None = None, online: bool | None = None,
                 round_to: torch.dtype | None = None) -> None:
        from safetensors.torch import load_file

        d = Path(directory)
        meta_path = d / META
        if not meta_path.is_file():
            raise FileNotFoundError(f"no self-distillation data at {d} ({META} missing)")
        self.meta = json.loads(meta_path.read_text())
        self.sequences: list[tuple[torch.Tensor, torch.Tensor | None, int, str]] = []
        for shard in sorted(d.glob("shard_*.safetensors")):
            data = load_file(str(shard))
            tasks = json.loads(shard.with_suffix(".json").read_text())
            off = data["offsets"].tolist()
            taps = data.get("taps")
            for i, task in enumerate(tasks):
                a, b = off[i], off[i + 1]
                self.sequences.append((data["ids"][a:b].long(), taps[a:b] if taps is not None else None,
                                       int(data["answer_starts"][i]), task))
        has_features = bool(self.sequences) and self.sequences[0][1] is not None
        self.online = (not has_features) if online is None else bool(online)
        self.target, self.round_to = target, round_to
        self.requests: list[RequestSpec | None] = []
        if (d / ANSWERS).is_file():
            with (d / ANSWERS).open() as f:
                self.requests = [RequestSpec.from_json(r["request"]) if r.get("request") else None
                                 for r in map(json.loads, f)]
        if self.online:
            if target is None:
                raise ValueError(f"{d}: online features need the target")
            if len(self.requests) != len(self.sequences) or any(r is None for r in self.requests):
                raise ValueError(f"{d}: online features need every request in {ANSWERS} (distil from a data file)")

    @property
    def tap_layers(self) -> list[int]:
        return list(self.meta["tap_layers"])

    def __len__(self) -> int:
        return len(self.sequences)

    def online_features(self, i: int) -> torch.Tensor:
        """Tap features [T, L*H] float32 of sequence ``i`` computed by the target (no grad), on its device."""
        ids, _, start, _ = self.sequences[i]
        prompt = self.target.prepare(self.requests[i].messages())
        full = with_answer(prompt, ids[start:].tolist())
        if prompt.num_tokens != start or not torch.equal(full.input_ids[0].cpu(), ids):
            raise ValueError(f"sequence {i}: the prompt no longer tokenizes as at distillation "
                             f"({prompt.num_tokens} vs {start} prompt tokens)")
        with torch.no_grad():
            _, rows = self.target.prefill(full, taps=self.tap_layers)
        taps = rows.taps
        if self.round_to is not None:
            taps = taps.to(self.round_to)
        return taps.float()

    def __getitem__(self, i: int) -> DistillSequence:
        ids, taps, start, task = self.sequences[i]
        feats = self.online_features(i) if self.online else taps.float()
        return DistillSequence(ids=ids, taps=feats, answer_start=start, task=task)

    def __iter__(self) -> Iterator[DistillSequence]:
        return (self[i] for i in range(len(self)))

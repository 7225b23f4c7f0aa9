"""Drafter training at scale, on tiny real targets: dataset formats with bad rows, online == cached features,
2 torchrun processes == 1 process (DDP, gradient accumulation), checkpoints / resume / log / PNG, held-out tau
and the best checkpoint, and the `train-pipeline --quick` run end to end."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glance_sgl.engine import GlanceEngine
from glance_sgl.train.blocks import glance_loss, make_block_batch
from glance_sgl.train.data import DistillDataset, build_distill_data
from glance_sgl.train.formats import DataError, SkipLog, read_dataset
from glance_sgl.train.trainer import DrafterTrainConfig, simulated_tau, train_drafter

from tests.glance_testing import make_image

ARCH = "qwen2_5_vl"


def write_llava(root: Path, n: int, size=(56, 56)) -> Path:
    """``n`` good LLaVA rows (one image, some multi-turn, one with two images) as ``root/data.json``."""
    rows = []
    for i in range(n):
        make_image(100 + i, size).save(root / f"img{i}.png")
        conv = [{"from": "human", "value": "<image>\nwhat colour is the circle"}]
        if i % 3 == 1:  # multi-turn: the dataset's answer stays as history, the target answers the last turn
            conv += [{"from": "gpt", "value": "red"}, {"from": "human", "value": "and the square"}]
        conv.append({"from": "gpt", "value": "blue"})
        rows.append({"image": f"img{i}.png", "conversations": conv, "task": f"t{i % 2}"})
    path = root / "data.json"
    path.write_text(json.dumps(rows))
    return path


@pytest.fixture(scope="module")
def cached(tmp_path_factory, targets):
    """A LLaVA file and its distillation with cached features (greedy answers)."""
    target = targets[ARCH]
    root = tmp_path_factory.mktemp("scale")
    data = write_llava(root, 6)
    out = root / "distill"
    build_distill_data(GlanceEngine(target, None, mode="ar"), read_dataset(data), out, taps=[1, 3],
                       max_new_tokens=10, temperature=0.0, progress=False, shard_size=4)
    return target, data, out


def test_llava_and_messages_rows_with_bad_rows_skipped(tmp_path, targets):
    target = targets[ARCH]
    make_image(1, (56, 56)).save(tmp_path / "a.png")
    make_image(2, (84, 56)).save(tmp_path / "b.png")
    (tmp_path / "broken.png").write_bytes(b"not a png")
    good_multi = {"image": ["a.png", "b.png"], "conversations": [
        {"from": "human", "value": "<image>\nleft\n<image>\nright: which is brighter"},
        {"from": "gpt", "value": "the left"}, {"from": "human", "value": "why"}, {"from": "gpt", "value": "x"}]}
    rows = [
        good_multi,                                                                              # row 1
        {"image": "missing.png", "conversations": [{"from": "human", "value": "<image>\nhi"}]},   # row 2
        {"image": "broken.png", "conversations": [{"from": "human", "value": "<image>\nhi"}]},    # row 3
        {"image": "a.png", "conversations": [{"from": "robot", "value": "<image>\nhi"}]},         # row 4
        {"image": "a.png", "conversations": [{"from": "human", "value": "<image><image> two?"}]},  # row 5
        {"images": ["b.png"], "messages": [{"role": "system", "content": "be brief"},             # row 6
                                           {"role": "user", "content": "<image>describe"}]},
        {"image": "a.png", "conversations": [{"from": "human", "value": "<image>\n" + "word " * 400}]},  # row 7
        {"prompt": "what colour is the circle", "image": "a.png"},                                # row 8
        {"image": "a.png", "conversations": [{"from": "human", "value": "<image>\nsay <|image_pad|>"}]},  # row 9
    ]
    data = tmp_path / "data.json"
    data.write_text(json.dumps(rows))
    skips = SkipLog(quiet=True)
    specs = list(read_dataset(data, skips))
    assert [s.row for s in specs] == [1, 6, 7, 8, 9]
    assert [(Path(s.file).name, s.row, s.field) for s in skips.skips] == [
        ("data.json", 2, "image"), ("data.json", 3, "image"), ("data.json", 4, "conversations[0].from"),
        ("data.json", 5, "conversations")]
    assert "image not found" in skips.skips[0].reason and "not a readable image" in skips.skips[1].reason
    assert "2 <image> marks but 1 images" in skips.skips[3].reason
    # row 1: both images where the marks are, the earlier answer kept as history, the last answer dropped
    turns = specs[0].turns
    assert [t["role"] for t in turns] == ["user", "assistant", "user"]
    assert [p["type"] for p in turns[0]["content"]] == ["image", "text", "image", "text"]
    assert turns[0]["content"][2]["path"].endswith("b.png")
    # row 8 (GLANCE JSONL) builds the same prompt as before: the images, then the prompt text
    from glance_sgl.cli import build_messages, load_image

    assert torch.equal(target.prepare(specs[3].messages()).input_ids,
                       target.prepare(build_messages("what colour is the circle",
                                                     [load_image(str(tmp_path / "a.png"))])).input_ids)
    # distillation: row 7 is too long for a 300-token context and row 9's text holds a special-token string (it
    # would become an image slot): both skipped where the prompt is built
    out = tmp_path / "d"
    build_distill_data(GlanceEngine(target, None, mode="ar"), specs, out, taps=[1], max_new_tokens=4,
                       temperature=0.0, progress=False, features=False, skips=skips, max_length=300)
    assert [(Path(s.file).name, s.row, s.field) for s in skips.skips[-2:]] == \
        [("data.json", 7, "conversations"), ("data.json", 9, "conversations")]
    assert "too long for the context" in skips.skips[-2].reason
    assert "'<|image_pad|>'" in skips.skips[-1].reason and "messages[0].content[1].text" in skips.skips[-1].reason
    assert skips.summary() == "skipped 6 rows (conversations: 3, conversations[0].from: 1, image: 2)"
    meta = json.loads((out / "distill.json").read_text())
    assert meta["sequences"] == 3 and meta["skipped"] == 6 and not meta["features"]
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert [a["request"]["row"] for a in answers] == [1, 6, 8]
    with pytest.raises(DataError, match=r"data\.json:2: field 'image': image not found"):
        list(read_dataset(data, SkipLog(strict=True)))


def test_online_features_give_the_cached_loss(cached):
    target, _, out = cached
    cached_data = DistillDataset(out)
    online = DistillDataset(out, target=target, online=True, round_to=torch.float16)
    exact = DistillDataset(out, target=target, online=True)
    assert not cached_data.online and online.online and len(online) == len(cached_data) == 6
    from tests.glance_testing import random_drafter

    drafter = random_drafter(target, seed=3, num_hidden_layers=1, block_size=8, tap_layers=[1, 3])
    drafter.bind_target(target.input_embeddings(), target.lm_head())
    idx = [0, 1, 4]

    def loss(data):
        batch = make_block_batch([data[i] for i in idx], 8, drafter.config.mask_token_id, 512, random.Random(5))
        return glance_loss(drafter, batch, 3.0)[0].item()

    ref = loss(cached_data)
    assert abs(loss(online) - ref) < 1e-6  # the same float16 features: the same loss
    assert abs(loss(exact) - ref) < 1e-3 * abs(ref)  # float32 features: the cache's rounding only
    assert torch.allclose(exact[1].taps, cached_data[1].taps, atol=2e-2, rtol=1e-2)


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_torchrun_processes_reproduce_one_process(cached, tmp_path, target_dirs):
    """Global batch 4: one process (batch 4 in one pass) vs torchrun 2 ranks x 2 micro-batches of 1."""
    from safetensors.torch import load_file

    target, _, data_dir = cached
    cfg = DrafterTrainConfig(steps=4, batch_size=4, lr=1e-2, block_size=8, num_layers=1, checkpoint_every=2,
                             seed=2, eval_every=2, eval_size=1, budget=7, branch_k=2)
    one = tmp_path / "one"
    torch.manual_seed(0)
    train_drafter(target, DistillDataset(data_dir), one, cfg, progress=False)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(29500 + os.getpid() % 1000)]
    args = ["-m", "glance_sgl.cli", "train-drafter", "--target", target_dirs[ARCH], "--data", str(data_dir),
            "--out", str(tmp_path / "two"), "--steps", "4", "--batch-size", "4", "--grad-accum", "2", "--lr",
            "1e-2", "--block-size", "8", "--checkpoint-every", "2", "--seed", "2", "--eval-every", "2",
            "--eval-size", "1", "--budget", "7", "--branch-k", "2", "--threads", "1"]
    proc = subprocess.run(torchrun + args, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    a, b = _log(one / "train_log.jsonl"), _log(tmp_path / "two" / "train_log.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 3]
    for ra, rb in zip(a, b):
        assert abs(ra["loss"] - rb["loss"]) < 1e-4, (ra, rb)
        assert ra["acc_k1"] == pytest.approx(rb["acc_k1"], abs=1e-6)
        assert ra["lr"] == rb["lr"]
    assert a[0]["loss"] != a[3]["loss"]
    wa, wb = load_file(str(one / "model.safetensors")), load_file(str(tmp_path / "two" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        # the all-reduced gradient sums in another order than one batch of 4: Adam steps of lr 1e-2 differ by
        # ~1e-5 after 4 steps (1.6e-5 seen on a 2-core machine)
        assert torch.allclose(wa[k], wb[k], atol=5e-5, rtol=1e-4), k
    # rank 0 wrote everything: checkpoint of step 2, the best held-out checkpoint, the log's fields, the PNG
    for run in (one, tmp_path / "two"):
        assert torch.load(run / "checkpoint" / "trainer_state.pt", weights_only=False)["step"] == 2
        assert (run / "best" / "model.safetensors").is_file() and (run / "loss_curve.png").stat().st_size > 1000
        best = json.loads((run / "best" / "eval.json").read_text())
        taus = {r["step"] + 1: r["tau"] for r in _log(run / "train_log.jsonl") if "tau" in r}
        assert set(taus) == {2, 4} and best["tau"] == max(taus.values()) and best["step"] in taus
    assert {"acc_k1", "acc_k7", "lr", "loss"} <= set(a[0])
    # resume from the step-2 checkpoint: the same steps 2-3, the same weights
    resumed: list[dict] = []
    train_drafter(target, DistillDataset(data_dir), one, cfg, progress=False, on_log=lambda s, r: resumed.append(r))
    assert [r["step"] for r in resumed] == [2, 3]
    for ra, rb in zip(a[2:], resumed):
        assert abs(ra["loss"] - rb["loss"]) < 1e-6
    again = load_file(str(one / "model.safetensors"))
    assert all(torch.allclose(wa[k], again[k], atol=1e-6) for k in wa)
    assert [r["step"] for r in _log(one / "train_log.jsonl")] == [0, 1, 2, 3]


def test_simulated_tau_counts_teacher_forced_acceptance(cached):
    """A drafter that has seen nothing accepts ~nothing (tau ~1); the walk commits every answer token once."""
    target, _, out = cached
    from tests.glance_testing import random_drafter

    data = DistillDataset(out)
    drafter = random_drafter(target, seed=1, num_hidden_layers=1, block_size=8, tap_layers=[1, 3], budget=7,
                             branch_k=2)
    drafter.bind_target(target.input_embeddings(), target.lm_head())
    seqs = list(data)
    ev = simulated_tau(drafter, seqs)
    answer_tokens = sum(len(s.ids) - 1 - s.answer_start for s in seqs)
    assert ev["tau"] * ev["rounds"] == pytest.approx(answer_tokens)
    assert 1.0 <= ev["tau"] < 1.5


def test_train_pipeline_quick_end_to_end(tmp_path, target_dirs):
    """data (LLaVA file with a bad row) -> distill (answers only) -> online training -> tau, one command."""
    from glance_sgl.cli import main

    root = tmp_path
    data = write_llava(root, 6)
    rows = json.loads(data.read_text())
    rows.insert(2, {"image": "gone.png", "conversations": [{"from": "human", "value": "<image>\nhi"}]})
    data.write_text(json.dumps(rows))
    assert main(["train-pipeline", "--quick", "--target", target_dirs[ARCH], "--data", str(data), "--out",
                 str(root / "run"), "--threads", "2"]) == 0
    report = json.loads((root / "run" / "pipeline.json").read_text())
    meta = json.loads((root / "run" / "distill" / "distill.json").read_text())
    assert meta["sequences"] == report["sequences"] == 6 and meta["skipped"] == 1 and not meta["features"]
    assert "data.json:3: field 'image'" in meta["rows"][0]
    assert report["best"]["tau"] >= 1.0 and report["best"]["rounds"] > 0
    drafter = root / "run" / "drafter"
    assert (drafter / "model.safetensors").is_file() and (drafter / "best" / "model.safetensors").is_file()
    from safetensors.torch import load_file

    shards = list((root / "run" / "distill").glob("shard_*.safetensors"))
    assert shards and all("taps" not in load_file(str(p)) for p in shards)  # no feature cache


def test_file_layouts_jsonl_json_list_and_wrapped(tmp_path):
    """The same rows as JSONL, as a JSON list, wrapped under "data", and as JSONL in a .json file; a line that is
    not JSON is a bad row of its own."""
    make_image(1, (56, 56)).save(tmp_path / "a.png")
    rows = [{"image": "a.png", "conversations": [{"from": "human", "value": "<image>\nq"}]},
            {"images": ["a.png"], "messages": [{"role": "user", "content": [{"type": "image"},
                                                                            {"type": "text", "text": "q"}]}]}]
    lines = "\n".join(json.dumps(r) for r in rows) + "\n{broken\n"
    (tmp_path / "a.jsonl").write_text(lines)
    (tmp_path / "b.json").write_text(json.dumps(rows))
    (tmp_path / "c.json").write_text(json.dumps({"data": rows}))
    (tmp_path / "d.json").write_text(lines)
    for name, bad in (("a.jsonl", 1), ("b.json", 0), ("c.json", 0), ("d.json", 1)):
        skips = SkipLog(quiet=True)
        specs = list(read_dataset(tmp_path / name, skips))
        assert [s.turns for s in specs][0] == specs[1].turns, name  # both variants: the same request
        assert [s.text_field for s in specs] == ["conversations", "messages"]
        assert [(s.row, s.field) for s in skips.skips] == ([(3, "row")] if bad else []), name

"""The drafter training pipeline on a tiny target: data, blocks, loss falls, checkpoint + resume."""

from __future__ import annotations

import random

import pytest
import torch

from glance_sgl.engine import GlanceEngine
from glance_sgl.train.blocks import loss_weights, make_block_batch
from glance_sgl.train.data import DistillDataset, DistillSequence, build_distill_data
from glance_sgl.train.trainer import DrafterTrainConfig, train_drafter

from tests.glance_testing import make_prompts


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, targets):
    target = targets["qwen2_5_vl"]
    engine = GlanceEngine(target, None, mode="ar")
    requests = [("demo", m) for m in make_prompts(12, seed=41)]
    out = tmp_path_factory.mktemp("distill")
    build_distill_data(engine, requests, out, taps=[1, 3], max_new_tokens=20, shard_size=5, progress=False,
                       temperature=0.0)
    return target, DistillDataset(out)


def test_distill_data_round_trip(distilled):
    target, data = distilled
    assert len(data) == 12 and data.tap_layers == [1, 3]
    seq = data[0]
    assert seq.taps.shape == (len(seq.ids), 2 * target.text_config.hidden_size)
    assert 0 < seq.answer_start < len(seq.ids)


def test_sampled_distillation_is_seeded_and_samples(targets, tmp_path):
    """Sampled answers repeat with the same seed, change with another, and differ from the greedy ones."""
    engine = GlanceEngine(targets["qwen2_5_vl"], None, mode="ar")
    requests = [("demo", m) for m in make_prompts(4, seed=43)]

    def answers(name: str, **kw) -> list[list[int]]:
        build_distill_data(engine, requests, tmp_path / name, taps=[1], max_new_tokens=12, progress=False, **kw)
        return [seq.ids[seq.answer_start:].tolist() for seq in DistillDataset(tmp_path / name)]

    greedy = answers("greedy", temperature=0.0)
    first, again = answers("s0", temperature=1.0, seed=5), answers("s0b", temperature=1.0, seed=5)
    other = answers("s1", temperature=1.0, seed=6)
    assert first == again
    assert first != other and first != greedy
    with pytest.raises(ValueError, match="temperature"):
        answers("bad", temperature=-1.0)


def test_block_batch_follows_the_recipe():
    ids = torch.arange(100, 112)  # T = 12, answer from index 8
    seq = DistillSequence(ids=ids, taps=torch.randn(12, 4), answer_start=8, task="x")
    batch = make_block_batch([seq], block_size=4, mask_token_id=7, max_anchors=512, rng=random.Random(0))
    # anchors 8, 9, 10 (each needs a label after it)
    assert batch.block_tokens[0].tolist() == [108, 7, 7, 7, 109, 7, 7, 7, 110, 7, 7, 7]
    assert batch.labels[0].tolist() == [-100, 109, 110, 111, -100, 110, 111, -100, -100, 111, -100, -100]
    assert batch.block_positions[0, :4].tolist() == [8, 9, 10, 11]
    t = 12
    m = batch.mask[0, 0]
    assert m[0, :8].all() and not m[0, 8:t].any()  # context strictly before the anchor
    assert m[4, :9].all() and not m[4, 9:t].any()
    assert m[0, t : t + 4].all() and not m[0, t + 4 :].any()  # own block only, bidirectional
    w = loss_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1 and torch.isclose(w[8], torch.exp(torch.tensor(-1.0)))


def test_loss_falls_and_resume(distilled, tmp_path):
    target, data = distilled
    cfg = DrafterTrainConfig(steps=60, batch_size=4, lr=1e-2, block_size=8, checkpoint_every=30, seed=1)
    losses: list[float] = []
    train_drafter(target, data, tmp_path / "d", cfg, progress=False, on_log=lambda s, r: losses.append(r["loss"]))
    assert len(losses) == 60
    assert sum(losses[-5:]) / 5 < 0.85 * sum(losses[:5]) / 5, losses
    assert (tmp_path / "d" / "checkpoint" / "trainer_state.pt").is_file()
    # resume from the step-30 checkpoint: only the remaining steps run
    resumed: list[int] = []
    train_drafter(target, data, tmp_path / "d", cfg, progress=False, on_log=lambda s, r: resumed.append(s))
    assert resumed == list(range(30, 60))


def test_distilled_answers_stop_before_a_vision_placeholder_token():
    """A sampled answer can contain the image / video placeholder id; fed back through the processor it would
    be an image slot without features, so the answer is cut there."""
    from types import SimpleNamespace

    from glance_sgl.train.data import _before_vision_placeholders

    target = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(image_token_id=5, video_token_id=6)))
    assert _before_vision_placeholders([9, 8, 5, 7], target) == [9, 8]
    assert _before_vision_placeholders([9, 6], target) == [9]
    assert _before_vision_placeholders([9, 8, 7], target) == [9, 8, 7]

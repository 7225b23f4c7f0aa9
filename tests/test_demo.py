"""The demo: deterministic disjoint task data, the bundled checkpoints, the bench report's schema."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from glance_sgl.demo import paths
from glance_sgl.demo.tasks import GROUNDED, TASKS, eval_set, train_example
from glance_sgl.engine import SamplingParams
from glance_sgl.costs import CostModel
from glance_sgl.planner import Planner


def pixels(img) -> bytes:
    return np.asarray(img).tobytes()


@pytest.mark.parametrize("task", TASKS)
def test_tasks_are_deterministic_and_disjoint(task):
    a, b = train_example(task, 7), train_example(task, 7)
    assert (a.prompt, a.answer, pixels(a.image)) == (b.prompt, b.answer, pixels(b.image))
    assert [e.key for e in eval_set(task)] == [e.key for e in eval_set(task)]
    eval_keys = {e.key for e in eval_set(task)}
    assert len(eval_set(task)) == 40
    assert not eval_keys & {train_example(task, i).key for i in range(400)}
    assert a.grounded == GROUNDED[task]


def test_grounded_answers_depend_on_the_image():
    answers = {train_example("text", i).answer for i in range(30)}
    assert len(answers) > 20  # different signs, different answers
    ex = train_example("caption", 3)
    assert ex.messages()[0]["content"][0]["image"] is ex.image


def sign_of(ex) -> tuple[str, str, str]:
    """(word, number, colour) of a text-task example, from its content key and its answer."""
    word, number = ex.key.split("|")[1].split()
    return word, number, ex.answer.split(" It is a ")[1].split()[0]


def test_text_answers_read_the_sign_and_name_its_colour():
    from glance_sgl.demo.tasks import SIGN_COLOURS

    for i in range(20):
        ex = train_example("text", i)
        word, number, colour = sign_of(ex)
        assert f'"{word} {number}"' in ex.answer and colour in SIGN_COLOURS
        assert ex.image.getpixel((84, 100)) == SIGN_COLOURS[colour]  # the sign's background, below the number


def test_open_choices_are_wide_and_lean_on_the_picture():
    """Every free choice is sampled from a wide distribution that changes with the scene and, for one scene, with
    the previous choice, so the most likely answer differs from picture to picture and no single story dominates
    the training data."""
    import math
    import random

    from glance_sgl.demo.tasks import CREATURE_ADJS, CREATURES, _Chooser, draw_scene

    def favourite(p: list[float]) -> str:
        return CREATURES[max(range(len(p)), key=p.__getitem__)]

    favourites, entropies = set(), []
    for i in range(20):
        _, shapes = draw_scene(random.Random(f"scene:{i}"))
        p = _Chooser(random.Random(0), shapes, "Tell me a story.").probabilities("who1", CREATURES)
        assert abs(sum(p) - 1.0) < 1e-9
        entropies.append(-sum(q * math.log(q) for q in p if q > 0))
        favourites.add(favourite(p))
    assert min(entropies) > 1.0  # nats; uniform over 12 would be 2.48
    assert len(favourites) >= 4
    chooser, after = _Chooser(random.Random(0), shapes, "Tell me a story."), set()
    for adjective in CREATURE_ADJS:
        chooser.prev = adjective
        after.add(favourite(chooser.probabilities("who1", CREATURES)))
    assert len(after) >= 4
    answers = {train_example("open", i).answer for i in range(30)}
    assert len(answers) == 30


def test_wild_task_is_deterministic_and_unlike_the_demo_tasks():
    from glance_sgl.demo.tasks import MAKERS
    from glance_sgl.demo.wild import KINDS, TASK, make_wild, wild_set

    a, b = wild_set(), wild_set()
    assert len(a) == 40 and TASK not in TASKS and TASK not in MAKERS  # never trained on
    again = make_wild(7)  # rebuilt from the seed, not cached
    assert again.key == a[7].key and [pixels(i) for i in again.images] == [pixels(i) for i in a[7].images]
    assert [e.key for e in wild_set(seed=1)] != [e.key for e in a]
    assert {e.kind for e in a[: len(KINDS)]} == set(KINDS)  # any limit of six or more covers every kind
    demo_prompts = {ex.prompt for t in TASKS for ex in eval_set(t)}
    demo_sizes = {ex.image.size for t in TASKS for ex in eval_set(t)}
    assert not {e.prompt for e in a} & demo_prompts
    sizes = {img.size for e in a for img in e.images}
    assert len(sizes) >= 6 and not sizes & demo_sizes and len({w / h for w, h in sizes}) >= 4
    counts = {kind: sum(e.kind == kind for e in a) for kind in KINDS}
    assert min(counts.values()) >= 6
    by_kind = {e.kind: e for e in a}
    assert not by_kind["text_only"].images and isinstance(by_kind["text_only"].messages()[0]["content"], str)
    assert [m["role"] for m in by_kind["chat"].messages()] == ["system", "user", "assistant", "user"]
    assert len(by_kind["two_images"].images) == 2 and len(by_kind["long"].prompt) > 600
    noise = np.asarray(by_kind["noise"].images[0], dtype=float)
    photo = np.asarray(by_kind["photo"].images[0], dtype=float)
    assert noise.std() > 20 and photo.std() > 5  # textured pictures, not flat canvases


def test_wild_requests_are_accepted_by_both_targets(targets):
    """Every kind goes through each target's processor (odd sizes and aspect ratios, system and assistant turns,
    two images, no image); the long prompts are long in tokens too. (The bench test runs one through every
    decoding method.)"""
    from glance_sgl.demo.wild import KINDS, wild_set

    for arch, target in targets.items():
        tokens = {ex.kind: target.prepare(ex.messages()).num_tokens for ex in wild_set()[: len(KINDS)]}
        assert tokens["long"] > 4 * tokens["text_only"] and tokens["two_images"] > tokens["text_only"], (arch, tokens)


@pytest.fixture(scope="module")
def bundled():
    from glance_sgl.engine import GlanceEngine

    assert (paths.bundled_target() / "config.json").is_file(), "bundled demo target missing"
    assert (paths.bundled_drafter() / "config.json").is_file(), "bundled demo drafter missing"
    return GlanceEngine.load(paths.bundled_target(), paths.bundled_drafter())


def _answered(bundled, ex) -> str:
    from glance_sgl.engine import SamplingParams

    glance = bundled.generate(ex.messages(), SamplingParams(max_tokens=64))
    ar = bundled.generate(ex.messages(), SamplingParams(max_tokens=64), mode="ar")
    assert glance.token_ids == ar.token_ids
    return glance.text.strip()


def test_bundled_checkpoints_read_order_forms(bundled):
    """The bundled demo loads offline and reads every item and quantity of order forms it never saw in
    training, speculatively and losslessly."""
    examples = eval_set("document")[:10]
    hits = sum(_answered(bundled, ex) == ex.answer for ex in examples)
    assert hits >= 9, f"only {hits}/{len(examples)} order forms read exactly right"


def test_bundled_checkpoints_read_sign_words_and_colours(bundled):
    """Signs it never saw: the word and the colour (the VLM still misreads some two-digit numbers; its exact-match
    accuracy is reported by `glance demo build`)."""
    examples = eval_set("text")[:10]
    hits = 0
    for ex in examples:
        word, _, colour = sign_of(ex)
        text = _answered(bundled, ex)
        hits += f'"{word} ' in text and f"It is a {colour} sign" in text
    assert hits >= 9, f"only {hits}/{len(examples)} sign words and colours read right"


def test_bundled_checkpoints_name_chart_kinds(bundled):
    from glance_sgl.engine import SamplingParams

    hits, charts = 0, eval_set("chart")[:10]
    for ex in charts:
        text = bundled.generate(ex.messages(), SamplingParams(max_tokens=48)).text
        kind = "bar" if " bar chart" in ex.answer else "line"
        other = "line" if kind == "bar" else "bar"
        hits += f"{kind} chart" in text and f"{other} chart" not in text
    assert hits >= 9, f"only {hits}/{len(charts)} chart kinds named correctly"


def test_bundled_drafter_accepts_long_blocks_where_the_picture_decides(bundled):
    """Tau (committed tokens per round) of the bundled pair: long blocks on forms and signs, short ones on stories
    (the drafter learned the VLM's distribution there, not its greedy picks). `glance bench` measures speed."""
    from glance_sgl.train.trainer import evaluate_tau

    tau = evaluate_tau(bundled, {t: [ex.messages() for ex in eval_set(t)[:4]] for t in ("document", "text", "open")},
                       max_tokens=64, progress=False)
    assert tau["document"] >= 6 and tau["text"] >= 4, tau
    assert tau["open"] < min(tau["document"], tau["text"]) - 1, tau


class FrozenCosts(CostModel):
    """A cost model that does not learn from timings: the planner's choices become a function of the outputs."""

    def observe_verify(self, rows, batch, ms): pass

    def observe_draft(self, batch, ms): pass

    def observe_overhead(self, ms): pass


def test_planner_drafts_on_forms_and_stops_on_unfamiliar_inputs(bundled):
    """With the costs of a 2-core CPU (a round of the 15-node tree ~2 AR steps), the bundled pair drafts nearly
    every round on order forms and hardly at all on requests unlike its training data, losslessly."""
    from glance_sgl.demo.wild import wild_set

    rows = [1, 2, 4, 8, 16, 32, 64]
    costs = FrozenCosts(rows, [5.5, 5.7, 6.0, 6.6, 8.0, 10.5, 14.0], [1], [2.0], overhead_ms=1.0)
    bundled.install_planner("cpu-like", Planner(costs, max_nodes=bundled.max_nodes,
                                                max_depth=bundled.block_size - 1))
    params = SamplingParams(max_tokens=64)
    no_draft = {"document": [0, 0], "wild": [0, 0]}
    examples = {"document": [ex.messages() for ex in eval_set("document")[:3]],
                "wild": [ex.messages() for ex in wild_set()[:6]]}
    for task, requests in examples.items():
        for messages in requests:
            got = bundled.generate(messages, params, planner="cpu-like")
            assert got.token_ids == bundled.generate(messages, params, mode="ar").token_ids
            no_draft[task][0] += got.metrics.rounds_without_drafting
            no_draft[task][1] += got.metrics.rounds
    assert no_draft["document"][0] <= 0.1 * no_draft["document"][1], no_draft
    assert no_draft["wild"][0] >= 0.7 * no_draft["wild"][1], no_draft


def test_make_serve_example_is_answered_as_printed(bundled):
    from glance_server.example import example

    from glance_sgl.engine import SamplingParams

    assert bundled.generate(example().messages(), SamplingParams(max_tokens=64)).text.strip() == example().answer


METHOD_COLUMNS = ("tau", "tau_minus_1", "decode_ms_per_token", "decode_speedup", "e2e_speedup",
                  "round_cost_ar_steps", "efficiency", "lossless_match_rate", "mean_rows_per_round", "rows_histogram",
                  "rounds_without_drafting", "predicted_tokens_per_round", "actual_tokens_per_predicted_round")


def test_bench_report_has_every_method_and_column(engines, tmp_path):
    """A tiny bench on the random pair: AR, GLANCE auto and fixed, the chain, n-gram only and merged (where the
    n-gram source runs) and the HF peers on a demo task and on wild, every column, lossless, accepted tokens per
    source, the law fitted on the fixed run's drafting rounds, JSON and plots."""
    import json

    from glance_sgl.demo.bench import format_table, ngram_available, run_bench, save_json, write_plots
    from glance_sgl.demo.wild import wild_set
    from glance_sgl.engine import SamplingParams

    engine = engines["qwen2_5_vl"]
    report = run_bench(engine, limit=1, max_tokens=8, tasks=("caption", "wild"), progress=False)
    sources = ["ngram", "merged"] if ngram_available() else []
    assert report["methods"] == ["ar", "auto", "fixed", "chain", *sources, "hf_greedy", "hf_prompt_lookup"]
    for task in ("caption", "wild"):
        s = report["tasks"][task]
        assert set(s["methods"]) == set(report["methods"])
        for method, m in s["methods"].items():
            assert set(METHOD_COLUMNS) <= set(m), method
            assert m["decode_speedup"] > 0 and m["e2e_speedup"] > 0
        for method in ("ar", "auto", "fixed", "chain", *sources, "hf_greedy"):
            assert s["methods"][method]["lossless_match_rate"] == 1.0, method
        none = {"rounds": 0, "accepted_tokens": 0}
        assert s["methods"]["ar"]["sources"] == {"drafter": none, "ngram": none, "both": none}
        for method in ("fixed", "chain"):  # the drafter alone (a round whose rows all lie past the end has none)
            per = s["methods"][method]["sources"]
            assert per["ngram"] == per["both"] == none
            assert 0 < per["drafter"]["rounds"] <= s["methods"][method]["rounds"]
        if sources:
            per = s["methods"]["ngram"]["sources"]
            assert per["drafter"] == per["both"] == none  # no drafter pass: n-gram candidates alone
            assert s["methods"]["ngram"]["rounds_without_drafting"] == s["methods"]["ngram"]["rounds"]
            assert all(v["rounds"] <= s["methods"]["merged"]["rounds"] for v in s["methods"]["merged"]["sources"].values())
        assert s["methods"]["hf_greedy"]["sources"] is None
        assert s["lossless_match_rate"] == 1.0
        ar, auto, fixed = s["methods"]["ar"], s["methods"]["auto"], s["methods"]["fixed"]
        assert ar["round_cost_ar_steps"] == pytest.approx(1.0) and ar["tau"] == 1.0
        assert ar["rows_histogram"] == {"1": ar["rounds"]} and ar["rounds_without_drafting"] == ar["rounds"]
        # the fixed tree drafts every round but one with room for a single token (its last, at the token limit)
        assert fixed["rounds_without_drafting"] == fixed["rows_histogram"].get("1", 0) <= 1
        assert sum(auto["rows_histogram"].values()) == auto["rounds"] >= auto["rounds_without_drafting"]
        assert auto["predicted_tokens_per_round"] >= 1.0 and fixed["predicted_tokens_per_round"] >= 1.0
        for m in (auto, fixed, s["methods"]["chain"]):
            assert m["efficiency"] == pytest.approx(m["decode_speedup"] / m["tau"])
        assert s["methods"]["hf_prompt_lookup"]["tau"] is None  # its rounds are not observable
        # where a round's time goes, per method: the engine's speculating methods only
        assert ar["ms_per_round_by_part"] is None and s["methods"]["hf_greedy"]["ms_per_round_by_part"] is None
        for method in ("auto", "fixed", "chain", *sources):
            parts = s["methods"][method]["ms_per_round_by_part"]
            assert parts["pass"] > 0 and min(parts.values()) >= 0, method
    assert report["tasks"]["caption"]["demo_task"] and not report["tasks"]["wild"]["demo_task"]
    assert report["geomean_tasks"] == ["caption"]  # wild is reported apart
    assert report["geomean_decode_speedup"] == pytest.approx(report["tasks"]["caption"]["methods"]["auto"]
                                                             ["decode_speedup"])
    assert set(report["wild"]) == set(report["methods"]) - {"ar"} and "holds" in report["law"]
    table = format_table(report)
    for text in ("GLANCE auto", "GLANCE fixed", "round/AR", "eff", "rows/rd", "pred/rd", "wild (not trained"):
        assert text in table
    if sources:
        assert "n-gram only" in table and "caption: GLANCE+ngram accepted tokens per source: drafter " in table
        assert report["source_methods"] == {"ngram": ["ngram"], "merged": ["drafter", "ngram"]}
    # the law is fitted on the fixed run's drafting rounds but each request's last (cut short by the answer's end
    # or its token limit)
    fixed = engine.generate(wild_set()[0].messages(), SamplingParams(max_tokens=8), planner="fixed")
    kept = [i for i, r in enumerate(fixed.metrics.rows_per_round) if r > 1][:-1]
    assert report["law_method"] == "fixed" and kept
    assert report["_rounds"]["wild"]["entropy"] == pytest.approx([fixed.metrics.root_entropies[i] for i in kept],
                                                                 abs=1e-3)
    assert report["_rounds"]["wild"]["accepted"] == [fixed.metrics.accept_lengths[i] for i in kept]
    save_json(report, tmp_path / "report.json")
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["tasks"]["wild"]["methods"]["auto"]["rows_histogram"] and "_rounds" not in saved
    assert [p.name for p in write_plots(report, tmp_path / "plots")] == [
        "speedup_per_task.png", "tau_per_task.png", "entropy_law.png"]


def test_bench_single_planner(engines):
    from glance_sgl.demo.bench import run_bench

    report = run_bench(engines["qwen2_5_vl"], limit=1, max_tokens=6, tasks=("open",), progress=False, peers=False,
                       planners=("fixed",), sources=False)
    assert report["methods"] == ["ar", "fixed", "chain"] and report["glance_method"] == "fixed"
    assert report["tasks"]["open"]["methods"]["fixed"]["lossless_match_rate"] == 1.0
    with pytest.raises(ValueError, match="planners"):
        run_bench(engines["qwen2_5_vl"], limit=1, planners=("greedy",))


def test_sampled_bench_is_lossless_against_ar_of_the_same_seeds(engines):
    """``--temperature``: every method samples with the prompt's seed and must commit AR's tokens; no HF peers
    (they decode greedily)."""
    from glance_sgl.demo.bench import ngram_available, run_bench

    report = run_bench(engines["qwen2_5_vl"], limit=2, max_tokens=8, tasks=("caption",), progress=False,
                       planners=("auto",), temperature=0.9)
    sources = ["ngram", "merged"] if ngram_available() else []
    assert report["temperature"] == 0.9 and report["methods"] == ["ar", "auto", "chain", *sources]
    for method, m in report["tasks"]["caption"]["methods"].items():
        assert m["lossless_match_rate"] == 1.0, method


def test_sweep_compares_tree_configs_with_the_chain(engines):
    from glance_sgl.demo.bench import format_sweep, run_sweep

    engine = engines["qwen2_5_vl"]
    before = engine.budget, engine.branch_k
    sweep = run_sweep(engine, [(3, 1), (9, 2)], limit=1, max_tokens=8, tasks=("caption",), progress=False,
                      planners=("fixed",))
    assert (engine.budget, engine.branch_k) == before  # the engine's own settings stay
    assert [(r["budget"], r["branch_k"]) for r in sweep["configs"]] == [(3, 1), (9, 2)] and sweep["temperature"] == 0
    for row in sweep["configs"]:
        s = row["tasks"]["caption"]
        assert row["glance_method"] == "fixed" and set(row["geomean"]) == {"fixed", "chain"}
        assert s["tau"] >= 1 and s["decode_speedup"] > 0 and s["chain_decode_speedup"] > 0
        assert row["tree_beats_chain"] == (["caption"] if s["decode_speedup"] > s["chain_decode_speedup"] else [])
    assert "budget   9 branch_k 2" in format_sweep(sweep)


@pytest.mark.parametrize("spec, message", [("15", "BUDGETxBRANCH_K"), ("15x0", "15x0"), ("ax2,15x2", "ax2")])
def test_sweep_spec_errors_name_the_item(spec, message):
    from glance_sgl.demo.bench import parse_sweep

    with pytest.raises(ValueError, match=message):
        parse_sweep(spec)
    assert parse_sweep("15x2, 31X4") == [(15, 2), (31, 4)]


def test_demo_vlm_training_saves_a_loadable_checkpoint_and_resumes(tmp_path):
    """The demo VLM recipe at toy size: a standard HF directory comes out, and a rerun with more steps resumes
    from the checkpoint instead of starting over."""
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    from glance_sgl.demo.target_training import TargetRecipe, train_target

    recipe = TargetRecipe(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                          vision_hidden=32, vision_depth=1, steps=2, batch_size=2)
    out = train_target(tmp_path / "vlm", recipe, progress=False, checkpoint_every=1)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(out)
    assert AutoProcessor.from_pretrained(out).tokenizer.chat_template
    assert (out / "checkpoint" / "trainer_state.pt").is_file()  # saved after step 1 (the last step saves `out`)
    recipe.steps = 3
    train_target(out, recipe, progress=False, checkpoint_every=1)
    state = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2 and sum(state["counters"].values()) == 2 * recipe.batch_size  # went on, not over
    resumed = Qwen2_5_VLForConditionalGeneration.from_pretrained(out)
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), resumed.state_dict().values()))


def test_image_token_similarity_flags_a_collapsed_vision_tower():
    from glance_sgl.demo.target_training import image_token_similarity

    grid = torch.tensor([[1, 4, 4], [1, 4, 2]])  # 4 + 2 merged tokens
    collapsed = torch.ones(6, 8) * torch.arange(1, 9)
    assert image_token_similarity(collapsed, grid, merge=4) == pytest.approx(1.0)
    distinct = torch.eye(8)[:6]
    assert image_token_similarity(distinct, grid, merge=4) == pytest.approx(0.0)

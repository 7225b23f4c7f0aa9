"""The playground page (``/``): its assets are local (no CDN), the ``stream_rounds`` chunk extension it reads adds
up, and a real headless Chromium (Debian's package, driven by Playwright's Python package) loads the page on a
real gateway serving the bundled demo VLM, sends a picture, sees the answer shaded round by round with tau and
rounds, measures the speedup and sees the lossless check; and the same page on the sglang backend.

``GLANCE_PLAYGROUND_SCREENSHOT=docs/playground.png`` makes the browser test save the page after the measured
answer (how the screenshot in docs/ is made).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

from glance_server.app import RoundChunks
from glance_server.example import example
from glance_server.jobs import GenOutput
from glance_sgl.engine import GlanceEngine, StreamDelta
from tests.server.server_helpers import API_KEY, check_glance, image_message, start_embedded

ASSET_REF = re.compile(r'(?:src|href)="([^"]+)"')
EXTERNAL = re.compile(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}", re.I)


def stream_chunks(url: str, body: dict, headers: dict | None = None) -> list[dict]:
    chunks = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


# ------------------------------------------------------------------------------------------------ no browser
def test_page_and_assets_are_local_and_open(gateway):
    """``/`` and its assets answer without the API key (the gateway has one) and name no external URL; the
    generation routes still need the key."""
    page = httpx.get(gateway.url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    refs = ASSET_REF.findall(page.text)
    assert sorted(refs) == ["/playground/app.js", "/playground/style.css"]
    for text in [page.text] + [httpx.get(gateway.url + ref, timeout=10).text for ref in refs]:
        assert not EXTERNAL.search(text), EXTERNAL.search(text).group(0)
    for ref, kind in [("/playground/app.js", "text/javascript"), ("/playground/style.css", "text/css"),
                      ("/playground/demo.png", "image/png"), ("/playground/info.json", "application/json")]:
        r = httpx.get(gateway.url + ref, timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), ref
    info = httpx.get(gateway.url + "/playground/info.json", timeout=10).json()
    assert info["backend"] == "embedded" and info["api_key_required"] and info["measure_speedup"]
    assert API_KEY not in json.dumps(info)
    assert httpx.get(gateway.url + "/playground/../app.py", timeout=10).status_code in (401, 404)
    assert httpx.get(gateway.url + "/playground/index.html", timeout=10).status_code == 401  # not an asset
    assert httpx.post(gateway.url + "/v1/chat/completions", json={"messages": []}, timeout=10).status_code == 401


def check_rounds(chunks: list[dict]) -> tuple[list[dict], dict]:
    """The identities of the glance_round objects against the final glance object; returns (rounds, glance)."""
    infos = [c["glance_round"] for c in chunks if "glance_round" in c and not c["glance_round"].get("final")]
    finals = [c["glance_round"] for c in chunks if c.get("glance_round", {}).get("final")]
    glance = next(c["glance"] for c in chunks if "glance" in c)
    assert len(finals) == 1 and finals[0]["rounds_confirmed"], finals
    assert infos[0]["prefill"] and infos[0]["tokens"] == 1 and infos[0]["round"] == 0
    assert [i["round"] for i in infos] == list(range(len(infos)))
    if finals[0]["last"] is not None:  # the last round, cut by a stop condition, restated
        assert finals[0]["last"]["round"] == infos[-1]["round"] and finals[0]["last"]["bonus"] == 0
        infos[-1] = finals[0]["last"]
    rounds = infos[1:]
    assert len(rounds) == glance["rounds"]
    if glance["committed_per_round"] is not None:
        assert [i["tokens"] for i in rounds] == glance["committed_per_round"]
    for i in rounds:
        assert i["rounds"] == 1 and i["accepted"] + i["bonus"] == i["tokens"] and i["bonus"] in (0, 1)
    accepted = sum(i["accepted"] for i in rounds)
    # a last round with its bonus was not cut: the counts are the engine's; a cut one kept fewer drafts
    assert accepted == glance["accepted_tokens"] if rounds[-1]["bonus"] else accepted <= glance["accepted_tokens"]
    return rounds, glance


@pytest.fixture(scope="module")
def demo_gateway():
    """The bundled demo VLM and drafter (what `make serve` runs), calibrated, no API key."""
    from glance_sgl.demo import paths

    engine = GlanceEngine.load(paths.bundled_target(), paths.bundled_drafter())
    server = start_embedded(engine, api_key=None, calibrate=True, max_tokens_limit=256, default_max_tokens=64)
    yield server
    server.stop()


def scene_message(scene) -> list[dict]:
    from tests.server.server_helpers import data_url
    import io

    buf = io.BytesIO()
    scene.image.save(buf, format="PNG")
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(buf.getvalue())}},
                                         {"type": "text", "text": scene.prompt}]}]


def check_stream(url: str, body: dict, headers: dict | None = None) -> list[dict]:
    chunks = stream_chunks(url, body, headers)
    rounds, glance = check_rounds(chunks)
    check_glance(glance, sum(i["tokens"] for i in rounds) + 1)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    plain = httpx.post(url + "/v1/chat/completions", headers=headers or {}, timeout=60,
                       json={k: v for k, v in body.items() if k not in ("stream", "glance")}).json()
    assert text == plain["choices"][0]["message"]["content"]
    return rounds


def test_stream_rounds_add_up(gateway, auth, demo_gateway):
    """Embedded: one glance_round per round, accepted + bonus = committed, the text is the non-streamed
    answer; a round at max_tokens drafts no deeper than the limit (its last token the bonus), a round with room
    for one token is an AR step; plain streams carry no glance_round. The random model (rounds of few tokens)
    and the demo VLM on a scene it answers in long rounds (max_tokens within the first round, then the
    second)."""
    for seed in range(2):
        check_stream(gateway.url, {"messages": image_message("describe it", seed=seed), "max_tokens": 10,
                                   "temperature": 0, "stream": True, "glance": {"stream_rounds": True}}, auth)
    from glance_sgl.demo.tasks import eval_set

    scene = eval_set("caption")[0]
    body = {"messages": scene_message(scene), "temperature": 0, "stream": True,
            "glance": {"stream_rounds": True, "planner": "fixed"}}  # the same tree every round: repeatable
    full = [i["tokens"] for i in check_stream(demo_gateway.url, {**body, "max_tokens": 64})]
    assert len(full) >= 2 and full[0] >= 3 and full[1] >= 2, full
    first = check_stream(demo_gateway.url, {**body, "max_tokens": full[0] - 1})  # 1 + full[0] - 2 tokens
    assert [(i["tokens"], i["accepted"], i["bonus"]) for i in first] == [(full[0] - 2, full[0] - 3, 1)]
    second = check_stream(demo_gateway.url, {**body, "max_tokens": full[0] + 2})
    assert [(i["tokens"], i["accepted"], i["bonus"]) for i in second] == [(full[0], full[0] - 1, 1), (1, 0, 1)]
    plain_chunks = stream_chunks(demo_gateway.url, {**body, "max_tokens": 18, "glance": None})
    assert not any("glance_round" in c for c in plain_chunks)


def feed(chunks: RoundChunks, deltas, accepted_tokens: int, rounds: int) -> list[dict]:
    """RoundChunks on synthetic upstream deltas ``(token_ids, spec_verify_ct, spec_num_correct_drafts)``."""
    out = []
    for ids, verify, correct in deltas:
        d = StreamDelta(token_ids=ids, text="x" * len(ids))
        d.spec_verify_ct, d.spec_num_correct_drafts = verify, correct
        out.append(next(iter(chunks.delta(d)))["glance_round"])
    glance = {"accepted_tokens": accepted_tokens, "rounds": rounds, "mode": "glance"}
    out.append(next(c for c in chunks.done(GenOutput("", [], "stop", 1, 9, glance)) if "glance_round" in c)
               ["glance_round"])
    return out


def test_stream_rounds_from_sglang_counts(engine):
    """SGLang backend, on upstream chunks as real SGLang 0.5.23 sends them (its speculative counts on the last
    chunk only; checked against a real server: the chunks of a GLANCE answer were one decode step each): each
    chunk taken as one round, confirmed by the final counts, the cut last round restated; a chunk that bundled
    two steps withdraws the confirmation; an upstream with counts on every chunk is split exactly."""
    tok = engine.target.tokenizer
    # SGLang's shape: prefill, 16 tokens (15 accepted + bonus), 5 tokens ending at EOS (5 accepted, bonus cut)
    first, one, two, final = feed(RoundChunks("r", "m", False, tok), [([11], None, None), (list(range(20, 36)),
                                  None, None), ([40, 41, 42, 43, 44], 2, 20)], accepted_tokens=20, rounds=2)
    assert first["prefill"] and (one["round"], one["accepted"], one["bonus"], one["provisional"]) == (1, 15, 1, True)
    assert (two["round"], two["accepted"], two["bonus"]) == (2, 4, 1)
    assert final["rounds_confirmed"] and (final["last"]["round"], final["last"]["accepted"],
                                          final["last"]["bonus"]) == (2, 5, 0)
    assert final["last"]["bonus_text"] is None
    # the same tokens in 2 chunks but 3 verify steps upstream: not one round per chunk
    *_, final = feed(RoundChunks("r", "m", False, tok), [([11], None, None), (list(range(20, 36)), None, None),
                     ([40, 41, 42, 43, 44], 3, 19)], accepted_tokens=19, rounds=3)
    assert not final["rounds_confirmed"] and final["last"] is None
    # counts on every chunk: exact, a two-round chunk included
    first, one, two, final = feed(RoundChunks("r", "m", False, tok), [([11], None, None), ([12, 13, 14], 1, 2),
                                  ([15, 16, 17, 18, 19], 3, 5)], accepted_tokens=5, rounds=3)
    assert (one["round"], one["rounds"], one["accepted"], one["bonus"], one["provisional"]) == (1, 1, 2, 1, False)
    assert (two["round"], two["rounds"], two["accepted"], two["bonus"]) == (None, 2, 3, 2)
    assert final["rounds_confirmed"] and final["last"] is None


def test_sglang_backend_streams_rounds(sglang_gateway):
    """Through the loopback SGLang-format upstream (an embedded gateway's /generate: one chunk per round, counts
    on the last chunk only, as SGLang): the same identities as the embedded backend, provisional then
    confirmed; the page's info says measuring is off."""
    body = {"messages": image_message("describe it"), "max_tokens": 12, "temperature": 0, "stream": True,
            "glance": {"stream_rounds": True}}
    chunks = stream_chunks(sglang_gateway.url, body)
    rounds, glance = check_rounds(chunks)
    assert all(i["provisional"] for i in rounds)
    assert sum(i["tokens"] for i in rounds) + 1 == glance["completion_tokens"]
    info = httpx.get(sglang_gateway.url + "/playground/info.json", timeout=10).json()
    assert info["backend"] == "sglang" and not info["measure_speedup"]


# ------------------------------------------------------------------------------------------------ the browser
def find_chromium() -> str | None:
    for candidate in (os.environ.get("GLANCE_CHROMIUM"), "/usr/lib/chromium/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture(scope="module")
def browser():
    pytest.importorskip("playwright.sync_api", reason="Playwright's Python package is not installed (dev extra)")
    from playwright.sync_api import sync_playwright

    path = find_chromium()
    if path is None:
        pytest.skip("no Chromium found ($GLANCE_CHROMIUM, /usr/lib/chromium/chromium, chromium on PATH): install "
                    "Debian's package (apt-get install chromium; .ci/run does it as root). Playwright's own "
                    "browser download is not used")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, headless=True, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def wait_done(page, timeout_ms: int = 60_000) -> None:
    page.wait_for_function("['done', 'error'].includes(document.body.dataset.state)", timeout=timeout_ms)
    assert page.get_attribute("body", "data-state") == "done", page.inner_text("#status")


def test_browser_playground(browser, demo_gateway, tmp_path):
    """Load the page, upload a demo scene, ask, see the reference answer shaded by round, with tau and rounds
    as the stream said; measure: speedup and the lossless check; then the page's own demo-image button."""
    from glance_sgl.demo.tasks import eval_set

    scene = eval_set("caption")[0]  # a scene the demo VLM answers correctly, in several rounds
    picture = tmp_path / "scene.png"
    scene.image.save(picture)
    page = browser.new_page(viewport={"width": 1280, "height": 860})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    outside: list[str] = []
    page.on("request", lambda req: outside.append(req.url) if not req.url.startswith(demo_gateway.url) else None)
    page.goto(demo_gateway.url + "/")
    page.wait_for_function("document.getElementById('backend').textContent.includes('embedded')")

    page.set_input_files("#file", str(picture))
    page.wait_for_selector("#preview:not([hidden])")
    page.fill("#question", scene.prompt)
    with page.expect_response("**/v1/chat/completions") as response:
        page.click("#send")
    wait_done(page)
    assert page.inner_text("#answer").replace("∎", "") == scene.answer
    sent = [json.loads(line[6:]) for line in response.value.text().splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]
    glance = next(c["glance"] for c in sent if "glance" in c)  # what the page was sent, at its end
    rounds = int(page.inner_text("#m-rounds"))
    assert rounds == glance["rounds"] >= 1 and int(page.inner_text("#m-tokens")) == glance["completion_tokens"]
    assert page.inner_text("#m-tau") == f"{glance['tau']:.2f}"
    spans = page.query_selector_all("#answer .round")
    assert len(spans) == rounds + 1  # the prefill token + one span per round
    assert "prefill" in (spans[0].get_attribute("class") or "")
    assert page.locator("#answer .round .acc").count() >= 1  # the drafts the target accepted
    final = next(c["glance_round"] for c in sent if c.get("glance_round", {}).get("final"))
    assert final["rounds_confirmed"]
    cut = int(final["last"] is not None and final["last"]["bonus"] == 0)
    assert page.locator("#answer .round .bon").count() == rounds - cut  # one bonus token per round
    assert page.is_hidden("#measured")

    page.click("#measure")
    wait_done(page)
    assert page.inner_text("#answer").replace("∎", "") == scene.answer
    assert page.inner_text("#m-lossless") == "✓ identical"
    assert re.fullmatch(r"\d+\.\d\d×", page.inner_text("#m-speedup"))
    assert re.fullmatch(r"\d+\.\d\d×", page.inner_text("#m-est"))
    shot = os.environ.get("GLANCE_PLAYGROUND_SCREENSHOT")
    if shot:
        page.screenshot(path=shot, full_page=True)

    page.fill("#question", "")
    page.click("#use-demo")
    page.wait_for_function("document.getElementById('question').value.length > 0")
    assert page.input_value("#question") == example().prompt
    page.click("#send")
    wait_done(page)
    assert page.inner_text("#answer").replace("∎", "") == example().answer
    assert not errors, errors
    assert not outside, outside
    page.close()


def test_browser_playground_sglang_backend(browser, sglang_gateway):
    """The page on the sglang backend: the answer streams shaded by round (confirmed at the end), the final rounds
    and tau show, measuring is off."""
    page = browser.new_page()
    page.goto(sglang_gateway.url + "/")
    page.wait_for_function("document.getElementById('backend').textContent.includes('sglang')")
    assert page.is_disabled("#measure")
    page.click("#use-demo")
    page.wait_for_selector("#preview:not([hidden])")
    page.fill("#max-tokens", "12")
    page.click("#send")
    wait_done(page)
    assert page.locator("#answer .round").count() >= 2
    assert int(page.inner_text("#m-tokens")) >= 2 and int(page.inner_text("#m-rounds")) >= 1 and page.inner_text("#m-tau") != "–"
    assert page.locator("#answer .round.prefill").count() == 1
    assert page.locator("#answer .round .bon").count() >= 1  # confirmed by the final counts: shaded by round
    assert page.locator("#answer .round.unknown").count() == 0
    page.close()


def test_browser_playground_api_key(browser, gateway):
    """On a gateway with an API key the page loads without it, asks for it, shows the 401 without it and answers
    with it."""
    page = browser.new_page()
    page.goto(gateway.url + "/")
    page.wait_for_selector("#key-row:not([hidden])")
    page.click("#use-demo")
    page.wait_for_selector("#preview:not([hidden])")
    page.fill("#max-tokens", "6")
    page.click("#send")
    page.wait_for_function("document.body.dataset.state === 'error'")
    assert "invalid_api_key" in page.inner_text("#status")
    page.fill("#api-key", API_KEY)
    page.click("#send")
    wait_done(page)
    assert int(page.inner_text("#m-tokens")) >= 1
    page.close()

// GLANCE playground: streams /v1/chat/completions with "glance": {"stream_rounds": true} and shades each
// verification round's committed tokens (accepted drafts vs the bonus token). No dependencies, no external URL.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { image: null, info: null, controller: null, rounds: 0, decodeTokens: 0, tokens: 0, roundsKnown: true,
                t0: 0, tFirst: 0, lastSpan: null };

function setStatus(text, cls) { const s = $("status"); s.textContent = text; s.className = cls || "muted"; }
function fmt(x, digits = 2) { return x === null || x === undefined || Number.isNaN(x) ? "–" : Number(x).toFixed(digits); }

async function loadInfo() {
  try {
    const r = await fetch("/playground/info.json");
    state.info = await r.json();
  } catch (e) { state.info = { backend: "?", api_key_required: false, measure_speedup: true }; }
  const info = state.info;
  $("backend").textContent = "backend: " + info.backend;
  $("key-row").hidden = !info.api_key_required;
  if (info.demo_prompt) $("question").placeholder = info.demo_prompt;
  if (!info.measure_speedup) {
    $("measure").disabled = true;
    $("measure").title = "the " + info.backend + " backend cannot decode a request without speculation: measuring needs the embedded backend";
  }
  if (info.backend === "sglang") {
    $("note").textContent = "SGLang backend: each of SGLang's stream chunks is shaded as one round while it streams; " +
      "SGLang's verify and accepted-draft counts at the end confirm it (or the shading is withdrawn).";
  }
}

// ------------------------------------------------------------------ the image
function setImage(dataUrl, label) {
  state.image = dataUrl;
  $("preview").src = dataUrl;
  $("preview").hidden = false;
  $("image-info").textContent = label || "";
}

function readFile(file) {
  if (!file || !file.type.startsWith("image/")) { setStatus("not an image: " + (file ? file.type || file.name : "nothing"), "error"); return; }
  const reader = new FileReader();
  reader.onload = () => setImage(reader.result, file.name + " (" + Math.round(file.size / 1024) + " KiB)");
  reader.readAsDataURL(file);
}

async function useDemo() {
  const blob = await (await fetch("/playground/demo.png")).blob();
  const reader = new FileReader();
  reader.onload = () => {
    setImage(reader.result, "the demo scene");
    if (!$("question").value && state.info && state.info.demo_prompt) $("question").value = state.info.demo_prompt;
  };
  reader.readAsDataURL(blob);
}

function wireImageInputs() {
  const drop = $("drop");
  $("file").addEventListener("change", (e) => readFile(e.target.files[0]));
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => { e.preventDefault(); drop.classList.remove("over"); readFile(e.dataTransfer.files[0]); });
  document.addEventListener("paste", (e) => {
    for (const item of e.clipboardData ? e.clipboardData.items : []) {
      if (item.kind === "file" && item.type.startsWith("image/")) { readFile(item.getAsFile()); e.preventDefault(); return; }
    }
  });
  $("use-demo").addEventListener("click", useDemo);
}

// ------------------------------------------------------------------ the answer, round by round
function resetAnswer() {
  $("answer").textContent = "";
  Object.assign(state, { rounds: 0, decodeTokens: 0, tokens: 0, roundsKnown: true, tFirst: 0, lastSpan: null });
  for (const id of ["m-rounds", "m-tau", "m-tokens", "m-tps", "m-accept", "m-est", "m-speedup", "m-e2e", "m-ar-ms", "m-lossless"]) {
    $(id).textContent = "–"; $(id).className = "";
  }
  $("measured").hidden = true;
  $("per-round").textContent = "";
}

function piece(cls, text) { const s = document.createElement("span"); s.className = cls; s.textContent = text; return s; }

function fillRound(span, text, info) {
  span.textContent = "";
  span.className = "round";
  const bonusText = info.bonus_text;
  if (info.prefill) {
    span.classList.add("prefill");
    span.textContent = text;
    span.title = "the prefill token (belongs to no round)";
    return;
  }
  if (info.accepted === null || info.accepted === undefined) {
    span.classList.add("unknown");
    span.textContent = text;
    span.title = info.tokens + " token(s); the backend does not say which round committed them";
    return;
  }
  const where = info.round !== null ? "round " + info.round : info.rounds + " rounds";
  span.title = where + ": " + info.accepted + " accepted draft(s) + " + info.bonus + " bonus token(s)" + (info.cut ? " (cut by the stop condition)" : "") +
    (info.provisional ? " (one stream chunk taken as one round)" : "");
  if (info.bonus === 1 && bonusText && text.endsWith(bonusText)) {
    const head = text.slice(0, text.length - bonusText.length);
    if (head) span.appendChild(piece("acc", head));
    span.appendChild(piece("bon", bonusText));
  } else if (info.bonus === 1 && bonusText === "") {  // a bonus token with no text (end of sequence)
    if (text) span.appendChild(piece("acc", text));
    const eos = piece("bon eos", "∎");
    eos.title = "the bonus token has no text (end of sequence)";
    span.appendChild(eos);
  } else if (info.bonus >= 1 && info.accepted === 0) {
    span.appendChild(piece("bon", text));
  } else {
    span.appendChild(piece("acc", text));
  }
}

function onRoundChunk(text, info) {
  const span = document.createElement("span");
  span.dataset.round = info.round === null ? "" : info.round;
  span.dataset.text = text;
  fillRound(span, text, info);
  $("answer").appendChild(span);
  state.lastSpan = span;
  state.tokens += info.tokens;
  if (!info.prefill) {
    state.decodeTokens += info.tokens;
    if (!state.tFirst) state.tFirst = performance.now();
    if (info.rounds === null || info.rounds === undefined) state.roundsKnown = false; else state.rounds += info.rounds;
  }
  $("m-tokens").textContent = state.tokens;
  if (state.roundsKnown) {
    $("m-rounds").textContent = state.rounds;
    $("m-tau").textContent = state.rounds ? fmt(state.decodeTokens / state.rounds) : "–";
  }
  const secs = (performance.now() - state.tFirst) / 1000;
  if (state.decodeTokens > 1 && secs > 0) $("m-tps").textContent = fmt(state.decodeTokens / secs, 1);
}

// The finish chunk: were the chunks one round each (SGLang streams may bundle steps)? Was the last round cut?
function onFinalRounds(info) {
  if (!info.rounds_confirmed) {
    for (const span of $("answer").querySelectorAll(".round:not(.prefill)")) {
      fillRound(span, span.dataset.text, { tokens: 0, rounds: null, accepted: null });
      span.title = "the backend's counts do not confirm one round per chunk: this chunk's rounds are unknown";
    }
    state.roundsKnown = false;
    $("note").textContent = "The stream's chunks did not match the verification rounds one to one, so they are not shaded by round.";
  } else if (info.last && state.lastSpan) {
    fillRound(state.lastSpan, state.lastSpan.dataset.text, Object.assign({}, info.last, { cut: true }));
  }
}

function onFinal(glance) {
  $("m-rounds").textContent = glance.rounds;
  $("m-tau").textContent = fmt(glance.tau);
  $("m-tokens").textContent = glance.completion_tokens;
  $("m-tps").textContent = fmt(glance.decode_tokens_per_s, 1);
  $("m-accept").textContent = glance.acceptance_rate === null ? "–" : fmt(100 * glance.acceptance_rate, 0) + " %";
  $("m-est").textContent = glance.estimated_speedup ? fmt(glance.estimated_speedup) + "×" : "–";
  if (glance.committed_per_round) {
    $("per-round").textContent = "committed per round (accepted drafts + bonus): " + glance.committed_per_round.join(" · ") +
      (glance.rounds_without_drafting ? "  —  " + glance.rounds_without_drafting + " round(s) without drafting" : "");
  }
  const m = glance.measured;
  if (m) {
    $("measured").hidden = false;
    $("m-speedup").textContent = m.decode_speedup ? fmt(m.decode_speedup) + "×" : "–";
    $("m-e2e").textContent = m.e2e_speedup ? fmt(m.e2e_speedup) + "×" : "–";
    $("m-ar-ms").textContent = fmt(m.ar_decode_ms_per_token);
    $("m-lossless").textContent = m.lossless_match ? "✓ identical" : "✗ differs";
    $("m-lossless").className = m.lossless_match ? "ok" : "bad";
  }
}

// ------------------------------------------------------------------ the request
function requestBody(measure) {
  const text = $("question").value.trim() || $("question").placeholder;
  const content = [];
  if (state.image) content.push({ type: "image_url", image_url: { url: state.image } });
  content.push({ type: "text", text });
  const glance = { stream_rounds: true };
  if (measure) glance.measure_speedup = true;
  return { messages: [{ role: "user", content }], stream: true, glance,
           max_tokens: parseInt($("max-tokens").value, 10) || 64,
           temperature: parseFloat($("temperature").value) || 0 };
}

function errorMessage(body, status) {
  return body && body.error ? body.error.message + (body.error.code ? " (" + body.error.code + ")" : "") : "HTTP " + status;
}

async function send(measure) {
  if (state.controller) return;
  resetAnswer();
  document.body.dataset.state = "streaming";
  setStatus(measure ? "decoding, then decoding again autoregressively to measure…" : "decoding…");
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = "Bearer " + key;
  state.controller = new AbortController();
  for (const b of ["send", "measure"]) $(b).disabled = true;
  $("stop").hidden = false;
  state.t0 = performance.now();
  let finished = false;
  try {
    const resp = await fetch("/v1/chat/completions", { method: "POST", headers, body: JSON.stringify(requestBody(measure)),
                                                        signal: state.controller.signal });
    if (!resp.ok) {
      let body = null; try { body = await resp.json(); } catch (e) { /* not JSON */ }
      throw new Error(errorMessage(body, resp.status));
    }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") { finished = true; continue; }
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(errorMessage(chunk, 500));
          const choice = chunk.choices && chunk.choices[0];
          const info = chunk.glance_round;
          if (info && info.final) onFinalRounds(info);
          else if (info) onRoundChunk((choice && choice.delta && choice.delta.content) || "", info);
          else if (choice && choice.delta && choice.delta.content) onRoundChunk(choice.delta.content, { tokens: 0, rounds: null, accepted: null });
          if (chunk.glance) onFinal(chunk.glance);
          if (choice && choice.finish_reason) setStatus("finished (" + choice.finish_reason + ") in " + fmt((performance.now() - state.t0) / 1000, 1) + " s");
        }
      }
    }
    if (!finished) throw new Error("the stream ended early");
    document.body.dataset.state = "done";
  } catch (e) {
    document.body.dataset.state = "error";
    setStatus(e.name === "AbortError" ? "stopped" : "error: " + e.message, "error");
  } finally {
    state.controller = null;
    $("send").disabled = false;
    $("measure").disabled = !(state.info && state.info.measure_speedup);
    $("stop").hidden = true;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  document.body.dataset.state = "idle";
  wireImageInputs();
  $("send").addEventListener("click", () => send(false));
  $("measure").addEventListener("click", () => send(true));
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("question").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send(false); });
  loadInfo();
});

"""Host one ``sglang.Engine`` in its own process and drive it with JSON lines (tests and the benchmark).

SGLang's Engine forks its scheduler and detokenizer; a crash there kills the caller's process tree, so the
callers (pytest, ``python -m glance_sgl.sglang.bench``) keep it in a child process:

    with EngineProcess(engine_kwargs) as eng:
        out = eng.generate(requests, concurrent=True)

Each request is ``{"text": prompt with the chat template applied, "image": base64 PNG or None,
"max_tokens": int, "temperature": float, "seed": int or None}``; each result has ``output_ids``, ``text`` and
SGLang's ``meta_info`` (``spec_verify_ct``, ``spec_accept_length``, ...). ``generate(..., concurrency=c)`` keeps
``c`` requests in flight (a new one starts as soon as one finishes), ``concurrent=True`` submits all at once.
``cpu_engine_kwargs`` gives the CPU mode's engine arguments; ``demo_requests`` / ``wild_requests`` build
request lists (the demo's evaluation prompts; pictures and prompts unlike them).
"""

from __future__ import annotations

import base64
import gc
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .launch import rendezvous_port


def cpu_engine_kwargs(model: str | Path, drafter: str | Path | None = None, algorithm: str | None = "GLANCE",
                      **overrides: Any) -> dict[str, Any]:
    """``sglang.Engine`` arguments for the CPU mode (float32, the ``glance_cpu`` attention backend; idle
    schedulers sleep instead of polling, so that engines side by side share the cores fairly)."""
    kw: dict[str, Any] = dict(
        model_path=str(model), device="cpu", attention_backend="glance_cpu", disable_cuda_graph=True,
        disable_overlap_schedule=True, dtype="float32", mem_fraction_static=0.3, max_total_tokens=4096,
        context_length=1024, log_level="warning", random_seed=0,
        sleep_on_idle=True,  # an idle scheduler otherwise spins a core: engines side by side would starve
    )
    if algorithm == "GLANCE":
        kw.update(speculative_algorithm="GLANCE", speculative_draft_model_path=str(drafter))
    elif algorithm == "NGRAM":
        kw.update(speculative_algorithm="NGRAM", speculative_num_draft_tokens=8)
    elif algorithm is not None:
        kw.update(speculative_algorithm=algorithm)
    kw.update(overrides)
    return kw


def image_b64(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat_prompt(tokenizer, messages: list[dict[str, Any]]) -> str:
    """The prompt text of ``messages`` with the target's chat template (images as placeholders)."""
    plain = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
              [{"type": "image"} if p.get("type") in ("image", "image_url") else p for p in m["content"]]}
             for m in messages]
    return tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)


def demo_requests(model_dir: str | Path, n: int, max_tokens: int, tasks: tuple[str, ...] | None = None
                  ) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    """``n`` demo evaluation prompts, round-robin over the tasks: (runner requests, chat messages)."""
    from transformers import AutoTokenizer

    from glance_sgl.demo.tasks import TASKS, eval_set

    tasks = tasks or TASKS
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    reqs, msgs = [], []
    i = 0
    while len(reqs) < n:
        ex = eval_set(tasks[i % len(tasks)])[i // len(tasks)]
        m = ex.messages()
        reqs.append({"text": chat_prompt(tok, m), "image": image_b64(ex.image), "max_tokens": max_tokens,
                     "temperature": 0.0})
        msgs.append(m)
        i += 1
    return reqs, msgs


WILD_PROMPTS = (
    "Describe this image.",
    "What do you see in this picture?",
    "Write a short story inspired by this image.",
    "Is there anything unusual here? Explain.",
    "What colours dominate the picture, and what mood do they set?",
    "Tell me a joke about what is shown.",
    "List three questions someone might ask about this photo.",
    "Summarise the scene in one sentence, then give details.",
)
WILD_SIZES = ((84, 84), (140, 112), (112, 196), (168, 168), (56, 224))


def wild_image(seed: int, size: tuple[int, int]):
    """A deterministic picture unlike the demo's: uniform noise (even seeds) or a photo-like scene (odd seeds:
    smooth colour gradients, soft blobs, sensor noise). ``size`` = (width, height) in pixels."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    if seed % 2 == 0:
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.zeros((h, w, 3), np.float32)
    for c in range(3):  # a sky-to-ground gradient per channel
        a, b = rng.uniform(0, 255, 2)
        img[..., c] = a + (b - a) * yy / max(h - 1, 1)
    for _ in range(int(rng.integers(3, 8))):  # soft objects
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(6, max(w, h) / 3)
        blob = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * r * r))[..., None]
        img = img * (1 - blob) + rng.uniform(0, 255, 3)[None, None, :] * blob
    img += rng.normal(0, 8, img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def wild_requests(model_dir: str | Path, n: int, max_tokens: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` requests unlike the demo tasks: noise / photo-like images of other sizes with generic prompts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    reqs = []
    for i in range(n):
        prompt = WILD_PROMPTS[(i + seed) % len(WILD_PROMPTS)]
        msg = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        reqs.append({"text": chat_prompt(tok, msg), "image": image_b64(wild_image(seed * 1000 + i,
                                                                                   WILD_SIZES[i % len(WILD_SIZES)])),
                     "max_tokens": max_tokens, "temperature": 0.0})
    return reqs


# ---------------------------------------------------------------------------------------------- child side
def _serve(engine_kwargs: dict[str, Any]) -> None:
    # The replies get their own descriptor; fd 1 (inherited by SGLang's processes) goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import sglang as sgl

    t0 = time.perf_counter()
    llm = sgl.Engine(**engine_kwargs)
    # As SGLang's HTTP server does after its warm-up: the start-up objects (about 800,000) leave the collector's
    # view; else a full collection stalls this process (the requests' event loop) for 0.4-0.5 s once, mid-run.
    llm.freeze_gc()
    out.write(json.dumps({"ready": True, "startup_s": time.perf_counter() - t0}) + "\n")
    out.flush()
    for line in sys.stdin:
        job = json.loads(line)
        if job["op"] == "stop":
            break
        try:
            if job["op"] == "generate":
                reply = _generate(llm, job["requests"], job.get("concurrent", False), job.get("concurrency"))
            elif job["op"] == "info":
                reply = {"info": _info(llm)}
            else:
                reply = {"error": f"unknown op {job['op']!r}"}
        except Exception as exc:  # reported to the parent, which fails its test
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    llm.shutdown()


# SGLang sampling parameters a runner request may carry as they are
SAMPLING_KEYS = ("top_p", "top_k", "min_p", "min_new_tokens", "logit_bias", "ignore_eos", "stop_token_ids",
                 "repetition_penalty", "frequency_penalty", "presence_penalty")


def _params(r: dict[str, Any]) -> dict[str, Any]:
    p = {"max_new_tokens": r.get("max_tokens", 32), "temperature": r.get("temperature", 0.0)}
    if r.get("seed") is not None:
        p["sampling_seed"] = r["seed"]
    p.update((k, r[k]) for k in SAMPLING_KEYS if r.get(k) is not None)
    return p


def _generate(llm, requests: list[dict[str, Any]], concurrent: bool, concurrency: int | None = None
              ) -> dict[str, Any]:
    def one(res):
        return {"output_ids": res.get("output_ids"), "text": res.get("text"), "meta_info": res.get("meta_info")}

    t0 = time.perf_counter()
    results = []
    if concurrency:
        import asyncio

        async def run_all():
            gate = asyncio.Semaphore(int(concurrency))

            async def run(r):
                async with gate:
                    return await llm.async_generate(prompt=r["text"], sampling_params=_params(r),
                                                    image_data=r.get("image"))

            return await asyncio.gather(*(run(r) for r in requests))

        results = [one(o) for o in llm.loop.run_until_complete(run_all())]
    elif concurrent:
        images = [r.get("image") for r in requests]
        outs = llm.generate(prompt=[r["text"] for r in requests], sampling_params=[_params(r) for r in requests],
                            image_data=images if any(images) else None)
        results = [one(o) for o in outs]
    else:
        for r in requests:
            results.append(one(llm.generate(prompt=r["text"], sampling_params=_params(r),
                                            image_data=r.get("image"))))
    return {"results": results, "wall_s": time.perf_counter() - t0}


def _info(llm) -> dict[str, Any]:
    info = llm.get_server_info()
    keep = ("max_total_num_tokens", "internal_states", "speculative_algorithm", "attention_backend",
            "disable_overlap_schedule")
    return {**{k: info.get(k) for k in keep if k in info}, "gc_frozen_objects": gc.get_freeze_count()}


# ---------------------------------------------------------------------------------------------- parent side
def export_package(commit: str, dest: Path | None = None) -> Path:
    """The ``glance_sgl`` package as of ``commit`` of this checkout's git repository, exported (``git archive``)
    into ``dest`` (default: a new temporary folder), which is returned: ``dest / "glance_sgl"`` is that commit's
    package, for :class:`EngineProcess`'s ``code_root`` (an engine of an earlier commit beside this one's) or an
    import under another name (``scripts/compare_commit.py``). ValueError where this is no git checkout or the
    commit is unknown."""
    import tarfile
    import tempfile

    repo = Path(__file__).resolve().parents[2]
    dest = Path(tempfile.mkdtemp(prefix=f"glance-{commit[:12]}-")) if dest is None else dest
    try:
        data = subprocess.run(["git", "-C", str(repo), "archive", commit, "glance_sgl"], check=True,
                              capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        raise ValueError(f"cannot export glance_sgl at {commit!r} from {repo}: "
                         f"{detail.decode(errors='replace').strip() or exc}") from exc
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    return dest


class EngineProcess:
    """An ``sglang.Engine`` in a child process (``python -m glance_sgl.sglang.runner``). ``code_root``: a folder
    holding another ``glance_sgl`` (:func:`export_package`), which the child runs instead of this one (its working
    directory and the head of its ``PYTHONPATH``, ahead of the installed package; SGLang's plugin entry point
    imports it from there too). ``append_log``: add to ``log_path`` (an engine started again for the same method)
    instead of starting it afresh."""

    def __init__(self, engine_kwargs: dict[str, Any], env: dict[str, str] | None = None, log_path=None,
                 timeout: float = 300.0, wait: bool = True, code_root: Path | None = None,
                 append_log: bool = False) -> None:
        engine_kwargs = {**engine_kwargs}
        if engine_kwargs.get("nccl_port") is None:
            engine_kwargs["nccl_port"] = rendezvous_port()
        self.engine_kwargs, self.timeout = engine_kwargs, timeout
        child_env = dict(os.environ)
        child_env.setdefault("HF_HUB_OFFLINE", "1")
        child_env.setdefault("TRANSFORMERS_OFFLINE", "1")
        child_env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if engine_kwargs.get("device") == "cpu":
            child_env.setdefault("OMP_NUM_THREADS", "1")  # see launch.launch_sglang
        child_env.update(env or {})
        if code_root is not None:
            if not (Path(code_root) / "glance_sgl" / "__init__.py").is_file():
                raise ValueError(f"code_root {code_root}: no glance_sgl package there")
            child_env["PYTHONPATH"] = os.pathsep.join(
                [str(code_root)] + [x for x in child_env.get("PYTHONPATH", "").split(os.pathsep) if x])
        self.log_path = log_path
        self._log = open(log_path, "a" if append_log else "w") if log_path else subprocess.DEVNULL
        # the working directory leads sys.path under ``python -m``: a code root's package must not be shadowed by
        # a checkout the parent runs in
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "glance_sgl.sglang.runner", json.dumps(engine_kwargs)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=child_env,
            start_new_session=True, cwd=None if code_root is None else str(code_root))
        self.startup_s = None
        if wait:
            self.wait_ready()

    def wait_ready(self) -> "EngineProcess":
        """Block until the child's engine has started (raises with the log's tail if it died)."""
        if self.startup_s is None:
            self.startup_s = self._read().get("startup_s")
        return self

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=30)
            tail = Path(self.log_path).read_text()[-4000:] if self.log_path else ""
            raise RuntimeError(f"SGLang engine process exited ({code}):\n{tail}")
        return json.loads(line)

    def _call(self, job: dict[str, Any]) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def generate(self, requests: list[dict[str, Any]], concurrent: bool = False, concurrency: int | None = None
                 ) -> dict[str, Any]:
        """Results in request order; ``concurrency``: at most that many in flight (else ``concurrent``: all at
        once, or one after another)."""
        if concurrency is not None and concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        return self._call({"op": "generate", "requests": requests, "concurrent": concurrent,
                           "concurrency": concurrency})

    def info(self) -> dict[str, Any]:
        return self._call({"op": "info"})["info"]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except Exception:
                pass
        if self.proc.poll() is None:
            import signal

            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the child's own session: its scheduler too
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        if self._log is not subprocess.DEVNULL:
            self._log.close()

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    sys.stdout = sys.stderr  # SGLang's prints must not mix with the JSON replies
    _serve(json.loads(sys.argv[1]))

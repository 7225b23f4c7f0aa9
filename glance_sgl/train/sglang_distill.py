"""Distillation answers from an SGLang server: many requests in flight through SGLang's native ``/generate``.

The server serves the target alone (no drafter is needed to answer). :class:`SGLangAnswerer` sends each request
as ``{"text": chat-templated prompt, "image_data": [PNG data URLs], "sampling_params": {"max_new_tokens",
"temperature", "sampling_seed"}}`` from a pool of ``concurrency`` threads and returns the ``output_ids`` in
request order. :func:`launch_target_server` starts one (``glance_sgl.sglang.launch``, CPU mode when there is no
CUDA), as ``glance serve --backend sglang`` does.

Seeds: SGLang's sampler follows ``sampling_seed`` only on a server started with
``--enable-deterministic-inference`` (a GPU attention backend; :func:`launch_target_server` adds it on CUDA when
answers are sampled). Greedy answers (temperature 0) need nothing.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Sequence


class SGLangAnswerer:
    """Answers :class:`~glance_sgl.train.data.AnswerJob` lists through an SGLang server at ``url``.

    ``tokenizer``: the target's (its chat template builds the prompt text, images as placeholders). A request
    the server refuses (HTTP 4xx) comes back as a ``RuntimeError`` in its place (the caller skips the row); a
    server that cannot be reached raises.
    """

    name = "sglang"

    def __init__(self, url: str, tokenizer: Any, concurrency: int = 32, timeout: float = 600.0) -> None:
        self.url, self.tokenizer = url.rstrip("/"), tokenizer
        self.concurrency, self.timeout = max(1, int(concurrency)), timeout
        self.pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="distill-sglang")

    def margin(self) -> int:
        return 0

    def body(self, job: Any, temperature: float) -> dict[str, Any]:
        """The ``/generate`` request of one job."""
        from ..sglang.runner import chat_prompt, image_b64

        images = [p["image"] for m in job.messages if not isinstance(m["content"], str)
                  for p in m["content"] if p.get("type") == "image"]
        params: dict[str, Any] = {"max_new_tokens": int(job.max_tokens), "temperature": float(temperature)}
        if temperature > 0 and job.seed is not None:
            params["sampling_seed"] = int(job.seed)
        body: dict[str, Any] = {"text": chat_prompt(self.tokenizer, job.messages), "sampling_params": params}
        if images:
            body["image_data"] = [image_b64(img) for img in images]
        return body

    def _post(self, body: dict[str, Any]) -> list[int] | Exception:
        req = urllib.request.Request(self.url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                out = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            if 400 <= exc.code < 500:
                return RuntimeError(f"SGLang answered {exc.code}: {exc.read()[:300].decode(errors='replace')}")
            raise
        return list(out["output_ids"])

    def answer(self, jobs: Sequence[Any], temperature: float) -> Iterator[list[int] | Exception]:
        """Answers in job order; all of ``jobs`` are submitted at once, ``concurrency`` in flight."""
        bodies = [self.body(j, temperature) for j in jobs]
        return self.pool.map(self._post, bodies)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def launch_target_server(target_dir: str | Path, device: str = "auto", port: int | None = None,
                         extra_args: Sequence[str] = (), log_path: str | Path | None = None,
                         timeout: float = 600.0, seeded: bool = False, wait: bool = True):
    """Start ``sglang.launch_server`` on the target alone (no speculation) on loopback; returns the handle
    (``.url``, ``.stop()``). ``device``: auto (CUDA when present, else SGLang's CPU mode), cpu or cuda.

    ``seeded``: sampled answers should follow each request's ``sampling_seed``. SGLang's sampler honours it only
    under ``--enable-deterministic-inference``, added on CUDA; SGLang refuses that flag with the CPU mode's
    attention backend, so on CPU sampled answers are not reproducible per seed (a warning says so).
    ``wait=False`` returns at once (call ``.wait_ready()`` before sending requests)."""
    import sys

    import torch

    from ..sglang.launch import free_port, launch_sglang

    cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    extra = list(extra_args)
    if seeded and not cpu and "--enable-deterministic-inference" not in extra:
        extra.append("--enable-deterministic-inference")
    elif seeded and cpu:
        print("warning: SGLang's CPU mode cannot seed its sampler (--enable-deterministic-inference needs a GPU "
              "attention backend): sampled answers will not repeat per seed", file=sys.stderr, flush=True)
    return launch_sglang(target_dir, None, port=port or free_port(), cpu=cpu, extra_args=extra,
                         log_path=log_path, timeout=timeout, wait=wait)


__all__ = ["SGLangAnswerer", "launch_target_server"]

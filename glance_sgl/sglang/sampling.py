"""A request's sampling parameters as GLANCE's worker reads and applies them: every one SGLang's plain decoding
honours is either applied exactly the way plain decoding applies it, or refused when the request arrives.

- :func:`sampling_spec`: temperature, top-k, top-p, min-p and the seed, for ``glance_sgl.verify`` (whose sampled
  choice at every tree row is a draw from the same filtered distribution SGLang's sampler draws from);
- :func:`request_end`: what ends a request (stop token ids, EOS, ``min_new_tokens``, ``max_new_tokens``), for the
  round's pruning of rows past a request's end;
- :func:`logit_rules`: what SGLang adds to a row's logits before it picks (``glance_sgl.verify.LogitRules``),
  applied to every verified row as a plain step would have applied it at that row's output index:
  ``logit_bias``, and ``min_new_tokens``'s mask of the stop tokens (SGLang's ``BatchedMinNewTokensPenalizer``:
  -inf on them while fewer than ``min_new_tokens`` tokens came out; row ``r`` of a request picks output index
  ``next_index + depth[r]``);
- :func:`refuse_unsupported`: an AFTER hook of SGLang's ``SamplingParams.verify`` (run where a request arrives, a
  ``ValueError`` there is SGLang's 400) refusing what GLANCE cannot verify losslessly: repetition, frequency and
  presence penalties (their value at a tree row depends on the row's own path, which SGLang's penalizers do not
  see; SGLang's EAGLE and NGRAM apply them "relaxed", from committed tokens only) and custom logit processors.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Sequence

import torch

from glance_sgl.verify import LogitRules, SamplingSpec

from . import ALGORITHM

TOP_K_OFF = 1 << 30  # SGLang's "no top-k" (TOP_K_ALL); -1 in a request


def sampling_spec(req) -> SamplingSpec:
    """The request's sampling as ``glance_sgl.verify`` reads it (greedy where SGLang treats it as greedy: T ~ 0
    or top-k 1)."""
    sp = req.sampling_params
    temperature = float(getattr(sp, "temperature", 0.0) or 0.0)
    top_k = int(getattr(sp, "top_k", -1) or -1)
    if temperature < 1e-5 or top_k == 1:
        return SamplingSpec(0.0, 1.0, 0)
    seed = getattr(sp, "sampling_seed", None)
    if seed is None:
        seed = zlib.crc32(str(req.rid).encode())
    return SamplingSpec(temperature, float(getattr(sp, "top_p", 1.0) or 1.0), int(seed),
                        top_k=0 if top_k < 1 or top_k >= TOP_K_OFF else top_k,
                        min_p=float(getattr(sp, "min_p", 0.0) or 0.0))


def unit_temperature(spec: SamplingSpec) -> SamplingSpec:
    """``spec`` for logits that are already tempered (SGLang's sampler left ``softmax(logits / T)``): its filters
    and seed, temperature 1."""
    return dataclasses.replace(spec, temperature=1.0)


def stop_ids(req) -> frozenset[int]:
    """The token ids SGLang stops ``req`` at, ``ignore_eos`` aside: its stop token ids, the model's EOS ids, the
    tokenizer's EOS id and extra stop ids (the set SGLang's min-new-tokens penalizer masks)."""
    sp = req.sampling_params
    ids: set[int] = set(getattr(sp, "stop_token_ids", None) or ())
    ids.update(getattr(req, "eos_token_ids", None) or ())
    tok = getattr(req, "tokenizer", None)
    if tok is not None:
        if isinstance(getattr(tok, "eos_token_id", None), int):
            ids.add(tok.eos_token_id)
        ids.update(getattr(tok, "additional_stop_token_ids", None) or ())
    return frozenset(int(t) for t in ids if t is not None)


def request_end(req) -> tuple[frozenset[int], int, int | None]:
    """What ends ``req`` as SGLang checks it (``Req._check_token_based_finish``, ``max_new_tokens``): the token ids
    that stop it (:func:`stop_ids`; none with ``ignore_eos``), the output length before which they do not
    (``min_new_tokens``) and its token limit (None: none)."""
    sp = req.sampling_params
    ids = frozenset() if getattr(sp, "ignore_eos", False) else stop_ids(req)
    limit = getattr(sp, "max_new_tokens", None)
    return ids, int(getattr(sp, "min_new_tokens", 0) or 0), None if limit is None else int(limit)


def logit_rules(batch, min_new: Sequence[int], stops: Sequence[torch.Tensor | None], produced: Sequence[int]
                ) -> LogitRules | None:
    """The batch's ``LogitRules`` (None: no rule applies): its sampling info's logit bias, and the stop-token
    mask of each request whose output (``produced``, a lower bound where the host state lags) is shorter than its
    ``min_new`` (its ``stops`` tensor: :func:`stop_ids` on the device)."""
    info = getattr(batch, "sampling_info", None)
    bias = getattr(info, "logit_bias", None) if info is not None else None
    early = {b: (m, ids) for b, (m, ids, out) in enumerate(zip(min_new, stops, produced))
             if m > 0 and out < m and ids is not None and ids.numel()}
    return LogitRules(bias, early) if bias is not None or early else None


UNSUPPORTED = (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0))


def refuse_unsupported(result: Any, params: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of ``SamplingParams.verify``: where this server runs GLANCE, a ``ValueError`` (SGLang answers
    400) naming a penalty or a custom logit processor, which GLANCE would otherwise decode without."""
    from sglang.srt.runtime_context import get_spec

    try:
        algorithm = get_spec().speculative_algorithm
    except Exception:  # no runtime context in this process: not a serving process
        return None
    if algorithm != ALGORITHM:
        return None
    for name, neutral in UNSUPPORTED:
        value = getattr(params, name, neutral)
        if value is not None and float(value) != neutral:
            raise ValueError(f"{name} is not supported with speculative algorithm GLANCE (got {value}; only "
                             f"{neutral:g}): a penalty's value at a draft row depends on the row's own path, which "
                             f"GLANCE cannot verify losslessly")
    if getattr(params, "custom_logit_processor", None):
        raise ValueError("custom_logit_processor is not supported with speculative algorithm GLANCE")
    return None


def register_sampling_hook() -> None:
    """Register :func:`refuse_unsupported` with SGLang's HookRegistry (idempotent)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    target = "sglang.srt.sampling.sampling_params.SamplingParams.verify"
    if not any(hook is refuse_unsupported for _, hook, _ in HookRegistry._hooks.get(target, [])):
        HookRegistry.register(target, refuse_unsupported, HookType.AFTER)
    HookRegistry.apply_hooks()


__all__ = ["sampling_spec", "unit_temperature", "stop_ids", "request_end", "logit_rules",
           "refuse_unsupported", "register_sampling_hook", "TOP_K_OFF"]

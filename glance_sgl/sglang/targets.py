"""Per-architecture setup of the SGLang target's tap capture (Qwen2.5-VL, Qwen2-VL, Qwen3-VL dense).

Tap convention (``glance_sgl.config``): tap ``t`` is what enters decoder layer ``t + 1``; SGLang's aux hidden-state
capture at point ``t + 1`` is exactly that (on Qwen3-VL deepstack additions included, as in the embedded engine).
DFlash's ``target_layer_ids`` use the same numbering, so ``set_dflash_layers_to_capture(ids)`` and
``set_eagle3_layers_to_capture(ids)`` (what the GLANCE worker calls) both capture points ``id + 1``.

SGLang 0.5.23's ``Qwen3VLForConditionalGeneration.set_dflash_layers_to_capture`` calls a method its language
model does not have (AttributeError), so SGLang's own DFLASH cannot run on Qwen3-VL: :func:`register_target_hooks`
replaces it, through SGLang's HookRegistry, with the capture its ``set_eagle3_layers_to_capture`` already does.
SGLang's ``Qwen2_5_VLForConditionalGeneration`` (and Qwen2-VL) has no ``set_dflash_layers_to_capture`` at all, so
DFLASH refuses to start on them; an AROUND hook on ``configure_aux_hidden_state_capture`` (as ``model_runner``
imported it) gives such a target its ``set_eagle3_layers_to_capture`` capture, the same points: SGLang's DFLASH
then loads our drafters (DFlash checkpoints) on the targets GLANCE serves.

``GLANCE_SGL_DUMP_TAPS=DIR`` (``WorkerSettings.dump_taps``; tests, debugging) writes the tap features of every
prefill the GLANCE worker receives to ``DIR/prefill-NNNNN.pt`` (``taps`` [T, L*H] in drafter order,
``extend_lens``, ``prefix_lens``, ``input_ids``), through a HookRegistry BEFORE hook on the worker's prompt feed.
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

QWEN3_VL_DFLASH_CAPTURE = "sglang.srt.models.qwen3_vl.Qwen3VLForConditionalGeneration.set_dflash_layers_to_capture"
AUX_CAPTURE = "sglang.srt.model_executor.model_runner.configure_aux_hidden_state_capture"
FEED_PROMPT = "glance_sgl.sglang.glance_worker.GlanceWorker._feed_prompt"


def _qwen3_vl_set_dflash_layers_to_capture(self, layer_ids):
    """``Qwen3VLForConditionalGeneration.set_dflash_layers_to_capture`` as it is meant to work: capture the
    states entering layers ``id + 1`` (the same points ``set_eagle3_layers_to_capture`` sets)."""
    if not self.pp_group.is_last_rank:
        return
    if layer_ids is None:
        raise ValueError("DFLASH requires explicit layer_ids for aux hidden capture.")
    self.capture_aux_hidden_states = True
    self.model.capture_aux_hidden_states = True
    self.model.layers_to_capture = [int(v) + 1 for v in layer_ids]


def _dflash_capture_via_eagle3(original, *args, model, dflash_use_aux_hidden_state: bool = False,
                               dflash_target_layer_ids=None, is_dspark: bool = False, **kwargs):
    """AROUND ``configure_aux_hidden_state_capture``: a DFLASH target without a DFLASH (or DSpark) capture setter
    but with the EAGLE3 one (Qwen2.5-VL, Qwen2-VL in SGLang 0.5.23) captures through it; everything else as
    SGLang does."""
    lacks = not hasattr(model, "set_dflash_layers_to_capture") and not (
        is_dspark and hasattr(model, "set_dspark_layers_to_capture"))
    if dflash_use_aux_hidden_state and lacks and hasattr(model, "set_eagle3_layers_to_capture"):
        if dflash_target_layer_ids is None:
            raise ValueError("DFLASH requires explicit layer_ids for aux hidden capture.")
        model.set_eagle3_layers_to_capture(list(dflash_target_layer_ids))
        dflash_use_aux_hidden_state = False
    return original(*args, model=model, dflash_use_aux_hidden_state=dflash_use_aux_hidden_state,
                    dflash_target_layer_ids=dflash_target_layer_ids, is_dspark=is_dspark, **kwargs)


_dump_counter = itertools.count()


def dump_prompt_taps(out: Path):
    """A BEFORE hook of the GLANCE worker's prompt feed that saves what it is handed into ``out``
    (``WorkerSettings.dump_taps``, ``GLANCE_SGL_DUMP_TAPS``)."""

    def hook(worker, batch, taps, *args, **kwargs):
        out.mkdir(parents=True, exist_ok=True)
        record = {"taps": None if taps is None else taps.detach().float().cpu(),
                  "extend_lens": [int(x) for x in batch.extend_lens],
                  "prefix_lens": [int(x) for x in batch.prefix_lens],
                  "input_ids": batch.input_ids.detach().cpu()}
        torch.save(record, out / f"prefill-{os.getpid()}-{next(_dump_counter):05d}.pt")
        return None

    hook.__glance_dump__ = True  # registered once per process (register_target_hooks)
    return hook


def register_target_hooks() -> None:
    """Register this module's HookRegistry hooks (idempotent; applied by ``load_plugins``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .settings import WorkerSettings

    def register(target: str, hook, kind) -> None:
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, [])):
            HookRegistry.register(target, hook, kind)

    register(QWEN3_VL_DFLASH_CAPTURE, _qwen3_vl_set_dflash_layers_to_capture, HookType.REPLACE)
    register(AUX_CAPTURE, _dflash_capture_via_eagle3, HookType.AROUND)
    dump = WorkerSettings.from_env().dump_taps
    if dump is not None and not any(getattr(h, "__glance_dump__", False)
                                    for _, h, _ in HookRegistry._hooks.get(FEED_PROMPT, [])):
        HookRegistry.register(FEED_PROMPT, dump_prompt_taps(dump), HookType.BEFORE)
    HookRegistry.apply_hooks()  # idempotent; also when registered outside load_plugins (tests, scripts)

"""CUDA graphs for GLANCE's verify pass, through SGLang's own graph runner (``DecodeCudaGraphRunner``).

SGLang captures a speculative target's TARGET_VERIFY pass at start-up, for every batch size up to
``--cuda-graph-max-bs``, at one width (rows per request: ``--speculative-num-draft-tokens``). Which verify input
it captures with is asked per algorithm (``spec_info.create_dummy_verify_input`` and
``DecodeCudaGraphRunner.get_spec_info``); for a plugin algorithm they answer ``None``, so the capture would run
without a custom mask and without the tap features GLANCE reads. Two HookRegistry AROUND hooks
(:func:`register_graph_hooks`) answer for GLANCE with a :class:`~glance_sgl.sglang.glance_info.GlanceVerifyInput`
whose custom mask is the graph's own buffer and whose hidden-state capture is FULL (the aux captures of the tap
layers), the way SGLang answers for NGRAM and EAGLE.

The planner picks a tree size per batch, so one width is not enough: :class:`VerifyGraphs` captures a few more
widths (``GLANCE_CUDA_GRAPH_WIDTHS``, default 1, 4, 8, 16 and the full width), each with its own attention backend
and graph runner, built the way SGLang's adaptive EAGLE builds its step configurations
(``eagle_worker_v2.build_adaptive_runtime_state``). A step's row count is rounded up to the nearest captured width
(the extra rows are the next nodes of the best-first tree, so they can only add accepted tokens) and that width's
backend and runner are swapped in for the pass, as SGLang's ``apply_runtime_state`` does. A plain AR step is a
1-row verify then, replayed from the width-1 graphs (SGLang's DECODE graphs are not captured for a speculative
target). A verify input carries its width (``num_tokens_per_req``), so a width without graphs runs eagerly:
``DecodeCudaGraphRunner.can_run_graph`` refuses a width other than its own.

Under SGLang's overlap scheduler (GLANCE registers ``supports_overlap=True``) the host still picks each step's
width before the pass, from the accept lengths and lead entropies of the step before (the planner), so the pass
runs at the captured width that pick snaps to; docs/sglang.md ("Overlap scheduling: the V2 flow").
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from typing import Any, Iterator, Sequence

from . import ALGORITHM

logger = logging.getLogger(__name__)

DEFAULT_WIDTHS = (1, 4, 8, 16)


def is_glance(spec_algorithm: Any) -> bool:
    """Whether SGLang's ``spec_algorithm`` (an enum value or a plugin's ``CustomSpecAlgo``) is GLANCE."""
    return getattr(spec_algorithm, "name", None) == ALGORITHM


def dummy_verify_input(custom_mask, num_tokens_per_req: int):
    """The verify input a GLANCE TARGET_VERIFY graph is captured with: the graph's custom-mask buffer, ``width``
    rows per request, the tap layers' hidden states captured (FULL)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    from .glance_info import GlanceVerifyInput

    spec = GlanceVerifyInput(draft_token=None, custom_mask=custom_mask, positions=None, retrieve_index=None,
                             retrieve_next_token=None, retrieve_next_sibling=None,
                             draft_token_num=int(num_tokens_per_req))
    spec.capture_hidden_mode = CaptureHiddenMode.FULL
    return spec


def _create_dummy_verify_input_hook(original, spec_algorithm, custom_mask, num_tokens_per_req, is_draft_worker,
                                    *args, **kwargs):
    """AROUND ``spec_info.create_dummy_verify_input`` (SGLang's capture path in ``base_runner``)."""
    if is_glance(spec_algorithm) and not is_draft_worker:
        return dummy_verify_input(custom_mask, num_tokens_per_req)
    return original(spec_algorithm, custom_mask, num_tokens_per_req, is_draft_worker, *args, **kwargs)


def _get_spec_info_hook(original, runner, num_tokens, *args, **kwargs):
    """AROUND ``DecodeCudaGraphRunner.get_spec_info``: the runner's own mask buffer and capture width."""
    mr = runner.model_runner
    if is_glance(mr.spec_algorithm) and not mr.is_draft_worker:
        return dummy_verify_input(runner.buffers.custom_mask, runner.captured_req_width)
    return original(runner, num_tokens, *args, **kwargs)


_create_dummy_verify_input_hook.__glance_graph__ = True
_get_spec_info_hook.__glance_graph__ = True

HOOK_TARGETS = {
    "sglang.srt.speculative.spec_info.create_dummy_verify_input": _create_dummy_verify_input_hook,
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.get_spec_info":
        _get_spec_info_hook,
}


def register_graph_hooks() -> None:
    """Register the two capture hooks with SGLang's HookRegistry and apply them (idempotent)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in HOOK_TARGETS.items():
        if not any(getattr(h, "__glance_graph__", False) for _, h, _ in HookRegistry._hooks.get(target, [])):
            HookRegistry.register(target, hook, HookType.AROUND)
    HookRegistry.apply_hooks()


def graph_widths(full_width: int, asked: Sequence[int] | None = None) -> list[int]:
    """The TARGET_VERIFY widths to capture: ``asked`` (``WorkerSettings.graph_widths``,
    ``GLANCE_CUDA_GRAPH_WIDTHS``) or :data:`DEFAULT_WIDTHS`, clipped to ``full_width``, which is always included."""
    widths = list(DEFAULT_WIDTHS) if asked is None else [int(w) for w in asked]
    if any(w < 1 for w in widths):
        raise ValueError(f"graph widths must be row counts >= 1, got {widths}")
    return sorted({w for w in widths if w < full_width} | {int(full_width)})


def snap_rows(widths: list[int], rows: int) -> int:
    """The smallest captured width >= ``rows`` (``widths`` sorted, its last the full width)."""
    return widths[min(bisect.bisect_left(widths, rows), len(widths) - 1)]


class VerifyGraphs:
    """TARGET_VERIFY graph runners at several widths for one target ``model_runner``.

    The full width's backend and runner are SGLang's own (captured at start-up, hooks above); the others are built
    here at start-up. :meth:`use` swaps a width's pair in for one pass.
    """

    def __init__(self, model_runner, full_width: int, num_steps: int, widths: list[int]) -> None:
        from sglang.srt.model_executor.runner import DecodeCudaGraphRunner
        from sglang.srt.runtime_context import get_context

        self.model_runner = model_runner
        self.widths = widths
        self.states: dict[int, tuple[Any, Any]] = {
            full_width: (model_runner.attn_backend, model_runner.decode_cuda_graph_runner)}
        for width in widths:
            if width == full_width:
                continue
            get_context().override("glance.capture_override", speculative_num_steps=min(num_steps, width),
                                   speculative_num_draft_tokens=width)
            backup_init = model_runner.init_new_workspace
            try:
                backend = model_runner._get_attention_backend(init_new_workspace=True)
                runner = DecodeCudaGraphRunner(model_runner, attn_backend=backend,
                                               speculative_num_steps=min(num_steps, width),
                                               speculative_num_draft_tokens=width)
            finally:
                model_runner.init_new_workspace = backup_init
                get_context().override("glance.capture_restore", speculative_num_steps=num_steps,
                                       speculative_num_draft_tokens=full_width)
            self.states[width] = (backend, runner)
            logger.info("GLANCE verify graphs captured at width %d (batch sizes %s)", width,
                        getattr(runner, "capture_bs", "?"))

    def snap(self, rows: int) -> int:
        return snap_rows(self.widths, rows)

    @contextlib.contextmanager
    def use(self, width: int) -> Iterator[None]:
        """Run the target's passes inside with width ``width``'s attention backend and graph runner."""
        mr = self.model_runner
        saved = (mr.attn_backend, mr.decode_cuda_graph_runner)
        mr.attn_backend, mr.decode_cuda_graph_runner = self.states[width]
        try:
            yield
        finally:
            mr.attn_backend, mr.decode_cuda_graph_runner = saved

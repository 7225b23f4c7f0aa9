"""Registration of GLANCE with SGLang: the algorithm, its server arguments, the drafter model class, CPU mode.

Server arguments (SGLang's own flags, read the GLANCE way):

==================================  =========================================================================
``--speculative-algorithm GLANCE``  select GLANCE
``--speculative-draft-model-path``  the drafter checkpoint directory (a DFlash draft checkpoint:
                                    ``config.json`` + ``model.safetensors``), required
``--speculative-num-draft-tokens``  rows verified per request per step: tree budget + 1 (the root);
                                    default 32 (a 31-node tree, the SGLang default of design §1)
``--speculative-eagle-topk``        ``branch_k``, the per-offset top-k the tree grows from (default: the
                                    drafter config's ``branch_k``)
``--speculative-num-steps``         maximum tree depth, at most ``block_size - 1`` (default ``block_size - 1``;
                                    the block size is the drafter checkpoint's)
==================================  =========================================================================

``--speculative-num-draft-tokens`` is the most a step verifies: the planner picks per batch how many of those rows
to use (see below), down to 1 (a plain AR step without the drafter pass).

Environment of the server / engine process (read by the worker at start-up):

==========================  ===============================================================================
``GLANCE_PLANNER``          ``auto`` (default): cost-aware per batch (``glance_sgl.planner``): whether to draft
                            at all, then how many tree nodes to verify, from the lead entropies, the drafter's
                            probabilities and a cost model of this device at this batch size; ``fixed``: the
                            full tree every step (ablations, benchmarks); ``random[:SEED]``: random sizes and
                            AR steps, for losslessness tests only
``GLANCE_COST_CACHE``       where the cost model's calibration is cached (default
                            ``~/.cache/glance_sgl/costs``; ``off``: recalibrate every start). The worker
                            calibrates on the first decode batch of each new batch-size bucket (1, 2, 4, ...)
                            with a few extra verify / drafter passes, and refines the model from every step
``GLANCE_SGL_PROFILE=1``    log per-step phase times and the rows-per-step histogram
==========================  ===============================================================================

The radix cache stays on: the drafter's context K/V live in a draft KV pool addressed by SGLang's token slots
(``draft_pool.py``), so a prefix hit shares them with the target's K/V; that pool's bytes per token are budgeted
with the target's (a HookRegistry hook on SGLang's pool sizing). CUDA graphs stay on where the user has them on:
the verify pass is captured by SGLang's own graph runner at a few widths and the drafter pass by the worker
(``graphs.py``, ``draft_graph.py``; ``GLANCE_CUDA_GRAPH_WIDTHS`` lists the widths). SGLang's overlap scheduler
stays as the user set it (``supports_overlap=True``: the V2 worker publishes each step's lengths through
``on_publish`` and relays its roots through SGLang's ``FutureMap``; ``--disable-overlap-schedule`` runs it
synchronously; on a CPU device it is off unless ``GLANCE_SGL_CPU_OVERLAP=1``). Forced: no mixed chunked prefill,
and on a CPU device no graph capture.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from . import ALGORITHM

logger = logging.getLogger(__name__)

DEFAULT_NUM_DRAFT_TOKENS = 32  # 31 tree nodes + the root
MAX_NUM_DRAFT_TOKENS = 256


class GlanceArgsError(ValueError):
    """Bad server arguments for ``--speculative-algorithm GLANCE``."""


def read_drafter_config(path: str | Path | None) -> dict[str, Any]:
    """The drafter checkpoint's config.json, with clear errors for a missing or foreign directory."""
    if not path:
        raise GlanceArgsError(
            "--speculative-algorithm GLANCE needs --speculative-draft-model-path pointing to a GLANCE drafter "
            "checkpoint (a DFlash draft checkpoint: config.json + model.safetensors)")
    directory = Path(path)
    cfg_file = directory / "config.json"
    if not cfg_file.is_file():
        raise GlanceArgsError(f"GLANCE drafter checkpoint not found: {cfg_file} does not exist")
    try:
        data = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise GlanceArgsError(f"GLANCE drafter config {cfg_file} is not valid JSON: {exc}") from exc
    from glance_sgl.config import GlanceConfig

    try:  # a DFlash draft config (the checkpoint format) or the former glance_drafter one: the flat GLANCE fields
        data = GlanceConfig.from_any_dict(data, source=str(cfg_file)).to_dict()
    except ValueError as exc:
        raise GlanceArgsError(str(exc)) from exc
    if not any((directory / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")):
        raise GlanceArgsError(f"GLANCE drafter weights not found: {directory / 'model.safetensors'}")
    return data


def resolve_glance_args(args: Any) -> dict[str, int]:
    """Validate ``args`` (a ServerArgs or any object with the same fields) and return the GLANCE settings
    ``{num_draft_tokens, topk, num_steps, block_size, budget}``, defaults filled in. Raises GlanceArgsError."""
    from glance_sgl.tree import max_tree_size

    cfg = read_drafter_config(getattr(args, "speculative_draft_model_path", None))
    block = int(cfg.get("block_size", 16))
    if block < 2:
        raise GlanceArgsError(f"drafter block_size must be >= 2, got {block}")
    steps = getattr(args, "speculative_num_steps", None)
    steps = block - 1 if steps is None else int(steps)
    if not 1 <= steps <= block - 1:
        raise GlanceArgsError(
            f"--speculative-num-steps (maximum tree depth) must be in [1, {block - 1}] for a block size of "
            f"{block}, got {steps}")
    topk = getattr(args, "speculative_eagle_topk", None)
    topk = int(cfg.get("branch_k", 8)) if topk is None else int(topk)
    if not 1 <= topk <= 64:
        raise GlanceArgsError(f"--speculative-eagle-topk (branch_k) must be in [1, 64], got {topk}")
    ntok = getattr(args, "speculative_num_draft_tokens", None)
    ntok = DEFAULT_NUM_DRAFT_TOKENS if ntok is None else int(ntok)
    if not 2 <= ntok <= MAX_NUM_DRAFT_TOKENS:
        raise GlanceArgsError(
            f"--speculative-num-draft-tokens (tree budget + 1) must be in [2, {MAX_NUM_DRAFT_TOKENS}], got {ntok}")
    cap = max_tree_size(steps, topk)
    if ntok - 1 > cap:
        raise GlanceArgsError(
            f"--speculative-num-draft-tokens {ntok} asks for a {ntok - 1}-node tree, but depth {steps} with "
            f"branch_k {topk} allows at most {cap} nodes")
    device = getattr(args, "device", None)
    if device is not None and str(device) not in ("cpu", "cuda") and not str(device).startswith("cuda"):
        raise GlanceArgsError(f"GLANCE runs on 'cuda' or 'cpu' devices, got {device!r}")
    return {"num_draft_tokens": ntok, "topk": topk, "num_steps": steps, "block_size": block, "budget": ntok - 1}


def validate_server_args(server_args: Any) -> None:
    """SGLang's ``validate_server_args`` hook: reject bad GLANCE arguments and bad GLANCE settings (every
    variable of :mod:`glance_sgl.sglang.settings`) at start-up, before any model loads."""
    from .settings import SettingsError, WorkerSettings

    resolve_glance_args(server_args)
    try:
        WorkerSettings.from_env()
    except SettingsError as exc:
        raise GlanceArgsError(str(exc)) from None


def fill_server_args(server_args: Any) -> None:
    """SGLang's ``handle_server_args`` hook: fill the speculative fields and force the settings GLANCE needs."""
    s = resolve_glance_args(server_args)
    server_args.speculative_num_draft_tokens = s["num_draft_tokens"]
    server_args.speculative_num_steps = s["num_steps"]
    server_args.speculative_eagle_topk = s["topk"]
    server_args.enable_mixed_chunk = False
    if getattr(server_args, "max_running_requests", None) is None:
        server_args.max_running_requests = 48
    device = str(getattr(server_args, "device", None) or "cuda")
    if device == "cpu" and not getattr(server_args, "disable_cuda_graph", True):
        # SGLang's CPU "graphs" are torch.compile captures of plain decode; GLANCE's verify is not among them.
        logger.info("GLANCE on CPU: graph capture is off (--disable-cuda-graph)")
        server_args.disable_cuda_graph = True
    # On CUDA, graphs stay as the user set them: the verify pass is captured through the hooks of graphs.py.
    if device == "cpu" and not getattr(server_args, "disable_overlap_schedule", True):
        from .settings import WorkerSettings

        if not WorkerSettings.from_env().cpu_overlap:
            # A CPU runs the step synchronously anyway; the overlap relay only adds work there (SGLang turns it
            # off on a CPU for its own speculative algorithms too). GLANCE_SGL_CPU_OVERLAP=1 keeps it (tests).
            logger.info("GLANCE on CPU: overlap scheduling is off (GLANCE_SGL_CPU_OVERLAP=1 keeps it on)")
            server_args.disable_overlap_schedule = True


def _spec_class():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class GlanceSpecAlgo(CustomSpecAlgo):
        """GLANCE for SGLang's scheduler: a tree verify like NGRAM's, a drafter with its own context cache."""

        create_future_map = SpeculativeAlgorithm.create_future_map

        def carries_draft_hidden_states(self) -> bool:
            return False

        def need_topk(self) -> bool:
            return False

        def supports_mixed_chunk(self) -> bool:
            return False

        def has_draft_kv(self) -> bool:
            # The drafter's context K/V sit in a pool indexed by the target's own slots (one slot per token,
            # written with it): no per-branch draft slots to reserve, unlike EAGLE's draft tree.
            return False

        def handle_server_args(self, server_args) -> None:
            fill_server_args(server_args)

    return GlanceSpecAlgo


def _worker_factory(server_args):
    from .glance_worker import GlanceWorker

    return GlanceWorker


def register_algorithm() -> None:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    if get_spec(ALGORITHM) is not None:
        return
    SpeculativeAlgorithm.register(
        ALGORITHM, supports_overlap=True, validate_server_args=validate_server_args, spec_class=_spec_class()
    )(_worker_factory)


# SGLang's internal state (``/get_server_info``'s ``internal_states``, one per scheduler) gains the GLANCE worker's
# step parts where it profiles (``GLANCE_SGL_PROFILE=1``): per step kind, steps and ms summed (``StepStats.sums``)
STEP_PARTS_KEY = "glance_step_parts"
_INTERNAL_STATE = "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"


def _add_step_parts(result: Any, controller: Any, state: dict, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of SGLang's ``SchedulerInternalStateController._add_speculative`` (which every algorithm's state
    passes, none included): the GLANCE worker's step parts into ``state`` (nothing for another algorithm, or
    without profiling), and any engine's step timing where ``GLANCE_SGL_STEP_TIMING`` is on
    (:mod:`glance_sgl.sglang.step_timing`)."""
    from .glance_worker import GlanceWorker
    from .step_timing import STEP_TIMING_KEY, step_timing

    worker = getattr(getattr(controller, "scheduler", None), "draft_worker", None)
    if isinstance(worker, GlanceWorker) and worker.stats.log:
        state[STEP_PARTS_KEY] = worker.stats.sums()
    timing = step_timing()
    if timing is not None:
        state[STEP_TIMING_KEY] = timing
    return None


def register_state_hook() -> None:
    """Register :func:`_add_step_parts` with SGLang's HookRegistry (idempotent)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    target = f"{_INTERNAL_STATE}._add_speculative"
    if not any(hook is _add_step_parts for _, hook, _ in HookRegistry._hooks.get(target, [])):
        HookRegistry.register(target, _add_step_parts, HookType.AFTER)
    HookRegistry.apply_hooks()


# SGLang's slot table (``req_to_token``) gives each request ``context length + get_req_to_token_extra_context_len()``
# columns; the function is read where the table is built, under the name ``kv_cache_configurator`` imported
_ROW_HEADROOM = ("sglang.srt.mem_cache.allocation_sizing.get_req_to_token_extra_context_len",
                 "sglang.srt.mem_cache.kv_cache_configurator.get_req_to_token_extra_context_len")


def _decode_reserve_headroom(result: int, *args: Any, **kwargs: Any) -> int | None:
    """AFTER hook of SGLang's ``get_req_to_token_extra_context_len`` (a request's slot-table row past the context
    length): with GLANCE, at least what a decode step reserves past the committed tokens (SGLang's double buffer,
    ``get_alloc_reserve_per_decode``: 2 x ``--speculative-num-draft-tokens``) plus a page's rounding. SGLang widens
    the row that far only for a paged cache with a draft tree (``page_size > 1``); at one token a page a plugin
    algorithm gets ``4 + N`` columns, and a request within ``N - 4`` tokens of the context length reserved past its
    row: the next request's row on a GPU, a crash in the CPU mode's port (NGRAM alike). A few int32 columns per
    request slot; None (SGLang's own) for another algorithm."""
    from sglang.srt.mem_cache.allocation_sizing import (get_alloc_page_size, get_alloc_reserve_per_decode,
                                                         get_spec as runtime_spec)

    if runtime_spec().speculative_algorithm != ALGORITHM:
        return None
    return max(int(result), get_alloc_reserve_per_decode() + get_alloc_page_size() - 1)


def register_headroom_hook() -> None:
    """Register :func:`_decode_reserve_headroom` with SGLang's HookRegistry (idempotent)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target in _ROW_HEADROOM:
        if not any(hook is _decode_reserve_headroom for _, hook, _ in HookRegistry._hooks.get(target, [])):
            HookRegistry.register(target, _decode_reserve_headroom, HookType.AFTER)
    HookRegistry.apply_hooks()


def register_model() -> None:
    from sglang.srt.models.registry import ModelRegistry

    from .drafter_model import EntryClass, register_hf_config

    register_hf_config()
    for cls in EntryClass:
        ModelRegistry.models.setdefault(cls.__name__, cls)


def register_all() -> None:
    import warnings

    from . import cpu
    from .draft_pool import install_memory_accounting
    from .graphs import register_graph_hooks
    from .sampling import register_sampling_hook
    from .settings import WorkerSettings
    from .step_timing import register_step_timing
    from .targets import register_target_hooks

    cpu.install_vllm_stub()
    cpu.install_sgl_kernel_stub()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if WorkerSettings.from_env().step_timing:  # first: HookRegistry patches a target once, at the first apply
            register_step_timing()
        register_algorithm()
        install_memory_accounting()
        cpu.register_cpu_backend()
        cpu.register_cpu_hooks()
        register_graph_hooks()
        register_target_hooks()
        register_state_hook()
        register_headroom_hook()
        register_sampling_hook()
        register_model()

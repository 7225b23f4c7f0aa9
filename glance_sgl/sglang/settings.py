"""The GLANCE worker's settings inside an SGLang server: one validated object, read once per process.

SGLang gives a plugin no server flag of its own (its server arguments are SGLang's dataclass, shared by every
process), so the settings that are not SGLang's come from the environment of the server / engine process,
exactly once, here: :meth:`WorkerSettings.from_env` (called by the worker's constructor) parses and validates
every variable, and a bad value stops the server at start-up with a message naming the variable
(``plugin.validate_server_args`` calls it before any model loads). Nothing else in the plugin reads the
environment; the worker takes the object.

| variable | setting | values (default first) | what it does |
|---|---|---|---|
| ``GLANCE_PLANNER`` | ``planner``, ``planner_seed`` | ``auto`` / ``fixed`` / ``off`` / ``random[:SEED]`` | the planning policy (``off``: never speculate; ``random``: tests) |
| ``GLANCE_DRAFT_SOURCES`` | ``draft_sources`` | ``drafter,ngram`` / ``drafter`` / ``ngram`` | the candidate sources of the verify tree (``ngram``: SGLang's ``NgramCorpus`` over the request's prompt, its output and recent answers, no model pass; several: one merged tree) |
| ``GLANCE_NGRAM_CORPUS`` | ``ngram_corpus`` | ``shared`` / ``per-key`` / ``off`` | which recent answers the n-gram source matches besides the request's own tokens (``NgramSettings.scope``) |
| ``GLANCE_CUDA_GRAPH_WIDTHS`` | ``graph_widths`` | default widths / ``1,4,8,...`` | the verify widths captured in CUDA graphs |
| ``GLANCE_SGL_STEP`` | ``step`` | ``auto`` / ``host`` / ``device`` | where the step's tree build and walk run (``auto``: the device on CUDA, the host elsewhere) |
| ``GLANCE_SGL_STATIC_DRAFT`` | ``static_draft`` | ``0`` / ``1`` | the drafter pass with the static shapes of its graphs, without graphs (CPU tests of the GPU path) |
| ``GLANCE_SGL_CPU_OVERLAP`` | ``cpu_overlap`` | ``0`` / ``1`` | on a CPU device, keep SGLang's overlap scheduler on (default: off there, as SGLang does for its own speculative algorithms: a CPU runs the step synchronously anyway, and the relay costs; tests of the overlap path set it) |
| ``GLANCE_SGL_RAGGED_VERIFY`` | ``ragged_verify`` | ``0`` / ``1`` | ``1``: where the attention backend takes it (``glance_cpu``, no CUDA graphs, one rank), every request of a batch verifies its own number of tree rows in one pass, sized by the planner (default: one size for the batch; ragged passes lost on first-seen traffic, docs/planner.md) |
| ``GLANCE_SGL_COMPILE_DRAFTER`` | ``compile_drafter`` | ``1`` / ``0`` | on a CPU device, the drafter's block pass through ``torch.compile`` (``GlanceDrafter.compile_block``: compiled at start-up; CUDA replays graphs instead) |
| ``GLANCE_SGL_PROFILE`` | ``profile`` | ``0`` / ``1`` | log a per-phase time profile of decode steps |
| ``GLANCE_SGL_COUNT_HOST_READS`` | ``count_host_reads`` | ``0`` / ``1`` | count device-to-host reads per step and log them |
| ``GLANCE_SGL_STEP_TIMING`` | ``step_timing`` | ``0`` / ``1`` | time every engine's scheduler steps and target forwards, whatever its algorithm (``glance_sgl.sglang.step_timing``; the benchmark's side-by-side step table) |
| ``GLANCE_SGL_DUMP_TAPS`` | ``dump_taps`` | unset / a directory | save the prompt taps the worker is handed (debugging the tap capture) |

``GLANCE_SGL_DEVICE_STEP=1``, the earlier spelling of ``GLANCE_SGL_STEP=device``, is still read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping

from glance_sgl.ngram_source import SCOPES as NGRAM_CORPORA
# the worker's sources by default: the drafter and n-gram matches, merged (on 2 CPU cores, interleaved, ahead of
# the drafter alone in every scenario of the SGLang bench; docs/sglang.md "Candidate sources")
from glance_sgl.round import DEFAULT_DRAFT_SOURCES, DRAFT_SOURCES, check_draft_sources

PLANNER_ENV = "GLANCE_PLANNER"  # also set by `glance serve --backend sglang --planner` for its server
PLANNERS = ("auto", "fixed", "off", "random")
STEPS = ("auto", "host", "device")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")

Step = Literal["auto", "host", "device"]


class SettingsError(ValueError):
    """A setting with a bad value; the message names the environment variable."""


def _flag(env: Mapping[str, str], name: str, default: bool = False) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise SettingsError(f"{name}={env[name]!r}: use 1 or 0")


def parse_planner(raw: str, name: str = "GLANCE_PLANNER") -> tuple[str, int]:
    """``(mode, seed)`` of ``auto`` | ``fixed`` | ``off`` | ``random[:SEED]`` (case and blanks ignored; empty =
    auto; ``off``: never speculate, the speculative path's fixed cost)."""
    text = raw.strip().lower() or "auto"
    mode, _, seed = text.partition(":")
    if mode not in PLANNERS or (seed and mode != "random"):
        raise SettingsError(f"{name}={raw!r}: choose auto, fixed, off or random[:SEED] (random is for tests)")
    try:
        return mode, int(seed) if seed else 0
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: the random planner's seed must be an integer") from None


def parse_widths(raw: str, name: str = "GLANCE_CUDA_GRAPH_WIDTHS") -> tuple[int, ...] | None:
    """Comma-separated row counts >= 1, or None when empty (the default widths)."""
    if not raw.strip():
        return None
    try:
        widths = tuple(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise SettingsError(f"{name} must be a comma-separated list of row counts, got {raw!r}") from None
    if not widths or any(w < 1 for w in widths):
        raise SettingsError(f"{name}: row counts must be >= 1, got {raw!r}")
    return widths



def parse_draft_sources(raw: str, name: str = "GLANCE_DRAFT_SOURCES") -> tuple[str, ...]:
    """A comma list of ``drafter`` / ``ngram`` (case and blanks ignored; empty = :data:`DEFAULT_DRAFT_SOURCES`),
    deduplicated in canonical order."""
    names = [x.strip().lower() for x in raw.split(",") if x.strip()] or list(DEFAULT_DRAFT_SOURCES)
    bad = [x for x in names if x not in DRAFT_SOURCES]
    if bad:
        raise SettingsError(f"{name}={raw!r}: a comma list of drafter, ngram (unknown: {', '.join(bad)})")
    return check_draft_sources(names)


@dataclass(frozen=True)
class WorkerSettings:
    """What the GLANCE worker does beyond SGLang's own server arguments (the module docstring's table)."""

    planner: str = "auto"
    planner_seed: int = 0
    graph_widths: tuple[int, ...] | None = None
    step: Step = "auto"
    static_draft: bool = False
    profile: bool = False
    count_host_reads: bool = False
    step_timing: bool = False
    dump_taps: Path | None = None
    draft_sources: tuple[str, ...] = DEFAULT_DRAFT_SOURCES
    ngram_corpus: str = "shared"
    cpu_overlap: bool = False
    ragged_verify: bool = False
    compile_drafter: bool = True

    def __post_init__(self) -> None:
        if self.planner not in PLANNERS:
            raise SettingsError(f"planner must be one of {PLANNERS}, got {self.planner!r}")
        if self.step not in STEPS:
            raise SettingsError(f"step must be one of {STEPS}, got {self.step!r}")
        if self.graph_widths is not None and (not self.graph_widths or min(self.graph_widths) < 1):
            raise SettingsError(f"graph_widths must be row counts >= 1, got {self.graph_widths!r}")
        try:
            check_draft_sources(self.draft_sources)
        except ValueError as exc:
            raise SettingsError(f"draft_sources: {exc}") from None
        if self.ngram_corpus not in NGRAM_CORPORA:
            raise SettingsError(f"ngram_corpus must be one of {NGRAM_CORPORA}, got {self.ngram_corpus!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "WorkerSettings":
        """The settings of this process's environment (``env``: another mapping, for tests); SettingsError
        naming the variable on a bad value."""
        env = os.environ if env is None else env
        planner, seed = parse_planner(env.get("GLANCE_PLANNER", ""))
        step = env.get("GLANCE_SGL_STEP", "").strip().lower() or "auto"
        if step not in STEPS:
            raise SettingsError(f"GLANCE_SGL_STEP={env['GLANCE_SGL_STEP']!r}: choose auto, host or device")
        if step == "auto" and _flag(env, "GLANCE_SGL_DEVICE_STEP"):
            step = "device"
        dump = env.get("GLANCE_SGL_DUMP_TAPS", "").strip()
        widths = parse_widths(env.get("GLANCE_CUDA_GRAPH_WIDTHS", ""))
        sources = parse_draft_sources(env.get("GLANCE_DRAFT_SOURCES", ""))
        corpus = env.get("GLANCE_NGRAM_CORPUS", "").strip().lower() or "shared"
        if corpus not in NGRAM_CORPORA:
            raise SettingsError(f"GLANCE_NGRAM_CORPUS={env['GLANCE_NGRAM_CORPUS']!r}: choose shared, per-key or off")
        return cls(planner=planner, planner_seed=seed, graph_widths=widths, step=step,
                   static_draft=_flag(env, "GLANCE_SGL_STATIC_DRAFT"), profile=_flag(env, "GLANCE_SGL_PROFILE"),
                   count_host_reads=_flag(env, "GLANCE_SGL_COUNT_HOST_READS"),
                   step_timing=_flag(env, "GLANCE_SGL_STEP_TIMING"), dump_taps=Path(dump) if dump else None,
                   draft_sources=sources, ngram_corpus=corpus, cpu_overlap=_flag(env, "GLANCE_SGL_CPU_OVERLAP"),
                   ragged_verify=_flag(env, "GLANCE_SGL_RAGGED_VERIFY"),
                   compile_drafter=_flag(env, "GLANCE_SGL_COMPILE_DRAFTER", default=True))

    def device_step(self, on_cuda: bool) -> bool:
        """Whether the step's tree build and walk run as device tensors (no per-request host loops)."""
        return self.step == "device" or (self.step == "auto" and on_cuda)


__all__ = ["DEFAULT_DRAFT_SOURCES", "PLANNER_ENV", "SettingsError", "WorkerSettings", "parse_draft_sources",
           "parse_planner", "parse_widths"]

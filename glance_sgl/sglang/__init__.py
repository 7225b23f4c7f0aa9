"""GLANCE as an SGLang speculative algorithm (entry point group ``sglang.srt.plugins``).

``register()`` runs in every SGLang process (SGLang's ``load_plugins()``) and is idempotent. It registers:

- the speculative algorithm ``GLANCE`` (``--speculative-algorithm GLANCE``) with its worker
  (:class:`glance_sgl.sglang.glance_worker.GlanceWorker`), server-args validation and defaults;
- the drafter as an SGLang model class (``GlanceDrafterForSGLang``) in SGLang's ``ModelRegistry``, loading the
  same checkpoint directory as the embedded engine;
- the CPU mode (:mod:`glance_sgl.sglang.cpu`): the ``glance_cpu`` attention backend with TARGET_VERIFY, and the
  stand-ins SGLang needs on a machine without CUDA. Its torch ops are installed only when that backend is
  built, i.e. on the CPU.
"""

from __future__ import annotations

ALGORITHM = "GLANCE"
_registered = False


def register() -> None:
    """SGLang plugin entry point; safe to call many times."""
    global _registered
    if _registered:
        return
    from .plugin import register_all

    register_all()
    _registered = True


__all__ = ["ALGORITHM", "register"]

"""Count device-to-host transfers made through tensor methods: tests bound them, and the SGLang worker logs them
per decode step with ``GLANCE_SGL_COUNT_HOST_READS=1``.

``HostTransferCounter`` is a ``TorchFunctionMode``: tensor method calls go through it (torch 2.x dispatches these
C- and Python-implemented methods to active modes; ``tests/test_verify.py`` checks each one). Counted: ``item``,
``tolist``, ``cpu``, ``numpy``, ``__bool__``, ``__int__``, ``__float__``, ``__complex__``, ``__index__`` and the
Python-level readers whose inner ``item`` / ``numpy`` / ``tolist`` a mode does not see (it is switched off while a
call it intercepted runs): ``__array__``, ``__contains__``, ``__format__``, ``__repr__``. Each reads a tensor's
values on the host: a device-to-host copy and a sync for a CUDA tensor; on the CPU there is no transfer and the
calls themselves are counted, as the ones that would be. Also ``Tensor.to`` with a CPU target from a tensor that is
not on the CPU (a ``.to`` of a CPU tensor is a no-op, so device-agnostic ``x.to(y.device)`` code reads zero on the
CPU; ``x.cpu()`` always counts). ``len(tensor)`` is not a transfer (the shape lives on the host).

Not seen: syncs without a tensor method on this list (``nonzero``, boolean-mask indexing, ``torch.unique``, ...)
and reads inside other Python-level torch functions. On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` catches
every sync.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

HOST_READS = frozenset(
    getattr(torch.Tensor, name)
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__complex__", "__index__",
                 "__array__", "__contains__", "__format__", "__repr__")
)


class HostTransferCounter(TorchFunctionMode):
    """Counts device-to-host transfers by method name in ``calls``; ``total`` sums them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self._paused = False

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Reads inside are not counted (e.g. another component's code the bound is not about)."""
        self._paused, before = True, self._paused
        try:
            yield
        finally:
            self._paused = before

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._paused:
            if func in HOST_READS:
                self.calls[func.__name__] += 1
            elif func is torch.Tensor.to and _to_host(args[0], args[1:], kwargs):
                self.calls["to"] += 1
        return func(*args, **kwargs)


def _to_host(tensor: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether ``tensor.to(*args, **kwargs)`` copies a tensor off a device onto the CPU."""
    device = torch._C._nn._parse_to(*args, **kwargs)[0]
    return device is not None and device.type == "cpu" and tensor.device.type != "cpu"


@contextmanager
def count_host_transfers() -> Iterator[HostTransferCounter]:
    """``with count_host_transfers() as counter: ...`` then read ``counter.total`` / ``counter.calls``."""
    with HostTransferCounter() as counter:
        yield counter

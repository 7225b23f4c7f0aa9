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

Host copies: code that works on tensors that live on the host whatever the device (a tree the round read back
once, an n-gram lookup's result, a statistics table) runs under :func:`on_host`: reads of CPU tensors there are not
counted (on a CPU device they would be indistinguishable from device reads), reads of any other device still are.

Not seen: syncs without a tensor method on this list (``nonzero``, boolean-mask indexing, ``torch.unique``, ...)
and reads inside other Python-level torch functions. On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` catches
every sync.
"""

from __future__ import annotations

import contextlib
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
        self._host_data = False  # on_host(): CPU tensors are host copies, not device data

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def paused(self) -> contextlib.AbstractContextManager:
        """Reads inside are not counted (e.g. another component's code the bound is not about)."""
        return self._while("_paused")

    def host_copies(self) -> contextlib.AbstractContextManager:
        """Reads of CPU tensors inside are not counted: they are host copies (see :func:`on_host`)."""
        return self._while("_host_data")

    @contextmanager
    def _while(self, flag: str) -> Iterator[None]:
        """``flag`` set inside, restored after."""
        before = getattr(self, flag)
        setattr(self, flag, True)
        try:
            yield
        finally:
            setattr(self, flag, before)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        host_copy = self._host_data and bool(args) and isinstance(args[0], torch.Tensor) and \
            args[0].device.type == "cpu"
        if not self._paused and not host_copy:
            if func in HOST_READS:
                self.calls[func.__name__] += 1
            elif func is torch.Tensor.to and _to_host(args[0], args[1:], kwargs):
                self.calls["to"] += 1
        return func(*args, **kwargs)


def _to_host(tensor: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether ``tensor.to(*args, **kwargs)`` copies a tensor off a device onto the CPU."""
    device = torch._C._nn._parse_to(*args, **kwargs)[0]
    return device is not None and device.type == "cpu" and tensor.device.type != "cpu"


def read_stacked(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """``tensors`` (each [B, ...], one device) on the host in one device-to-host read: flattened to [B, k], put side
    by side as float64 (exact for token ids, which stay below 2**53, and for float32 values), read, split and given
    back their shapes and dtypes."""
    bs, dev = tensors[0].shape[0], tensors[0].device
    flat = [t.to(dev, torch.float64).reshape(bs, -1) for t in tensors]
    host = torch.cat(flat, 1).cpu()
    out, at = [], 0
    for t, f in zip(tensors, flat):
        out.append(host[:, at:at + f.shape[1]].reshape(t.shape).to(t.dtype))
        at += f.shape[1]
    return out


_ACTIVE: list[HostTransferCounter] = []  # the counters counting now, innermost last


@contextmanager
def count_host_transfers() -> Iterator[HostTransferCounter]:
    """``with count_host_transfers() as counter: ...`` then read ``counter.total`` / ``counter.calls``."""
    with HostTransferCounter() as counter:
        _ACTIVE.append(counter)
        try:
            yield counter
        finally:
            _ACTIVE.remove(counter)


_NOTHING = contextlib.nullcontext()


def on_host() -> contextlib.AbstractContextManager:
    """Marks code that reads host copies: CPU tensors read inside are not counted by an active counter (where none
    counts, the hot path: a shared no-op context). Only for tensors that are on the host on every device; a device
    tensor read inside is still counted."""
    if not _ACTIVE:
        return _NOTHING
    stack = contextlib.ExitStack()
    for counter in _ACTIVE:
        stack.enter_context(counter.host_copies())
    return stack

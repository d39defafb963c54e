"""Count the calls that would block the host if a batch were on a GPU (a test utility).

On a CPU every read is free, so a test cannot time a host sync; it can count the calls that
would be one on a GPU. :class:`HostSyncCounter` follows the tensors it is told are the batch,
and every tensor computed from them (the outputs of an op with such an input, and a tensor an op
writes them into), and records each call on one of them that waits for a device:

- reads into Python: ``item()``, ``bool(t)``, ``int(t)`` (``aten._local_scalar_dense``),
  ``tolist()``, ``numpy()``;
- ops whose output size depends on the data: ``nonzero`` (boolean indexing and
  ``masked_select`` too), ``unique``, ``repeat_interleave`` without ``output_size``, and
  ``torch.equal``, which answers a Python bool;
- copies to the host: ``.cpu()`` (a request for the host, wherever the tensor is), and a
  ``.to()`` without ``non_blocking`` that moves a tensor from a device to the CPU (on a CPU run
  ``.to(logits.device)`` is no copy, and on a GPU it would not be one either).

Two modes do it: a dispatch mode sees the ops torch runs (and so the reads made in C++, such as
``int(t)`` of an argument), a function mode the reads that never dispatch on a CPU tensor
(``tolist``, ``numpy``, ``cpu``, ``to``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

_aten = torch.ops.aten
_DATA_DEPENDENT = {_aten._local_scalar_dense.default, _aten.nonzero.default, _aten.nonzero.out, _aten.equal.default,
                   _aten.masked_select.default, _aten._unique2.default, _aten.unique_consecutive.default,
                   _aten.unique_dim.default}


class HostSyncCounter:
    """``with HostSyncCounter(batch) as syncs: ...``; then ``syncs.calls`` lists what was counted.

    ``batch``: a tensor, or a dict, list or dataclass holding tensors (a ``PackedBatch``'s
    tensors count as the batch's)."""

    def __init__(self, batch) -> None:
        self.derived = WeakTensorKeyDictionary()
        self.calls: list[str] = []
        for t in _tensors(batch):
            self.derived[t] = True
        self._modes = (_Reads(self), _Ops(self))

    def is_derived(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.derived

    def __enter__(self) -> "HostSyncCounter":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))


class _Ops(TorchDispatchMode):
    # a higher-order op (FlexAttention) is one device kernel here: its inputs taint its outputs
    supports_higher_order_operators = True

    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        derived = any(self.counter.is_derived(t) for t in pytree.tree_leaves((args, kwargs)))
        if derived and (func in _DATA_DEPENDENT or (func is _aten.repeat_interleave.Tensor
                                                     and kwargs.get("output_size") is None)):
            self.counter.calls.append(str(func))
        out = func(*args, **kwargs)
        if derived:
            schema = getattr(func, "_schema", None)  # a higher-order op has none, and writes nothing
            params = schema.arguments if schema is not None else []
            written = [a for a, arg in zip(args, params) if arg.alias_info and arg.alias_info.is_write]
            written += [kwargs[arg.name] for arg in params if arg.alias_info and arg.alias_info.is_write
                        and arg.name in kwargs]
            for t in [*pytree.tree_leaves(out), *written]:
                if isinstance(t, torch.Tensor):
                    self.counter.derived[t] = True
                    if t._base is not None:  # written through a view: the base holds it too
                        self.counter.derived[t._base] = True
        return out


class _Reads(TorchFunctionMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and self.counter.is_derived(args[0]) and _reads_to_host(func, args, kwargs):
            self.counter.calls.append(f"Tensor.{func.__name__}")
        return func(*args, **kwargs)


def _reads_to_host(func, args, kwargs) -> bool:
    if func in (torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu):
        return True
    if func is torch.Tensor.to and not kwargs.get("non_blocking", False) and args[0].device.type != "cpu":
        target = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))]
        return bool(target) and torch.device(target[0]).type == "cpu"
    return False

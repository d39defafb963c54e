"""The one registry of what slipstream changes in other code, and its exact undo.

Each entry carries the part of slipstream that made it (its ``owner``):

- ``patch(target, name, replacement)``: idempotent, the original reachable as the
  replacement's ``__wrapped__`` where the replacement takes attributes; the undo sets an
  attribute the target held itself back to the original and deletes one it inherited (a
  method, a model's ``forward`` patched on one instance);
- ``change(key, what, undo)``: a change made another way (torch's backend tables edited in
  place, say), which ``undo`` puts back.

``patches()`` lists the live entries (``slipstream.status()``), ``uninstall_all()`` undoes them
newest first (``slipstream.disable()``). A target that takes weak references (a model) is not
kept alive by the registry: its entries leave with it.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Hashable

__all__ = ["MARKER", "change", "forget", "is_patched", "patch", "patches", "uninstall_all", "unpatch"]

MARKER = "__slipstream_patch__"
"""Set on a replacement that takes attributes: the owner that installed it."""


@dataclass(frozen=True, eq=False)
class _Entry:
    ref: Callable[[], Any]
    """The target (a weak reference where the target allows one)."""
    name: str
    original: Any
    """The attribute before the patch; None where it was inherited (the undo deletes)."""
    replacement: Callable[[], Any]
    """The replacement (weakly where the target's own ``__dict__`` holds it: an instance's
    patch must not keep the instance alive through the registry)."""
    owned: bool
    """Whether ``name`` was in the target's own ``__dict__`` (else it was inherited)."""
    owner: str
    what: str
    undo: Callable[[], None] | None = None


_LIVE: dict[Hashable, _Entry] = {}  # (id(target), name), or a change's key -> the entry
_LOCK = threading.RLock()


def _weakly(value, key=None) -> Callable[[], Any]:
    """A weak reference to ``value`` (with ``key``: its entry leaves with it), else a strong one."""
    try:
        return weakref.ref(value, None if key is None else (lambda ref: _drop(key, ref)))
    except TypeError:  # modules and classes take weak references; a few builtins do not
        return lambda: value


def _drop(key, ref) -> None:
    with _LOCK:
        if getattr(_LIVE.get(key), "ref", None) is ref:
            del _LIVE[key]


def patch(target, name: str, replacement, *, owner: str) -> bool:
    """Set ``target.name = replacement``; False (nothing changed) when already patched."""
    with _LOCK:
        if is_patched(target, name):
            return False
        original = getattr(target, name)
        owned = name in getattr(target, "__dict__", {name: None})
        for attr, value in (("__wrapped__", original), (MARKER, owner)):
            try:
                if attr != "__wrapped__" or not hasattr(replacement, "__wrapped__"):
                    setattr(replacement, attr, value)
            except (AttributeError, TypeError):  # e.g. a bound method takes no attributes
                pass
        setattr(target, name, replacement)
        key = (id(target), name)
        where = getattr(target, "__name__", None) or type(target).__name__
        held = _weakly(replacement) if not owned else (lambda: replacement)
        _LIVE[key] = _Entry(_weakly(target, key), name, original if owned else None, held, owned, owner,
                            f"{where}.{name}")
        return True
def unpatch(target, name: str) -> bool:
    """Undo ``patch`` exactly; False when ``target.name`` is not ours."""
    with _LOCK:
        key = (id(target), name)
        found = _LIVE.get(key)
        if found is None or found.ref() is not target:
            return False
        del _LIVE[key]
    if found.owned:
        setattr(target, name, found.original)
    elif name in getattr(target, "__dict__", {}):
        delattr(target, name)
    return True


def is_patched(target, name: str) -> bool:
    found = _LIVE.get((id(target), name))
    return found is not None and found.ref() is target and getattr(target, name, None) is found.replacement()


def change(key: Hashable, what: str, undo: Callable[[], None], *, owner: str, target=None) -> bool:
    """Record a change made another way, which ``undo()`` reverts; False when ``key`` is
    recorded already (the first record, and its undo, stay). With ``target`` (a model the
    change is on), the record leaves with the target, which it does not keep alive."""
    with _LOCK:
        if ("change", key) in _LIVE:
            return False
        ref = _weakly(target, ("change", key)) if target is not None else (lambda: None)
        _LIVE["change", key] = _Entry(ref, "", None, lambda: None, False, owner, what, undo)
        return True


def forget(key: Hashable, *, undo: bool = False) -> bool:
    """Drop the change recorded under ``key`` (running its undo when ``undo``); False if none is."""
    with _LOCK:
        found = _LIVE.pop(("change", key), None)
    if found is not None and undo:
        found.undo()
    return found is not None


def patches(owner: str | None = None) -> list[str]:
    """The live entries, oldest first: ``"deepspeed: deepspeed.initialize"``."""
    with _LOCK:
        return [f"{e.owner}: {e.what}" for e in _LIVE.values() if owner is None or e.owner == owner]


def uninstall_all(owner: str | None = None) -> None:
    """Undo every live entry (of ``owner`` only, if given), newest first."""
    with _LOCK:
        found = [(k, e) for k, e in reversed(list(_LIVE.items())) if owner is None or e.owner == owner]
    for key, entry in found:
        if entry.undo is not None:
            forget(key[1], undo=True)
        elif (target := entry.ref()) is not None:
            unpatch(target, entry.name)

"""The one registry of what slipstream changes in other code, and its exact undo.

Two kinds of entry, each with the part of slipstream that made it (its ``owner``):

- an attribute patch, ``patch(target, name, replacement)``: idempotent (patching a patched
  attribute again is a no-op), the original reachable as the replacement's ``__wrapped__``
  where the replacement takes attributes, and an exact undo: an attribute the target held
  itself is set back to the original, one it inherited (a method, a model's ``forward``
  patched on one instance) is deleted again;
- a change made another way, ``change(key, what, undo)``: torch's backend tables edited in
  place, say; ``undo`` puts it back.

Every live entry is listed by ``patches()`` (what ``slipstream.status()`` shows) and undone by
``uninstall_all()`` (what ``slipstream.disable()`` runs), newest first. Targets that can be
weakly referenced (model instances) are not kept alive by the registry: an entry leaves with
its target.

    patch(deepspeed, "initialize", hooked, owner="deepspeed")
    unpatch(deepspeed, "initialize")
    uninstall_all("deepspeed")          # one owner's entries; no owner: every entry
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

    def describe(self) -> str:
        return f"{self.owner}: {self.what}"


_LIVE: dict[Hashable, _Entry] = {}  # (id(target), name), or a change's key -> the entry
_LOCK = threading.RLock()


def _reference(target, key) -> Callable[[], Any]:
    try:
        return weakref.ref(target, lambda ref: _drop(key, ref))
    except TypeError:  # modules and classes take weak references; a few builtins do not
        return lambda: target


def _weakly(value) -> Callable[[], Any]:
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda: value


def _drop(key, ref) -> None:
    with _LOCK:
        entry = _LIVE.get(key)
        if entry is not None and entry.ref is ref:
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
        _LIVE[key] = _Entry(_reference(target, key), name, original if owned else None, held, owned, owner,
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
        ref = _reference(target, ("change", key)) if target is not None else (lambda: None)
        _LIVE["change", key] = _Entry(ref, "", None, lambda: None, False, owner, what, undo)
        return True


def forget(key: Hashable, *, undo: bool = False) -> bool:
    """Drop the change recorded under ``key`` (running its undo when ``undo``); False when
    none is."""
    with _LOCK:
        found = _LIVE.pop(("change", key), None)
    if found is not None and undo:
        found.undo()
    return found is not None


def patches(owner: str | None = None) -> list[str]:
    """The live entries, oldest first: ``"deepspeed: deepspeed.initialize"``."""
    with _LOCK:
        return [e.describe() for e in _LIVE.values() if owner is None or e.owner == owner]


def uninstall_all(owner: str | None = None) -> None:
    """Undo every live entry (of ``owner`` only, if given), newest first."""
    with _LOCK:
        found = [(k, e) for k, e in reversed(list(_LIVE.items())) if owner is None or e.owner == owner]
    for key, entry in found:
        if entry.undo is not None:
            forget(key[1], undo=True)
            continue
        target = entry.ref()
        if target is not None:
            unpatch(target, entry.name)

"""The one way an adapter changes another library's objects.

A patch is idempotent (patching a patched attribute again is a no-op), keeps the original
reachable as the replacement's ``__wrapped__`` where the replacement takes attributes, and has
an exact undo: an attribute the target held itself is set back to the original, one it
inherited (a method patched on one instance) is deleted again. Every live patch is listed by
``patches()``, which is what a user or a test reads to see what slipstream changed.

    patch(deepspeed, "initialize", hooked, owner="deepspeed")
    unpatch(deepspeed, "initialize")
    uninstall_all()          # every adapter's patches, newest first
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["is_patched", "patch", "patches", "uninstall_all", "unpatch"]

MARKER = "__slipstream_patch__"


@dataclass(frozen=True)
class _Patch:
    target: Any
    name: str
    original: Any
    replacement: Any
    owned: bool
    """Whether ``name`` was in the target's own ``__dict__`` (else it was inherited)."""
    owner: str
    """The adapter that made it: ``deepspeed``, ``fsdp``, ``megatron``."""

    def describe(self) -> str:
        where = getattr(self.target, "__name__", None) or type(self.target).__name__
        return f"{self.owner}: {where}.{self.name}"


_LIVE: dict[tuple[int, str], _Patch] = {}  # (id(target), name) -> the patch; targets kept alive here


def patch(target, name: str, replacement, *, owner: str) -> bool:
    """Set ``target.name = replacement``; False (nothing changed) when already patched."""
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
    _LIVE[id(target), name] = _Patch(target, name, original, replacement, owned, owner)
    return True


def unpatch(target, name: str) -> bool:
    """Undo ``patch`` exactly; False when ``target.name`` is not ours."""
    found = _LIVE.pop((id(target), name), None)
    if found is None:
        return False
    if found.owned:
        setattr(target, name, found.original)
    elif name in getattr(target, "__dict__", {}):
        delattr(target, name)
    return True


def is_patched(target, name: str) -> bool:
    found = _LIVE.get((id(target), name))
    return found is not None and found.target is target and getattr(target, name, None) is found.replacement


def patches(owner: str | None = None) -> list[str]:
    """The live patches, oldest first: ``"deepspeed: deepspeed.initialize"``."""
    return [p.describe() for p in _LIVE.values() if owner is None or p.owner == owner]


def uninstall_all(owner: str | None = None) -> None:
    """Undo every live patch (of ``owner`` only, if given), newest first."""
    for found in reversed(list(_LIVE.values())):
        if owner is None or found.owner == owner:
            unpatch(found.target, found.name)

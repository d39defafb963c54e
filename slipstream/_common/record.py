"""What slipstream did in this process, recorded by the parts that did it: the stacks an adapter
engaged (or left stock, and why), the warnings given, and the switch (who turned slipstream on).
``slipstream.status()`` reads it; the start line is printed by a listener the api registers
(``on_start``), so that no lower layer calls up to print.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["deferred", "note_stack", "on_start", "stacks", "start", "switch", "update_stack", "warn_once", "warnings"]

log = logging.getLogger("slipstream")


@dataclass(slots=True, eq=False)
class Switch:
    """Who turned slipstream on in this process (``enable()``, ``SLIPSTREAM=1``; empty: off),
    and the collectives' settings given in code (``enable(config)``; None: none given)."""

    source: str = ""
    config: Any = None

    @property
    def on(self) -> bool:
        return bool(self.source)


@dataclass(slots=True, eq=False)
class _Record:
    stacks: dict[str, dict] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    started: bool = False
    deferred: int = 0  # > 0 while an adapter sets a job up
    listeners: list[Callable[[], None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


_RECORD = _Record()
switch = Switch()


def note_stack(name: str, **facts: Any) -> None:
    """An adapter records what it did (or why it left its stack stock)."""
    with _RECORD.lock:
        _RECORD.stacks[name] = dict(facts)


def update_stack(name: str, **facts: Any) -> None:
    """An adapter's later finding about its stack (a choice made during the job)."""
    with _RECORD.lock:
        _RECORD.stacks.setdefault(name, {}).update(facts)


def stacks() -> dict[str, dict]:
    with _RECORD.lock:
        return {k: dict(v) for k, v in _RECORD.stacks.items()}


def warn_once(message: str) -> None:
    """A warning, once per process, kept for ``status()``."""
    with _RECORD.lock:
        if message in _RECORD.warnings:
            return
        _RECORD.warnings.append(message)
    log.warning("slipstream: %s", message)


def warnings() -> list[str]:
    with _RECORD.lock:
        return list(_RECORD.warnings)


def on_start(listener: Callable[[], None]) -> None:
    """Call ``listener()`` once, when a job first uses slipstream (idempotent per listener)."""
    with _RECORD.lock:
        if listener not in _RECORD.listeners:
            _RECORD.listeners.append(listener)


def start(*, by_adapter: bool = False) -> None:
    """A job uses slipstream now (a communicator was built, or an adapter finished setting the
    job up): the listeners run, once per process."""
    with _RECORD.lock:
        if _RECORD.started or (_RECORD.deferred and not by_adapter):
            return
        _RECORD.started = True
        listeners = list(_RECORD.listeners)
    for listener in listeners:
        listener()


@contextlib.contextmanager
def deferred():
    """While an adapter sets a job up, communicators it builds do not start the job; it calls
    ``start(by_adapter=True)`` when done, so that the start line names its work."""
    with _RECORD.lock:
        _RECORD.deferred += 1
    try:
        yield
    finally:
        with _RECORD.lock:
            _RECORD.deferred -= 1

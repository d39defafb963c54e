"""The end of a worker process that one of slipstream's commands launched."""

from __future__ import annotations

import atexit
import os
import sys


def leave(code: int = 0) -> None:
    """End a worker whose results are written: run the exit handlers (our communicators close
    and release their shared memory), flush, and leave without the C++ static destructors.

    torch 2.13's gloo aborts in them ('terminate called without an active exception', SIGABRT)
    in ~1 process exit of 5 with stock DDP or FSDP2 on gloo, after every result is written; the
    launcher would then report a finished job as failed."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

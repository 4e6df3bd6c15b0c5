"""SIGTERM to a replica's process drains it instead of killing it.

A replica is a Ray worker process. Ray's worker answers SIGTERM in its main thread with a handler
(`Worker.main_loop`'s `sigterm_handler`) that exits the process through
`ray._private.worker.raise_sys_exit_with_custom_error_message`. Python lets only the main thread install a signal
handler, and a replica's code runs on Ray Serve's user-code thread, so statelm cannot install its own; it redirects
the one call Ray's handler makes instead. The handler then calls statelm's callback (still on the main thread, which
must not block) and returns, and the process lives on; once the replica has drained, `exit_process` puts Ray's
function back and signals the process again, so it exits exactly as Ray would have had it.

This leans on a private detail of Ray's worker, checked before it is used: where the handler or the function is not
what is expected (another Ray version), `drain_on_sigterm` returns False and SIGTERM ends the process at once, as
before (its sessions then continue on another replica from their journals).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import ray._private.worker as ray_worker

RAY_HANDLER = "Worker.main_loop.<locals>.sigterm_handler"
EXIT_FUNCTION = "raise_sys_exit_with_custom_error_message"


def drain_on_sigterm(start_drain: Callable[[], None]) -> bool:
    """Have SIGTERM call start_drain (on the main thread; it must return at once) instead of exiting the process; a
    second SIGTERM exits at once. False if Ray's worker does not handle SIGTERM the expected way here."""
    handler = signal.getsignal(signal.SIGTERM)
    original = getattr(ray_worker, EXIT_FUNCTION, None)
    if getattr(handler, "__qualname__", None) != RAY_HANDLER or original is None or _redirected(original):
        return False
    state = {"signalled": False}

    def on_exit_call(message: str, *args: Any, **kwargs: Any) -> None:
        if "SIGTERM" in message and not state["signalled"]:
            state["signalled"] = True
            start_drain()
            return
        original(message, *args, **kwargs)

    on_exit_call.statelm_original = original  # type: ignore[attr-defined]
    setattr(ray_worker, EXIT_FUNCTION, on_exit_call)
    return True


def exit_process() -> None:
    """End this replica's process the way Ray's own SIGTERM handling does (after a drain); callable from any thread."""
    current = getattr(ray_worker, EXIT_FUNCTION)
    if _redirected(current):
        setattr(ray_worker, EXIT_FUNCTION, current.statelm_original)
    os.kill(os.getpid(), signal.SIGTERM)


def _redirected(function: Any) -> bool:
    return hasattr(function, "statelm_original")

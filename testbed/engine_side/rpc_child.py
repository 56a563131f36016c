"""The child half of ``testbed.engine_proc``: a JSON-lines request loop.

Imported by the engine-side scripts of this directory (run by path in the engine venv, so
this directory is ``sys.path[0]``); it never imports ``lmcache_kv_fast``.

:func:`take_stdout` keeps the real stdout for replies and points file descriptor 1 at
stderr, so whatever vLLM, LMCache or transformers print goes to the child's log, never
into the reply stream.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, TextIO

Handler = Callable[..., Any]


def take_stdout() -> TextIO:
    """Return a private writer on the original stdout; fd 1 then goes to stderr."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return reply


def send(out: TextIO, rid: int, ok: bool, payload: Any) -> None:
    """Write one reply line."""
    key = "result" if ok else "error"
    out.write(json.dumps({"id": rid, "ok": ok, key: payload}) + "\n")
    out.flush()


def serve(out: TextIO, handlers: dict[str, Handler], on_exit: Callable[[], None] | None = None
          ) -> None:
    """Answer requests from stdin until EOF or an ``exit`` request.

    Args:
        out: The reply writer from :func:`take_stdout`.
        handlers: ``op`` name -> function taking the request's ``args`` as keywords.
        on_exit: Called once before returning (e.g. engine shutdown).
    """
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            req = json.loads(line)
            op, rid = req.get("op"), req.get("id", 0)
            if op == "exit":
                break
            fn = handlers.get(op)
            if fn is None:
                send(out, rid, False, f"unknown op {op!r}; known: {sorted(handlers)}")
                continue
            try:
                result = fn(**req.get("args", {}))
            except Exception:
                send(out, rid, False, traceback.format_exc())
            else:
                send(out, rid, True, result)
    finally:
        if on_exit is not None:
            on_exit()


def start_or_fail(out: TextIO, start: Callable[[], Any]) -> Any:
    """Run the start-up step and send its reply (id 0); exit the process if it failed."""
    try:
        info = start()
    except BaseException:
        send(out, 0, False, traceback.format_exc())
        raise SystemExit(1) from None
    send(out, 0, True, info)
    return info

"""The worker interpreter: one SDK/backend, driven op by op, rep by rep, over stdin.

A backend is chosen once per process, so each SDK/backend runs in its own worker
(``native``, ``torch``, ``upstream``); :func:`worker_main` is its entry. The upstream
worker must never import ``lmcache_kv_fast``: it runs ``python -m benches.harness.worker``
(the package ``__init__`` files import nothing), so this module and what it imports
(:mod:`.names`, :mod:`.sizes`, :mod:`.workloads`, :mod:`.worker_ops`,
:mod:`.edits`, :mod:`.helpers`) use relative imports and only the standard library at
import; this SDK is imported inside functions, in its own workers only.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .helpers import http_clear, malloc_trim, punch_segment, random_kv
from .sizes import Sizes
from .worker_ops import BUILDERS, OpState
from .workloads import Variant, driven, recorded_op, worker_plan, workload, workload_of

logger = logging.getLogger("benches.harness")


class Worker:
    """One SDK/backend in its own interpreter, driven op by op, rep by rep, over stdin."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch

        self.torch = torch
        self.spec = spec
        self.kind: str = spec["worker"]
        self.s = Sizes(**spec["sizes"])
        self.plan = worker_plan(spec)
        self.out = Path(spec["out"])
        self.records: dict[tuple[str, str], dict[str, Any]] = {}
        self.notes: list[str] = []
        self.phases: dict[str, Any] | None = None  # ctx.last_timing of the call just timed
        self.info: dict[str, Any] = {"worker": self.kind, "pid": os.getpid(),
                                     "torch_threads": torch.get_num_threads()}
        self.torch_default = torch.get_num_threads()
        self.cur: OpState | None = None
        #: Stores per server since its L1 was last cleared (see ``Driven.clear_each``).
        self.since_clear: dict[str, int] = {}
        #: ``lmcache_kv_fast._native`` in the native worker, else None.
        self.native: Any = None
        self._ctxs: dict[tuple[str, str], Any] = {}
        self._srcs: dict[str, Any] = {}
        self._counter = itertools.count(1)
        self._backend: Any = None
        if self.kind != "upstream":
            from lmcache_kv_fast.copy.select import backend

            self._backend = backend()
            self.info["backend"] = self._backend.NAME
            if self.kind != self._backend.NAME:
                raise RuntimeError(f"worker {self.kind} got backend {self._backend.NAME}")
            if self.kind == "native":
                from lmcache_kv_fast import _native

                self.native = _native
                self.info["native_config"] = _native.config()

    # -- plumbing ----------------------------------------------------------------------
    def ctx(self, server: str, model: str) -> Any:
        """This worker's SDK context on ``server`` for ``model`` (connected once)."""
        key = (server, model)
        c = self._ctxs.get(key)
        if c is None:
            info = self.spec[server]
            if self.kind == "upstream":
                import lmcache.sdk.kvcache as up

                c = up.connect(info["url"], info["http_url"], model, timeout=60)
            else:
                import lmcache_kv_fast.kvcache as kvf

                c = kvf.connect(info["url"], info["http_url"], model, timeout=60.0)
            self._ctxs[key] = c
        return c

    def tokens(self, n: int) -> list[int]:
        """``n`` fresh token ids (a worker-specific range: workers share the servers' L1)."""
        slot = {"native": 0, "torch": 1, "upstream": 2}[self.kind]
        base = ((next(self._counter) % 1300) * 3 + slot) * (1 << 20)
        return list(range(base, base + n))

    def clear(self, server: str) -> None:
        """Clear ``server``'s L1."""
        http_clear(self.spec[server]["http_url"])
        self.since_clear[server] = 0

    def punch(self) -> bool:
        """Release the SHM server's L1 pool pages (only on a cleared L1)."""
        return punch_segment(self.spec["shm"].get("segment", ""))

    def activate(self, v: Variant) -> None:
        """Set torch's and the copy backend's threads for variant ``v``."""
        self.torch.set_num_threads(1 if v.torch1 else self.torch_default)
        if v.threads is not None:
            if v.roofline:
                self.native.set_threads(v.threads)
            elif self._backend is not None:
                self._backend.set_threads(v.threads)

    def record(self, path: str, op: str, nbytes: int, dt: float | None, note: str = "",
               *, rep: int | None = None, during: str | None = None,
               phases: dict[str, Any] | None = None) -> dict[str, Any]:
        """Add one sample (None: a failure); ``rep`` and ``during`` (the driven op) pair it.

        ``phases``: the SDK call's ``ctx.last_timing`` (this SDK's paths only).
        """
        rec = self.records.setdefault((path, op), {"path": path, "op": op, "nbytes": nbytes,
                                                   "samples": [], "failures": 0, "note": "",
                                                   "reps": [], "during": [], "phases": []})
        if dt is None:
            rec["failures"] += 1
        else:
            rec["samples"].append(dt)
            rec["reps"].append(rep)
            rec["during"].append(during)
            if phases is not None:
                rec["phases"].append(phases)
        if note and not rec["note"]:
            rec["note"] = note
        return rec

    def take_phases(self, ctx: Any) -> None:
        """Keep this SDK's phase breakdown of the call just timed (upstream has none)."""
        timing = getattr(ctx, "last_timing", None)
        self.phases = None if timing is None else timing.as_dict()

    def flush(self) -> None:
        """Write the records, notes and info to the ``out`` file of the spec."""
        data = {"records": list(self.records.values()), "notes": self.notes, "info": self.info}
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.out)

    def note(self, msg: str) -> None:
        """Log ``msg`` and keep it for the report."""
        logger.warning("%s", msg)
        self.notes.append(f"[{self.kind}] {msg}")

    def src(self, family: str) -> Any:
        """The KV tensor of a workload (made once, random finite bf16)."""
        t = self._srcs.get(family)
        if t is None:
            shape = workload(family).shape
            assert shape is not None, family
            t = self._srcs[family] = random_kv(shape(self.s))
        return t

    # -- driving -----------------------------------------------------------------------
    def begin(self, op: str) -> None:
        """Prepare ``op`` (seed what it reads, allocate buffers); no timing."""
        d = driven(op)
        variants = self.plan[op]
        family = workload_of(op).name
        for fam in [f for f in self._srcs if f != family]:
            del self._srcs[fam]  # ops run workload by workload: free the previous tensors
        gc.collect()
        malloc_trim()
        try:
            self.cur = BUILDERS[d.action](self, d, variants)
        except Exception as err:
            for v in variants:
                for o in d.records or [recorded_op(op, v)]:
                    self.record(v.path, o, 0, None, f"{type(err).__name__}: {err}")
            self.note(f"{op}: {type(err).__name__}: {err}")
            self.cur = None
            raise

    def rep(self, i: int) -> None:
        """Run rep ``i`` of the current op for every live variant, round-robin."""
        st = self.cur
        if st is None:
            return
        if st.record and i >= st.warmup:
            self._ping(st)
        for v in list(st.live):
            self.activate(v)
            op = recorded_op(st.op, v)
            self.phases = None
            try:
                dt = st.fn(v, i)
            except Exception as err:
                msg = f"{v.path} {op}: {type(err).__name__}: {err}"
                self.note(msg + "\n" + traceback.format_exc(limit=3))
                self.record(v.path, op, st.nbytes, None, msg)
                st.live.remove(v)
                continue
            if st.record and i >= st.warmup:
                self.record(v.path, op, st.nbytes, dt,
                            "" if dt is not None else f"{op} reported a failure",
                            rep=i - st.warmup, during=st.op, phases=self.phases)
        self.activate(Variant("reset"))

    def _ping(self, st: OpState) -> None:
        """Time one ``ping`` round trip on each server of the op (this SDK's workers).

        A ping is dispatched like ``lookup`` (to a pool thread of the server) and does no
        work: its round trip is the floor under every RPC of the op's calls, taken between
        the op's reps, under the same load. Kept in ``info["ping_s"][server][op]``.
        """
        if self.kind == "upstream" or not driven(st.op).ping:
            return
        for server in dict.fromkeys(v.server for v in st.live if not v.roofline):
            ctx = next((c for (srv, _m), c in self._ctxs.items() if srv == server), None)
            if ctx is None:
                continue
            t0 = time.perf_counter()
            ok = ctx.ping()
            dt = time.perf_counter() - t0
            if ok:
                self.info.setdefault("ping_s", {}).setdefault(server, {}).setdefault(
                    st.op, []).append(dt)

    def end(self) -> None:
        """Finish the current op (free its buffers) and save the samples."""
        st, self.cur = self.cur, None
        if st is not None and st.end is not None:
            st.end()
        self.flush()

    def close(self) -> None:
        """Close every context, clear the SHM server's L1 and release its pages."""
        for c in self._ctxs.values():
            with contextlib.suppress(Exception):
                c.close()
        self._ctxs.clear()
        with contextlib.suppress(Exception):
            self.clear("shm")
            self.punch()  # give the L1 pages back to /dev/shm


def worker_main(argv: Sequence[str]) -> int:
    """Entry of a worker interpreter: ``argv[0]`` is the spec JSON file.

    Prints ``@@ready`` (or ``@@skip <reason>``), then serves one JSON command per stdin line
    (``begin`` / ``rep`` / ``end`` / ``quit``), answering ``@@ok`` or ``@@err <reason>``.
    """
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    spec = json.loads(Path(argv[0]).read_text())
    if spec["worker"] == "upstream":
        try:
            import lmcache.sdk.kvcache  # noqa: F401
        except Exception as err:
            print(f"@@skip upstream SDK not importable: {err!r}", flush=True)
            return 0
    w = Worker(spec)
    print("@@ready", flush=True)
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            cmd = msg["cmd"]
            if cmd == "quit":
                break
            try:
                if cmd == "begin":
                    w.begin(msg["op"])
                elif cmd == "rep":
                    w.rep(int(msg["i"]))
                elif cmd == "end":
                    w.end()
                print("@@ok", flush=True)
            except Exception as err:
                print("@@err " + json.dumps(f"{type(err).__name__}: {err}"), flush=True)
    finally:
        w.close()
        w.flush()
    print("@@bye", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))

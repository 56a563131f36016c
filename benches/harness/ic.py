"""IC: ``import`` + ``connect`` in fresh interpreters (this SDK, upstream, ``import torch``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from .names import IC_KVF, IC_TORCH, IC_UP
from .procs import Progress, child_env


def _ic_script(module: str, connect: str) -> str:
    """Fresh-interpreter timing: ``import torch``, then ``module`` (the rest), then connect."""
    return (
        "import time, json, sys\n"
        "t0 = time.perf_counter()\nimport torch\nt1 = time.perf_counter()\n"
        + (f"import {module} as m\nt2 = time.perf_counter()\n{connect}\n"
           "t3 = time.perf_counter()\nctx.close()\n" if module else "t2 = t3 = t1\n")
        + "print('@@IC', json.dumps({'torch': t1 - t0, 'import': t2 - t0, 'connect': t3 - t2, "
          "'own': t3 - t1}), flush=True)\n"
    )


#: What each fresh interpreter times. ``own`` = the SDK's import after torch + connect.
IC_SCRIPTS = {
    IC_TORCH: _ic_script("", ""),
    IC_KVF: _ic_script("lmcache_kv_fast.kvcache",
                       "ctx = m.connect(sys.argv[1], sys.argv[2], sys.argv[3], 60.0)"),
    IC_UP: _ic_script("lmcache.sdk.kvcache",
                      "ctx = m.connect(sys.argv[1], sys.argv[2], sys.argv[3], timeout=60)"),
}


def run_ic(kinds: Sequence[str], url: str, http_url: str, model: str, reps: int, warmup: int,
           progress: Progress, notes: list[str], upstream_python: str | None = None
           ) -> dict[str, dict[str, list[float]]]:
    """Import + connect in fresh interpreters, interleaved; seconds per part.

    ``upstream_python``: the interpreter of the upstream SDK (default: this one).

    Every contender imports from cached bytecode, as from an installed package: the
    children write and read ``.pyc`` files under one temporary ``PYTHONPYCACHEPREFIX``
    (filled by a first, untimed round), even where ``PYTHONDONTWRITEBYTECODE`` is set —
    else a source checkout would be compiled on every import while site-packages come
    with the bytecode pip compiled.
    """
    parts = ("torch", "import", "connect", "own", "total", "process")
    res: dict[str, dict[str, list[float]]] = {k: {p: [] for p in parts} for k in kinds}
    pycache = tempfile.mkdtemp(prefix="lmckvf-ic-pyc-")
    env = child_env()
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = pycache
    try:
        for k in kinds:  # compile and cache every module the timed rounds import
            subprocess.run([_python(k, upstream_python), "-c", IC_SCRIPTS[k], url, http_url,
                            model],
                           capture_output=True, env=env, timeout=180, stdin=subprocess.DEVNULL)
        return _ic_rounds(kinds, url, http_url, model, reps, warmup, progress, notes, env, res,
                          upstream_python)
    finally:
        shutil.rmtree(pycache, ignore_errors=True)


def _ic_rounds(kinds: Sequence[str], url: str, http_url: str, model: str, reps: int,
               warmup: int, progress: Progress, notes: list[str], env: dict[str, str],
               res: dict[str, dict[str, list[float]]], upstream_python: str | None
               ) -> dict[str, dict[str, list[float]]]:
    for i in range(warmup + reps):
        for k in kinds:
            t0 = time.perf_counter()
            p = subprocess.run([_python(k, upstream_python), "-c", IC_SCRIPTS[k], url, http_url,
                            model],
                               capture_output=True, text=True, env=env, timeout=180,
                               stdin=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("@@IC ")), None)
            if p.returncode != 0 or line is None:
                notes.append(f"IC {k} failed (rc {p.returncode}): {p.stderr[-800:]}")
            elif i >= warmup:
                d = json.loads(line[5:])
                for part in ("torch", "import", "connect", "own"):
                    res[k][part].append(d[part])
                res[k]["total"].append(d["import"] + d["connect"])
                res[k]["process"].append(wall)
            progress.step(f"IC {k}")
    return res


def _python(kind: str, upstream_python: str | None) -> str:
    return (upstream_python if kind == IC_UP else None) or sys.executable

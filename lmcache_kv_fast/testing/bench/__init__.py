"""Benchmark harness: ``lmcache-kv-fast bench`` (also ``python -m lmcache_kv_fast bench``).

Measures, in one run and against the same real LMCache MP servers, every way this SDK (and
the upstream SDK it replaces) moves KV between CPU tensors and the server.

Paths (the rows of the table):

* ``kvfast-native-<k>t``: this SDK, native backend, ``connect(..., copy_threads=k)``;
* ``kvfast-torch``: this SDK, torch backend (``LMCACHE_KV_FAST_BACKEND=torch``);
* ``kvfast-pickle``: this SDK over the pickle plane (a second server, without SHM);
* ``upstream`` / ``upstream-pickle``: ``lmcache.sdk.kvcache`` on the same two servers
  (skipped with a note when it cannot be imported);
* ``kvfast-native@torch1`` / ``upstream@torch1``: both SDKs with the caller at
  ``torch.set_num_threads(1)`` (the native pool keeps its own threads);
* ``roofline-<k>t``: a flat ``memcpy`` of the same bytes on k threads (warm destination;
  ``cold``: into never-touched anonymous memory).

Workloads (sizes are flags; ``--quick`` shrinks them for CI):

* W1: store / retrieve ``[2, 32, 4096, 1024]`` bf16 (0.5 GiB). ``warm``: after warm-up reps,
  L1 cleared before each store (the server reuses the pages it already faulted in).
  ``cold``: a store into fresh L1 pages (cleared, then the pool segment's pages released
  with ``fallocate(PUNCH_HOLE)``); a retrieve into fresh result memory (``malloc_trim`` and
  this SDK's result pool emptied first). ``retrieve+out``: into a preallocated ``out``.
* W2: one 256-token chunk of a 28-layer model ``[2, 28, 256, 1024]``: store / retrieve
  latency over ``--w2-ops`` operations (p50 / p90 / p99).
* W3: batch rewrite of ``--w3-sequences`` sequences of 2048 tokens (retrieve, drop every
  10th token, store under the new tokens): ``batch.rewrite`` vs a sequential loop over this
  SDK's retrieve/store vs the same loop over the upstream SDK. L1 is cleared and re-seeded
  for each contender, so each one finds exactly the seeded sequences. The loops' edit
  writes into ``torch.empty`` (fresh pages, what a plain loop gets); under ``rewrite`` it
  writes into the ``alloc`` it is given (rewrite's pool of warm buffers), unless
  ``--w3-no-alloc``.
* W3P: W3 with the plain edit users write (issue 24), exactly
  ``kv.index_select(2, torch.tensor(keep))`` into a fresh tensor, no ``alloc``, given to
  ``batch.rewrite``, this SDK's loop and upstream's loop alike (same sizes and pairing as
  W3); targets: ``rewrite`` >= 1.5x this SDK's loop and >= 3x upstream's.
* W4: 64 MiB store / retrieve over the pickle plane.
* IC: ``import`` + ``connect`` in fresh interpreters (this SDK, upstream, and ``import
  torch`` alone, so this SDK's own share beyond torch is visible).

A backend is chosen once per process, so each SDK/backend runs in its own worker
interpreter: ``native`` (this SDK's native paths, its pickle path and the roofline),
``torch`` and ``upstream`` (which never imports this package). The workers live side by
side and the orchestrator drives them in lock-step over stdin: op by op, rep by rep, one
worker after the other, each rep visiting every path of the worker (roofline copies ride
along in the native worker's reps). So every path of a workload is measured in the same
seconds, and drift or a neighbour's burst on a shared machine hits them all alike.
L1 is cleared before every op.

Modules:

* :mod:`.workloads`: each workload's ops, reps, paths and targets (the extension point),
  with :mod:`.names` (path and op names), :mod:`.sizes` (sizes, ``--quick``, L1 sizing)
  and :mod:`.edits` (W3's edit functions);
* :mod:`.worker` (the worker interpreter) and :mod:`.worker_ops` (what it does in each
  op); :mod:`.helpers` (HTTP clear, L1 page release, malloc_trim, random KV);
* :mod:`.runner` (one run: servers, IC, lock-step driving), :mod:`.procs` (worker
  processes, child environment, progress), :mod:`.servers` (servers, models, machine),
  :mod:`.ic` (import + connect in fresh interpreters);
* :mod:`.stats` (rows, ratios), :mod:`.targets` (targets, ceilings, verdicts),
  :mod:`.report` (tables, phases, JSON), :mod:`.plot`;
* :mod:`.cli`: ``build_parser`` and ``main``.
"""

from .cli import build_parser, main, resolve_sizes
from .edits import EDITS, drop_every_kth, drop_every_kth_index_select, drop_every_kth_plain
from .helpers import punch_segment
from .names import *  # noqa: F403 - the path and op names
from .names import __all__ as _names
from .report import ic_summary, merge_pings, phase_summary, print_phases, print_table
from .sizes import QUICK, Sizes, kv_nbytes
from .stats import Row, add_ratios, percentile, rows_of, speedup
from .targets import Target, compute_targets, floor_s, print_targets, reduced_sizes, samples_during
from .workloads import GLOBAL_OPS, OP_ORDER, REGISTRY, WORKLOADS, Workload, worker_plan

__all__ = [
    "EDITS",
    "GLOBAL_OPS",
    "OP_ORDER",
    "QUICK",
    "REGISTRY",
    "WORKLOADS",
    "Row",
    "Sizes",
    "Target",
    "Workload",
    "add_ratios",
    "build_parser",
    "compute_targets",
    "drop_every_kth",
    "drop_every_kth_index_select",
    "drop_every_kth_plain",
    "floor_s",
    "ic_summary",
    "kv_nbytes",
    "main",
    "merge_pings",
    "percentile",
    "phase_summary",
    "print_phases",
    "print_table",
    "print_targets",
    "punch_segment",
    "reduced_sizes",
    "resolve_sizes",
    "rows_of",
    "samples_during",
    "speedup",
    "worker_plan",
    *_names,
]

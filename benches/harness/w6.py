"""Bench W6: the batched stream's modify phase on a real engine, this SDK vs upstream's.

``lmcache-kv-fast bench --w6``: 16 request streams of 2,048-token prompts run prefill →
modify (drop every 10th token's K/V) → decode against a real vLLM CPU engine (the
OpenAI-compatible server, ``testbed/engine.py``) writing into a real LMCache server,
once with ``lmcache_kv_fast.sdk`` and once with upstream 0.5.6's
``lmcache.sdk.batch.LMCacheBatchedStream`` (with what it needs on a CPU engine,
``testbed/upstream_cpu.py``), each side in its own worker process
(``w6_worker.py``), sides alternating over the reps. Both sides use the same engine
hook and edit; prefill and decode are the engine's time, reported for context.

The served model is a random-weight Llama with the KV geometry of Llama-3.2-1B (16 layers
× 8 KV heads × 64: 32 KiB of KV per token, 64 MiB per stream; :data:`DEFAULT_KV_GEOMETRY`)
and the test model's small hidden size, written locally like the test model.
``--w6-kv-geometry test`` serves the test model itself (1 KiB per token: there the
per-request work of server, engine and edit outweighs the bytes, and the floor below
caps any client's speed-up under 5×); ``--w6-kv-geometry L,H,D`` any other geometry.

A third worker per rep (``land``, ``--w6-no-land`` skips it) runs the same prefill, then
looks every stream up until the engine's store of all of them is visible, and times the
edit alone; with the modify's CPU per process (this worker, the server's and the
engine's process groups) that gives the *floor* of any client's modify on this machine
(:func:`modify_floor`), printed with the largest speed-up any client could show.

This SDK's side edits with the library's ``edits.drop_every`` (the same tokens dropped as
upstream's plain ``index_select`` edit), which its modify rewrites slot to slot
(``--w6-edit plain``: the plain edit on both sides).

Targets (``--w6-edit library``): modify ≥ 15× faster than upstream's, its private memory
growth ≤ 0.1× upstream's; with the plain edit ≥ 5× and ≤ 0.3× (peak RSS growth ≤ 0.3×
upstream's on both).
``--quick``: 4 streams × 512 tokens, one rep (a smoke run; its verdicts are indicative).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("benches.harness")

__all__ = ["W6Sizes", "add_w6_args", "run_w6"]

#: Targets of the issue: upstream modify time / ours, ours peak RSS growth / upstream's.
SPEEDUP_TARGET = 5.0
RSS_TARGET = 0.3
#: With the library's edit (the fused path): speed-up and private-memory ratio.
FUSED_SPEEDUP_TARGET = 15.0
FUSED_PRIVATE_TARGET = 0.1
#: ``(layers, kv_heads, head_dim)`` of the default model: Llama-3.2-1B's KV geometry (32 KiB
#: of bf16 KV per token), on random weights with the test model's small hidden size, so
#: the engine's prefill stays short while the KV has a real model's size.
DEFAULT_KV_GEOMETRY = (16, 8, 64)
CHUNK = 256


@dataclass
class W6Sizes:
    """The run's sizes."""

    streams: int = 16
    prompt_tokens: int = 2048
    decode_tokens: int = 16
    reps: int = 2
    drop_every: int = 10


QUICK = W6Sizes(streams=4, prompt_tokens=512, decode_tokens=4, reps=1)


def add_w6_args(ap: argparse.ArgumentParser) -> None:
    """The W6 flags of ``bench``."""
    g = ap.add_argument_group("W6: batched stream modify on a real engine (--w6)")
    g.add_argument("--w6", action="store_true",
                   help="run W6 only (starts a vLLM CPU engine unless --w6-vllm-url)")
    g.add_argument("--w6-streams", type=int, help=f"request streams (default {W6Sizes.streams})")
    g.add_argument("--w6-tokens", type=int,
                   help=f"prompt tokens per stream (default {W6Sizes.prompt_tokens})")
    g.add_argument("--w6-decode", type=int,
                   help=f"decode tokens per stream (default {W6Sizes.decode_tokens})")
    g.add_argument("--w6-reps", type=int, help=f"reps per side (default {W6Sizes.reps})")
    g.add_argument("--w6-vllm-url", help="a running vLLM OpenAI server to use (with --url, "
                   "--http-url of the LMCache server it writes into and --w6-model)")
    g.add_argument("--w6-model", help="model name of --w6-vllm-url, or a model directory to "
                   "serve (default: a random-weight Llama of --w6-kv-geometry)")
    g.add_argument("--w6-kv-geometry", metavar="LAYERS,KV_HEADS,HEAD_DIM",
                   help="KV geometry of the random-weight Llama the bench writes and serves "
                        f"(default {','.join(map(str, DEFAULT_KV_GEOMETRY))}, Llama-3.2-1B's: "
                        "32 KiB of KV per token, 64 MiB per 2,048-token stream; e.g. 8,8,128 "
                        "has the same bytes in half the layers); 'test' serves the test "
                        "model (2,2,64: 1 KiB per token, where per-request work outweighs "
                        "copies); default with --w6-model: that model's config.json")
    g.add_argument("--w6-kernel", help="the engine's CPU attention kernel (default: this "
                   "machine's choice for the model)")
    g.add_argument("--w6-no-upstream", action="store_true", help="skip the upstream side")
    g.add_argument("--w6-edit", choices=("library", "plain"), default="library",
                   help="this SDK's edit: the library's edits.drop_every (rewritten slot to "
                        "slot; default) or the plain index_select fn upstream's side runs")
    g.add_argument("--w6-settle", type=float, default=0.0,
                   help="seconds between the prefill and the modify, untimed, both sides "
                        "(vLLM's CPU worker busy-polls a core for 1 s after its last step: "
                        "1.5 measures the modify on an idle engine)")
    g.add_argument("--w6-cold-pool", action="store_true",
                   help="leave the server's SHM pool sparse (by default every page of it is "
                        "allocated once before the reps, as on a server that has run a "
                        "while: a fresh pool's first writes allocate and zero each page, "
                        "whichever side stores first)")
    g.add_argument("--w6-no-land", action="store_true",
                   help="skip the landing probe (a third worker per rep: prefill, then "
                        "lookups until the engine's store of every stream is visible; the "
                        "lower bound of any client's modify)")
    g.add_argument("--w6-max-in-flight", type=int, help="this SDK's modify bound (default: the "
                   "batched stream's)")
    g.add_argument("--w6-torch-threads", type=int, default=1,
                   help="torch intra-op threads of both workers (the edit and the layout "
                        "conversions of 2 MiB tensors; OpenMP spin-waits on a busy box cost "
                        "more than they gain); 0 = torch's default")


def test_model_geometry() -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of the test model (``testbed/tiny_model.py``)."""
    from testbed.tiny_model import TinyLlamaSpec

    spec = TinyLlamaSpec()
    return spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim


def model_geometry(model: str) -> tuple[int, int, int] | None:
    """``(layers, kv_heads, head_dim)`` from a model directory's ``config.json``.

    Returns:
        None if there is none or it lacks the fields.
    """
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
        heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
        dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        return int(cfg["num_hidden_layers"]), heads, dim
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


def kv_geometry(args: argparse.Namespace) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of the served model.

    ``--w6-kv-geometry``, else that of ``--w6-model`` (its ``config.json``; the test
    model's if it has none), else :data:`DEFAULT_KV_GEOMETRY`.
    """
    text = getattr(args, "w6_kv_geometry", None)
    if not text:
        model = getattr(args, "w6_model", None)
        if model:
            return model_geometry(model) or test_model_geometry()
        return DEFAULT_KV_GEOMETRY
    if text.strip().lower() == "test":
        return test_model_geometry()
    try:
        layers, heads, dim = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--w6-kv-geometry wants LAYERS,KV_HEADS,HEAD_DIM, got {text!r}") \
            from None
    if min(layers, heads, dim) < 1 or dim % 16:
        raise SystemExit(f"--w6-kv-geometry: positive sizes and a head dim that is a "
                         f"multiple of 16, got {text!r}")
    return layers, heads, dim


def geometry_model(layers: int, heads: int, dim: int) -> str:
    """The directory of a tiny Llama with that KV geometry (written once)."""
    from testbed.tiny_model import TinyLlamaSpec, ensure_tiny_model

    base = TinyLlamaSpec()
    spec = TinyLlamaSpec(num_hidden_layers=layers, num_key_value_heads=heads,
                         num_attention_heads=max(heads, base.num_attention_heads // heads * heads),
                         head_dim=dim)
    return str(ensure_tiny_model(spec))


def sizes_from(args: argparse.Namespace) -> W6Sizes:
    """Sizes from the flags (``--quick`` defaults)."""
    base = QUICK if getattr(args, "quick", False) else W6Sizes()
    return W6Sizes(streams=args.w6_streams or base.streams,
                   prompt_tokens=args.w6_tokens or base.prompt_tokens,
                   decode_tokens=args.w6_decode or base.decode_tokens,
                   reps=args.w6_reps or base.reps)


@contextlib.contextmanager
def _engine(args: argparse.Namespace, s: W6Sizes) -> Iterator[dict[str, Any]]:
    """The LMCache server and the vLLM engine (started here unless given)."""
    from lmcache_kv_fast.testing import LMCacheServer
    from testbed.engine import OpenAIEngine
    from testbed.tiny_model import ensure_tiny_model

    with contextlib.ExitStack() as stack:
        if args.w6_vllm_url:
            if not (args.url and args.http_url and args.w6_model):
                raise SystemExit("--w6-vllm-url needs --url, --http-url and --w6-model")
            yield {"url": args.url, "http_url": args.http_url, "vllm_url": args.w6_vllm_url,
                   "model": args.w6_model, "engine": None, "pgids": {}, "clear": None}
            return
        layers, heads, dim = kv_geometry(args)
        if args.w6_model:
            model = args.w6_model
        elif (layers, heads, dim) == test_model_geometry():
            model = str(ensure_tiny_model())
        else:
            model = geometry_model(layers, heads, dim)
        kv_token_bytes = layers * 2 * heads * dim * 2  # bf16
        pgids: dict[str, int] = {}
        if args.url and args.http_url:
            url, http_url = args.url, args.http_url
            port = int(url.rsplit(":", 1)[1])
        else:
            # one worker's prompts and edits with room to spare (L1 is emptied before every
            # worker), at least 6 GiB
            l1 = max(1.0, min(max(6.0, 2.5 * s.streams * s.prompt_tokens * kv_token_bytes / 2**30),
                              4 * s.reps * s.streams * s.prompt_tokens * kv_token_bytes / 2**30))
            srv = stack.enter_context(LMCacheServer(shm=True, chunk_size=CHUNK, l1_size_gb=l1))
            url, http_url, port = srv.url, srv.http_url, srv.port
            if not getattr(args, "w6_cold_pool", False):
                srv.warm_pool()  # before the engine stores anything
            if srv.proc is not None:
                pgids["server"] = os.getpgid(srv.proc.pid)
        max_len = max(2048, -(-(s.prompt_tokens + s.decode_tokens + 16) // 1024) * 1024)
        kv_gb = max(1, -(-int(1.5 * s.streams * (s.prompt_tokens + s.decode_tokens)
                              * kv_token_bytes) // 2**30))
        eng = stack.enter_context(OpenAIEngine(model, port, max_model_len=max_len,
                                               kv_space_gb=kv_gb))
        with contextlib.suppress(AttributeError, OSError, TypeError):
            pgids["engine"] = os.getpgid(eng.proc.pid)  # type: ignore[union-attr]
        yield {"url": url, "http_url": http_url, "vllm_url": eng.url, "model": model,
               "engine": eng, "pgids": pgids,
               "clear": None if args.url and args.http_url else srv.clear}


def _external_hits(vllm_url: str) -> float:
    import requests

    try:
        text = requests.get(f"{vllm_url}/metrics", timeout=30).text
    except requests.RequestException:
        return float("nan")
    total = 0.0
    for line in text.splitlines():
        if not line.startswith("#") and "external_prefix_cache_hits" in line:
            with contextlib.suppress(ValueError):
                total += float(line.rpartition(" ")[2])
    return total


def _worker(cfg: dict[str, Any], timeout: float = 1800.0) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benches.harness.w6_worker", "-"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("LMCACHE_TRACK_USAGE", "false")
    env.setdefault("DO_NOT_TRACK", "1")
    proc = subprocess.run(cmd, input=json.dumps(cfg), capture_output=True, text=True,
                          timeout=timeout, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("W6RESULT "):
            return dict(json.loads(line[len("W6RESULT "):]))
    raise RuntimeError(f"W6 {cfg['side']} worker failed (exit {proc.returncode}):\n"
                       f"{proc.stderr[-4000:]}")


def _prompts(s: W6Sizes, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(s.prompt_tokens)] for _ in range(s.streams)]


def run_w6(args: argparse.Namespace) -> dict[str, Any]:
    """Run W6; print the table and return the JSON document."""
    from lmcache_kv_fast.layout import select_cpu_kernel

    s = sizes_from(args)
    sides = ["ours"] if args.w6_no_upstream else ["ours", "upstream"]
    if not getattr(args, "w6_no_land", False):
        sides.append("land")
    nonce = secrets.token_hex(3)
    runs: list[dict[str, Any]] = []
    t_start = time.time()
    with _engine(args, s) as env:
        kernel = args.w6_kernel or select_cpu_kernel("bfloat16", 128, kv_geometry(args)[2])
        for rep in range(s.reps):
            order = sides if rep % 2 == 0 else sides[::-1]
            for side in order:
                seed = 1000 * rep + {"ours": 1, "upstream": 2}.get(side, 3)
                cfg = {"side": side, "url": env["url"], "http_url": env["http_url"],
                       "vllm_url": env["vllm_url"], "model": env["model"],
                       "prompts": _prompts(s, seed), "salt": f"w6-{nonce}-{side}-{rep}",
                       "max_tokens": s.decode_tokens, "drop_every": s.drop_every,
                       "kernel": kernel, "torch_threads": args.w6_torch_threads,
                       "max_in_flight": args.w6_max_in_flight, "pgids": env["pgids"],
                       "settle_s": args.w6_settle, "edit": args.w6_edit}
                if env["clear"] is not None:
                    # every worker starts on the same server state: an emptied L1, so no
                    # eviction pass (1 Hz above 80 % use) runs during anyone's phases
                    env["clear"]()
                before = _external_hits(env["vllm_url"])
                res = _worker(cfg)
                res["external_hits"] = _external_hits(env["vllm_url"]) - before
                res["rep"] = rep
                res["edit"] = args.w6_edit if side == "ours" else "plain"
                res.pop("tokens", None)
                runs.append(res)
                if side == "land":
                    logger.info("W6 rep %d land: engine's store visible %.3fs (first) .. "
                                "%.3fs (last) after the prefill", rep, res["land_first_s"],
                                res["land_last_s"])
                else:
                    logger.info("W6 rep %d %s: modify %.3fs, +%.1f MiB, %s streams fused",
                                rep, side, res["modify_s"], res["modify_rss_growth"] / 2**20,
                                res.get("fused_streams", "-"))
    doc = summarize(s, runs)
    doc["pool"] = pool_state(args)
    doc["seconds"] = time.time() - t_start
    print_w6(doc)
    return doc


def pool_state(args: argparse.Namespace) -> str:
    """How the server's SHM pool was when the reps started (for the report)."""
    if getattr(args, "url", None) and getattr(args, "http_url", None):
        return "as given (--url)"
    return "cold (sparse)" if getattr(args, "w6_cold_pool", False) else \
        "warm (every page allocated before the reps); L1 emptied before every worker"


def summarize(s: W6Sizes, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per side, ratios and verdicts."""
    per: dict[str, dict[str, float]] = {}
    land: dict[str, float] = {}
    for side in sorted({r["side"] for r in runs}):
        mine = [r for r in runs if r["side"] == side]
        if side == "land":
            land = {k: statistics.median(r[k] for r in mine)
                    for k in ("prefill_s", "land_first_s", "land_last_s", "edit_cpu_s")}
            continue
        per[side] = {k: statistics.median(r[k] for r in mine)
                     for k in ("prefill_s", "modify_s", "decode_s", "modify_rss_growth",
                               "modify_private_growth", "external_hits", "import_connect_s")}
        cpu = [r.get("modify_cpu_s") or {} for r in mine]
        for k in sorted({k for c in cpu for k in c}):
            per[side][f"modify_cpu_{k}_s"] = statistics.median(c.get(k, 0.0) for c in cpu)
    doc: dict[str, Any] = {"workload": "W6", "sizes": asdict(s), "runs": runs, "sides": per}
    if land:
        doc["land"] = land
        floor = modify_floor(per, land)
        if floor:
            doc["floor"] = floor
    if "ours" in per and "upstream" in per:
        o, u = per["ours"], per["upstream"]
        speed = u["modify_s"] / o["modify_s"] if o["modify_s"] > 0 else float("inf")
        def ratio(key: str) -> float:
            return o[key] / u[key] if u[key] > 0 else float("nan")

        rss, priv = ratio("modify_rss_growth"), ratio("modify_private_growth")
        library = any(r.get("edit") == "library" for r in runs if r["side"] == "ours")
        want_speed = FUSED_SPEEDUP_TARGET if library else SPEEDUP_TARGET
        want_priv = FUSED_PRIVATE_TARGET if library else RSS_TARGET
        doc["edit"] = "library" if library else "plain"
        doc["paired"] = paired_ratios(runs)
        doc["targets"] = {
            "modify_speedup": {"value": speed, "target": want_speed,
                               "met": speed >= want_speed},
            # the process's private memory: what the SDK allocates
            "modify_private_rss_ratio": {"value": priv, "target": want_priv,
                                         "met": priv <= want_priv},
            # all of its RSS, including the server's SHM pool pages it touched
            "modify_rss_ratio": {"value": rss, "target": RSS_TARGET, "met": rss <= RSS_TARGET},
        }
    return doc


def paired_ratios(runs: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Each rep's modify on both sides and upstream's over ours (reps both sides ran).

    The verdict is on the medians; these show how much one rep moves it.
    """
    by = {(r["side"], r.get("rep")): r["modify_s"] for r in runs
          if r["side"] in ("ours", "upstream")}
    reps = sorted({rep for side, rep in by if side == "ours" and ("upstream", rep) in by})
    return [{"rep": rep, "ours_s": by["ours", rep], "upstream_s": by["upstream", rep],
             "ratio": by["upstream", rep] / by["ours", rep] if by["ours", rep] > 0
             else float("inf")} for rep in reps]


def modify_floor(per: dict[str, dict[str, float]], land: dict[str, float],
                 cores: int | None = None) -> dict[str, float]:
    """The shortest modify any client could have on this machine and engine, and its ratio.

    Whatever the client, a modify must (1) wait until the engine's store of the last
    stream is visible (``land_last_s``), (2) have the server handle the requests that read
    and write every stream (at least the CPU the cheaper of the two SDKs' request sets
    cost the server, measured) and (3) run the user's edit on every stream (its CPU,
    measured alone, the cheaper of a plain run and one whose outputs go to memory that is
    already mapped: ``w6_worker.edit_cpu``). (2) and (3) share the machine's cores with
    what the engine keeps busy during the phase (vLLM's CPU worker busy-polls a core for
    1 s after each step: the smaller of the two sides' engine CPU per second of modify).
    A client with no cost of its own would take ``max((1), ((2) + (3)) / free cores)``;
    upstream's modify over that is the largest speed-up any client could show here.

    Returns:
        ``{}`` without both SDKs' CPU figures; else the parts, ``floor_s`` and
        ``max_possible_speedup``.
    """
    o, u = per.get("ours"), per.get("upstream")
    keys = ("modify_cpu_server_s", "modify_cpu_engine_s")
    if not o or not u or any(k not in o or k not in u for k in keys) or o["modify_s"] <= 0 \
            or u["modify_s"] <= 0:
        return {}
    n = cores or len(os.sched_getaffinity(0))
    server = min(o["modify_cpu_server_s"], u["modify_cpu_server_s"])
    engine_cores = min(o["modify_cpu_engine_s"] / o["modify_s"],
                       u["modify_cpu_engine_s"] / u["modify_s"])
    free = max(0.25, n - engine_cores)
    edit = land.get("edit_cpu_s", 0.0)
    edit = 0.0 if edit != edit else edit  # NaN: no edit measured
    floor = max(land["land_last_s"], (server + edit) / free)
    return {"cores": float(n), "engine_busy_cores": engine_cores, "server_cpu_s": server,
            "edit_cpu_s": edit, "land_last_s": land["land_last_s"], "floor_s": floor,
            "max_possible_speedup": u["modify_s"] / floor if floor > 0 else float("inf")}


def print_w6(doc: dict[str, Any]) -> None:
    """The W6 table."""
    s = doc["sizes"]
    print(f"\nW6 — batched stream on a real vLLM CPU engine: {s['streams']} streams x "
          f"{s['prompt_tokens']} prompt tokens, drop every {s['drop_every']}th token, "
          f"decode {s['decode_tokens']} tokens; medians of {s['reps']} rep(s) per side; "
          f"this SDK's edit: {doc.get('edit', 'library')}")
    if doc.get("pool"):
        print(f"server's SHM pool: {doc['pool']}")
    print(f"{'side':<10}{'prefill s':>11}{'modify s':>11}{'+RSS MiB':>10}{'+private MiB':>14}"
          f"{'decode s':>11}{'ext. hits':>11}")
    for side, v in doc["sides"].items():
        print(f"{side:<10}{v['prefill_s']:>11.3f}{v['modify_s']:>11.3f}"
              f"{v['modify_rss_growth'] / 2**20:>10.1f}{v['modify_private_growth'] / 2**20:>14.1f}"
              f"{v['decode_s']:>11.3f}{v['external_hits']:>11.0f}")
    for side, v in doc["sides"].items():
        cpu = {k[len("modify_cpu_"):-2]: x for k, x in v.items() if k.startswith("modify_cpu_")}
        if cpu:
            faults = cpu.pop("self_minflt", None)
            gcs = {k: cpu.pop(k) for k in ("gc_collections", "gc_full", "gc_s") if k in cpu}
            print(f"  {side} modify CPU s (medians): "
                  + ", ".join(f"{k} {x:.3f}" for k, x in cpu.items())
                  + ("" if faults is None else f"; its page faults {faults:.0f}")
                  + ("" if not gcs else f"; Python GC {gcs.get('gc_collections', 0):.0f} "
                     f"collections ({gcs.get('gc_full', 0):.0f} full) "
                     f"{gcs.get('gc_s', 0.0):.3f} s"))
    land = doc.get("land")
    if land:
        print(f"land      {land['prefill_s']:>11.3f}   the engine's store visible "
              f"{land['land_first_s']:.3f} s (first stream) .. {land['land_last_s']:.3f} s "
              "(last) after the prefill returned")
    f = doc.get("floor")
    if f:
        print(f"  floor of any client's modify here: {f['floor_s']:.3f} s = max(last store "
              f"visible {f['land_last_s']:.3f} s, (server CPU {f['server_cpu_s']:.3f} s + edit "
              f"CPU {f['edit_cpu_s']:.3f} s) / {f['cores'] - f['engine_busy_cores']:.2f} free "
              f"cores of {f['cores']:.0f}; the engine kept {f['engine_busy_cores']:.2f} busy)")
        print(f"  => at most {f['max_possible_speedup']:.2f}x upstream's modify for a client "
              f"that costs nothing itself")
    pairs = doc.get("paired") or []
    if pairs:
        ratios = [p["ratio"] for p in pairs]
        print("  modify per rep, ours / upstream's s (upstream's ÷ ours): "
              + ", ".join(f"{p['ours_s']:.3f} / {p['upstream_s']:.3f} ({p['ratio']:.1f}x)"
                          for p in pairs)
              + f"; paired ratios {min(ratios):.1f}x .. {max(ratios):.1f}x, median "
                f"{statistics.median(ratios):.1f}x")
    for name, t in (doc.get("targets") or {}).items():
        op = ">=" if name == "modify_speedup" else "<="
        print(f"  {name}: {t['value']:.2f} (target {op} {t['target']}) "
              f"{'MET' if t['met'] else 'NOT MET'}")
    print("  (prefill and decode are the engine's time; modify includes waiting for the engine's "
          "store; +RSS is the modify phase's peak RSS growth (plus the result buffers this SDK "
          "made ready for it during the prefill), which includes the pages of the "
          "server's SHM pool the worker touched — the same for both SDKs; +private is its "
          "private part, RssAnon)")


def write_json(doc: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write the document."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=2))
    return p

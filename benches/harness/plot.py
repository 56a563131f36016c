"""``--plot``: a bar chart of GB/s per path and workload plus the W2 latency CDF."""

from __future__ import annotations

from typing import Any

from .names import W2_RET, W2_STORE
from .report import path_order
from .stats import Key, Row
from .workloads import OP_ORDER


def write_plot(path: str, rows: dict[Key, Row], records: dict[Key, dict[str, Any]]
               ) -> str | None:
    """Bar chart of GB/s per path and workload + W2 latency CDF; returns a note on failure."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot needs matplotlib (pip install matplotlib); no plot written"
    ops = [op for op in OP_ORDER if any(o == op for (_p, o) in rows) and not op.startswith("W2")]
    paths = path_order(sorted({p for (p, _o) in rows}))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(12, 1.1 * len(ops) + 7), 10))
    width = 0.8 / max(1, len(paths))
    cmap = plt.get_cmap("tab20")
    for i, p in enumerate(paths):
        xs = [j + i * width for j, op in enumerate(ops) if (p, op) in rows]
        ys = [rows[(p, op)].gbps for op in ops if (p, op) in rows]
        if xs:
            ax1.bar(xs, ys, width, label=p, color=cmap(i % 20))
    ax1.set_yscale("log")
    ax1.set_xticks([j + 0.4 - width / 2 for j in range(len(ops))])
    ax1.set_xticklabels(ops, rotation=30, ha="right", fontsize=8)
    ax1.set_ylabel("GB/s (median, log)")
    ax1.set_title("throughput per path and workload")
    ax1.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    color = {p: cmap(i % 20) for i, p in enumerate(paths)}
    for (p, op), rec in sorted(records.items()):
        if op not in (W2_STORE, W2_RET) or not rec["samples"]:
            continue
        xs = sorted(1e3 * x for x in rec["samples"])
        ys = [(j + 1) / len(xs) for j in range(len(xs))]
        ax2.step(xs, ys, where="post", label=f"{op}: {p}",
                 linestyle="-" if op == W2_RET else "--", color=color.get(p))
    ax2.set_xscale("log")
    ax2.set_xlabel("W2 latency, ms (log)")
    ax2.set_ylabel("fraction of ops")
    ax2.set_title("W2 one-chunk latency CDF")
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None

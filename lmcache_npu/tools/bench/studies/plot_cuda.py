"""Plot GB/s against chunk count from a cuda_matrix.py JSON and print the matrix as a markdown table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def markdown(data: dict) -> str:
    lines = ["| preset | chunks | variant | direction | GB/s | x pinned copy | x naive torch | kernel ms | launches |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m in data["matrix"]:
        for r in m["rows"]:
            lines.append(f"| {m['preset']} | {m['chunks']} | {m['variant']} | {r['direction']} | {r['gb_per_s']:.1f} | "
                         f"{r['gb_per_s'] / r['pinned_gb_per_s']:.3f} | {r['gb_per_s'] / r['naive_gb_per_s']:.2f} | "
                         f"{r['kernel_ms']:.3f} | {r['launches']} |")
    return "\n".join(lines)


def plot(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, direction in zip(axes, ("store", "load")):
        series: dict[str, list[tuple[int, float]]] = {}
        pinned: dict[int, float] = {}
        for m in data["sweep"]:
            row = next(r for r in m["rows"] if r["direction"] == direction)
            series.setdefault(m["variant"], []).append((m["chunks"], row["gb_per_s"]))
            pinned[m["chunks"]] = row["pinned_gb_per_s"]
        for name, points in series.items():
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.plot(sorted(pinned), [pinned[c] for c in sorted(pinned)], "k--", label="pinned copy, same bytes")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("256-token chunks per transfer")
        ax.set_title(f"{data['sweep'][0]['preset']} {direction}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(loc="lower right")
    fig.suptitle(f"lmcache_npu cuda backend on {data['environment']['gpu']}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("json", type=Path)
    parser.add_argument("--png", type=Path, required=True)
    args = parser.parse_args()
    data = json.loads(args.json.read_text())
    plot(data, args.png)
    print(markdown(data))


if __name__ == "__main__":
    main()

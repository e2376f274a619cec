"""Plot a layer_pipeline JSON (`layer_pipeline.py --plot` calls it): per geometry, TTFT over the ideal and the compute
slowdown against T_load/T_compute per S, and the store's tail after the forward per S."""

from __future__ import annotations

from pathlib import Path

TARGET = 0.05  # issue 41's bar, the band drawn on both load panels


def plot(data: dict, out: Path) -> None:
    """Per geometry: over-ideal and compute slowdown against T_load/T_compute per S, and the store's tail per S."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["geometry"] for r in data["rows"]))
    fig, axes = plt.subplots(len(names), 3, figsize=(15, 4 * len(names)), squeeze=False)
    for row_axes, name in zip(axes, names):
        rows = [r for r in data["rows"] if r["geometry"] == name]
        biggest = max(r["chunks"] for r in rows)
        rows = [r for r in rows if r["chunks"] == biggest]
        launches = list(dict.fromkeys(r.get("launch", "at-once") for r in rows))  # older JSON: one launch mode
        for launch, s in [(launch, s) for launch in launches for s in sorted({r["slices"] for r in rows})]:
            points = sorted((r["ratio"], r["over_ideal"] * 100, r["slowdown"] * 100, r.get("over_copy")) for r in rows
                            if r["slices"] == s and r.get("launch", "at-once") == launch)
            if not points:
                continue
            label = f"S={s}" + (" (L)" if s == rows[0]["layers"] else "") + (f", {launch}" if len(launches) > 1 else "")
            style = "--" if launch == "per-slice" and len(launches) > 1 else "-"
            line, = row_axes[0].plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=label)
            if all(p[3] is not None for p in points):  # over the copy floor (JSON from round 5 on): dotted, same colour
                row_axes[0].plot([p[0] for p in points], [p[3] * 100 for p in points], ":", marker="x",
                                 color=line.get_color())
            row_axes[1].plot([p[0] for p in points], [p[2] for p in points], style, marker="o", label=label)
        for ax, title in zip(row_axes[:2], ("TTFT over ideal %, dotted: copy floor",
                                             "compute slowdown, slices landing %")):
            ax.axhspan(-TARGET * 100, TARGET * 100, color="green", alpha=0.1)
            ax.axvspan(0.3, 3, color="grey", alpha=0.08)
            ax.set_xscale("log")
            ax.set_xlabel("T_load / T_compute")
            ax.set_title(f"{name}, {rows[0]['load_mb']:.0f} MB: {title}")
            ax.grid(alpha=0.3)
        row_axes[0].legend(fontsize=8)
        stores = [s for s in data.get("stores", []) if s["geometry"] == name and s["chunks"] == biggest]
        for ratio in sorted({s["target_ratio"] for s in stores}):
            points = sorted((s["slices"], s["tail"]) for s in stores if s["target_ratio"] == ratio)
            row_axes[2].plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"ratio {ratio:g}")
        row_axes[2].set_xscale("log", base=2)
        row_axes[2].set_xlabel("store batches S (1: one store after the forward)")
        row_axes[2].set_ylabel("ms")
        row_axes[2].set_title(f"{name}: store tail after the forward")
        row_axes[2].grid(alpha=0.3)
        if stores:
            row_axes[2].legend(fontsize=8)
    fig.suptitle(f"layer_pipeline on {data['environment']['gpu']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)

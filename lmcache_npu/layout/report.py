"""A KVLayout as a person reads it (`lmcache-npu inspect`): one row per plan group, then bytes per chunk."""

from __future__ import annotations

from typing import Any

from .discovery import KVLayout, LayoutGroup


def _planes_cell(group: LayoutGroup) -> str:
    parts = []
    for entry in group.to_json()["planes"]:
        parts.append(f"{entry['count']}x {entry['role']} {entry['dtype']} {entry['row_bytes']} B")
    return "\n".join(parts)


def render_layout(layout: KVLayout, title: str) -> list[Any]:
    """Rich renderables: the group table and a summary line."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, show_lines=True)
    for col, justify in (("group", "right"), ("sched", "right"), ("spec", "left"), ("layers", "right"),
                         ("tokens/block", "right"), ("ratio", "right"), ("window", "right"),
                         ("rows/chunk", "right"), ("planes", "left"), ("stored", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for g in layout.groups:
        stored = f"skipped: {g.skip_reason}" if g.skipped else ("yes" + (f" ({g.note})" if g.note else ""))
        table.add_row(str(g.index), str(g.scheduler_group), f"{g.spec}\n{g.kind.value}", str(len(g.layers)),
                      str(g.tokens_per_block), str(g.compress_ratio),
                      "-" if g.sliding_window is None else str(g.sliding_window),
                      "-" if g.skipped else str(g.rows_per_chunk), _planes_cell(g), stored)
    stored, naive = layout.bytes_per_chunk, layout.naive_bytes_per_chunk
    summary = Text(
        f"bytes per {layout.plan.chunk_tokens}-token chunk: {stored:,} stored vs {naive:,} for a naive copier "
        f"(every group's full chunk, state groups included): {naive / stored:.2f}x less"
        if stored else "nothing is stored: every group is skipped")
    out: list[Any] = [table, summary]
    out += [Text(f"caveat: {c}", style="yellow") for c in layout.caveats]
    return out

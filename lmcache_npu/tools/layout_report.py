"""A KVLayout as a person reads it (`lmcache-npu inspect`): one row per plan group, then bytes per chunk."""

from __future__ import annotations

from typing import Any

from ..layout.discovery import KVLayout, LayoutGroup


def _planes_cell(group: LayoutGroup) -> str:
    return ", ".join(f"{e['count']} {e['role']} {e['dtype']} {e['row_bytes']} B" for e in group.to_json()["planes"])


def render_layout(layout: KVLayout, title: str) -> list[Any]:
    """Rich renderables: the group table, the skip reasons and notes, and the bytes-per-chunk summary."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title)
    for col in ("group", "sched", "spec", "kind", "layers", "tok/block", "ratio", "window", "rows/chunk", "planes",
                "stored"):
        table.add_column(col, justify="left" if col in ("spec", "kind", "planes", "stored") else "right")
    notes: list[str] = []
    for g in layout.groups:
        text = g.skip_reason if g.skipped else g.note
        mark = ""
        if text:
            notes.append(f"[{len(notes) + 1}] group {g.index}: {text}")
            mark = f" [{len(notes)}]"
        table.add_row(str(g.index), str(g.scheduler_group), g.spec, g.kind.value, str(len(g.layers)),
                      str(g.tokens_per_block), str(g.compress_ratio),
                      "-" if g.sliding_window is None else str(g.sliding_window),
                      "-" if g.skipped else str(g.rows_per_chunk), _planes_cell(g),
                      g.stored + mark)
    stored, naive = layout.bytes_per_chunk, layout.naive_bytes_per_chunk
    summary = (f"bytes per {layout.plan.chunk_tokens}-token chunk: {stored:,} stored vs {naive:,} for a naive copier "
               f"(every group's full chunk, state groups included): {naive / stored:.2f}x"
               if stored else "nothing is stored: every group is skipped")
    out: list[Any] = [table, *(Text(n) for n in notes), Text(summary, style="bold")]
    out += [Text(f"caveat: {c}", style="yellow") for c in layout.caveats]
    return out

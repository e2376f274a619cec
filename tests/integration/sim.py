"""A simulated model over a preset's registered tensors: every step writes, for every computed token, rows that are
a pure function of (rank, plane, the token ids up to and including that position), as a real forward guarantees;
and a checker that reads back the rows the next forward would read.

Row kinds follow the plan groups: attention and MLA rows per token (a compressed row once its last token is
computed), sliding-window and compressor-state rows per token, and one recurrent state per block (the state after
the last computed token, kept in that token's block, as vLLM's mamba "align" mode does).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from lmcache_npu.layout.discovery import KVLayout, LayoutGroup, SpecKind
from lmcache_npu.ops import Plane
from lmcache_npu.ops.torch_backend import row_view


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, elementwise on uint64 (wrapping)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _mix_int(x: int) -> int:
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def prefix_hashes(tokens: Sequence[int], known: Optional[np.ndarray] = None) -> np.ndarray:
    """h[p] depends on tokens[0..p] and nothing else; extends `known` (the hashes of a shorter prefix)."""
    start = 0 if known is None else len(known)
    out = np.zeros(len(tokens), dtype=np.uint64)
    if start:
        out[:start] = known
    h = int(out[start - 1]) if start else 0x9E3779B97F4A7C15
    values = []
    for token in tokens[start:]:
        h = _mix_int(h ^ (int(token) + 1))
        values.append(h)
    out[start:] = np.array(values, dtype=np.uint64)
    return out


def row_pattern(seeds: np.ndarray, salt: int, row_bytes: int) -> np.ndarray:
    """(len(seeds), row_bytes) uint8: distinct per seed and salt in every 8-byte word."""
    words = -(-row_bytes // 8)
    column = np.arange(words, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    with np.errstate(over="ignore"):
        values = _mix((seeds.reshape(-1, 1) ^ np.uint64(salt)) * column)
    return values.view(np.uint8).reshape(len(seeds), words * 8)[:, :row_bytes]


def _salt(rank: int, plane: Plane) -> int:
    return int.from_bytes(hashlib.blake2b(f"{rank}:{plane.name}".encode(), digest_size=8).digest(), "little")


@dataclass
class _PlaneRows:
    plane: Plane
    salt: int
    view: torch.Tensor = field(repr=False)


class SimModel:
    """One rank's model. `tables` are the runner's block tables (one list per scheduler group)."""

    def __init__(self, rank: int, layout: KVLayout) -> None:
        self.rank = rank
        self.layout = layout
        self.planes: dict[int, list[_PlaneRows]] = {g.index: [] for g in layout.groups}
        for plane in layout.plan.planes:
            self.planes[plane.group].append(_PlaneRows(plane, _salt(rank, plane), row_view(plane)))

    def _write(self, rows: _PlaneRows, blocks: np.ndarray, within: np.ndarray, seeds: np.ndarray) -> None:
        target = rows.view
        data = torch.from_numpy(row_pattern(seeds, rows.salt, rows.plane.row_bytes)).to(target.device)
        index = (torch.from_numpy(blocks).to(target.device), torch.from_numpy(within).to(target.device))
        target[index] = data.reshape((len(seeds),) + tuple(target.shape[2:]))

    def _read(self, rows: _PlaneRows, blocks: np.ndarray, within: np.ndarray) -> np.ndarray:
        device = rows.view.device
        picked = rows.view[torch.from_numpy(blocks).to(device), torch.from_numpy(within).to(device)]
        return picked.reshape(len(blocks), rows.plane.row_bytes).cpu().numpy()

    @staticmethod
    def _locate(g: LayoutGroup, table: Sequence[int], row_index: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(blocks, rows within block, mask of rows in a live block) of group rows `row_index`."""
        tokens = row_index * g.compress_ratio
        logical = tokens // g.tokens_per_block
        ids = np.asarray(table, dtype=np.int64)
        present = logical < ids.size
        blocks = np.where(present, ids[np.minimum(logical, max(ids.size - 1, 0))] if ids.size else 0, 0)
        live = present & (blocks != 0)
        return blocks, (tokens % g.tokens_per_block) // g.compress_ratio, live

    def forward(self, hashes: np.ndarray, tables: Sequence[Sequence[int]], start: int, end: int) -> None:
        """Writes the rows of tokens [start, end) of one request (hashes cover at least [0, end))."""
        for g in self.layout.groups:
            table = tables[g.scheduler_group]
            if g.recurrent:  # the state after the last computed token, in that token's block
                blocks, _, live = self._locate(g, table, np.array([(end - 1) // g.tokens_per_block]))
                if live[0]:
                    for rows in self.planes[g.index]:
                        self._write(rows, blocks, np.zeros(1, dtype=np.int64), hashes[end - 1:end])
                continue
            r = g.compress_ratio
            index = np.arange(start // r, end // r, dtype=np.int64)  # rows whose last token is computed now
            if index.size == 0:
                continue
            blocks, within, live = self._locate(g, table, index)
            seeds = hashes[(index + 1) * r - 1]
            for rows in self.planes[g.index]:
                self._write(rows, blocks[live], within[live], seeds[live])

    def required_rows(self, g: LayoutGroup, n: int) -> np.ndarray:
        """Row indices of group `g` the forward of token `n` reads (what a load or a recompute must provide)."""
        r = g.compress_ratio
        if g.kind == SpecKind.COMPRESSOR_STATE:
            owner = g.sliding_window - g.stored_tokens  # the compression ratio these states feed
            first = max(0, n // owner * owner - g.stored_tokens)
        elif g.windowed:
            first = max(0, n - g.sliding_window + 1)
        else:
            first = 0
        return np.arange(-(-first // r), n // r, dtype=np.int64)

    def check(self, hashes: np.ndarray, tables: Sequence[Sequence[int]], n: int, what: str) -> list[str]:
        """Mismatches between the pages and what the model wrote for every row the next forward reads."""
        problems = []
        for g in self.layout.groups:
            if g.skipped or n == 0:
                continue
            table = tables[g.scheduler_group]
            if g.recurrent:
                blocks, _, live = self._locate(g, table, np.array([(n - 1) // g.tokens_per_block]))
                index, seeds, within = np.array([0]), hashes[n - 1:n], np.zeros(1, dtype=np.int64)
            else:
                index = self.required_rows(g, n)
                blocks, within, live = self._locate(g, table, index)
                seeds = hashes[(index + 1) * g.compress_ratio - 1]
            if not live.all():
                problems.append(f"{what}: group {g.index} ({g.kind.value}) rows "
                                f"{index[~live][:4].tolist()} needed at token {n} are in no live block")
                continue
            for rows in self.planes[g.index]:
                got = self._read(rows, blocks, within)
                want = row_pattern(seeds, rows.salt, rows.plane.row_bytes)
                bad = np.flatnonzero((got != want).any(axis=1))
                if bad.size:
                    problems.append(f"{what}: rank {self.rank} plane {rows.plane.name} rows {index[bad][:4].tolist()} "
                                    f"(of {index.size}) differ from the model's bytes at token {n}")
        return problems

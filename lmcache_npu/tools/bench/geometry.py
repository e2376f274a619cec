"""Per-layer KV geometry for benchmarks: the `--geometry` JSON schema, and materialising it as a plan."""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ...ops import GroupSpec, PageLayout, Plane, TransferPlan, rows_per_chunk

DTYPES = {
    "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "int8": torch.int8,
    "uint8": torch.uint8, "fp8": torch.uint8,
}


@dataclass(frozen=True)
class PlaneGeometry:
    """`layers` identical planes (one per layer) of one group."""

    row_bytes: int
    rows_per_block: int
    block_stride_bytes: int
    layers: int = 1
    num_blocks: Optional[int] = None  # None: as many as the benchmark's chunks need
    name: str = ""
    dtype: str = "uint8"
    layout: str = "nd"  # nd | fractal_nz
    nz_unit_bytes: int = 0
    page: str = ""  # planes of one group with the same page name share each layer's allocation
    page_offset_bytes: int = 0


@dataclass(frozen=True)
class GroupGeometry:
    tokens_per_block: int
    planes: tuple[PlaneGeometry, ...]
    compress_ratio: int = 1
    sliding_window: Optional[int] = None
    skip: bool = False
    skip_reason: str = ""
    name: str = ""


@dataclass(frozen=True)
class Geometry:
    groups: tuple[GroupGeometry, ...]
    chunk_tokens: int  # required: a geometry's chunk bytes depend on it, so no file may leave it to a default
    name: str = "custom"
    notes: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Integers of the schema: the smallest value each takes (None also allowed where the field is Optional). The upper
# bound keeps every byte count an int64 for torch and the native backends.
_MIN_INT = {"row_bytes": 1, "rows_per_block": 1, "block_stride_bytes": 1, "layers": 1, "num_blocks": 1,
            "nz_unit_bytes": 0, "page_offset_bytes": 0, "tokens_per_block": 1, "compress_ratio": 1,
            "sliding_window": 1, "chunk_tokens": 1}
_MAX_INT = 2**62
_OPTIONAL = {"num_blocks", "sliding_window"}
_STRINGS = {"name", "dtype", "layout", "page", "skip_reason", "notes"}


def _check_keys(cls: type, data: Any, where: str) -> None:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
    valid = {f.name for f in fields(cls)}
    unknown = set(data) - valid
    if unknown:
        shown = sorted(map(str, unknown))  # JSON keys are strings; str() keeps a caller's odd key sortable
        raise ValueError(f"{where}: unknown keys {shown}; valid keys are {sorted(valid)}")
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    missing = sorted(required - set(data))
    if missing:
        raise ValueError(f"{where}: missing keys {missing}")
    for key, value in data.items():
        if key in _MIN_INT:
            if value is None and key in _OPTIONAL:
                continue
            if type(value) is not int or not _MIN_INT[key] <= value <= _MAX_INT:  # type(): true is not 1 here
                rule = f"an integer from {_MIN_INT[key]} to 2**62" + (" or null" if key in _OPTIONAL else "")
                raise ValueError(f"{where}: {key} must be {rule}, got {_shown(value)}")
        elif key in _STRINGS and not isinstance(value, str):
            raise ValueError(f"{where}: {key} must be a string, got {_shown(value)}")
        elif key == "skip" and not isinstance(value, bool):
            raise ValueError(f"{where}: skip must be true or false, got {_shown(value)}")
        elif key in ("groups", "planes") and (not isinstance(value, list) or not value):
            raise ValueError(f"{where}: {key} must be a non-empty list of objects, got {_shown(value)}")


def _shown(value: Any) -> str:
    """A value for an error message, cut short: a JSON file can nest deeper than repr() recurses."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int past Python's digit limit, nesting past the stack
        return f"a {type(value).__name__}"
    return text if len(text) <= 120 else f"{text[:120]}..."


def geometry_from_dict(data: dict[str, Any], name: str = "custom") -> Geometry:
    """A `--geometry` object checked key by key: any malformed input is a ValueError naming where and the rule."""
    _check_keys(Geometry, data, "geometry")
    groups = []
    for gi, g in enumerate(data["groups"]):
        _check_keys(GroupGeometry, g, f"groups[{gi}]")
        planes = []
        for pi, p in enumerate(g["planes"]):
            _check_keys(PlaneGeometry, p, f"groups[{gi}].planes[{pi}]")
            plane = PlaneGeometry(**p)
            if plane.dtype not in DTYPES:
                raise ValueError(f"groups[{gi}].planes[{pi}]: dtype {plane.dtype!r} is not one of {sorted(DTYPES)}")
            if plane.layout not in ("nd", "fractal_nz"):
                raise ValueError(f"groups[{gi}].planes[{pi}]: layout must be 'nd' or 'fractal_nz'")
            planes.append(plane)
        groups.append(GroupGeometry(**{**g, "planes": tuple(planes)}))
    return Geometry(tuple(groups), data["chunk_tokens"], data.get("name", name), data.get("notes", ""))


def load_geometry(path: Path) -> Geometry:
    """A `--geometry` JSON file; an unreadable or malformed one is a ValueError naming the file."""
    try:
        data = json.loads(Path(path).read_bytes())
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the geometry file ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    except (ValueError, RecursionError) as exc:  # not UTF-8, an int past the digit limit, nesting past the stack
        raise ValueError(f"{path}: not a geometry JSON file ({type(exc).__name__}: {str(exc)[:120]})") from None
    try:
        return geometry_from_dict(data, name=Path(path).stem)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


@dataclass
class Materialized:
    """A geometry allocated on a device: the plan plus the slot mapping the benchmark moves."""

    plan: TransferPlan
    slots: list[Optional[torch.Tensor]]
    allocations: list[torch.Tensor] = field(default_factory=list)
    block_tables: list[np.ndarray] = field(default_factory=list)  # presets: the request's table per scheduler group


def blocks_needed(chunks: int, rows: int, rows_per_block: int) -> int:
    return math.ceil(chunks * rows / rows_per_block) + 1


def materialize(geometry: Geometry, chunks: int, device: torch.device, seed: int = 0,
                chunk_tokens: Optional[int] = None) -> Materialized:
    """Allocates every plane (random bytes) and a scattered block table per group."""
    tokens = chunk_tokens or geometry.chunk_tokens
    gen = torch.Generator().manual_seed(seed)
    groups, planes, allocations, slots = [], [], [], []
    for gi, g in enumerate(geometry.groups):
        groups.append(GroupSpec(g.tokens_per_block, g.compress_ratio, g.sliding_window, g.skip, g.skip_reason, g.name))
        rows = rows_per_chunk(tokens, g.compress_ratio, g.sliding_window)
        rpb = g.planes[0].rows_per_block
        need = blocks_needed(chunks, rows, rpb)
        num_blocks = g.planes[0].num_blocks or need
        if num_blocks < need and not g.skip:
            raise ValueError(f"groups[{gi}]: {num_blocks} blocks hold fewer than the {need} that {chunks} chunks need")
        for layer in range(max(p.layers for p in g.planes)):
            pages: dict[str, torch.Tensor] = {}
            for pi, p in enumerate(g.planes):
                if layer >= p.layers:
                    continue
                if (p.num_blocks or num_blocks) != num_blocks:
                    raise ValueError(f"groups[{gi}].planes[{pi}]: num_blocks differs from the group's first plane")
                key = p.page or f"#{pi}"
                span = (num_blocks - 1) * p.block_stride_bytes + p.rows_per_block * p.row_bytes + p.page_offset_bytes
                if key not in pages or pages[key].numel() < span:
                    raw = torch.randint(0, 256, (max(span, num_blocks * p.block_stride_bytes),), dtype=torch.uint8,
                                        generator=gen).to(device)
                    pages[key] = raw
                    allocations.append(raw)
                view = torch.as_strided(pages[key], (num_blocks, p.rows_per_block * p.row_bytes),
                                        (p.block_stride_bytes, 1), p.page_offset_bytes)
                layout = PageLayout.FRACTAL_NZ if p.layout == "fractal_nz" else PageLayout.ND
                label = f"g{gi}.{p.name or f'p{pi}'}.l{layer}"
                planes.append(Plane(view, gi, p.rows_per_block, p.row_bytes, layout, p.nz_unit_bytes,
                                    DTYPES[p.dtype], label))
        if g.skip:
            slots.append(None)
            continue
        table = torch.randperm(num_blocks, generator=gen)
        logical = torch.arange(chunks * rows)
        slots.append((table[logical // rpb] * rpb + logical % rpb).reshape(chunks, rows))
    return Materialized(TransferPlan(groups, planes, tokens), slots, allocations)


def geometry_of_plan(plan: TransferPlan, name: str, notes: str = "") -> Geometry:
    """A plan's shapes as a `--geometry` file (one plane entry per plane, each in its own allocation): a machine
    without vLLM, where presets cannot be built, benchmarks the same chunks byte for byte."""
    dtype_names = {dtype: key for key, dtype in reversed(list(DTYPES.items()))}
    groups = []
    for gi, g in enumerate(plan.groups):
        planes = tuple(
            PlaneGeometry(row_bytes=p.row_bytes, rows_per_block=p.rows_per_block,
                          block_stride_bytes=p.block_stride_bytes, name=p.name or f"p{i}",
                          dtype=dtype_names.get(p.dtype, "uint8"),
                          layout="fractal_nz" if p.layout == PageLayout.FRACTAL_NZ else "nd",
                          nz_unit_bytes=p.nz_unit_bytes)
            for i, p in enumerate(plan.planes) if p.group == gi)
        if planes:
            groups.append(GroupGeometry(g.tokens_per_block, planes, g.compress_ratio, g.sliding_window, g.skip,
                                        g.skip_reason, g.name))
    return Geometry(tuple(groups), plan.chunk_tokens, name, notes)

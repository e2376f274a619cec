"""Slices of one synchronous load, in the order the forward consumes them (issue 41 item 2).

A load moves (chunk x plane) items; every plane belongs to layers (`PlaneInfo.layers`). The layers the runtime
announces (those that call `wait_for_layer_load`, in the order they call it) are cut into S consecutive windows,
as equal as whole layers allow (`window_ends` says why). Slice k holds every plane
whose first consuming announced layer lies in window k, for every chunk of the load and across all plan groups, so
a DeepSeek-V4 layer's compressed rows, indexer keys and scales, SWA tail and compressor-state rows travel together;
a sliding-window plane holds only its stored tail, as every load does. Planes no announced layer consumes (mamba or
Gated DeltaNet states, models whose attention never calls the hook) go to slice 0, which lands before the forward
needs anything. A plane's layers are matched to announced layers by layer number (`model.layers.<n>.`), because a
layer calls the hook once under its attention's name while its other caches are registered under other names;
names without a number match only themselves.

Each slice is a plane subset of the layout's plan (`TransferPlan.plane_subset`): one batch, one kernel launch, the
object layout untouched. The planner is pure: it reads the layout and the announced names and launches nothing.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping, Optional, Sequence, Union

import numpy as np

from ..layout.discovery import KVLayout
from ..ops import TransferPlan

logger = logging.getLogger(__name__)

LayerKey = Union[int, str]
_LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|:|$)")


def layer_key(name: str) -> LayerKey:
    """What ties a registered cache to the layer that consumes it: its layer number, or the whole name."""
    found = _LAYER_NUMBER.search(name)
    return int(found.group(1)) if found else name


@dataclass(frozen=True)
class LoadSlice:
    """One launch of a sliced load: the planes (positions in the plan's `moved_planes`) of every chunk it moves."""

    index: int
    layers: tuple[str, ...]  # the announced layers of its window, in forward order
    planes: tuple[int, ...]
    plan: TransferPlan = field(compare=False, repr=False)  # the plane subset one batch is built on

    @property
    def empty(self) -> bool:
        """No plane: nothing is launched, its event marks the slice before it."""
        return not self.planes


@dataclass(frozen=True)
class SlicePlan:
    """A load cut into `slices` (forward order). `layer_slice` maps each announced layer to its window's slice."""

    slices: tuple[LoadSlice, ...]
    layer_slice: Mapping[str, int]
    announced: tuple[str, ...]
    plan_fingerprint: bytes  # the layout's plan the slices were cut from (a mover refuses another layout's)

    def __len__(self) -> int:
        return len(self.slices)

    @cached_property
    def plane_slices(self) -> np.ndarray:
        """Per moved plane of the plan, the slice that moves it (what a backend launching every slice at once
        orders its items by)."""
        owner = np.zeros(sum(len(piece.planes) for piece in self.slices), dtype=np.int64)
        for piece in self.slices:
            owner[list(piece.planes)] = piece.index
        return owner

    def slice_of_layer(self, layer: str) -> Optional[int]:
        """The slice that must have landed before `layer` runs; None for a layer that was not announced."""
        return self.layer_slice.get(layer)


def window_ends(layers: int, count: int) -> list[int]:
    """Exclusive ends of `count` consecutive windows over `layers` positions, as equal as whole layers allow (the
    first never larger than a later one). Equal windows keep the forward one window behind the load when the load
    dominates (it ends the window's compute after the load) and the load ahead when the compute dominates (slice 0,
    then the forward): growing windows left the last half of the forward after the load (H200 study)."""
    if count < 1:
        raise ValueError(f"a sliced load needs at least 1 slice, got {count}")
    if count > max(layers, 1):
        raise ValueError(f"{count} slices over {layers} announced layers: a slice needs at least one layer's window")
    return [layers * (k + 1) // count for k in range(count)]  # nothing announced: one slice, [0], holds every plane


def _announced_positions(announced: Sequence[str]) -> dict[LayerKey, int]:
    """Forward position of each announced layer's key (its first call)."""
    positions: dict[LayerKey, int] = {}
    for position, name in enumerate(announced):
        positions.setdefault(layer_key(name), position)
    return positions


def plane_consumers(layout: KVLayout, announced: Sequence[str]) -> list[Optional[int]]:
    """Per moved plane of `layout.plan`: the forward position of the first announced layer that consumes it, or None
    when no announced layer does (it must land before the forward)."""
    positions = _announced_positions(announced)
    layers_of = {info.name: info.layers for group in layout.groups for info in group.planes}
    consumers: list[Optional[int]] = []
    for plane in layout.plan.moved_planes:
        if plane.name not in layers_of:
            raise ValueError(f"plane {plane.label}: the layout names no layer for it (slices need each plane's "
                             "layers; build the plan with discover_layout)")
        found = [positions[k] for k in map(layer_key, layers_of[plane.name]) if k in positions]
        consumers.append(min(found) if found else None)
    return consumers


def plan_slices(layout: KVLayout, announced: Sequence[str], count: int) -> SlicePlan:
    """`count` slices of a load of `layout`'s plan for a forward that announces `announced` (layer names in the
    order they call `wait_for_layer_load`; duplicates keep their first position)."""
    order = tuple(dict.fromkeys(announced))
    ends = window_ends(len(order), count)
    window_of = [0] * len(order)
    begin = 0
    for k, end in enumerate(ends):
        window_of[begin:end] = [k] * (end - begin)
        begin = end
    # a key's first announced position decides: a second name of one layer rides with the first
    positions = _announced_positions(order)
    layer_slice = {name: window_of[positions[layer_key(name)]] for name in order}
    members: list[list[int]] = [[] for _ in ends]
    unannounced = 0
    for index, consumer in enumerate(plane_consumers(layout, order)):
        if consumer is None:
            unannounced += 1
        members[0 if consumer is None else window_of[consumer]].append(index)
    if unannounced:
        logger.debug("%d plane(s) no announced layer consumes go to slice 0", unannounced)
    slices = []
    begin = 0
    for k, end in enumerate(ends):
        slices.append(LoadSlice(k, order[begin:end], tuple(members[k]), layout.plan.plane_subset(members[k])))
        begin = end
    sliced = SlicePlan(tuple(slices), layer_slice, order, layout.plan.fingerprint)
    check_slice_order(sliced, layout)
    return sliced


def check_slice_order(sliced: SlicePlan, layout: KVLayout) -> None:
    """Raises ValueError, naming the plane and the layer, unless every moved plane of `layout` is in exactly one
    slice, at or before the slice of the first announced layer that consumes it (slice 0 when none does), and the
    announced layers' slices never go back in forward order."""
    if sliced.plan_fingerprint != layout.plan.fingerprint:
        raise ValueError("slice plan: cut from another layout's plan (its fingerprint differs)")
    planes = layout.plan.moved_planes
    owner: dict[int, int] = {}
    for piece in sliced.slices:
        for index in piece.planes:
            if not 0 <= index < len(planes):
                raise ValueError(f"slice {piece.index}: plane position {index} is outside the plan's {len(planes)} "
                                 "moved planes")
            if index in owner:
                raise ValueError(f"plane {planes[index].label} is in slices {owner[index]} and {piece.index}: each "
                                 "plane is loaded once")
            owner[index] = piece.index
        subset = piece.plan.moved_planes
        if len(subset) != len(piece.planes) or any(a is not planes[i] for a, i in zip(subset, sorted(piece.planes))):
            raise ValueError(f"slice {piece.index}: its batch plan moves other planes than the slice names (build it "
                             "with TransferPlan.plane_subset of the slice's planes)")
    missing = [planes[i].label for i in range(len(planes)) if i not in owner]
    if missing:
        raise ValueError(f"planes {missing[:3]} are in no slice: a sliced load must move every plane")
    positions = _announced_positions(sliced.announced)
    previous = 0
    for position in sorted(set(positions.values())):  # each layer number's first name decides its slice
        name = sliced.announced[position]
        if name not in sliced.layer_slice:
            raise ValueError(f"layer {name} is announced but has no slice")
        if sliced.layer_slice[name] < previous:
            raise ValueError(f"layer {name} is in slice {sliced.layer_slice[name]}, before an earlier layer's slice "
                             f"{previous}: slices follow the forward")
        previous = sliced.layer_slice[name]
    for index, consumer in enumerate(plane_consumers(layout, sliced.announced)):
        if consumer is None:
            if owner[index] != 0:
                raise ValueError(f"plane {planes[index].label} is consumed by no announced layer but sits in slice "
                                 f"{owner[index]}: it must land before the forward (slice 0)")
            continue
        layer = sliced.announced[consumer]
        if owner[index] > sliced.layer_slice[layer]:
            raise ValueError(f"plane {planes[index].label} is in slice {owner[index]}, after layer {layer}'s slice "
                             f"{sliced.layer_slice[layer]}, and that layer consumes it: every item a layer consumes "
                             "must be in a slice at or before that layer's window")

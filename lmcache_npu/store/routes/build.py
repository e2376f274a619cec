"""Wires one rank's executor from its parts: the shared context, the envelope guard and one handler per route set
(device, disk, remote, drop). The config-level factory (`transfer.pipeline.build_executor`) builds the tiers and
calls this; tests and benches call it with fakes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ..arena import HostArena
from ..commands import Tier
from ..envelope import Sealer
from ..executor import StoreExecutor
from .context import RouteContext
from .device import DeviceMover, DeviceRoute
from .disk import DiskRoute
from .drop import DropRoute
from .guard import EnvelopeGuard
from .remote import RemoteRoute

if TYPE_CHECKING:  # built by the caller
    from ..disk.tier import DiskTier
    from ..mooncake import MooncakeTier


def make_executor(rank: int, arena: HostArena, mover: Optional[DeviceMover] = None, disk: Optional[DiskTier] = None,
                  remote: Optional[MooncakeTier] = None, io_threads: int = 4, sealer: Optional[Sealer] = None,
                  yields: bool = False) -> StoreExecutor:
    """One rank's executor over `arena`. `disk` is a `DiskTier`, `remote` a `MooncakeTier`; either may be None (its
    commands then fail with the reason). `sealer` seals and verifies envelopes (digest only when None: no store
    secret). `yields`: persists, puts and remote drops run on threads that yield to compute. Closing the executor
    closes the tiers."""
    context = RouteContext(rank, arena, io_threads=io_threads, yields=yields)
    guard = EnvelopeGuard(context, sealer)
    disk_route = DiskRoute(context, guard, disk)
    remote_route = RemoteRoute(context, guard, remote)
    drop_route = DropRoute(context, {Tier.DISK: disk_route, Tier.REMOTE: remote_route})
    return StoreExecutor(context, guard, [DeviceRoute(context, mover), disk_route, remote_route, drop_route])

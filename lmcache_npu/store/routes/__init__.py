"""The worker's route handlers: one object per set of routes (source, destination) a command's bytes take, the way
vLLM's `OffloadingHandler` serves a medium pair. Each takes batches of commands and answers each command once through
the shared `RouteContext`; `StoreExecutor` only dispatches to them. `build.make_executor` wires them up.

- `device.DeviceRoute`: device <-> arena, through a `DeviceMover` (the transfer lanes);
- `disk.DiskRoute`: arena <-> disk (spills, persists, promotions);
- `remote.RemoteRoute`: arena <-> Mooncake (puts, gets);
- `drop.DropRoute`: deletes a tier's copy;
- `guard.EnvelopeGuard`: seals, verifies and remembers which key each slot's trailer seals.

Nothing here imports a tier's module: the tiers are handed in (docs/architecture.md, "The worker").
"""

"""The store (DESIGN §7): chunk keys, host arena, scheduler-owned index, worker executor, disk and Mooncake tiers.

The scheduler builds one `ChunkIndex` (`factory.build_index`); every worker builds a `StoreExecutor` over its own
`HostArena` and tiers (`transfer.pipeline.build_executor`). The index emits `commands`; executors answer `Completion`s.
Scheduler side: `index`, `keys`, `commands`, `policies`, `tier`, `config`; worker side: `arena`, `segments`,
`executor`, `routes` (its handlers), `envelope`, `disk`, `mooncake`. Nothing of the scheduler side imports the worker side
(tests/house/test_layers.py), so this package imports no module itself: import what you use from its module.
"""

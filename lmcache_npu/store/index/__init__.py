"""The scheduler side of the store (DESIGN §7): `contract.ChunkManager`, the verbs a scheduler half codes against,
and `chunk_index.ChunkIndex`, the in-process manager, with its collaborators (`slots`, `disk_catalog`, `ledger`,
`reuse_gate`, `remote_presence`), one noun per module. Nothing here imports the workers' side of the store."""

"""One-off measurements behind the numbers in docs/ (performance, storage, architecture): each module is a command,
`python -m lmcache_npu.tools.bench.studies.<name> --help`, run from the repository root. Two of them read the
repository's tests/ (arena_cuda: the transfer oracle's geometries; connector_step_cost: the simulated engine), so
they need a checkout, not only the installed package."""

"""One cache per node: a service that owns the node's host cache, disk tier and Mooncake client (`service.py`), and
the engines' side of it (`client.py`): the scheduler's chunk manager over a Unix socket, and the workers' mapping of
the shared arena their device moves read and write. docs/deployment.md, "Node cache", says how to run it."""

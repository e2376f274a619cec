"""What is about the machine, under both `ops` and `store`: device facts, host memory and its registration.

Nothing here imports the rest of the package; `ops`, `store` and the tools import from here.
"""

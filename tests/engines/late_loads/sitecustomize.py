"""On the PYTHONPATH of test_pd_node.py's control decode server only: every process of that server (the API server,
the engine core) loads the plugin's rows one token late, the negative control of the P/D token comparison (the same
patch node_cache_scenario's LATE_LOADS applies in process)."""

from tests.engines.node_cache_scenario import _load_rows_one_token_late

_load_rows_one_token_late(True)

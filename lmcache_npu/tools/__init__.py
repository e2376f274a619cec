"""The tools around the runtime: the CLI, doctor, status, the self-test, the benches, bench-serve, replay, the layout
presets and a local Mooncake master; nothing of the runtime imports them (tests/house/test_layers.py)."""

"""`lmcache-npu bench-serve`: `vllm serve` with and without the plugin (vLLM's prefix cache on in both), driven by
vLLM's own `vllm bench serve` load generator over prefix_repetition, a multi-turn chat trace and random prompts."""

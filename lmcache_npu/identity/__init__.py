"""Content identity of model weights and adapters: what a namespace says the KV was computed with."""

"""The main job: a real vLLM engine replays multi-turn conversations with and without the plugin."""

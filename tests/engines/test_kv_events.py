"""KV events on a real CPU engine: vLLM's ZMQ publisher carries the plugin's chunks (stored in the arena, written
to disk, evicted from the arena) with the request's block hashes and the tier as medium, and a router replaying the
stream holds exactly what the plugin's index holds."""

from __future__ import annotations

import socket
import time
from typing import Any

import msgspec
import pytest
import zmq
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch


from ..kv_events_view import check_against_index, ours
from .compare import prompt

RECIPE = "llama"
TOPIC = "lmcache-npu-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    """A router's end of vLLM's stream: it connects to the engine's publisher (which binds a wildcard endpoint) and
    decodes vLLM's msgpack batches."""

    def __init__(self, port: int) -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self._sub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.5)  # the subscription must reach the publisher before the first request (ZMQ's slow joiner)
        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list[Any] = []
        self.seqs: list[int] = []

    def drain(self, quiet_s: float = 1.0) -> list[Any]:
        """Everything published until the stream is quiet for `quiet_s` (the publisher sends from a thread)."""
        while self._sub.poll(int(quiet_s * 1000)):
            topic, seq, payload = self._sub.recv_multipart()
            self.seqs.append(int.from_bytes(seq, "big"))
            self.events.extend(self._decode.decode(payload).events)
        return self.events

    def close(self) -> None:
        self._sub.close(linger=0)
        self._ctx.term()


def test_vllms_event_stream_tells_a_router_what_the_plugin_holds(engines, model_dirs, tmp_path) -> None:
    port = free_port()
    events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}",
                                   topic=TOPIC)
    engine = engines(RECIPE, model_dirs(RECIPE), engine_args={"kv_events_config": events_config},
                     extra_config={"cpu_bytes": "2MiB", "disk_path": str(tmp_path / "kv"), "disk_bytes": "256MiB"})
    subscriber = Subscriber(port)
    try:
        half = engine.scheduler_connector.scheduler_half
        assert half.events is not None, "KV events are on, yet the connector built no event source"
        chunk = half.chunk_tokens
        slots = half.index.num_slots
        prompts = [prompt(3 * chunk + 20, 500 + i) for i in range(slots + 2)]  # more chunks than the arena holds
        for text in prompts:
            engine.generate([text], 4)
        engine.generate([[1, 2, 3]], 1)  # one more step reports the last completions
        time.sleep(0.5)
        stream = ours(subscriber.drain())
    finally:
        subscriber.close()
    assert subscriber.seqs == sorted(subscriber.seqs)
    stored_cpu = [e for e in stream if isinstance(e, BlockStored) and e.medium == "CPU"]
    removed_cpu = [e for e in stream if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    stored_disk = [e for e in stream if isinstance(e, BlockStored) and e.medium == "STORAGE"]
    assert stored_cpu and removed_cpu and stored_disk, (len(stored_cpu), len(removed_cpu), len(stored_disk))
    first = stored_cpu[0]
    assert first.token_ids == prompts[0][:chunk] and first.parent_block_hash is None
    assert len(first.block_hashes) * first.block_size == chunk
    for gone in removed_cpu:  # every removal follows its chunk's store
        chunk_hashes = tuple(gone.block_hashes)
        stored_at = next(i for i, e in enumerate(stream) if isinstance(e, BlockStored) and e.medium == "CPU"
                         and tuple(e.block_hashes) == chunk_hashes)
        assert stored_at < stream.index(gone)
    check_against_index(stream, half)
    # negative control: the same stream without one stored chunk no longer matches the index
    missing = [e for e in stream if e is not stored_cpu[-1]]
    with pytest.raises((AssertionError, ValueError)):
        check_against_index(missing, half)

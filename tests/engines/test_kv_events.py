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

from lmcache_npu.integration.vllm.events import MEDIUMS, RouterView
from lmcache_npu.store.index import SlotState

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


def ours(events: list[Any]) -> list[Any]:
    mediums = {m for m, _ in MEDIUMS.values()}
    return [e for e in events if getattr(e, "medium", None) in mediums]


def index_view(half: Any) -> dict[str, set[tuple[Any, ...]]]:
    """What the plugin's index holds per medium, named by the block hashes its events carry."""
    events, index = half.events, half.index
    held: dict[str, set[tuple[Any, ...]]] = {"CPU": set(), "STORAGE": set()}
    for key in list(index._entries):
        payload = events._payloads.get(key)
        if payload is None:
            continue
        chunk = tuple(payload.block_hashes)
        _, state, disk = index.location(key)
        if state in (SlotState.READY, SlotState.READING):
            held["CPU"].add(chunk)
        if disk.value == "present":
            held["STORAGE"].add(chunk)
    return held


def check_stream(stream: list[Any], half: Any) -> None:
    view = RouterView()
    view.apply(stream)
    for medium, chunks in index_view(half).items():
        got = view.holds(medium)
        assert got == chunks, (f"{medium}: the stream announces {len(got)} chunks, the index holds {len(chunks)} "
                               f"({len(got - chunks)} extra, {len(chunks - got)} missing)")


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
    check_stream(stream, half)
    # negative control: the same stream without one stored chunk no longer matches the index
    missing = [e for e in stream if e is not stored_cpu[-1]]
    with pytest.raises((AssertionError, ValueError)):
        check_stream(missing, half)

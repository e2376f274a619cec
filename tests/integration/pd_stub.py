"""A stand-in for a P/D connector (NixlConnector's shape) beside the plugin in vLLM's MultiConnector.

- Its workers send a handshake payload of their own, and its scheduler half refuses any other kind, as
  `NixlConnectorScheduler` does: a plugin that put its plan in the shared handshake breaks it.
- A request whose `kv_transfer_params` say `do_remote_prefill` is its to serve: it claims the whole prompt but the
  last token, asynchronously, and its worker "receives" those rows from the prefill engine by having the harness
  write the simulated model's rows into the request's blocks (`writer`), then reports the request as received.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

# (rank, request id, block ids per group, first token, end token): writes the rows the prefill engine computed
RowWriter = Callable[[int, str, list[list[int]], int, int], None]


@dataclass(frozen=True)
class StubHandshake(KVConnectorHandshakeMetadata):
    rank: int


@dataclass
class StubMetadata(KVConnectorMetadata):
    # request id -> (its block ids per group, first token to receive, end token)
    receives: dict[str, tuple[list[list[int]], int, int]] = field(default_factory=dict)


class PDStubConnector(KVConnectorBase_V1, SupportsHMA):
    writer: ClassVar[Optional[RowWriter]] = None  # set by the harness that owns the simulated model

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.rank = vllm_config.parallel_config.rank
        self.handshakes: Optional[dict[int, Any]] = None
        self.served: list[str] = []  # requests whose prompt it received (scheduler side)
        self._to_receive: dict[str, tuple[list[list[int]], int, int]] = {}
        self._received: set[str] = set()

    # ---- worker side ----------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        return None

    def get_handshake_metadata(self) -> StubHandshake:
        return StubHandshake(self.rank)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StubMetadata), f"the stub got {type(meta).__name__}, not its own metadata"
        for request_id, (tables, first, end) in meta.receives.items():
            assert PDStubConnector.writer is not None, "no harness writes the prefill engine's rows"
            PDStubConnector.writer(self.rank, request_id, tables, first, end)
            self._received.add(request_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        received, self._received = self._received, set()
        return None, received or None

    # ---- scheduler side -------------------------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        foreign = sorted({type(m).__name__ for m in metadata.values() if not isinstance(m, StubHandshake)})
        if foreign:
            raise ValueError(f"PDStubConnector expects StubHandshake for handshake metadata, got {foreign}")
        self.handshakes = metadata

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        if not (request.kv_transfer_params or {}).get("do_remote_prefill"):
            return 0, False
        return request.num_tokens - 1 - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        end = request.num_tokens - 1
        self._to_receive[request.request_id] = ([list(ids) for ids in blocks.get_block_ids()],
                                                end - num_external_tokens, end)
        request.kv_transfer_params["do_remote_prefill"] = False  # one hand-off per request, as NIXL does
        self.served.append(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> StubMetadata:
        meta, self._to_receive = StubMetadata(self._to_receive), {}
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        return False, None

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, Optional[dict[str, Any]]]:
        return False, None

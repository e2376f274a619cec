"""The KV rows each finished request's full-attention layers hold, copied when vLLM hands its blocks to the
connector (the forward that wrote them is done and nothing has reused them): a loaded prefix must hold, byte for
byte, the rows computing it wrote. No kernel rounding excuses a difference here, unlike the logprobs of a bf16
model (`lmcache_npu.tools.replay.compare`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

KEPT_WHOLE = ("FullAttentionSpec", "MLAAttentionSpec")  # groups whose table holds every computed token's block
POISON = 1e30  # what a loaded block holds until the load writes it: no model computes rows of this value


@dataclass(frozen=True)
class FinishedRows:
    """One finished request: its prompt, and per full-attention layer its blocks in table order."""

    prompt: tuple[int, ...]
    block_size: dict[str, int]  # layer -> tokens per block of its group
    blocks: dict[str, torch.Tensor]  # layer -> [blocks of the request, ...] copied


class RowRecorder:
    """Copies every finished request's full-attention blocks (the engine runs the connector in this process)."""

    def __init__(self, engine: Any) -> None:
        worker = engine.worker_connector.worker_half
        half = engine.scheduler_connector.scheduler_half
        config = worker.kv_cache_config
        self.finished: list[FinishedRows] = []
        self._groups = [(g, group.kv_cache_spec.block_size, list(group.layer_names))
                        for g, group in enumerate(config.kv_cache_groups)
                        if type(group.kv_cache_spec).__name__ in KEPT_WHOLE]
        assert self._groups, "the model has no full-attention group whose rows could be compared"
        self._caches = worker.kv_caches
        for _, _, layers in self._groups:
            for layer in layers:
                cache = self._caches[layer]
                assert isinstance(cache, torch.Tensor) and cache.shape[0] == config.num_blocks, \
                    f"{layer}: expected a [num_blocks, ...] cache, got {getattr(cache, 'shape', type(cache))}"
        finished, allocated = half.request_finished, half.update_state_after_alloc

        def record(request: Any, block_ids: Sequence[Sequence[int]]) -> Any:
            self._record(request, block_ids)
            return finished(request, block_ids)

        def poison(request: Any, blocks: Any, num_external_tokens: int) -> None:
            allocated(request, blocks, num_external_tokens)
            load = next((p for p in reversed(half._loads) if p.request_id == request.request_id), None)
            if load is not None:  # the tokens this step's load writes, in the request's fresh blocks
                self._poison(half.requests[request.request_id].blocks, load.first_token, load.end_token)

        half.request_finished = record
        half.update_state_after_alloc = poison

    def _poison(self, tables: Sequence[Sequence[int]], first_token: int, end_token: int) -> None:
        """Fills the blocks a load is about to write with POISON: vLLM may hand a reader the blocks a writer just
        freed, whose old rows would equal the writer's even if the load wrote nothing."""
        for g, block_size, layers in self._groups:  # whole blocks only: vLLM's own cached rows stay
            ids = list(tables[g][-(-first_token // block_size):end_token // block_size])
            for layer in layers:
                self._caches[layer][torch.tensor(ids, dtype=torch.long)] = POISON

    def _record(self, request: Any, block_ids: Sequence[Sequence[int]]) -> None:
        sizes, blocks = {}, {}
        for g, block_size, layers in self._groups:
            ids = torch.tensor(list(block_ids[g]), dtype=torch.long)
            for layer in layers:
                sizes[layer] = block_size
                blocks[layer] = self._caches[layer][ids].clone()
        self.finished.append(FinishedRows(tuple(request.prompt_token_ids), sizes, blocks))

    def of(self, prompt: Sequence[int]) -> list[FinishedRows]:
        """Every finished request of `prompt`, in finishing order."""
        return [f for f in self.finished if f.prompt == tuple(prompt)]


def assert_same_prefix_rows(writer: FinishedRows, reader: FinishedRows, tokens: int) -> None:
    """The reader's full-attention rows of tokens [0, tokens) equal the writer's, byte for byte (whole blocks)."""
    assert writer.prompt[:tokens] == reader.prompt[:tokens], "the two requests do not share that prefix"
    for layer, size in writer.block_size.items():
        count = tokens // size
        assert count >= 1, f"{layer}: {tokens} tokens fill no whole {size}-token block: nothing would be compared"
        mine, theirs = writer.blocks[layer][:count], reader.blocks[layer][:count]
        assert mine.shape[0] == theirs.shape[0] == count, f"{layer}: fewer than {count} blocks were recorded"
        same = (mine.view(torch.uint8) == theirs.view(torch.uint8)).reshape(count, -1).all(dim=1)
        if not bool(same.all()):
            block = int((~same).nonzero()[0])
            raise AssertionError(f"{layer}: the loaded rows of block {block} (tokens {block * size}.."
                                 f"{(block + 1) * size - 1}) differ from the rows computing them wrote")

"""What the scheduler asks one step to move for one request: its device moves (each a Store or Load with its block
window, `store.commands.DeviceMove`) and what the worker reports a failed load with. Plain picklable dataclasses; the
connector's metadata carries them to every worker (pickle keeps one copy of the window the moves share)."""

from __future__ import annotations

from dataclasses import dataclass

from ..store.commands import BlockWindow, DeviceMove


@dataclass(frozen=True)
class LoadPlan:
    """One request's loads of this step: chunks `[first_token // chunk, end_token // chunk)` into its pages."""

    request_id: str
    moves: tuple[DeviceMove, ...]  # one load per chunk, in chunk order
    window: BlockWindow
    first_token: int  # vLLM's own prefix cache computed the tokens before this one: their rows are left alone
    end_token: int  # the hit's end (rows from it on are left alone); only the chunk ending here loads end-state rows
    error_block_ids: tuple[int, ...] = ()  # what an invalid-block report names if the load fails
    refused: str = ""  # the index could not issue the loads (the reason): the worker reports a failed load
    # the request computes in this step (vLLM was told load_kv_async=False): the forward waits per slice, the load is
    # never reported as received, and a failure is reported as `error_block_ids`
    sliced: bool = False

    @property
    def cmd_ids(self) -> tuple[int, ...]:
        return tuple(move.cmd_id for move in self.moves)


@dataclass(frozen=True)
class StorePlan:
    """One request's stores of this step, run after the forward that computed their last tokens."""

    request_id: str
    moves: tuple[DeviceMove, ...]
    window: BlockWindow

    @property
    def cmd_ids(self) -> tuple[int, ...]:
        return tuple(move.cmd_id for move in self.moves)

    @property
    def without_end_state(self) -> tuple[int, ...]:
        """Cmd ids stored with their end-state rows left out (zeros)."""
        return tuple(move.cmd_id for move in self.moves if move.without_end_state)

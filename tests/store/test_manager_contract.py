"""The chunk manager's contract (`store/index/contract.ChunkManager`), checked through its verbs only, for every
implementation: the in-process `ChunkIndex`, and the node cache's socket client (issue 33) attached to a service
started for the test (`tests/node/harness.py`) with exactly the slots the test asks for. What the contract promises a
scheduler half:

- a stored chunk is found only once every rank completed its store, and a failure on one rank fails it;
- a lookup reserves its hit until `prepare_load` or `release`; `prepare_load` checks every chunk before it issues
  any load;
- `take_commands` hands each command out once, in order, and `queued_commands` shows them without taking;
- every argument and answer is a plain value that survives pickling (a manager may live in another process).

A broken manager (stores visible after the first rank's answer) must fail the first promise: the negative control.
"""

from __future__ import annotations

import pickle
from typing import Callable, Iterable, Iterator

import pytest

from lmcache_npu.store.commands import Completion, Load, Store, Tier
from lmcache_npu.store.index.chunk_index import ChunkIndex
from lmcache_npu.store.index.contract import ChunkManager, ChunkView, LookupResult, SlotState

from tests.node.harness import NodeManagers

from .fakes import make_key

RANKS = 2
Factory = Callable[[int, int], ChunkManager]  # (slots, ranks) -> a fresh manager

# a factory with a close() method started something (a service) that the test's end must stop
IMPLEMENTATIONS: dict[str, Callable[[], Factory]] = {
    "ChunkIndex": lambda: (lambda slots, ranks: ChunkIndex(slots, ranks)),
    "NodeCacheClient": NodeManagers,
}


class FirstAnswerWins(ChunkIndex):
    """Broken on purpose: a command counts as done once any rank answered (the others' answers are dropped)."""

    def on_completions(self, completions: Iterable[Completion]) -> None:
        answered = {done.cmd_id for done in completions}
        super().on_completions([Completion(cmd_id, rank, True) for cmd_id in answered
                                for rank in range(self.num_ranks)])


def answer(manager: ChunkManager, commands: Iterable, ranks: Iterable[int], ok: bool = True) -> None:
    manager.on_completions([Completion(c.cmd_id, rank, ok, "" if ok else "device: test") for c in commands
                            for rank in ranks])


def check_stores_need_every_rank(make: Factory) -> None:
    manager = make(4, RANKS)
    keys = [make_key(i) for i in range(3)]
    stores = manager.prepare_store("r", list(enumerate(keys)))
    assert [type(c) for c in stores] == [Store] * 3 and manager.take_commands() == stores
    answer(manager, stores, [0])
    assert manager.lookup("q", keys).ready_chunks == 0, "a chunk was found before every rank stored it"
    manager.release("q")
    answer(manager, stores, range(1, RANKS))
    assert manager.lookup("q", keys) == LookupResult(3, 3, (Tier.ARENA,) * 3)
    manager.release("q")
    assert manager.in_flight == 0 and not any(manager.is_pending(c.cmd_id) for c in stores)


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def make(request: pytest.FixtureRequest) -> Iterator[Factory]:
    factory = IMPLEMENTATIONS[request.param]()
    yield factory
    close = getattr(factory, "close", None)
    if close is not None:
        close()


def test_a_chunk_is_found_once_every_rank_stored_it(make: Factory) -> None:
    check_stores_need_every_rank(make)


def test_negative_control_a_manager_that_trusts_the_first_rank_fails_the_contract() -> None:
    with pytest.raises(AssertionError, match="before every rank stored it"):
        check_stores_need_every_rank(lambda slots, ranks: FirstAnswerWins(slots, ranks))


def test_a_failure_on_one_rank_fails_the_store(make: Factory) -> None:
    manager = make(4, RANKS)
    key = make_key(1)
    stores = manager.prepare_store("r", [(0, key)])
    manager.take_commands()
    answer(manager, stores, [0])
    answer(manager, stores, [1], ok=False)
    assert manager.lookup("q", [key]).hit_chunks == 0
    assert manager.location(key)[1] is SlotState.FREE


def test_a_hit_is_reserved_until_it_is_loaded_or_released(make: Factory) -> None:
    manager = make(2, 1)
    keys = [make_key(i) for i in range(2)]
    stores = manager.prepare_store("r", list(enumerate(keys)))
    answer(manager, manager.take_commands(), [0])
    assert manager.lookup("q", keys).ready_chunks == 2
    assert all(view.reservations == frozenset({"q"}) for view in manager.chunks())
    assert manager.prepare_store("s", [(0, make_key(9))]) == []  # every slot is reserved: nothing to evict
    loads = manager.prepare_load("q", [(0, keys[0])])
    assert [type(c) for c in loads] == [Load] and loads[0].slot in {s.slot for s in stores}
    manager.release("q")
    assert not any(view.reservations for view in manager.chunks())
    answer(manager, manager.take_commands(), [0])
    assert manager.prepare_store("s", [(0, make_key(9))]) != []  # released: the policy may evict now


def test_prepare_load_checks_every_chunk_before_it_issues_any(make: Factory) -> None:
    manager = make(4, 1)
    ready, absent = make_key(1), make_key(2)
    manager.prepare_store("r", [(0, ready)])
    answer(manager, manager.take_commands(), [0])
    manager.lookup("q", [ready])
    with pytest.raises(ValueError, match=absent.chunk_hash.hex()):
        manager.prepare_load("q", [(0, ready), (1, absent)])
    assert manager.queued_commands() == () and manager.in_flight == 0


def test_commands_are_handed_out_once_in_order(make: Factory) -> None:
    manager = make(4, 1)
    stores = manager.prepare_store("r", [(i, make_key(i)) for i in range(3)])
    assert manager.queued_commands() == tuple(stores)
    assert manager.take_commands() == stores
    assert manager.take_commands() == [] and manager.queued_commands() == ()
    assert [c.cmd_id for c in stores] == sorted({c.cmd_id for c in stores})


def test_every_argument_and_answer_is_a_plain_value(make: Factory) -> None:
    manager = make(4, 1)
    keys = [make_key(i) for i in range(2)]
    values: list[object] = [keys, list(enumerate(keys))]
    values.append(manager.prepare_store("r", list(enumerate(keys))))
    values.append(manager.take_commands())
    answer(manager, values[-1], [0])  # type: ignore[arg-type]
    values += [manager.lookup("q", keys), manager.presence(keys), manager.occupancy(), manager.chunks(),
               manager.location(keys[0]), manager.prepare_load("q", [(0, keys[0])])]
    for value in values:
        assert pickle.loads(pickle.dumps(value)) == value
    assert all(isinstance(view, ChunkView) for view in manager.chunks())


def test_the_step_epoch_and_its_mapping_are_asked_of_every_manager_alike(make: Factory) -> None:
    """The scheduler never asks which manager it has: None means the workers' own arenas (nothing to map); a shared
    manager names the epoch its workers must map, and is usable once every rank that told maps that one."""
    manager = make(2, RANKS)
    epoch = manager.step_epoch()
    if epoch is None:
        assert manager.epoch is None and manager.mapped_on({0: "any", 1: ""})
    else:
        assert epoch == manager.epoch != "" and manager.lease != ""
        assert manager.mapped_on({0: epoch, 1: epoch}) and manager.mapped_on({})
        assert not manager.mapped_on({0: epoch, 1: "an older epoch"})
    assert manager.take_refused() == []
    manager.sync()  # nothing one-way is pending: no effect, no error

"""store/index/ledger.py alone: command ids never repeat, and a command settles (its effect applied) once, when the
last rank answered, with every rank's failure; answers nobody waits for are counted and ignored."""

from __future__ import annotations

from lmcache_npu.store.commands import Completion, Store
from lmcache_npu.store.index.ledger import CommandLedger
from lmcache_npu.store.keys import ChunkKey
from lmcache_npu.store.metrics import Metric
from lmcache_npu.store.tier import TierCounters

KEY = ChunkKey("0" * 32, b"chunk")


def store(ledger: CommandLedger) -> Store:
    return ledger.emit(Store(ledger.new_id(), KEY, 0, "request", 0))


def test_ids_start_at_first_id_and_never_repeat() -> None:
    ledger = CommandLedger(1, TierCounters(), first_id=7)
    assert [ledger.new_id() for _ in range(3)] == [7, 8, 9]


def test_emitted_commands_are_taken_once() -> None:
    ledger = CommandLedger(2, TierCounters())
    command = store(ledger)
    assert ledger.queued() == (command,)
    assert ledger.take() == [command] and ledger.take() == [] and ledger.queued() == ()
    assert ledger.is_pending(command.cmd_id)  # taken is not answered


def test_a_command_settles_only_after_every_rank_answered() -> None:
    ledger = CommandLedger(3, TierCounters())
    command = store(ledger)
    assert list(ledger.answer([Completion(command.cmd_id, 0, True), Completion(command.cmd_id, 2, True)])) == []
    assert ledger.waiting_ranks(command.cmd_id) == {1} and ledger.in_flight == 1
    assert list(ledger.answer([Completion(command.cmd_id, 1, True)])) == [(command, [])]
    assert not ledger.is_pending(command.cmd_id) and ledger.pending_ids() == ()


def test_negative_control_a_rank_answering_twice_does_not_stand_in_for_a_silent_one() -> None:
    counters = TierCounters()
    ledger = CommandLedger(2, counters)
    command = store(ledger)
    twice = [Completion(command.cmd_id, 0, True), Completion(command.cmd_id, 0, True)]
    assert list(ledger.answer(twice)) == [] and ledger.waiting_ranks(command.cmd_id) == {1}
    assert counters.snapshot() == {Metric.UNEXPECTED_COMPLETIONS: 1}


def test_every_ranks_failure_is_reported_with_its_reason() -> None:
    ledger = CommandLedger(2, TierCounters())
    command = store(ledger)
    settled = list(ledger.answer([Completion(command.cmd_id, 1, False, "miss"),
                                  Completion(command.cmd_id, 0, False, "corrupt: checksum")]))
    assert settled == [(command, ["rank 1: miss", "rank 0: corrupt: checksum"])]


def test_an_answer_to_an_unknown_command_is_counted_and_ignored() -> None:
    counters = TierCounters()
    ledger = CommandLedger(1, counters)
    command = store(ledger)
    settled = list(ledger.answer([Completion(command.cmd_id + 40, 0, True), Completion(command.cmd_id, 0, True)]))
    assert settled == [(command, [])] and counters.snapshot()[Metric.UNEXPECTED_COMPLETIONS] == 1


def test_commands_settle_in_answer_order_one_at_a_time() -> None:
    ledger = CommandLedger(1, TierCounters())
    first, second = store(ledger), store(ledger)
    answers = ledger.answer([Completion(second.cmd_id, 0, True), Completion(first.cmd_id, 0, True)])
    assert next(answers)[0] == second and ledger.is_pending(first.cmd_id)  # lazy: the next answer is not read yet
    assert next(answers)[0] == first and ledger.pending_ids() == ()

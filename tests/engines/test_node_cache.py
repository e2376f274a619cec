"""One cache per node, with real engines: two vLLM CPU engines in processes of their own share one `lmcache-npu
node-cache` service. A conversation's turns alternate between the engines and each turn hits what the other engine
stored, with the tokens of a run without the plugin, while the node holds each chunk once; an engine killed mid
request gives its lease back and the other keeps hitting; a killed service costs hits, never tokens, and the
engines attach again once it is back; a successor that takes the service over keeps every hit and every mapping.

The engines and the service are shared by the tests of this module (node_cache_scenario.Node): starting an engine
process pays vLLM's imports, rebuilding an engine in a live one does not."""

from __future__ import annotations

import signal
from typing import Iterator

import pytest

from lmcache_npu.tools.replay.compare import differences, tolerance_for

from .compare import assert_identical
from .node_cache_scenario import (LATE_LOADS, PRIVATE, Conversation, Node, NodeCacheProcess, ServedRank, alternate,
                                  computed_tokens, configure, distinct_chunks, missing_cross_engine_hits, node_settings,
                                  run_rounds, wait_until, whole_chunks)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    shared = Node(tmp_path_factory.mktemp("node"))
    try:
        yield shared
    finally:
        shared.close()


def _dtype() -> str:
    from lmcache_npu.tools.replay.models import RECIPES

    from .node_cache_scenario import RECIPE

    return RECIPES[RECIPE].dtype


def _answers(turns) -> list:
    """Every turn's completion, conversation after conversation."""
    return [turn.completion for conversation in turns for turn in conversation]


def _flat(answers) -> list:
    return [answer for conversation in answers for answer in conversation]


def test_alternating_turns_hit_the_other_engines_chunks_and_the_node_holds_one_copy(node: Node) -> None:
    engines = node.serving()
    before = node.service.metrics()
    assert before.value("node_leases") == 2 and before.engines() == {e.engine_name for e in engines}
    conversations = [Conversation(1000 + c) for c in range(3)]
    turns = run_rounds(engines, conversations, 3, alternate)
    after = node.settle(engines)

    # every turn after the first loads what the other engine computed in the turn before, exactly that much
    assert missing_cross_engine_hits(turns) == []
    assert [[t.completion.cached_tokens for t in conversation] for conversation in turns] == [
        [0] + [whole_chunks(computed_tokens(previous)) for previous in conversation[:-1]] for conversation in turns]
    assert_identical(_flat(node.reference_answers(conversations, 3)), _answers(turns), _dtype())

    # one copy: the node's arena holds each distinct chunk once, each stored by one engine or the other
    names = [engine.engine_name for engine in engines]
    stores = [after.value("node_stores_total", name) - before.value("node_stores_total", name) for name in names]
    hits = [after.value("node_lookup_hit_chunks_total", name) - before.value("node_lookup_hit_chunks_total", name)
            for name in names]
    used = after.value("cpu_used_chunks") - before.value("cpu_used_chunks")
    assert used == sum(stores) == distinct_chunks(turns) == 18, (used, stores)
    assert min(stores) > 0 and min(hits) > 0, (stores, hits)

    # negative control of the token comparison: the other engine's loads from the node put each row one token late
    late = [Conversation(1100)]
    configure(engines, [node_settings(node.service.socket_path),
                        {**node_settings(node.service.socket_path), LATE_LOADS: True}])
    wrong = run_rounds(engines, late, 2, alternate)
    assert wrong[0][1].completion.cached_tokens == whole_chunks(computed_tokens(wrong[0][0]))
    assert differences(_flat(node.reference_answers(late, 2))[1:], _answers(wrong)[1:], tolerance_for(_dtype()))

    # negative control: private arenas (today), the first turn pair of a conversation: the second engine finds
    # nothing of the first's, and the check above reports it
    configure(engines, [PRIVATE, PRIVATE])
    private = run_rounds(engines, conversations[:1], 2, alternate)
    assert [turn.completion.cached_tokens for turn in private[0]] == [0, 0]
    assert len(missing_cross_engine_hits(private)) == 1
    assert_identical(_flat(node.reference_answers(conversations[:1], 2)), _answers(private), _dtype())


@pytest.mark.one_era(0, 28)  # tests/engines/conftest.py: the node's crash handling is era-neutral, runs once
def test_a_killed_service_costs_hits_not_tokens_and_the_engines_attach_again(node: Node) -> None:
    engines = node.serving()
    conversations = [Conversation(3000), Conversation(3001)]
    reference = node.reference_answers(conversations, 2)
    names = [engine.engine_name for engine in engines]
    epochs = [engine.stats()["epoch"] for engine in engines]
    looked = node.service.metrics()

    def kill_the_service_while_both_compute(turn: int) -> None:
        if turn == 0:
            wait_until(lambda: all(node.service.metrics().value("node_lookup_chunks_total", name) >
                                   looked.value("node_lookup_chunks_total", name) for name in names),
                       "both engines looked up their first prompts")
            node.service.kill()

    # the service dies while both engines compute the first turn; the second turn finds no service: misses
    away = run_rounds(engines, conversations, 2, alternate, kill_the_service_while_both_compute)
    assert [turn.completion.cached_tokens for conversation in away for turn in conversation] == [0] * 4
    assert_identical(_flat(reference), _answers(away), _dtype())
    for engine in engines:
        counted = engine.stats()["index"]
        assert counted["node_cache_disconnects"] == 1 and counted["node_cache_unreachable"] > 0, counted

    # the service is back on the same socket: the engines attach again (a new epoch) and their workers follow
    node.service.start()

    def attached_again() -> bool:
        for engine in engines:
            engine.generate([[1, 2, 3]], 1)  # a step asks the service (after the client's 1 s between attempts)
        stats = [engine.stats() for engine in engines]
        return all(s["epoch"] not in (None, old) and s["worker_epoch"] == s["epoch"] for s, old in zip(stats, epochs))

    wait_until(attached_again, "both engines attached to the restarted service", timeout_s=30, every_s=0.5)
    assert node.service.metrics().engines() == set(names)
    again = run_rounds(engines, conversations, 2, alternate)
    assert missing_cross_engine_hits(again) == []
    assert [conversation[1].completion.cached_tokens for conversation in again] == [
        whole_chunks(computed_tokens(conversation[0])) for conversation in again]
    assert_identical(_flat(reference), _answers(again), _dtype())
    for engine in engines:  # what an operator sees of it on the engine's own metrics
        exported = engine.stats()["exported"]
        assert {name: exported.get(name) for name in ("node_cache_disconnects", "node_cache_reconnects",
                                                      "epoch_changes")} == dict.fromkeys(
            ("node_cache_disconnects", "node_cache_reconnects", "epoch_changes"), 1), exported
        assert "counter_regressions" not in exported, exported  # no counter moved back (the arena's levels are gauges)


@pytest.mark.one_era(0, 32)  # tests/engines/conftest.py: the node's restart handling is era-neutral, runs once
def test_a_hand_over_to_a_successor_keeps_every_hit_and_the_engines_mappings(node: Node) -> None:
    engines = node.serving()
    conversations = [Conversation(6000), Conversation(6001)]
    reference = node.reference_answers(conversations, 2)
    first = run_rounds(engines, conversations, 1, alternate)
    stored = node.settle(engines).value("cpu_used_chunks")
    was = [engine.stats() for engine in engines]

    # a planned restart: a successor takes the pools and the socket over; the predecessor exits once it handed over
    predecessor = node.service
    node.service = NodeCacheProcess(predecessor.socket_path, node.directory / "successor.log", take_over=True)
    node.service.start()
    assert predecessor.process is not None and predecessor.process.wait(60) == 0
    assert predecessor.said().startswith("lmcache-npu node-cache: handed the host cache over")
    wait_until(lambda: node.service.metrics().value("cpu_used_chunks") == stored,
               "the successor's index holds every chunk its predecessor sealed")

    def attached_again() -> bool:
        for engine in engines:
            engine.generate([[1, 2, 3]], 1)  # a step asks the service (after the client's 1 s between attempts)
        now = [engine.stats() for engine in engines]
        return all(s["epoch"] is not None and s["exported"].get("node_rebinds", 0) > w["exported"].get("node_rebinds", 0)
                   for s, w in zip(now, was))

    wait_until(attached_again, "both engines and their workers attached again to the successor", timeout_s=30,
               every_s=0.5)
    for now, before in zip((engine.stats() for engine in engines), was):  # same epoch: nothing mapped again
        assert now["epoch"] == now["worker_epoch"] == before["epoch"], (now["epoch"], now["worker_epoch"])
        assert now["exported"].get("epoch_changes", 0) == before["exported"].get("epoch_changes", 0)

    # each conversation's second turn, on the engine that never saw it, loads every chunk the first turn stored
    # before the hand-over (a crash or cold restart loses them: the killed-service test above is the control)
    answers = []
    for c, (turn,) in enumerate(first):
        other = engines[1 - turn.engine]
        second = other.generate([conversations[c].next_prompt(list(turn.prompt), turn.completion, 1)])[0]
        assert second.cached_tokens == whole_chunks(computed_tokens(turn)), (c, second.cached_tokens)
        answers.append([turn.completion, second])
    assert_identical(_flat(reference), _flat(answers), _dtype())


@pytest.mark.one_era(0, 28)  # tests/engines/conftest.py: the node's crash handling is era-neutral, runs once
def test_an_engine_killed_mid_request_gives_its_lease_back_and_the_other_keeps_hitting(node: Node) -> None:
    from lmcache_npu.store.index.contract import SlotState

    from .compare import prompt

    survivor, victim = node.serving()
    conversation = [Conversation(4000)]
    reference = node.reference_answers(conversation, 2)
    first = run_rounds([victim], conversation, 1, lambda c, k: 0)  # the victim stores the first turn
    node.settle([victim])
    victim_name = victim.engine_name
    assert victim_name is not None

    # a long request, then SIGKILL while its stores are in flight (stopped first, so the count cannot move)
    victim.send("generate", [prompt(3000, 4100)], 300)
    in_flight = 0
    while not in_flight:
        wait_until(lambda: node.service.metrics().value("node_lease_commands", victim_name) > 0,
                   "the long request's stores are in flight", every_s=0.01)
        victim.signal(signal.SIGSTOP)
        in_flight = int(node.service.metrics().value("node_lease_commands", victim_name))
        if not in_flight:
            victim.signal(signal.SIGCONT)
    before = node.service.metrics()
    victim.kill()
    assert victim.process.returncode == -signal.SIGKILL
    with pytest.raises(RuntimeError, match="exited"):
        victim.receive(timeout_s=1)  # the long request never answered

    after = wait_until(lambda: (m := node.service.metrics()).value("node_leases") == 1 and m,
                       "the killed engine's lease ended")
    assert after.engines() == {survivor.engine_name}
    assert after.value("leases_ended_total") - before.value("leases_ended_total") == 1
    assert after.value("abandoned_commands_total") - before.value("abandoned_commands_total") == in_flight
    chunks = survivor.call("chunks")
    assert chunks, "the node lost the chunks the killed engine had stored"
    assert all(c.slot_state not in (SlotState.WRITING, SlotState.READING) and c.readers == 0 and c.disk_readers == 0
               and not c.reservations for c in chunks)

    # the survivor serves the conversation's next turn from the chunks the killed engine stored
    hits_before = after.value("node_lookup_hit_chunks_total", survivor.engine_name)
    second = survivor.generate([conversation[0].next_prompt(first[0][0].prompt, first[0][0].completion, 1)])
    assert second[0].cached_tokens == whole_chunks(computed_tokens(first[0][0]))
    assert_identical(reference[0], [first[0][0].completion, second[0]], _dtype())
    assert node.service.metrics().value("node_lookup_hit_chunks_total", survivor.engine_name) > hits_before


@pytest.mark.one_era(0, 32)  # tests/engines/conftest.py: vLLM 0.32's DP ranks on this machine, run once
def test_the_data_parallel_ranks_of_one_server_hit_each_others_chunks(node: Node, model_dirs, tmp_path) -> None:
    """`vllm serve --data-parallel-size 2` on the node cache: each DP rank is an engine core with its own scheduler
    (its own lease, `<engine id>/dp<rank>`); turns alternate between the ranks (vLLM's X-data-parallel-rank header)
    and hit what the other rank stored, with the tokens of a run without the plugin, and the node holds one copy."""
    from lmcache_npu.tools.servebench.server import kv_transfer_config, vllm_server

    from .node_cache_scenario import RECIPE

    conversations = [Conversation(5000 + c) for c in range(2)]
    reference = node.reference_answers(conversations, 3)
    service = node.service_up()
    before = service.metrics()
    model = model_dirs(RECIPE)
    args = ["--skip-tokenizer-init", "--dtype", _dtype(), "--enforce-eager", "--max-model-len", "2048",
            "--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(128 << 20), "--max-num-seqs", "4",
            "--data-parallel-size", "2", "--distributed-executor-backend", "uni", "--enable-prompt-tokens-details",
            "--kv-transfer-config", kv_transfer_config(node_settings(service.socket_path)["extra_config"])]
    # two ranks on this machine's cores: none kept back (vLLM's CPU default would reserve one per rank)
    with vllm_server(model, args, tmp_path / "serve.log", {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}) as base:
        ranks = [ServedRank(base, model, rank) for rank in (0, 1)]

        def both_ranks() -> set[str]:
            new = service.metrics().engines() - before.engines()
            return new if len(new) == 2 else set()

        # one server's engine id and the rank: vLLM 0.32 gives each rank of a dense model an engine of its own,
        # `<id>_dp<rank>`, whose data-parallel rank is 0 (`<id>_dp1/dp0`); they sort in rank order either way
        leased = wait_until(both_ranks, "both DP ranks attached to the node cache")
        for rank, name in zip(ranks, sorted(leased)):
            rank.engine_name = name
        assert len({name[:36] for name in leased}) == 1, leased  # one server's uuid
        turns = run_rounds(ranks, conversations, 3, alternate)
        after = node.settle(ranks)
        for rank in ranks:
            rank.close()
    assert missing_cross_engine_hits(turns) == []
    assert [[t.completion.cached_tokens for t in conversation] for conversation in turns] == [
        [0] + [whole_chunks(computed_tokens(previous)) for previous in conversation[:-1]] for conversation in turns]
    assert_identical(_flat(reference), _answers(turns), _dtype())
    stores = [after.value("node_stores_total", rank.engine_name) for rank in ranks]
    used = after.value("cpu_used_chunks") - before.value("cpu_used_chunks")
    assert used == sum(stores) == distinct_chunks(turns) and min(stores) > 0, (used, stores)
    assert wait_until(lambda: not leased & service.metrics().engines(), "the stopped server's leases ended")

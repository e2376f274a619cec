"""An empty step (every runnable request waits for its KV) waits in `get_finished` for one of its loads instead of
letting the engine spin; a step that computes never waits."""

from __future__ import annotations

from lmcache_npu.ops import Direction

from .conftest import assert_quiescent, preset_engine, prompt
from .wrappers import Slow, wait_until, wrap


def _spy_waits(engine, slow: Slow) -> list[tuple[frozenset, float]]:
    """Records every wait the workers ask for; the first one releases the held load, and waits get a generous
    timeout so the check does not depend on the machine's speed."""
    calls: list[tuple[frozenset, float]] = []
    for worker in engine.workers:
        executor = worker.worker_half.executor
        real = executor.wait_for_any

        def spy(cmd_ids, timeout, real=real):
            calls.append((frozenset(cmd_ids), timeout))
            slow.release.set()
            return real(cmd_ids, 30.0)

        executor.wait_for_any = spy
    return calls


def _stored_prompt_with_held_loads(make_engine, seed: int):
    """An engine holding a two-chunk prompt, its load lane held until the first wait (spied) releases it."""
    engine = preset_engine(make_engine, "llama3-8b", "ascend")
    chunk = engine.connector.scheduler_half.chunk_tokens
    text = prompt(2 * chunk + 20, seed=seed)
    engine.add(text, max_tokens=2, request_id="seed")
    engine.run()
    (slow,) = wrap(engine, lambda b: Slow(b, Direction.LOAD), Direction.LOAD)
    return engine, chunk, text, slow, _spy_waits(engine, slow)


def test_an_empty_step_reports_the_load_it_waited_for(make_engine):
    engine, chunk, text, slow, calls = _stored_prompt_with_held_loads(make_engine, 31)
    engine.add(text + [7, 7, 7], max_tokens=2, request_id="hit")
    so = engine.step()  # the only request waits for its KV: nothing is computed
    assert not so.total_num_scheduled_tokens and so.kv_connector_metadata.idle
    assert len(calls) == 1 and calls[0][0], calls  # it waited for the load's commands
    assert "hit" in engine.loaded_tokens, "the load that finished during the wait was not reported"
    engine.run()
    assert engine.loaded_tokens["hit"] == 2 * chunk
    assert_quiescent(engine)


def test_a_step_that_computes_never_waits(make_engine):
    engine, chunk, text, slow, calls = _stored_prompt_with_held_loads(make_engine, 32)
    engine.add(prompt(chunk, seed=33), max_tokens=chunk, request_id="busy")  # computes through every step below
    engine.step()
    engine.add(text + [5, 5], max_tokens=2, request_id="hit")
    wait_until(slow.waiting.is_set, engine.step)
    for _ in range(3):
        so = engine.step()
        assert so.total_num_scheduled_tokens and not so.kv_connector_metadata.idle
    assert not calls, "a step that computed waited for a load"  # negative control: the held load is still held
    assert "hit" not in engine.loaded_tokens
    slow.release.set()
    engine.run()
    assert engine.loaded_tokens["hit"] == 2 * chunk
    assert_quiescent(engine)

"""Scheduler steps from admission to first token (tools/replay/steps.py), on a fake connector driven the way vLLM's
scheduler drives ours: allocations during `schedule()`, then `build_connector_meta` once per step."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from lmcache_npu.tools.replay.steps import StepCounter, StepCounts


class FakeConnector:
    """Records what reaches the original methods (the wrappers must pass everything on unchanged)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.scheduler_half = SimpleNamespace(requests={})

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.calls.append(("alloc", (request.request_id, blocks, num_external_tokens)))

    def build_connector_meta(self, scheduler_output: Any) -> str:
        self.calls.append(("build", scheduler_output))
        return "meta"


def request(req_id: str, prompt: int, sliced: bool = False, connector: Any = None) -> Any:
    if connector is not None:  # the scheduler half's lookup says how the hit loads
        connector.scheduler_half.requests[req_id] = SimpleNamespace(lookup=SimpleNamespace(sliced=sliced))
    return SimpleNamespace(request_id=req_id, num_prompt_tokens=prompt)


def step(new: dict[str, tuple[int, int]] = {}, cached: dict[str, tuple[int, int]] = {}) -> Any:  # noqa: B006
    """A SchedulerOutput: request id -> (tokens computed before the step, tokens scheduled in it)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, (c, _) in new.items()],
        scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached), num_computed_tokens=[c for c, _ in cached.values()]),
        num_scheduled_tokens={r: n for r, (_, n) in {**new, **cached}.items()})


def attached() -> tuple[FakeConnector, StepCounter]:
    connector, counter = FakeConnector(), StepCounter()
    counter.attach(connector)
    return connector, counter


def test_a_sliced_hit_computed_in_the_step_that_admitted_it_counts_one() -> None:
    connector, counter = attached()
    connector.update_state_after_alloc(request("a", 1792, True, connector), "blocks", 1536)
    assert connector.build_connector_meta(step(new={"a": (1536, 256)})) == "meta"
    assert counter.take() == StepCounts((1,), sliced=1)
    assert connector.calls[0] == ("alloc", ("a", "blocks", 1536))  # the original saw the same arguments


def test_an_async_hit_counts_at_least_two_the_negative_control() -> None:
    connector, counter = attached()
    connector.update_state_after_alloc(request("a", 1792, False, connector), "blocks", 1536)
    connector.build_connector_meta(step())  # admitted, waiting for its load: not scheduled
    connector.build_connector_meta(step())  # the load was not reported yet
    connector.update_state_after_alloc(request("a", 1792), "blocks", 0)  # scheduled after the load: no external
    connector.build_connector_meta(step(new={"a": (1536, 256)}))
    counts = counter.take()
    assert counts.steps == (3,) and counts.sliced == 0 and min(counts.steps) >= 2


def test_a_chunked_prefill_counts_until_the_step_that_completes_the_prompt() -> None:
    connector, counter = attached()
    connector.update_state_after_alloc(request("a", 2048, True, connector), "blocks", 1024)
    connector.build_connector_meta(step(new={"a": (1024, 512)}))
    assert counter.take() == StepCounts() and counter.waiting == 1
    connector.build_connector_meta(step(cached={"a": (1536, 512)}))
    assert counter.take().steps == (2,)


def test_misses_and_other_requests_are_not_counted() -> None:
    connector, counter = attached()
    connector.update_state_after_alloc(request("miss", 512), "blocks", 0)
    connector.update_state_after_alloc(request("hit", 640, True, connector), "blocks", 512)
    connector.build_connector_meta(step(new={"miss": (0, 512), "hit": (512, 128)}))
    assert counter.take() == StepCounts((1,), sliced=1)


def test_restart_forgets_the_warm_up() -> None:
    connector, counter = attached()
    connector.update_state_after_alloc(request("w", 640), "blocks", 512)
    counter.restart()
    connector.build_connector_meta(step(new={"w": (512, 128)}))
    assert counter.take() == StepCounts() and counter.waiting == 0


def test_counts_summarise_and_merge() -> None:
    counts = StepCounts.merged([StepCounts((1, 1), 2), StepCounts((2, 3, 2), 0)])
    assert counts.hits == 5 and counts.sliced == 2
    assert counts.histogram() == {1: 2, 2: 2, 3: 1}
    summary = counts.to_json()
    assert (summary["min"], summary["median"], summary["max"]) == (1, 2, 3)
    assert StepCounts().to_json()["hits"] == 0

"""Random request events against vLLM 0.23's Scheduler and the connector: requests sharing prefixes arrive, steps
run, requests are aborted, vLLM's own prefix cache is dropped, stores are slowed past the step. The arena is small,
so evictions happen. After every step the pages every scheduled request's next forward reads match the simulated
model; at the end every request finishes and nothing is leaked."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcache_npu.ops import Direction

from .conftest import PRESET_ENGINES, assert_quiescent, prompt
from .engine import Engine, EngineSpec
from .wrappers import Slow, wrap

PREFIXES = [prompt(900, seed=50 + i) for i in range(3)]


class RequestEvents(RuleBasedStateMachine):
    preset = ("gpt-oss-120b", "cuda")

    def __init__(self) -> None:
        super().__init__()
        settings_ = dict(PRESET_ENGINES[self.preset], num_blocks=260, max_num_batched_tokens=512)
        probe = Engine(EngineSpec(preset=self.preset[0], family=self.preset[1], **settings_))
        slot = probe.workers[0].worker_half.executor.arena.slot_bytes
        probe.close()
        self.engine = Engine(EngineSpec(preset=self.preset[0], family=self.preset[1], **settings_,
                                        extra_config={"cpu_bytes": 6 * slot}))
        self.count = 0
        self.slow: list = []

    def teardown(self) -> None:
        for slow in self.slow:
            slow.release.set()
        try:
            self.engine.run(max_steps=5000)
            assert_quiescent(self.engine)
        finally:
            self.engine.close()

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), keep=st.integers(0, 900), suffix=st.integers(0, 300),
          max_tokens=st.integers(1, 40))
    def add(self, prefix, keep, suffix, max_tokens):
        self.count += 1
        tokens = PREFIXES[prefix][:keep] + prompt(suffix, seed=1000 + self.count)
        if tokens:
            self.engine.add(tokens, max_tokens=max_tokens)

    @rule(steps=st.integers(1, 6))
    def step(self, steps):
        for _ in range(steps):
            self.engine.step()

    @rule(pick=st.integers(0, 1000))
    def abort(self, pick):  # a no-op when nothing is live (a precondition on engine state would make draws flaky)
        live = [r for r, q in self.engine.scheduler.requests.items() if not q.is_finished()]
        if live:
            self.engine.abort(live[pick % len(live)])

    @precondition(lambda self: not self.slow)
    @rule()
    def slow_stores(self):
        self.slow += wrap(self.engine, lambda b: Slow(b, Direction.STORE, seconds=0.05), Direction.STORE)

    @rule()
    def drop_device_prefix_cache(self):
        self.engine.scheduler.reset_prefix_cache()

    @invariant()
    def index_is_consistent(self):
        self.engine.connector.scheduler_half.index.check_invariants()


class RequestEventsDeepseekV4(RequestEvents):
    preset = ("deepseek-v4-flash", "ascend")


TestRequestEvents = RequestEvents.TestCase
TestRequestEvents.settings = settings(max_examples=12, stateful_step_count=25)
TestRequestEventsDeepseekV4 = RequestEventsDeepseekV4.TestCase
TestRequestEventsDeepseekV4.settings = settings(max_examples=8, stateful_step_count=25)

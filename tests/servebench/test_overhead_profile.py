"""The overhead profile's bookkeeping: a package's entry points are the functions called from outside it, each
charged with the outside calls' cumulative time once; threads' CPU seconds come from /proc by thread name; the hook
timers time a class's public methods and put them back."""

from __future__ import annotations

import cProfile
import importlib.util
import os
import pstats
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_npu.tools.servebench.overhead_profile import Entry, entries, random_prompts, thread_cpu_seconds

MODULE = '''
def helper(n):
    return sum(i * i for i in range(n))

def work(n):
    return helper(n) + helper(n)
'''


def _package(tmp_path: Path) -> tuple[ModuleType, str]:
    folder = tmp_path / "pkg"
    folder.mkdir()
    (folder / "inner.py").write_text(MODULE)
    spec = importlib.util.spec_from_file_location("pkg_inner", folder / "inner.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, str(folder)


def _own_cumulative(stats: pstats.Stats, function: str) -> float:
    return next(v[3] for k, v in stats.stats.items() if k[2] == function)  # type: ignore[attr-defined]


def test_only_calls_from_outside_are_entries(tmp_path: Path) -> None:
    module, folder = _package(tmp_path)
    profiler = cProfile.Profile()
    profiler.enable()
    module.work(20000)
    profiler.disable()
    stats = pstats.Stats(profiler)
    found = entries(stats, folder)
    assert list(found) == ["inner.py:work"]  # helper runs only under work: not charged a second time
    assert found["inner.py:work"].seconds == pytest.approx(_own_cumulative(stats, "work"))
    assert found["inner.py:work"].calls == 1


def test_a_direct_outside_call_makes_a_second_entry(tmp_path: Path) -> None:  # negative control
    module, folder = _package(tmp_path)
    profiler = cProfile.Profile()
    profiler.enable()
    module.work(1000)
    module.helper(1000)
    profiler.disable()
    found = entries(pstats.Stats(profiler), folder)
    assert sorted(found) == ["inner.py:helper", "inner.py:work"]
    assert found["inner.py:helper"].calls == 1  # the direct call only: work's two calls are the package's own
    assert entries(pstats.Stats(profiler), str(tmp_path / "elsewhere")) == {}
    # a harness folder counts as outside: its functions are no entries
    assert entries(pstats.Stats(profiler), str(tmp_path), harness=[folder]) == {}
    assert isinstance(found["inner.py:work"], Entry)


def test_a_busy_thread_is_found_by_name() -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    thread = threading.Thread(target=spin, name="lmcache-test-spinner")
    thread.start()
    try:
        seen = 0.0
        for _ in range(400):  # until the kernel has charged it one clock tick
            seen = thread_cpu_seconds().get("lmcache-test-spinner", 0.0)
            if seen > 0:
                break
            stop.wait(0.05)
    finally:
        stop.set()
        thread.join()
    assert seen > 0
    assert "lmcache-test-spinner" not in thread_cpu_seconds()  # an ended thread is not listed


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 8), st.integers(1, 64), st.integers(0, 2**31))
def test_random_prompts_are_fresh_and_in_range(count: int, tokens: int, seed: int) -> None:
    prompts = random_prompts(count, tokens, 2048, seed)
    assert len(prompts) == count and all(len(p) == tokens for p in prompts)
    assert all(4 <= t < 2048 for p in prompts for t in p)
    assert prompts == random_prompts(count, tokens, 2048, seed)
    assert random_prompts(count, max(tokens, 16), 2048, seed + 1) != random_prompts(count, max(tokens, 16), 2048,
                                                                                      seed)


def test_random_prompts_refuse_bad_sizes() -> None:
    with pytest.raises(ValueError, match="vocabulary above 4"):
        random_prompts(1, 1, 4, 0)


def test_the_report_charges_the_plugin_against_the_baseline() -> None:
    from lmcache_npu.tools.servebench.overhead_profile import RunProfile, render

    base = RunProfile("vLLM alone", [10.0, 10.0])
    step = "integration/vllm/connector.py:build_connector_meta"
    plugin = RunProfile("vLLM + lmcache-npu", [10.5, 10.5], entries_s={step: 0.21}, entry_calls={step: 420},
                        plugin_threads_cpu_s={"lmcache-npu-store-r0": 0.05})
    text = "\n".join(render([base, plugin]))
    assert "wall +1.00 s against vLLM alone (+5.0%)" in text
    assert "engine thread in the plugin 0.210 CPU s (1.00% of wall, 0.500 ms per scheduler step (420 steps))" in text
    assert "    500.0" in text  # microseconds per call
    assert "connector.py:build_connector_meta" in text and "lmcache-npu-store-r0" in text
    alone = "\n".join(render([plugin]))  # the plugin profiled without a baseline: no comparison made up
    assert "against" not in alone and "wall 21.00 s" in alone


class _Hooks:
    def step(self, value: int) -> int:
        time.sleep(0.002)
        return value + 1

    def _private(self) -> int:
        return 7


def test_hook_timers_time_public_methods_and_restore_them() -> None:
    from lmcache_npu.tools.servebench.overhead_profile import HookTimers

    original = _Hooks.step
    hooks = _Hooks()
    with HookTimers(_Hooks, package_dir=os.path.dirname(__file__)) as timers:
        assert [hooks.step(i) for i in range(3)] == [1, 2, 3]  # the wrapped method still answers
        hooks._private()
    key = "test_overhead_profile.py:step"
    assert timers.calls == {key: 3}  # negative control: the private method was not timed
    assert timers.seconds[key] >= 3 * 0.002
    assert _Hooks.step is original  # restored
    hooks.step(0)
    assert timers.calls[key] == 3  # calls after the block are not counted


def test_the_report_names_the_clock_it_ran_on() -> None:
    from lmcache_npu.tools.servebench.overhead_profile import RunProfile, render

    step = "integration/vllm/connector.py:build_connector_meta"
    plugin = RunProfile("vLLM + lmcache-npu", [1.0], entries_s={step: 0.01}, entry_calls={step: 100}, clock="wall")
    text = "\n".join(render([plugin]))
    header = next(line for line in text.splitlines() if "entry point" in line)
    assert "engine thread in the plugin 0.010 wall s" in text and "wall s" in header and "CPU s" not in header
    profiled = "\n".join(render([RunProfile("p", [1.0], entries_s={step: 0.01}, entry_calls={step: 100})]))
    assert "engine thread in the plugin 0.010 CPU s" in profiled  # negative control: cProfile's clock is CPU

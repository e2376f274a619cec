"""The hook map (issue 41 item 4): which layers the runtime announces through `wait_for_layer_load`, learned from
forwards of the shapes vLLM and vllm-ascend produce (no engine: the announcements are injected)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lmcache_npu.integration.vllm.hook_map import HookMap

ATTENTION = [f"model.layers.{i}.self_attn.attn" for i in range(6)]


def forward(hooks: HookMap, layers: list[str]) -> tuple[str, ...]:
    for layer in layers:
        hooks.announce(layer)
        hooks.announce(layer)  # a layer may call the hook more than once (a second op of one layer)
    return hooks.end_forward()


def test_the_first_forward_that_announces_teaches_the_order_and_empty_forwards_teach_nothing():
    hooks = HookMap()
    assert forward(hooks, []) == () and not hooks.learned  # a profiling run: no metadata bound, no hook reached us
    forward(hooks, ATTENTION)
    assert hooks.learned and hooks.order == tuple(ATTENTION) and not hooks.dropped
    forward(hooks, [])
    assert hooks.order == tuple(ATTENTION) and hooks.forwards == 1


def test_a_layer_one_forward_skips_is_never_trusted_again():
    """vllm-ascend's MLA skips the hook on steps whose batch has no real prefill: the layers a forward skipped load
    before the forward from then on, even when later forwards announce them again. The control: forwards that
    announce the same layers drop nothing."""
    hooks = HookMap()
    forward(hooks, ATTENTION)
    assert forward(hooks, ATTENTION) == () and not hooks.dropped  # the control
    assert forward(hooks, ATTENTION[:2] + ATTENTION[3:]) == (ATTENTION[2],)
    forward(hooks, ATTENTION)
    assert hooks.order == tuple(ATTENTION[:2] + ATTENTION[3:]) and hooks.dropped == {ATTENTION[2]}


def test_a_layer_first_announced_late_was_missing_before_and_is_not_trusted():
    hooks = HookMap()
    forward(hooks, ATTENTION[:3])
    forward(hooks, ATTENTION[:4])
    assert hooks.order == tuple(ATTENTION[:3]) and ATTENTION[3] in hooks.dropped


def test_the_running_forward_says_what_it_announced_so_far():
    hooks = HookMap()
    hooks.announce(ATTENTION[0])
    assert hooks.announced_now(ATTENTION[0]) and not hooks.announced_now(ATTENTION[1])
    hooks.end_forward()
    assert not hooks.announced_now(ATTENTION[0])


@given(st.lists(st.lists(st.sampled_from(ATTENTION), unique=True), max_size=8))
def test_the_trusted_layers_are_those_of_every_forward_that_announced_anything(forwards):
    hooks = HookMap()
    for layers in forwards:
        forward(hooks, layers)
    announcing = [set(layers) for layers in forwards if layers]
    expected = set.intersection(*announcing) if announcing else set()
    assert set(hooks.order) == expected
    if announcing:
        last = [layers for layers in forwards if layers][-1]
        assert list(hooks.order) == [layer for layer in last if layer in expected]  # in the last forward's order

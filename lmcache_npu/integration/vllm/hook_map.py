"""Which layers the runtime announces through `wait_for_layer_load`, learned from the forwards (issue 41 item 4).

vLLM calls the hook from one decorator on its attention ops, once per layer and forward, under the attention
layer's name. Layers that never reach it (mamba and Gated DeltaNet states, upstream DeepSeek-V4's attention) are
never announced, and some paths skip it on some steps only (vllm-ascend's MLA when a step has no prefill but short
extends). A synchronous load may therefore wait per layer only for layers announced in *every* forward that
announced anything; everything else lands before the forward (the slicer's slice 0, `transfer/slices.py`).
A forward that announces nothing (no connector metadata bound, a profiling run) teaches nothing: the hook returns
before calling us there. A layer missing from one forward that announced others is never trusted again, and a layer
first announced after the first such forward was missing before, so it is not trusted either.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class HookMap:
    """Per worker: `announce` from `wait_for_layer_load` (the hot path: a set lookup), `end_forward` once the
    forward is done (`wait_for_save`)."""

    def __init__(self) -> None:
        self._now: list[str] = []  # announced in the forward running now, in order
        self._seen_now: set[str] = set()
        self._order: tuple[str, ...] = ()  # trusted layers, in the order the last forward announced them
        self._dropped: set[str] = set()  # announced in some forward, missing from another: never trusted again
        self.forwards = 0  # forwards that announced anything

    @property
    def learned(self) -> bool:
        """At least one forward announced layers: `order` says which may be waited for per layer."""
        return self.forwards > 0

    @property
    def order(self) -> tuple[str, ...]:
        """The layers announced in every forward that announced anything, in forward order."""
        return self._order

    @property
    def dropped(self) -> frozenset[str]:
        """Layers some forward announced and another skipped: their planes load before the forward."""
        return frozenset(self._dropped)

    def announce(self, layer_name: str) -> None:
        if layer_name not in self._seen_now:
            self._seen_now.add(layer_name)
            self._now.append(layer_name)

    def announced_now(self, layer_name: str) -> bool:
        """Whether the forward running now has announced `layer_name` yet."""
        return layer_name in self._seen_now

    def end_forward(self) -> tuple[str, ...]:
        """The forward is done: learn from it. Returns the trusted layers it skipped (each is dropped from now on)."""
        now, self._now, self._seen_now = self._now, [], set()
        if not now:
            return ()
        self.forwards += 1
        if self.forwards > 1 and tuple(now) == self._order:  # every step of a steady engine: nothing to learn
            return ()
        present = set(now)
        if self.forwards == 1:
            self._order = tuple(now)
            logger.debug("lmcache_npu: the forward announces %d layers through wait_for_layer_load", len(now))
            return ()
        skipped = tuple(layer for layer in self._order if layer not in present)
        late = [layer for layer in now if layer not in self._order and layer not in self._dropped]
        if skipped or late:
            self._dropped.update(skipped)
            self._dropped.update(late)
            logger.info("lmcache_npu: %d layer(s) announced in one forward and not another (%s); their KV loads "
                        "before the forward from now on", len(skipped) + len(late), ", ".join((*skipped, *late)[:4]))
        trusted = [layer for layer in now if layer not in self._dropped]
        self._order = tuple(trusted)
        return skipped

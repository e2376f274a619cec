"""The manager contract stays narrow and nobody asks which manager they have (issue 42, item 1):

- `ChunkManager`'s abstract members are the scheduler's eight verbs (like vLLM's `OffloadingManager`); observation
  is `ChunkManagerView`'s, restart adoption the factories'; everything else has an in-process default;
- no module of `lmcache_npu` asks `isinstance`/`issubclass` of a manager class (`NodeCacheClient`, `ChunkIndex`,
  `ChunkManager`, `ChunkManagerView`): a caller that needs to know is a contract member missing a default.
Negative controls: the scan finds planted checks in a fake source; a contract that grew an abstract member is seen.
"""

from __future__ import annotations

import ast
from abc import abstractmethod
from pathlib import Path
from typing import Iterable, Sequence

from lmcache_npu.node.client import NodeCacheClient
from lmcache_npu.store.index.chunk_index import ChunkIndex
from lmcache_npu.store.commands import Command, Completion, Load, Store
from lmcache_npu.store.index.contract import ChunkManager, ChunkManagerView, LookupResult, NumberedChunks
from lmcache_npu.store.keys import ChunkKey

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lmcache_npu"
MANAGERS = frozenset({"NodeCacheClient", "ChunkIndex", "ChunkManager", "ChunkManagerView"})
VERBS = frozenset({"lookup", "presence", "prepare_load", "release", "prepare_store", "take_commands",
                   "on_completions", "is_pending"})
OBSERVATION = frozenset({"in_flight", "eviction_policy", "occupancy", "location", "chunks", "queued_commands"})


def _names(node: ast.expr) -> Iterable[str]:
    """The class names a type argument of isinstance names (a name, a dotted name, or a tuple of them)."""
    if isinstance(node, ast.Tuple):
        for element in node.elts:
            yield from _names(element)
    elif isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Attribute):
        yield node.attr


def manager_type_checks(source: str, where: str = "<source>") -> list[str]:
    """Every `isinstance(x, M)` / `issubclass(x, M)` in `source` whose M names a manager class, as `where:line`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2
                and MANAGERS.intersection(_names(node.args[1]))):
            found.append(f"{where}:{node.lineno}")
    return found


def abstract_members(cls: type) -> frozenset[str]:
    return frozenset(getattr(cls, "__abstractmethods__", ()))


def test_no_module_asks_which_manager_it_has() -> None:
    offenders = [hit for path in sorted(PACKAGE.rglob("*.py"))
                 for hit in manager_type_checks(path.read_text(), str(path.relative_to(ROOT)))]
    assert offenders == [], "isinstance on managers: give the contract a member with a default instead"


def test_negative_control_planted_checks_are_found() -> None:
    fake = '''
from ..node import client
from ..node.client import NodeCacheClient

def follow(index, other):
    if isinstance(index, NodeCacheClient):
        index.sync()
    if isinstance(other, (int, client.NodeCacheClient)):
        pass
    if not isinstance(index, ChunkIndex):
        return issubclass(type(index), ChunkManager)
    return isinstance(index, dict) or isinstance(index, NodeCacheClientish)
'''
    assert manager_type_checks(fake, "fake.py") == ["fake.py:6", "fake.py:8", "fake.py:10", "fake.py:11"]


def test_the_contract_abstract_members_are_the_scheduler_verbs() -> None:
    assert abstract_members(ChunkManager) == VERBS, "ChunkManager grew: observation goes to ChunkManagerView"
    assert abstract_members(ChunkManagerView) == OBSERVATION
    assert not hasattr(ChunkManager, "adopt_disk") and not hasattr(ChunkManager, "occupancy")


def test_negative_control_a_grown_contract_is_seen() -> None:
    class Grown(ChunkManager):
        @abstractmethod
        def occupancy(self) -> dict:
            """Observation that slipped back into the contract."""

    assert abstract_members(Grown) == VERBS | {"occupancy"} != VERBS


class VerbsOnly(ChunkManager):
    """A second implementation that writes the eight verbs and nothing else (a cache that holds nothing)."""

    num_slots, disk_chunks = 0, 0

    def lookup(self, request_id: str, keys: Sequence[ChunkKey]) -> LookupResult:
        return LookupResult(0, 0)

    def presence(self, keys: Sequence[ChunkKey], remote: bool = True) -> list[bool]:
        return [False] * len(keys)

    def prepare_load(self, request_id: str, chunks: NumberedChunks) -> list[Load]:
        return []

    def release(self, request_id: str) -> None:
        pass

    def prepare_store(self, request_id: str, chunks: NumberedChunks) -> list[Store]:
        return []

    def take_commands(self) -> list[Command]:
        return []

    def on_completions(self, completions: Iterable[Completion]) -> None:
        pass

    def is_pending(self, cmd_id: int) -> bool:
        return False


def test_eight_verbs_make_a_manager_with_in_process_defaults() -> None:
    manager = VerbsOnly()
    assert manager.epoch is None and manager.lease == "" and manager.step_epoch() is None
    assert manager.mapped_on({0: "some epoch"}) and manager.take_refused() == []
    assert manager.share_payloads(lambda key, plain: None) is None
    manager.limit_slots(1)  # the defaults are no-ops: none raises
    manager.set_tier_listener(None)
    manager.sync()
    manager.close()


def test_both_implementations_are_a_manager_and_its_view() -> None:
    for cls in (ChunkIndex, NodeCacheClient):
        assert issubclass(cls, ChunkManager) and issubclass(cls, ChunkManagerView), cls.__name__

"""Fixtures of the node cache's tests: a short socket directory, and services that are closed after each test."""

from __future__ import annotations

import shutil
from typing import Callable, Iterator

import pytest

from lmcache_npu.store.config import StoreConfig

from .harness import Node, short_dir


@pytest.fixture
def node_dir() -> Iterator[str]:
    directory = short_dir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def start_node(node_dir: str) -> Iterator[Callable[..., Node]]:
    """`start_node(store, **options)`: a service on node_dir (each call on its own socket name unless given);
    every one is closed after the test, with what attached to it."""
    started: list[Node] = []

    def start(store: StoreConfig, **options: object) -> Node:
        options.setdefault("socket_name", f"s{len(started)}")
        node = Node(node_dir, store, **options)  # type: ignore[arg-type]
        started.append(node)
        return node

    yield start
    for node in reversed(started):
        node.close()

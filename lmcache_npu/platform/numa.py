"""NUMA and PCI topology as sysfs tells it: which nodes exist, which CPUs a node has, where a device hangs off."""

from __future__ import annotations

import os
from typing import Optional


def numa_nodes() -> list[int]:
    """NUMA nodes with memory on this host (empty where the kernel does not expose them)."""
    try:
        names = os.listdir("/sys/devices/system/node")
    except OSError:
        return []
    return sorted(int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit())


def pci_numa_node(bus_id: str) -> Optional[int]:
    """The NUMA node a PCI device (e.g. '0000:1b:00.0') hangs off, None where the firmware does not say."""
    try:
        with open(f"/sys/bus/pci/devices/{bus_id.lower()}/numa_node", encoding="ascii") as f:
            node = int(f.read())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def node_cpus(node: int) -> frozenset[int]:
    """The CPUs of NUMA node `node` this process may run on (empty where the kernel does not say, the node has no
    CPUs, or the process's affinity excludes them all)."""
    try:
        with open(f"/sys/devices/system/node/node{node}/cpulist", encoding="ascii") as f:
            cpus = parse_cpulist(f.read())
    except (OSError, ValueError):
        return frozenset()
    return cpus & frozenset(os.sched_getaffinity(0))


def parse_cpulist(text: str) -> frozenset[int]:
    """The CPUs of a kernel cpulist ('0-3,8,10-11'); a malformed list is a ValueError quoting it."""
    cpus: set[int] = set()
    try:
        for part in filter(None, text.strip().split(",")):
            first, _, last = part.partition("-")
            begin, end = int(first), int(last or first)
            if begin < 0 or end < begin:
                raise ValueError(part)
            cpus.update(range(begin, end + 1))
    except ValueError as exc:
        raise ValueError(f"a cpulist is comma-separated CPUs or ascending first-last ranges, got {text!r}") from exc
    return frozenset(cpus)

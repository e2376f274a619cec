"""The node cache's sizes (node/capacity.py): the node's bytes, a pool's equal share, each rank's whole slots, and the
refusals that name the key and the rule; the service refuses tier settings that carry sizes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from lmcache_npu.node.capacity import NodeCapacity, PoolRefused, PoolShare
from lmcache_npu.node.service import ServiceOptions
from lmcache_npu.store.arena import slot_bytes_for
from lmcache_npu.store.config import StoreConfig

OBJECT_BYTES = 4096


@settings(max_examples=80, deadline=None)
@given(node_slots=st.integers(1, 4096), pools=st.integers(1, 8), world=st.integers(1, 8), spare=st.integers(0, 4095))
def test_a_rank_gets_whole_slots_of_its_pools_share_and_never_more(node_slots, pools, world, spare):
    slot = slot_bytes_for(OBJECT_BYTES)
    capacity = NodeCapacity(node_slots * slot + spare, "/kv", 1 << 30)
    share = capacity.pool_share(pools)
    if share.cpu_bytes // world < slot:
        with pytest.raises(PoolRefused, match="--cpu-bytes"):
            share.rank_store(StoreConfig(), OBJECT_BYTES, world, "geo")
        return
    rank = share.rank_store(StoreConfig(hugepages="off"), OBJECT_BYTES, world, "geo")
    assert rank.cpu_bytes % slot == 0 and rank.cpu_bytes // slot == (capacity.cpu_bytes // pools) // world // slot
    assert rank.cpu_bytes * world * pools <= capacity.cpu_bytes  # the node's bytes are never overcommitted
    assert rank.cpu_bytes + slot > share.cpu_bytes // world  # and no whole slot is left unused
    assert (rank.disk_path, rank.disk_bytes) == ("/kv", (1 << 30) // pools // world)
    assert rank.hugepages == "off"  # the tier settings travel


def test_bad_node_sizes_are_refused_naming_the_key():
    with pytest.raises(ValueError, match="cpu_bytes .*--cpu-bytes"):
        NodeCapacity(0)
    with pytest.raises(ValueError, match="--disk-path and --disk-bytes"):
        NodeCapacity(1 << 20, "/kv")
    with pytest.raises(ValueError, match="--disk-path and --disk-bytes"):
        NodeCapacity(1 << 20, None, 1 << 20)
    with pytest.raises(ValueError, match="max_pools"):
        NodeCapacity(1 << 20).pool_share(0)
    assert PoolShare(1 << 20).disk_path is None


def test_the_service_refuses_tier_settings_that_carry_sizes():
    ServiceOptions("/tmp/s", NodeCapacity(1 << 20), StoreConfig(hugepages="off"))  # the control: accepted
    for tiers in (StoreConfig(cpu_bytes=1 << 20), StoreConfig(disk_path="/kv", disk_bytes=1 << 20)):
        with pytest.raises(ValueError, match="NodeCapacity"):
            ServiceOptions("/tmp/s", NodeCapacity(1 << 20), tiers)
    with pytest.raises(ValueError, match="disk"):  # StoreConfig's own disk rules hold for the node's disk
        ServiceOptions("/tmp/s", NodeCapacity(1 << 20, "kv\0", 1 << 20))

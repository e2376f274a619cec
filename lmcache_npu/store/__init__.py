"""The store (DESIGN §7): chunk keys, host arena, scheduler-owned index, worker executor, disk and Mooncake tiers."""

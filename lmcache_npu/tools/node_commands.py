"""The node cache's commands of `lmcache-npu`: `node-cache` (the service, and its warm restarts), `node-ping` (a
probe) and `bench-node-restart` (what a restart costs, cold against warm)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..store.commands import COMMAND_DEADLINE_S, COMMAND_TTL_S


def _command_ttl(seconds: float) -> float:
    """--command-ttl, refused unless the workers' own deadline comes first (a live engine must answer before the
    service fails its command and hands the slot to another)."""
    if not seconds > COMMAND_DEADLINE_S:
        raise ValueError(f"node-cache: --command-ttl {seconds:g} must be more than the workers' command deadline "
                         f"({COMMAND_DEADLINE_S:g} s): a live engine's command would fail while its worker still "
                         "waits for it")
    return seconds

def _node_cache(args: argparse.Namespace) -> int:
    import signal
    import threading

    from ..config import read_config_file
    from ..node.handover import HandoverFailed
    from ..node.capacity import NodeCapacity
    from ..node.service import NodeCacheService, ServiceOptions
    from ..store.config import parse_bytes
    from ..store.config import StoreConfig

    values = read_config_file(args.config) if args.config else {}
    for key, flag in (("cpu_bytes", args.cpu_bytes), ("disk_path", args.disk_path), ("disk_bytes", args.disk_bytes)):
        if flag is not None:
            values[key] = flag
    if "cpu_bytes" not in values:
        raise ValueError("node-cache: --cpu-bytes (or cpu_bytes in --config) is required: the node's host cache size")
    if not 0 <= args.hand_over_drain_seconds <= 3600:
        raise ValueError(f"node-cache: --hand-over-drain-seconds must be 0-3600, got {args.hand_over_drain_seconds}")
    # the node's sizes and disk are the service's own keys; every other key is a tier setting (node/capacity.py)
    capacity = NodeCapacity(parse_bytes("cpu_bytes", values.pop("cpu_bytes")), values.pop("disk_path", None),
                            parse_bytes("disk_bytes", values.pop("disk_bytes", 0)))
    tiers = StoreConfig.from_dict(values)
    try:
        service = NodeCacheService(ServiceOptions(args.socket, capacity, tiers, max_pools=args.max_pools, group=args.group,
                                                  metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                                                  pool_idle_s=args.pool_idle_seconds,
                                                  lease_slot_share=args.lease_slot_share,
                                                  reservation_ttl_s=args.reservation_ttl,
                                                  command_ttl_s=_command_ttl(args.command_ttl), take_over=args.take_over,
                                                  hand_over_drain_s=args.hand_over_drain_seconds,
                                                  systemd_fd_store=not args.no_systemd_fd_store))
    except HandoverFailed as exc:  # the running service refused, or the hand-over broke off: it serves on
        raise ValueError(f"node-cache: --take-over: {exc}") from None
    except FileExistsError as exc:  # a live service, or a file that is not a socket, at --socket
        hint = " (start with --take-over to take its host cache over warm)" if "already serves" in str(exc) else ""
        raise ValueError(f"node-cache: {exc}{hint}") from None
    except OSError as exc:  # the socket's directory missing or closed to this user, the metrics port taken
        metrics = "" if args.metrics_port is None else f" and --metrics-port {args.metrics_port}"
        raise ValueError(f"node-cache: cannot serve --socket {args.socket}{metrics}: {exc.strerror or exc}") from None
    stop = threading.Event()
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: stop.set())
    service.start()
    where = f", metrics on http://{args.metrics_host}:{service.metrics_address[1]}/metrics" \
        if service.metrics_address else ""
    print(f"lmcache-npu node-cache: serving {args.socket} ({capacity.cpu_bytes / 2**30:.2f} GiB host memory"
          f"{', disk ' + capacity.disk_path if capacity.disk_path else ''}){where}", flush=True)
    while not stop.wait(0.2):
        if service.handed_over.is_set():
            print("lmcache-npu node-cache: handed the host cache over to a successor"
                  f"{'; waiting to be stopped' if args.after_hand_over == 'wait' else ''}", flush=True)
            if args.after_hand_over == "wait":  # a restarted container must not take it back (see --help)
                stop.wait()
            break
    service.close()  # the disk tiers flush their write-behind queues before the process ends
    return 0


def _node_ping(args: argparse.Namespace) -> int:
    from ..node.probe import PingFailed, ping

    try:
        about = ping(args.socket, args.timeout)
    except PingFailed as exc:
        print(f"lmcache-npu node-ping: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(about, sort_keys=True))
    return 0 if about.get("serving") else 1


def _bench_node_restart(args: argparse.Namespace) -> int:
    from ..store.config import parse_bytes
    from .bench.node_restart import render, run_restart_bench

    results = run_restart_bench(parse_bytes("--cpu-bytes", args.cpu_bytes),
                                chunk_bytes=parse_bytes("--chunk-bytes", args.chunk_bytes), ranks=args.ranks,
                                fill=args.fill, modes=tuple(args.modes), hugepages=args.hugepages)
    print(render(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def add_node_commands(sub: Any) -> None:
    node = sub.add_parser("node-cache", help="one KV cache for every engine on this node: host memory, disk tier and "
                          "Mooncake client shared through a Unix socket (engines set node_cache: PATH)")
    node.add_argument("--socket", required=True, help="the Unix socket engines attach to (created mode 0600)")
    node.add_argument("--cpu-bytes", help="host memory for the whole node, all engines and ranks (e.g. 512GiB)")
    node.add_argument("--disk-path", help="the node's disk tier directory (local NVMe)")
    node.add_argument("--disk-bytes", help="the disk tier's capacity for the whole node")
    node.add_argument("--config", help="a YAML file of store keys (eviction_policy, hugepages, numa_node, mooncake, "
                      "...); the flags above override it")
    node.add_argument("--max-pools", type=int, default=1,
                      help="model geometries served side by side, each with an equal share of the memory (default 1)")
    node.add_argument("--pool-idle-seconds", type=float, default=300.0,
                      help="a pool no engine has attached to for this long is given back, its memory freed (default "
                      "300); a new geometry beyond --max-pools takes an idle pool's place at once")
    node.add_argument("--group", help="a group (name or numeric gid) whose processes may attach too: their primary "
                      "gid must be it (the socket becomes 0660)")
    node.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (0: any free one)")
    node.add_argument("--metrics-host", default="127.0.0.1",
                      help="the metrics address (default 127.0.0.1); beyond loopback a pool's namespace label is a "
                      "pseudonym, not the weights' name")
    node.add_argument("--lease-slot-share", type=float, default=0.25,
                      help="while several engines hold leases on a pool, the share of its slots one engine may "
                      "reserve and load at once (default 0.25; alone it may use all)")
    node.add_argument("--reservation-ttl", type=float, default=120.0,
                      help="seconds after which a request's reservations no lookup renewed are released (default 120)")
    node.add_argument("--command-ttl", type=float, default=COMMAND_TTL_S,
                      help=f"seconds after which a device command no engine answered fails, its slot freed or its pin "
                      f"dropped (default {COMMAND_TTL_S:g}; more than the workers' own {COMMAND_DEADLINE_S:g} s "
                      "deadline)")
    node.add_argument("--take-over", action="store_true",
                      help="a planned restart or upgrade: take the host cache over from the node cache serving "
                      "--socket (same uid only). It stops handing out loads and stores, waits for its engines' "
                      "commands, seals its chunks and hands its pools and socket over; the chunks stay hits, the "
                      "engines keep their mappings, the node never holds two pools. Nothing there: a cold start. "
                      "The same --cpu-bytes, --max-pools, arena_segment_bytes and hugepages keep each pool; a pool "
                      "they would lay out otherwise starts cold")
    node.add_argument("--hand-over-drain-seconds", type=float, default=30.0,
                      help="with --take-over: how long the running service waits for its engines' loads and stores "
                      "before it hands over (default 30); the slots of commands still running rest in quarantine")
    node.add_argument("--after-hand-over", choices=("exit", "wait"), default="exit",
                      help="what this service's process does once a successor took its host cache over: exit "
                      "(default), or wait until it is stopped (a DaemonSet's old pod: a container the kubelet "
                      "restarted must not take the cache back)")
    node.add_argument("--no-systemd-fd-store", action="store_true",
                      help="under systemd (NOTIFY_SOCKET set) the pools' memory is kept in its file-descriptor store "
                      "(FileDescriptorStoreMax=) and found again after a crash or restart; this turns that off")
    node.set_defaults(func=_node_cache)

    ping = sub.add_parser("node-ping", help="exit 0 when the node cache at --socket answers and accepts engines (a "
                          "probe: a dead service's stale socket fails; the answer never waits on the service's lock)")
    ping.add_argument("--socket", required=True, help="the node cache's Unix socket")
    ping.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (default 5)")
    ping.set_defaults(func=_node_ping)

    bench = sub.add_parser("bench-node-restart", help="what restarting the node cache costs: time from the restart "
                           "to the first hit and the extra memory meanwhile, a cold restart against a warm hand-over "
                           "(and a crash found again through a descriptor store)")
    bench.add_argument("--cpu-bytes", default="4GiB", help="the pool's host memory (default 4GiB)")
    bench.add_argument("--chunk-bytes", default="2MiB", help="bytes per rank and chunk (default 2MiB)")
    bench.add_argument("--ranks", type=int, default=1, help="ranks of the pool's geometry (default 1)")
    bench.add_argument("--fill", type=float, default=1.0, help="share of the slots stored before the restart")
    bench.add_argument("--modes", nargs="+", choices=("cold", "warm", "crash"), default=["cold", "warm", "crash"])
    bench.add_argument("--hugepages", default="off", help="the arena's hugepages setting (default off)")
    bench.add_argument("--json", type=Path, help="write the results as JSON")
    bench.set_defaults(func=_bench_node_restart)

"""Which cores the engine and the plugin's transfer lanes run on, for the tools that measure them (replay,
bench-serve): on a CPU engine a sliced load overlaps the forward only when its copies run on a core the model's
threads leave alone (issue 41)."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Optional, Sequence

logger = logging.getLogger(__name__)


def parse_cpus(option: str, text: Optional[str]) -> Optional[tuple[int, ...]]:
    """"0", "0,1" or "2-3" as CPU ids; None for None or ""; a ValueError names the option."""
    if text is None or not text.strip():
        return None
    cpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last or first)
        except ValueError:
            raise ValueError(f"{option}: expected CPU ids such as 0 or 0,1 or 2-3, got {text!r}") from None
        if low < 0 or high < low:
            raise ValueError(f"{option}: expected CPU ids such as 0 or 0,1 or 2-3, got {text!r}")
        cpus.extend(range(low, high + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"{option} names a CPU twice: {text!r}")
    return tuple(cpus)


def check_apart(engine: Optional[Sequence[int]], transfer: Optional[Sequence[int]]) -> None:
    """The engine's and the lanes' cores must not overlap (the point of pinning them), and exist here."""
    available = os.sched_getaffinity(0)
    for option, cpus in (("--engine-cpus", engine), ("--transfer-cpus", transfer)):
        missing = sorted(set(cpus or ()) - available)
        if missing:
            raise ValueError(f"{option}: CPUs {missing} are not available here (this process may use "
                             f"{sorted(available)})")
    shared = sorted(set(engine or ()) & set(transfer or ()))
    if shared:
        raise ValueError(f"--engine-cpus and --transfer-cpus share CPUs {shared}: give the lanes cores of their own")


def pin_engine_here(cpus: Sequence[int]) -> None:
    """Pins this process's calling thread to `cpus` (the threads it starts later inherit it: an in-process vLLM
    engine's) and gives torch as many intra-op threads (vLLM's CPU worker forbids changing them later)."""
    import torch

    os.sched_setaffinity(0, set(cpus))
    torch.set_num_threads(len(cpus))
    logger.info("engine pinned to CPUs %s, %d torch thread(s)", sorted(cpus), len(cpus))


def server_env(cpus: Optional[Sequence[int]]) -> dict[str, str]:
    """Environment that binds a `vllm serve` CPU engine's OpenMP threads to `cpus` ({} for None)."""
    if not cpus:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cpus)}


def add_mode_options(parser: argparse.ArgumentParser, engine_cpus_help: str) -> None:
    """The options replay and bench-serve share for issue 41's runs: slices, and where the engine and lanes run."""
    parser.add_argument("--load-slices", type=int, help="the plugin's load_slices (slices of a sliced load, 1-8)")
    parser.add_argument("--engine-cpus", help=engine_cpus_help)
    parser.add_argument("--transfer-cpus", help="the plugin's transfer_cpus: its transfer lanes pin themselves to "
                                                "these CPU ids, e.g. 1 (default: not pinned)")

"""How late one CUDA stream learns that another has passed a point, by the mechanism the CUDA backend could use to
meet its copy engine: a stream memory operation (cuStreamWaitValue32 on a flag another stream writes) or an event
(cudaStreamWaitEvent). The waiting stream starts waiting at once, and the other side arrives after a copy of the given
size: what a pipelined load's kernel waits for. Prints the delay from the signal to the waiter's next operation.

    PYTHONPATH=. python3 -m lmcache_npu.tools.bench.studies.cuda_gate_latency [--json F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table


def gate_delay_us(cuda: object, mechanism: str, nbytes: int, repeats: int) -> float:
    """Median delay between the signalling stream passing its point and the waiting stream going on."""
    device = torch.device("cuda")
    host = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
    target = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    signaller, waiter = torch.cuda.Stream(device), torch.cuda.Stream(device)
    torch.cuda.synchronize()
    delays = []
    for value in range(1, repeats + 1):
        sent, seen = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        passed = torch.cuda.Event()
        if mechanism == "memop":
            assert cuda.stream_wait_value32(waiter.cuda_stream, flag.data_ptr(), value)  # type: ignore[attr-defined]
        with torch.cuda.stream(signaller):
            target.copy_(host, non_blocking=True)
            sent.record(signaller)
            if mechanism == "memop":
                assert cuda.stream_write_value32(signaller.cuda_stream, flag.data_ptr(), value)  # type: ignore
            else:
                passed.record(signaller)
        if mechanism == "event":
            waiter.wait_event(passed)
        seen.record(waiter)
        seen.synchronize()
        delays.append(sent.elapsed_time(seen) * 1e3)
    delays.sort()
    return delays[len(delays) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from lmcache_npu import _cuda  # type: ignore[attr-defined]

    table = Table(title="delay from the signal to the waiting stream's next operation (median, µs)")
    for column in ("copy before the signal", "stream memory op", "event"):
        table.add_column(column, justify="right")
    results = []
    for nbytes in (1 << 20, 8 << 20, 32 << 20, 128 << 20, 256 << 20):
        row = {"bytes": nbytes}
        for mechanism in ("memop", "event"):
            row[mechanism] = gate_delay_us(_cuda, mechanism, nbytes, args.repeats)
        results.append(row)
        table.add_row(f"{nbytes >> 20} MiB", f"{row['memop']:.1f}", f"{row['event']:.1f}")
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

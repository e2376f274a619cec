"""Does the cost model's transfer side predict what the device does? (issue 40: within 10 % of `cuda_timeline` on an
H100/H200.)

Per geometry, stores and loads of 1 to 8 chunks run through the connector's worker path (the store executor, the
transfer lanes, the backend), queued behind the model's GPU work as in serving, with the worker's `TransferTimer`
attached the way the worker half attaches it: its samples teach one `TierModel` per direction (the fit and the
seeds the scheduler's cost model uses on a GPU engine). A first pass over the sizes teaches the models; in the
second each size's time is predicted *before* it runs, then set against the transfer's device window (CUDA events
over the connector's transfer: what `cuda_timeline` measures) and against the time until the worker reported it
(what the scheduler's model learns from), and its samples are taught after, as in serving.

    PYTHONPATH=. python3 -m lmcache_npu.tools.bench.studies.transfer_model_check \\
        --geometry lmcache_npu/tools/bench/geometries/*.json --json transfer_model.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path as FilePath
from typing import Any, Optional, Sequence

from ....store.cost.samples import Path
from ....store.cost.tiers import TierModel, observe_samples, seeds_for
from ....store.cost.timer import TransferTimer
from ..connector_path import PathReport, run_connector_path
from ..geometry import Geometry, load_geometry

DIRECTIONS = {"store": Path.STORE, "load": Path.LOAD}
DEFAULT_CHUNKS = (1, 2, 3, 4, 6, 8)
TARGET = 0.10  # the bound on |predicted / measured - 1|


@dataclass(frozen=True)
class Prediction:
    """One size of one direction, predicted before it ran."""

    geometry: str
    direction: str
    chunks: int
    payload_mb: float
    predicted_ms: float
    device_ms: float  # the connector's transfer's device window (best of the repeats, as cuda_timeline reports)
    reported_ms: float  # submit to the last report (median): what the worker's timer measures

    @property
    def device_error(self) -> float:
        return self.predicted_ms / self.device_ms - 1

    @property
    def reported_error(self) -> float:
        return self.predicted_ms / self.reported_ms - 1


def predict_sizes(source: Any, backend: str, chunks: Sequence[int], repeats: int, starts: Sequence[str],
                  device_family: str) -> list[Prediction]:
    """The two passes of the module's docstring for one geometry (or preset name)."""
    warm = run_connector_path(source, backend, chunks=1, repeats=1, starts=starts)  # CUDA's lazy start; the object
    timer = TransferTimer(warm.object_bytes)
    models = {path: TierModel(path, seeds_for(device_family)[path]) for path in DIRECTIONS.values()}

    def run(count: int) -> PathReport:
        report = run_connector_path(source, backend, chunks=count, repeats=repeats, starts=starts, timer=timer)
        if not report.same_bytes:
            raise RuntimeError(f"{report.source}: the connector's path moved different bytes than the bench's")
        return report

    for count in chunks:  # the first pass teaches
        run(count)
        observe_samples(models, timer.take())
    predictions = []
    for count in chunks:
        predicted = {name: models[path].seconds(count * warm.object_bytes) for name, path in DIRECTIONS.items()}
        report = run(count)
        observe_samples(models, timer.take())
        for row in report.rows:
            predictions.append(Prediction(report.source, row.direction, count, row.payload_bytes / 1e6,
                                          predicted[row.direction] * 1e3, row.connector_ms, row.reported_ms))
    return predictions


def worst(predictions: Sequence[Prediction], measure: str) -> float:
    """The largest |predicted / measured - 1| over the predictions, against `device` or `reported`."""
    return max(abs(getattr(p, f"{measure}_error")) for p in predictions)


def render(predictions: Sequence[Prediction]) -> Any:
    from rich.table import Table

    table = Table(title="The cost model's transfer side, predicted before each transfer ran", title_justify="left")
    for name in ("geometry", "direction", "chunks", "MB", "predicted ms", "device ms", "error vs device",
                 "reported ms", "error vs reported"):
        table.add_column(name, justify="left" if name in ("geometry", "direction") else "right")
    for p in predictions:
        table.add_row(p.geometry, p.direction, str(p.chunks), f"{p.payload_mb:.1f}", f"{p.predicted_ms:.3f}",
                      f"{p.device_ms:.3f}", f"{p.device_error:+.1%}", f"{p.reported_ms:.3f}",
                      f"{p.reported_error:+.1%}")
    return table


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", type=FilePath, nargs="*", default=[], help="geometry files (GPU machine)")
    parser.add_argument("--preset", nargs="*", default=[], help="presets (a machine with vLLM)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--chunks", type=int, nargs="+", default=list(DEFAULT_CHUNKS))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", type=FilePath)
    args = parser.parse_args(argv)
    sources: list[Any] = [load_geometry(path) for path in args.geometry] + list(args.preset)
    if not sources:
        raise SystemExit("name at least one --geometry file or --preset")
    if any(c < 1 for c in args.chunks) or args.repeats < 1:
        raise SystemExit(f"--chunks and --repeats must be >= 1, got {args.chunks} and {args.repeats}")
    import torch
    from rich.console import Console

    cuda = torch.cuda.is_available()
    starts = ("queued",) if cuda else ("idle",)  # behind the model's GPU work, as in serving
    predictions: list[Prediction] = []
    for source in sources:
        predictions += predict_sizes(source, args.backend, args.chunks, args.repeats, starts,
                                     "cuda" if cuda else "cpu")
    console = Console()
    console.print(render(predictions))
    summary = {measure: worst(predictions, measure) for measure in ("device", "reported")}
    larger = [p for p in predictions if p.chunks > 1]
    console.print(f"worst |error|: {summary['device']:.1%} against the device window, {summary['reported']:.1%} "
                  f"against the reported time; from 2 chunks: {worst(larger, 'device') if larger else 0:.1%} / "
                  f"{worst(larger, 'reported') if larger else 0:.1%} (target {TARGET:.0%}); median against the "
                  f"device {statistics.median(abs(p.device_error) for p in predictions):.1%}")
    if args.json:
        args.json.write_text(json.dumps({"starts": starts, "repeats": args.repeats, "worst": summary,
                                         "predictions": [{**asdict(p), "device_error": p.device_error,
                                                          "reported_error": p.reported_error}
                                                         for p in predictions]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

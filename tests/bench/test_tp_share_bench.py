"""The tp_share_bench study's logic on CPU with gloo (two processes): both variants leave every rank with
every byte (the script checks it before timing), and the share variant moves half the bytes per rank host ->
device; a gather that loses the other rank's share is caught by that check."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.multiprocessing as mp

ARGS = ["--backend", "gloo", "--device", "cpu", "--presets", "deepseek-v4-flash", "--chunks", "2", "--reps", "1",
        "--warmup", "0"]


def _bench() -> ModuleType:
    return importlib.import_module("lmcache_npu.tools.bench.studies.tp_share_bench")


def _rank(rank: int, out: str, lose_share: bool) -> None:
    bench = _bench()
    if lose_share:  # every gather keeps this rank's own share and zeros where the other's belongs
        from lmcache_npu.transfer.share_mover import ShareExchange

        gather = ShareExchange.gather

        def own_share_only(self, contribution, size, out=None):
            result = gather(self, contribution, size, out)
            shares = result[:size * contribution.numel()].view(size, -1)
            shares[1 - rank].zero_()
            return result

        ShareExchange.gather = own_share_only
    bench.dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=2)
    try:
        bench.run_rank(rank, 2, bench.parse(ARGS), out)
    except AssertionError as exc:
        Path(out, f"rank{rank}.error").write_text(str(exc))
    finally:
        bench.dist.destroy_process_group()


def test_gloo_run_checks_bytes_and_halves_pcie(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(str(tmp_path), False), nprocs=2, join=True)
    rows = [row for r in range(2) for row in json.loads(Path(tmp_path, f"rank{r}.json").read_text())]
    by = {(r["variant"], r["rank"]): r for r in rows}
    assert set(by) == {(v, r) for v in ("whole", "host", "device") for r in (0, 1)}
    for rank in (0, 1):
        whole, host, device = by[("whole", rank)], by[("host", rank)], by[("device", rank)]
        assert whole["pcie_bytes_per_rank"] == host["pcie_bytes_per_rank"] == 2 * whole["object_bytes"]
        assert whole["pcie_bytes_per_rank"] <= 2 * device["pcie_bytes_per_rank"] <= whole["pcie_bytes_per_rank"] + 256
        assert device["exchanged_bytes_per_rank"] == host["exchanged_bytes_per_rank"] == device["pcie_bytes_per_rank"]
        assert whole["exchanged_bytes_per_rank"] == 0
        assert 2 * host["stored_bytes_per_rank"] == 2 * device["stored_bytes_per_rank"] >= whole["stored_bytes_per_rank"]
    assert "deepseek-v4-flash" in _bench().table(rows)


def test_a_lost_share_fails_the_byte_check(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(str(tmp_path), True), nprocs=2, join=True)
    for rank in (0, 1):
        assert "differ from the stored ones" in Path(tmp_path, f"rank{rank}.error").read_text()
        assert not Path(tmp_path, f"rank{rank}.json").exists()


def test_the_exported_cuda_geometries_match_the_presets() -> None:
    pytest.importorskip("vllm", reason="presets are built from vLLM's spec classes")
    from lmcache_npu.tools.bench.geometry import geometry_of_plan, load_geometry
    from lmcache_npu.tools.bench.presets import materialize_preset

    bench = _bench()
    for name in bench.PRESETS:
        m, _, _ = materialize_preset(name, 1, torch.device("cpu"), device_family="cuda")
        fresh = geometry_of_plan(m.plan, name).to_dict()
        stored = load_geometry(bench.GEOMETRIES / f"{name}.json").to_dict()
        fresh.pop("notes"), stored.pop("notes")
        assert stored == fresh, f"{name}: re-export with the export_geometry study, --device-family cuda"
        tampered = dict(fresh, chunk_tokens=fresh["chunk_tokens"] * 2)
        assert stored != tampered, "the comparison notices a changed field"

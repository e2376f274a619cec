"""The CUDA backend's knobs as backend options: each addressed by its name, checked by its type, refused naming its
key (no GPU needed: the tuning is checked before the backend looks for a device)."""

from __future__ import annotations

import dataclasses

import pytest

from lmcache_npu.config import check_backend_options
from lmcache_npu.ops.backend import backend_class
from lmcache_npu.ops.cuda.tuning import CudaPath, CudaTuning

KNOBS = ["path", "blocks", "threads", "pipeline", "piece_bytes", "store_first_slice_bytes", "store_slice_growth",
         "load_tail_bytes", "load_tail_share", "pipelined_blocks", "store_mapped_prefix_share",
         "load_mapped_prefix_share"]


def test_every_knob_is_a_backend_option_by_its_name() -> None:
    assert backend_class("cuda").option_names() == KNOBS
    check_backend_options("cuda", {knob: getattr(CudaTuning(), knob) for knob in KNOBS})


def test_options_become_typed_knobs() -> None:
    tuning = CudaTuning.from_options({"path": "staging", "blocks": None, "threads": 256, "pipeline": False,
                                      "store_mapped_prefix_share": 0})
    assert tuning.path is CudaPath.STAGING and tuning.path == "staging"
    assert (tuning.blocks, tuning.threads, tuning.pipeline, tuning.store_mapped_prefix_share) == (None, 256, False, 0)
    assert dataclasses.replace(tuning, path="mapped").path is CudaPath.MAPPED


@pytest.mark.parametrize("options, message", [
    ({"path": "device"}, "backend_options.path must be one of auto, mapped, staging, got 'device'"),
    ({"path": "fast"}, "backend_options.path must be one of auto, mapped, staging, got 'fast'"),
    ({"threads": "256"}, "backend_options.threads must be an integer, got '256'"),
    ({"piece_bytes": 1.5}, "backend_options.piece_bytes must be an integer, got 1.5"),
    ({"blocks": True}, "backend_options.blocks must be an integer or null, got True"),
    ({"pipeline": 1}, "backend_options.pipeline must be true or false or null, got 1"),
    ({"bogus": 1}, "backend_options: 'bogus' not accepted by the cuda backend; valid options: path, blocks"),
])
def test_a_bad_option_is_refused_naming_its_key(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        CudaTuning.from_options(options)


def test_config_refuses_an_unknown_cuda_option() -> None:
    with pytest.raises(ValueError, match="'blockz' not accepted by the cuda backend"):
        check_backend_options("cuda", {"blockz": 4})

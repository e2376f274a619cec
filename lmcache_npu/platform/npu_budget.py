"""What the plugin takes from an Ascend NPU's memory and cores, stated once for the backend, the share exchange and
`doctor` (docs/kernels.md §4 says why each number is what it is)."""

from __future__ import annotations

# Vector cores the transfer kernel launches by default. On the staging path the kernel only gathers HBM -> HBM and the
# copy engine crosses the host link; 16 AIVs gather a window in about 1/8 of its PCIe time and leave the rest of the
# 40-48 AIVs to the model (docs/kernels.md §4).
TRANSFER_CORES_DEFAULT = 16
# The device staging window each transfer lane keeps (host chunk objects pass through it; larger batches are moved
# in several windows, back to back on the lane's stream): 64 MiB is ~1.3 ms of a 50 GB/s link, so the per-window
# launch and copy set-up (tens of microseconds) stays a few percent.
STAGING_WINDOW_BYTES_DEFAULT = 64 << 20
# How long one transfer may take before the lane gives up on it (a load then recomputes): a window moves in
# milliseconds, so a minute only passes when torch_npu's task queue or the device has stalled.
TRANSFER_WAIT_TIMEOUT_MS_DEFAULT = 60_000
# Transfer lanes per worker (one loads, one stores), each with its own staging window.
TRANSFER_LANES = 2
# HCCL buffer of each communicator the TP share exchange makes (HCCL takes 2 x this per communicator; its default is
# 200 MB). Shares of one load are a few MB; HCCL moves a collective larger than its buffer through it in pieces.
HCCL_SHARE_BUFFER_MB = 16

"""The collectives follow the rank's device, not the machine: gloo for CPU tensors, NCCL for CUDA ones, even on a
machine with a GPU (`torch.cuda.is_available` patched to True here); and every tensor DP attention's gather hands
to a collective lives on its input's device (a CPU-made count under NCCL would fail). Without processes: the
collectives are replaced by recorders (NCCL itself is checked on a GPU by bench/gpu_check.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from radixk3.parallel import ParallelState, collective_backend, dp_gather, init_parallel, set_parallel_state


class _Stop(Exception):
    """Raised by a recorder where a real collective would block on its peers."""


def test_backend_is_the_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine
    assert collective_backend("cpu") == collective_backend(torch.device("cpu")) == "gloo"
    assert collective_backend("cuda") == collective_backend("cuda:1") == "nccl"
    chosen: list[str] = []

    def init(backend: str, **_: Any) -> None:
        chosen.append(backend)
        raise _Stop

    monkeypatch.setattr(dist, "init_process_group", init)
    for device in ({}, {"device": "cpu"}):  # --device cpu --tp 2 (and a caller that names no device)
        with pytest.raises(_Stop):
            init_parallel(0, 2, "tcp://127.0.0.1:1", **device)
    assert chosen == ["gloo", "gloo"]


class _Recorder:
    """all_reduce / all_gather as two attention groups of two ranks would see them, recording each tensor's
    device: rank r of the group holds `rows[r // 2]` rows."""

    def __init__(self, rows: list[int], hidden: int) -> None:
        self.rows, self.hidden = rows, hidden
        self.devices: list[torch.device] = []

    def all_reduce(self, t: torch.Tensor, **_: Any) -> None:
        self.devices.append(t.device)
        if t.device.type == "meta":
            raise _Stop  # nothing to fill in: the device is what this records
        t.copy_(torch.tensor([self.rows[r // 2] for r in range(4)]))

    def all_gather(self, parts: list[torch.Tensor], t: torch.Tensor, **_: Any) -> None:
        self.devices += [t.device, *(p.device for p in parts)]
        for r, p in enumerate(parts):
            p.zero_()
            p[: self.rows[r // 2]] = r // 2 + 1  # group g's rows hold g + 1


def test_dp_gather_tensors_live_on_the_inputs_device(monkeypatch: pytest.MonkeyPatch) -> None:
    set_parallel_state(ParallelState(tp_rank=2, tp_size=4, dp_size=2))  # group 1, attention TP 2
    try:
        rec = _Recorder([3, 2], hidden=5)
        monkeypatch.setattr(dist, "all_reduce", rec.all_reduce)
        monkeypatch.setattr(dist, "all_gather", rec.all_gather)
        with pytest.raises(_Stop):  # the count exchange, on a device that is not the CPU
            dp_gather(torch.empty(2, 5, device="meta"))
        assert rec.devices == [torch.device("meta")]
        rec.devices.clear()
        got = dp_gather(torch.full((2, 5), 2.0))  # and the whole gather on the CPU
        assert (got.start, got.count) == (3, 2) and got.rows.tolist() == [[1.0] * 5] * 3 + [[2.0] * 5] * 2
        assert set(rec.devices) == {torch.device("cpu")}
    finally:
        set_parallel_state(ParallelState())

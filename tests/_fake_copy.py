"""The host-to-device copy of a machine without a GPU, for the offload tests: a new tensor with the same values,
counted (``Offload(device_copy=FakeDeviceCopy())`` runs the offloaded step's whole path on the CPU)."""

import torch


class FakeDeviceCopy:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.calls += 1
        return t.to(device, copy=True)

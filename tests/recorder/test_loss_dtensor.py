"""``h.loss()`` with a DTensor loss (``recorder/step.py``): torch's ``loss_parallel`` cross entropy is a
DTensor replicated over ``tp``, whose value is its local tensor; a loss with another placement (a partial
sum) is made whole first. The trace's summed loss is a plain float either way (``StepState.summed_loss``
crashed on a DTensor: ``.tolist()`` of a tensor subclass). The real DTensor path runs in
``tests/replay/test_tp_loss_parallel.py``; here the two branches, with stand-ins for the placements."""

from __future__ import annotations

import dataclasses

import torch

from sdc_forensics.recorder.step import StepRecording, StepState


@dataclasses.dataclass
class _Placement:
    replicate: bool

    def is_replicate(self) -> bool:
        return self.replicate


class _LossDTensor:
    """What ``h.loss`` reads of a DTensor: its mesh, placements, local part and whole value."""

    def __init__(self, local: float, whole: float, replicate: bool) -> None:
        self.device_mesh = object()
        self.placements = (_Placement(replicate),)
        self._local, self._whole = torch.tensor(local), torch.tensor(whole)

    def to_local(self) -> torch.Tensor:
        return self._local

    def full_tensor(self) -> torch.Tensor:
        return self._whole


def test_a_replicated_dtensor_loss_is_kept_as_its_local_value_and_a_partial_one_made_whole():
    state = StepState(step=0, ids=None)
    handle = StepRecording(state, injector=None, seed=0)
    handle.loss(_LossDTensor(local=1.5, whole=9.0, replicate=True))
    handle.loss(_LossDTensor(local=0.25, whole=0.5, replicate=False))
    handle.loss(torch.tensor(2.0))
    assert state.summed_loss() == 1.5 + 0.5 + 2.0

"""The conv net with BatchNorm: a job whose state holds buffers that DDP broadcasts (issue 21).

The same job as ``sdc_forensics.demo.convnet`` (three ``Conv2d`` blocks, ReLU, SGD with momentum
0.9, clipping, ``StepLR``), with ``BatchNorm2d`` after each convolution instead of
``GroupNorm``. In training mode BatchNorm normalises with the batch's own statistics and updates
its buffers (``running_mean``, ``running_var``, ``num_batches_tracked``) in place; DDP
(``broadcast_buffers=True``, its default) overwrites every rank's buffers with rank 0's before the
first forward of each step. So the buffers a checkpoint holds are rank 0's, updated by rank 0's
microbatches only, and a replay reproduces them only if it models that broadcast
(``sdc_forensics.replay.buffers``).

Referenced as ``sdc_forensics.demo.batchnorm:recipe``.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from sdc_forensics.demo.convnet import ConvNetRecipe

#: The reference the recorder writes into the manifest for this recipe.
REFERENCE = "sdc_forensics.demo.batchnorm:recipe"


@dataclasses.dataclass(kw_only=True)
class BatchNormRecipe(ConvNetRecipe):
    """The conv net job with ``BatchNorm2d`` (running statistics in the state and the checkpoint)."""

    bn_momentum: float = 0.1

    def norm(self, channels: int) -> nn.Module:
        """``BatchNorm2d``: affine, with running statistics (buffers DDP broadcasts from rank 0)."""
        return nn.BatchNorm2d(channels, momentum=self.bn_momentum)


#: The instance referenced as ``sdc_forensics.demo.batchnorm:recipe``.
recipe = BatchNormRecipe()

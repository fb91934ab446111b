"""Adapters that record a training framework's job in two lines (docs/integrations.md).

One module per framework, each imported only when used, so that ``import sdc_forensics`` never
pulls a framework in:

* :mod:`sdc_forensics.integrations.hf`: the Hugging Face ``Trainer`` (``pip install 'sdc-forensics[hf]'``);
* :mod:`sdc_forensics.integrations.accelerate`: an ``accelerate.Accelerator`` loop
  (``pip install 'sdc-forensics[accelerate]'``);
* :mod:`sdc_forensics.integrations.lightning`: a Lightning ``Trainer`` with ``DDPStrategy``;
* :mod:`sdc_forensics.integrations.torchtitan`: the FSDP2 online checks in a torchtitan
  ``Trainer`` (it records nothing yet: the FSDP2 recorder is not built);
* :mod:`sdc_forensics.integrations.deepspeed`: a ``DeepSpeedEngine`` under ZeRO 1, 2 or 3 (``pip install 'sdc-forensics[deepspeed]'``);

Each adapter builds the ordinary :class:`~sdc_forensics.recorder.Recorder` on the framework's DDP
model and names a replay recipe generated from what the framework was configured with, so the
unchanged CLI (``bisect``, ``certify``, ``verify-checkpoint``) reads, replays and certifies the
trace. What a framework does that an adapter cannot see or replay is refused when it attaches,
with one line, before anything is written (never a silent partial trace).
"""

__all__: list[str] = []

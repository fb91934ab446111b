"""One rank of the Slurm drills' training job: ``srun`` starts one task per rank.

The demo's training loop (``sdc_forensics.demo.run``: the recorder attached, faults injected,
``exit_on_alarm`` around it, so a run stopped by an online check exits 18) with the rank and
world size taken from Slurm (``SLURM_PROCID``, ``SLURM_NTASKS``) and the rendezvous from
``MASTER_PORT``; the recorder notes ``SLURM_JOB_ID`` and ``SLURMD_NODENAME`` in the manifest.
``--resume-certificate FILE`` resumes from the checkpoint a ``certify --certificate-out`` file
names (its ``resume_step``), as a job's resume logic would.

    python -m tests.slurm.train_task --out RUN [--steps 8] [--checkpoint-every 2] [--inject SPEC] [--resume-certificate FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--checkpoint-every", type=int, default=2)
    parser.add_argument("--inject", action="append", default=[])
    parser.add_argument("--resume-certificate", type=Path)
    args = parser.parse_args(argv)

    from sdc_forensics.demo.run import DemoConfig, _worker
    from sdc_forensics.inject import parse_specs

    rank, world_size = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    resume = json.loads(args.resume_certificate.read_text())["resume_step"] if args.resume_certificate else None
    print(
        f"train_task: rank {rank} of {world_size} on node {os.environ.get('SLURMD_NODENAME', '?')}"
        + (f", resuming from checkpoint {resume}" if resume is not None else ""),
        file=sys.stderr,
        flush=True,
    )
    config = DemoConfig(
        out_dir=args.out,
        injections=parse_specs(tuple(args.inject)) if args.inject else (),
        steps=args.steps,
        checkpoint_every=args.checkpoint_every,
        world_size=world_size,
        policy="raise",
        resume_from=resume,
    )
    (args.out / "demo").mkdir(
        parents=True, exist_ok=True
    )  # each rank's report: what run_config makes before it starts the ranks
    _worker(rank, config, int(os.environ["MASTER_PORT"]))


if __name__ == "__main__":
    main()

"""``sdc-forensics demo``: the whole story on CPU, nothing to configure.

Runs a 4-process ``gloo`` DDP job of the demo recipe with the recorder attached and a fault
injected, then says what happened and what to run next. ``--json`` prints the ground truth.
"""

from __future__ import annotations

from pathlib import Path

import click

from sdc_forensics.cli.common import stdout_is_data
from sdc_forensics.cli.output import emit_json, err


@click.command("demo")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("sdc-demo"),
    show_default=True,
    help="Output directory (trace/, checkpoints/); must not hold a previous demo.",
)
@click.option(
    "--inject",
    "injections",
    multiple=True,
    metavar="SPEC",
    help="Fault LOCATION:step=S:rank=R:bit=B[:element=I], repeatable; 'none' for a clean run. "
    "Locations: grad, allreduce, allreduce-all, weights, update, input, checkpoint-file. "
    "Default: grad:step=23:rank=2:bit=30 (scaled to --steps).",
)
@click.option("--steps", type=int, default=40, show_default=True, help="Optimizer steps.")
@click.option(
    "--checkpoint-every",
    type=int,
    default=10,
    show_default=True,
    help="Checkpoint interval (checkpoint 0 is the initial state).",
)
@click.option("--audit-every", type=int, default=5, show_default=True, help="Audit every N-th step (0: no audits).")
@click.option(
    "--policy",
    type=click.Choice(["continue", "raise"]),
    default="continue",
    show_default=True,
    help="On an online alarm: record and continue (so bisect has a run to examine), or stop.",
)
@click.option(
    "--recipe",
    default=None,
    metavar="MOD:ATTR",
    help="Recipe to train (default: the demo MLP). sdc_forensics.demo.convnet:recipe is a conv net whose "
    "last bits depend on the thread count.",
)
@click.option(
    "--threads",
    default=None,
    metavar="N|N0,N1,N2,N3",
    help="Intra-op CPU threads per rank: one count for all, or one per rank.  [default: 1]",
)
@click.option(
    "--parallel",
    type=click.Choice(["ddp", "fsdp", "hsdp", "tp", "pp", "3d"]),
    default="ddp",
    show_default=True,
    help="How the 4 processes split the model: DDP replicas, FSDP2 shards (fully_shard), HSDP (2 replicas "
    "x 2 shards), tensor parallel 2 x FSDP2 2 (a transformer, sequence parallel), or pipeline parallel 2 x FSDP2 2 "
    "(a transformer in 2 stages, Schedule1F1B, 4 microbatches), or 3d: PP 2 x FSDP2 2 x TP 2 on 8 processes. Sharded locations: local-gradient, reduce-scatter-output, "
    "all-reduce-output (hsdp), all-gather-output, weights, update, input (tp, pp, 3d: a token id); with pp also "
    "pp-activation (a flip of the activation a stage hands to the next, ranks 0 and 1); with tp and 3d also tp-collective (a flip of a TP rank's row-parallel reduce-scatter output in the forward).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the ground truth as JSON on stdout.")
@stdout_is_data
def demo_cmd(
    out_dir: Path,
    injections: tuple[str, ...],
    steps: int,
    checkpoint_every: int,
    audit_every: int,
    policy: str,
    recipe: str | None,
    threads: str | None,
    parallel: str,
    as_json: bool,
) -> None:
    """Run a 4-process DDP (or FSDP2, HSDP, TP, PP) job on CPU with an injected fault, recorded for bisect."""
    from sdc_forensics.demo.run import RECIPE_REFERENCE, DemoConfig, default_injection, run_config
    from sdc_forensics.errors import UsageError
    from sdc_forensics.inject import parse_specs
    from sdc_forensics.present.demo import demo_document, render_demo, render_demo_start

    if steps < 1 or checkpoint_every < 1:
        raise UsageError(f"--steps and --checkpoint-every must be >= 1 (got {steps} and {checkpoint_every})")
    if parallel != "ddp":
        _sharded_demo(out_dir, parallel, injections, steps, checkpoint_every, policy, recipe, threads, as_json)
        return
    specs = parse_specs(injections or (default_injection(steps, checkpoint_every),))
    config = DemoConfig(
        out_dir=out_dir,
        injections=specs,
        steps=steps,
        checkpoint_every=checkpoint_every,
        world_size=4,
        audit_every=audit_every,
        policy=policy,
        recipe=recipe or RECIPE_REFERENCE,
        threads=_parse_threads(threads, 4),
        # every usage error (specs against the model too) surfaces here, before anything runs
    )
    render_demo_start(config, err)
    result = run_config(config)
    render_demo(result, err)
    if as_json:
        emit_json(demo_document(result))


def _sharded_demo(
    out_dir: Path,
    parallel: str,
    injections: tuple[str, ...],
    steps: int,
    checkpoint_every: int,
    policy: str,
    recipe: str | None,
    threads: str | None,
    as_json: bool,
) -> None:
    """``--parallel fsdp|hsdp|tp|pp``: the sharded job (``demo/sharded.py``, ``demo/tp.py``, ``demo/pp.py``),
    then what to run next."""
    from sdc_forensics.demo import sharded
    from sdc_forensics.errors import UsageError
    from sdc_forensics.inject import FSDP_LOCATIONS, LOCATIONS, PP_LOCATIONS, TP_LOCATIONS, parse_spec

    refused = [flag for flag, given in (("--recipe", recipe), ("--threads", threads), ("--json", as_json)) if given]
    if refused:
        raise UsageError(
            f"{', '.join(refused)} go with the DDP demo; the sharded demo trains its own model on 1 thread per rank"
        )
    texts = (
        [t for t in injections if t.strip().lower() != "none"]
        if injections
        else [sharded.default_injection(steps, checkpoint_every)]
    )
    # every spec checked before anything runs
    for text in texts:
        # tp-collective: the TP demo's own drill (demo/tp.py), a flip inside a TP collective
        own = {"tp": TP_LOCATIONS, "pp": PP_LOCATIONS, "3d": PP_LOCATIONS + TP_LOCATIONS}.get(parallel, ())
        world = 8 if parallel == "3d" else 4
        spec = parse_spec(text, LOCATIONS + FSDP_LOCATIONS + own)
        if spec.location in ("grad", "allreduce", "allreduce-all", "checkpoint-file"):
            raise UsageError(
                f"fault spec {text!r}: {spec.location} is a DDP location; a sharded job's are "
                f"{', '.join(FSDP_LOCATIONS)}, weights, update, input"
            )
        if spec.location == "pp-activation" and spec.rank >= world // 2:
            raise UsageError(
                f"fault spec {text!r}: ranks {world // 2} to {world - 1} run the last stage, which hands no activation "
                f"on: use a rank below {world // 2}"
            )
        if not 0 <= spec.step < steps or not 0 <= spec.rank < world:
            raise UsageError(f"fault spec {text!r}: step must be in 0..{steps - 1} and rank in 0..{world - 1}")
    err.print(
        f"[bold]sdc-forensics demo[/]: {8 if parallel == '3d' else 4} processes on CPU, {parallel.upper()} "
        f"({ {'fsdp': 'mesh 4', 'hsdp': 'mesh 2 replicas x 2 shards', 'tp': 'mesh 2 dp x 2 tp', 'pp': 'mesh 2 pp x 2 dp', '3d': 'mesh 2 pp x 2 dp x 2 tp'}[parallel] }), {steps} steps, "
        f"DCP checkpoints every "
        f"{checkpoint_every}; fault: {', '.join(texts) or 'none'}"
    )
    if parallel == "tp":
        from sdc_forensics.demo import tp

        found = tp.run_demo(out_dir, tuple(texts), steps=steps, checkpoint_every=checkpoint_every, policy=policy)
    elif parallel in ("pp", "3d"):
        from sdc_forensics.demo import pp

        found = pp.run_demo(
            out_dir,
            tuple(texts),
            steps=steps,
            checkpoint_every=checkpoint_every,
            policy=policy,
            tp=2 if parallel == "3d" else 1,
        )
    else:
        found = sharded.run_demo(
            out_dir, parallel, tuple(texts), steps=steps, checkpoint_every=checkpoint_every, policy=policy
        )
    for alarm in found["alarms"][:3]:
        who = f"rank {alarm['rank']}" if alarm["rank"] >= 0 else "no single rank"
        err.print(f"online check fired: {alarm['check']} at step {alarm['step']}, {who}")
    if len(found["alarms"]) > 3:
        err.print(f"... and {len(found['alarms']) - 3} more alarm(s) (the trace holds them all: sdc-forensics inspect)")
    if not found["alarms"]:
        err.print(
            "online checks: nothing fired (a finite wrong value that every replica then shares is seen by a replay only)"
        )
    err.print(f"trace: {out_dir / 'trace'}   checkpoints: {out_dir / 'checkpoints'}")
    if parallel == "tp":
        # the one-process replay of a TP job is tolerant (it certifies nothing); the TP processes' replay is exact
        err.print(
            f"next: torchrun --standalone --nproc-per-node 2 -m sdc_forensics bisect {out_dir / 'trace'}   "
            "(the job's TP plan on 2 processes, exact; plain `sdc-forensics bisect` is tolerant)"
        )
    elif parallel in ("pp", "3d"):
        # a pipeline job at its layout: one stage per process (x TP), exact; one process holds the whole model
        need, other = (
            (2, "plain `sdc-forensics bisect`: the whole model on one process")
            if parallel == "pp"
            else (4, "--nproc-per-node 2: the TP plan on the whole model")
        )
        err.print(
            f"next: torchrun --standalone --nproc-per-node {need} -m sdc_forensics bisect {out_dir / 'trace'}   "
            f"(the job's layout, one stage per process, exact; also exact, {other})"
        )
    else:
        err.print(f"next: sdc-forensics bisect {out_dir / 'trace'}")


def _parse_threads(text: str | None, world_size: int) -> tuple[int, ...] | None:
    """``--threads``: ``N`` for every rank, or ``N0,N1,...`` one per rank."""
    from sdc_forensics.errors import UsageError

    if text is None:
        return None
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(
            f"--threads {text!r} is not a count or a comma-separated count per rank (e.g. 2 or 1,2,1,1)"
        ) from None
    return counts * world_size if len(counts) == 1 else counts

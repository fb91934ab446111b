"""``sdc-forensics demo``: the whole story on CPU, nothing to configure.

Runs a 4-process ``gloo`` DDP job of the demo recipe with the recorder attached and a fault
injected, then says what happened and what to run next. ``--json`` prints the ground truth.
"""

from __future__ import annotations

from pathlib import Path

import click

from sdc_forensics.cli.output import emit_json, err


@click.command("demo")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("sdc-demo"), show_default=True,
              help="Output directory (trace/, checkpoints/); must not hold a previous demo.")
@click.option("--inject", "injections", multiple=True, metavar="SPEC",
              help="Fault LOCATION:step=S:rank=R:bit=B[:element=I], repeatable; 'none' for a clean run. "
              "Locations: grad, allreduce, allreduce-all, weights, update, input, checkpoint-file. "
              "Default: grad:step=23:rank=2:bit=30 (scaled to --steps).")
@click.option("--steps", type=int, default=40, show_default=True, help="Optimizer steps.")
@click.option("--checkpoint-every", type=int, default=10, show_default=True, help="Checkpoint interval (checkpoint 0 is the initial state).")
@click.option("--audit-every", type=int, default=5, show_default=True, help="Audit every N-th step (0: no audits).")
@click.option("--policy", type=click.Choice(["continue", "raise"]), default="continue", show_default=True,
              help="On an online alarm: record and continue (so bisect has a run to examine), or stop.")
@click.option("--recipe", default=None, metavar="MOD:ATTR",
              help="Recipe to train (default: the demo MLP). sdc_forensics.demo.convnet:recipe is a conv net whose "
              "last bits depend on the thread count.")
@click.option("--threads", default=None, metavar="N|N0,N1,N2,N3",
              help="Intra-op CPU threads per rank: one count for all, or one per rank.  [default: 1]")
@click.option("--json", "as_json", is_flag=True, help="Print the ground truth as JSON on stdout.")
def demo_cmd(out_dir: Path, injections: tuple[str, ...], steps: int, checkpoint_every: int, audit_every: int, policy: str,
             recipe: str | None, threads: str | None, as_json: bool) -> None:
    """Run a 4-process DDP job on CPU with an injected fault, recorded for bisect."""
    from sdc_forensics.demo.run import RECIPE_REFERENCE, DemoConfig, default_injection, run_config
    from sdc_forensics.errors import UsageError
    from sdc_forensics.inject import parse_specs

    if steps < 1 or checkpoint_every < 1:
        raise UsageError(f"--steps and --checkpoint-every must be >= 1 (got {steps} and {checkpoint_every})")
    specs = parse_specs(injections or (default_injection(steps, checkpoint_every),))
    config = DemoConfig(out_dir=out_dir, injections=specs, steps=steps, checkpoint_every=checkpoint_every, world_size=4,
                        audit_every=audit_every, policy=policy, recipe=recipe or RECIPE_REFERENCE,
                        threads=_parse_threads(threads, 4))  # every usage error surfaces here, before anything runs
    err.print(f"[bold]sdc-forensics demo[/]: 4 ranks, gloo on CPU, {steps} steps, checkpoint every {checkpoint_every} → {out_dir}")
    result = run_config(config)
    cfg = result.config
    if cfg.injections:
        for fired in result.fired:
            err.print(f"  injected [bold]{fired['spec']}[/]: element {fired['element']} went {fired['old']:.6g} → {fired['new']:.6g}"
                      + (f" ({fired['detail']})" if fired["detail"] else ""))
        unfired = {str(s) for s in cfg.injections} - {f["spec"] for f in result.fired}
        for spec in sorted(unfired):
            err.print(f"  [yellow]not injected[/] {spec} (the run stopped before it, or nothing was there)")
    else:
        err.print("  no fault injected (clean run)")
    if result.alarms:
        for alarm in result.alarms:
            err.print(f"  [red]online {alarm['check']} check fired[/] at step {alarm['step']}: {alarm['detail']}")
    else:
        err.print("  online checks: no alarm (policy: record and continue)")
    if result.raised:
        err.print(f"  [red]training stopped[/]: {result.raised['message']}")
    err.print(f"  checkpoints: {', '.join(str(s) for s in result.checkpoints)} in {cfg.checkpoint_dir}")
    err.print(f"  finished in {result.wall_s:.1f} s")
    err.print(f"\nNext: [bold]sdc-forensics bisect {cfg.trace_dir}[/]  (finds the first divergent step, the rank and the last clean checkpoint)")
    if as_json:
        emit_json(result.to_json())


def _parse_threads(text: str | None, world_size: int) -> tuple[int, ...] | None:
    """``--threads``: ``N`` for every rank, or ``N0,N1,...`` one per rank."""
    from sdc_forensics.errors import UsageError

    if text is None:
        return None
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"--threads {text!r} is not a count or a comma-separated count per rank (e.g. 2 or 1,2,1,1)") from None
    return counts * world_size if len(counts) == 1 else counts

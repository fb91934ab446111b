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
    from sdc_forensics.present.demo import demo_document, render_demo, render_demo_start

    if steps < 1 or checkpoint_every < 1:
        raise UsageError(f"--steps and --checkpoint-every must be >= 1 (got {steps} and {checkpoint_every})")
    specs = parse_specs(injections or (default_injection(steps, checkpoint_every),))
    config = DemoConfig(out_dir=out_dir, injections=specs, steps=steps, checkpoint_every=checkpoint_every, world_size=4,
                        audit_every=audit_every, policy=policy, recipe=recipe or RECIPE_REFERENCE,
                        threads=_parse_threads(threads, 4))  # every usage error (specs against the model too) surfaces here, before anything runs
    render_demo_start(config, err)
    result = run_config(config)
    render_demo(result, err)
    if as_json:
        emit_json(demo_document(result))


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

"""Rendering of a demo run (:class:`~sdc_forensics.demo.run.DemoResult`) for people: what was
injected, what the online checks saw, where the files are and what to run next.

The text goes to the stderr console of ``cli/output.py``; ``demo --json`` prints
``DemoResult.to_json()`` on stdout. Neither changes the result.
"""

from __future__ import annotations

from rich.markup import escape

from sdc_forensics.demo.run import DemoConfig, DemoResult


def render_demo_start(config: DemoConfig, console) -> None:
    """One line before the run starts: its size and where it writes."""
    console.print(
        f"[bold]sdc-forensics demo[/]: {config.world_size} ranks, gloo on CPU, {config.steps} steps, "
        f"checkpoint every {config.checkpoint_every} → {escape(str(config.out_dir))}"
    )


def render_demo(result: DemoResult, console) -> None:
    """The summary after the run: faults fired, alarms, checkpoints, the next command."""
    from sdc_forensics.recorder.exit import ALARM_EXIT_CODE

    cfg = result.config
    if cfg.injections:
        for fired in result.fired:
            console.print(
                f"  injected [bold]{escape(fired['spec'])}[/]: element {fired['element']} went {fired['old']:.6g} → {fired['new']:.6g}"
                + (f" ({escape(fired['detail'])})" if fired["detail"] else "")
            )
        unfired = {str(s) for s in cfg.injections} - {f["spec"] for f in result.fired}
        for spec in sorted(unfired):
            console.print(f"  [yellow]not injected[/] {escape(spec)} (the run stopped before it, or nothing was there)")
    else:
        console.print("  no fault injected (clean run)")
    if result.alarms:
        for alarm in result.alarms:
            console.print(
                f"  [red]online {alarm['check']} check fired[/] at step {alarm['step']}: {escape(alarm['detail'])}"
            )
    else:
        console.print(
            f"  online checks: no alarm (policy: {'stop' if cfg.policy == 'raise' else 'record and continue'})"
        )
    if result.raised:
        console.print(f"  [red]training stopped[/]: {escape(result.raised['message'])}")
        stopped = [rank for rank, code in enumerate(result.exit_codes) if code == ALARM_EXIT_CODE]
        if stopped:
            console.print(
                f"  rank(s) {', '.join(map(str, stopped))} exited with code {ALARM_EXIT_CODE} "
                "(sdc_forensics.recorder.exit_on_alarm, for launchers and epilogs)"
            )
    console.print(
        f"  checkpoints: {', '.join(str(s) for s in result.checkpoints)} in {escape(str(cfg.checkpoint_dir))}"
    )
    console.print(f"  finished in {result.wall_s:.1f} s")
    console.print(
        f"\nNext: [bold]sdc-forensics bisect {escape(str(cfg.trace_dir))}[/]  "
        "(finds the first divergent step, the rank and the last clean checkpoint)"
    )


def demo_document(result: DemoResult) -> dict:
    """The ``--json`` document of ``demo``: the ground truth (docs/json.md, docs/schemas/demo.schema.json)."""
    return result.to_json()

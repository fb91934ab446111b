"""The demo job: a W-process ``gloo`` DDP run on CPU of a recipe, recorded, with injected faults.

:func:`run_demo` is what ``sdc-forensics demo`` runs and what tests call. It spawns ``W``
processes (one intra-op thread each unless told otherwise), trains ``steps`` optimizer steps of
a recipe (the demo MLP by default; ``sdc_forensics.demo.convnet:recipe`` is a conv net whose
last bits depend on the thread count) with gradient accumulation (``no_sync`` on all but the
last microbatch) and the recipe's ``before_step``/``after_step`` hooks around the update (as
replay runs them), writes ``OUT/trace/`` and a checkpoint every ``checkpoint_every`` steps to
``OUT/checkpoints/step-NNNNNNNN.pt`` (checkpoint N holds theta_N; checkpoint 0 is the initial
state, with the scheduler's state when the recipe has one), and returns the ground truth. A run
resumed from checkpoint N > 0 gives its new DDP the bucket layout of the uninterrupted run first
(:func:`rebuild_buckets`), so that it re-executes steps N.. bit for bit. Each process leaves a small
JSON report in ``OUT/demo/``. Nothing is left running: on a failure, a hang past the timeout or a
killed rank, every remaining process is killed before :func:`run_demo` returns or raises.

Over 400 lines on purpose: the launcher and the worker of one job share its configuration type and
its exit protocol (which rank failed, killed or hung, and how that is reported).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import signal
import time
from pathlib import Path

from sdc_forensics import recipe as recipe_mod
from sdc_forensics.errors import SdcError, UsageError
from sdc_forensics.demo import forked
from sdc_forensics.demo.ports import free_port
from sdc_forensics.demo.targets import check_injections
from sdc_forensics.inject import FaultSpec, parse_specs
from sdc_forensics.newfile import write_atomic
from sdc_forensics.trace.manifest import MANIFEST_NAME

RECIPE_REFERENCE = "sdc_forensics.demo.recipe:recipe"


def train_step(
    ddp, optimizer, recipe, microbatches, count: int, handle=None, scheduler=None, step: int | None = None
) -> None:
    """One DDP optimizer step: ``count`` microbatches accumulated under ``no_sync`` but the last.

    The update is ``recipe.before_step`` (clipping), ``optimizer.step()``, ``recipe.after_step``
    (the scheduler), in the order replay runs them (``sdc_forensics.recipe``).

    Args:
        ddp: the ``DistributedDataParallel`` model.
        optimizer: its optimizer.
        recipe: gives ``loss(model, microbatch)`` and the optional hooks.
        microbatches: the step's microbatches, in order (an iterable: fetched lazily).
        count: how many there are.
        handle: the recorder's step handle (``Recorder.step``), or None for an unrecorded step.
        scheduler: the recipe's scheduler (``build``'s third value), or None.
        step: the optimizer step, handed to hooks that declare a ``step`` parameter (as replay does).
    """
    for i, batch in enumerate(microbatches):
        if handle is not None:
            batch = handle.input(batch)
        with ddp.no_sync() if i < count - 1 else contextlib.nullcontext():
            loss = recipe.loss(ddp, batch)
            loss.backward()
        if handle is not None:
            handle.loss(loss)
    recipe_mod.before_step(recipe, ddp.module, optimizer, step=step)
    optimizer.step()
    recipe_mod.after_step(recipe, ddp.module, optimizer, scheduler, step=step)
    optimizer.zero_grad(set_to_none=True)


def rebuild_buckets(ddp, recipe, microbatch) -> None:
    """Bring a new DDP to the gradient bucket layout a run has from its second step on, with no
    trace of the pass that does it: what a resumed run needs to re-execute its steps bit for bit.

    DDP reduces its first iteration with one bucket in parameter order and then rebuilds its
    buckets in the order the gradients became ready; gloo's ring all-reduce adds the ranks in an
    order that depends on an element's offset in the bucket, so a run resumed at step N > 0 with a
    new DDP would reduce step N in the wrong layout and differ from the uninterrupted run in the
    last bits. One forward and backward of ``microbatch`` (synced, so the reducer notes the order)
    gives DDP that order, as step 0 gave it to the uninterrupted run; its gradients are dropped,
    the module's buffers (BatchNorm's statistics) and the RNG put back, the optimizer untouched.
    A collective: every rank calls it, before the recorder or a comm hook is attached.
    """
    import torch

    module = ddp.module
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    device = next(module.parameters()).device
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        recipe.loss(ddp, microbatch).backward()
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)
    for param in module.parameters():
        param.grad = None


def default_injection(steps: int = 40, checkpoint_every: int = 10) -> str:
    """The fault ``sdc-forensics demo`` injects unless told otherwise.

    An exponent flip (bit 30: x 2**128, still finite) of one element of rank 2's local gradient,
    inside the checkpoint interval that holds 60 % of the run, a few steps after its checkpoint:
    step 23 of the default 40 steps with checkpoints every 10.
    """
    base = (steps * 3 // 5) // checkpoint_every * checkpoint_every
    step = min(base + max(1, 3 * checkpoint_every // 10), steps - 1)
    return f"grad:step={step}:rank=2:bit=30"


DEFAULT_INJECTION = default_injection()


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """One demo run.

    Attributes:
        out_dir: output directory (``trace/``, ``checkpoints/``, ``demo/``).
        injections: faults to inject.
        steps: optimizer steps.
        checkpoint_every: checkpoint interval in steps (checkpoint 0 is always written).
        world_size: number of processes.
        policy: online-check policy; ``continue`` (default here) so the run finishes and bisect
            has something to find; ``raise`` stops every rank at the first alarm.
        audit_every: audit every N-th step (0: no audits).
        node_of_rank: pretend node map; default: every rank is its own node.
        record: attach the recorder (False trains the same job without it, for comparisons).
        kill_rank, kill_step, kill_point: SIGKILL rank ``kill_rank`` at ``kill_point`` of step
            ``kill_step`` (``demo/kill.py``; default ``after-record``: right after it recorded
            the step; ``checkpoint``: while checkpoint ``kill_step`` is written).
        kill_bytes: ``record-write``: bytes of the STEP record that reach the file (default: half).
        resume_from: resume an earlier run in ``out_dir`` from its checkpoint N (a new attempt
            that re-executes steps N..steps-1 into the same trace).
        timeout_s: the whole run is killed after this many seconds.
        recipe: the recipe trained and recorded in the manifest (``module:attribute``); it
            needs ``microbatch_ids(step, rank, world_size)`` besides the replay protocol.
        recipe_args: job settings for the recipe (``Recorder(recipe_args=...)``: recorded in
            the manifest, handed back to the recipe at replay); None: the recipe as referenced.
        threads: intra-op CPU thread count of each rank (None: 1 for every rank).
        reduction: the recorder's all-reduce mechanism (``native`` or ``ordered``, ``RecorderOptions.reduction``).
        comm_hook: ``module:attribute`` of a DDP comm hook the job uses (passed as
            ``Recorder(comm_hook=...)``); None: DDP's own mean all-reduce.
        device: ``cpu``, or ``cuda``: every rank on the one GPU ``cuda:0`` (gloo over CUDA tensors:
            NCCL refuses two ranks on one GPU), microbatches fetched onto it.
        replayable: every rank calls ``sdc_forensics.recorder.replayable()`` before joining the
            process group (deterministic kernels, the ordered reduction: ``reduction`` is ignored).
    """

    out_dir: Path
    injections: tuple[FaultSpec, ...] = ()
    steps: int = 40
    checkpoint_every: int = 10
    world_size: int = 4
    policy: str = "continue"
    audit_every: int = 0
    node_of_rank: tuple[int, ...] | None = None
    record: bool = True
    kill_rank: int | None = None
    kill_step: int | None = None
    kill_point: str = "after-record"
    kill_bytes: int | None = None
    resume_from: int | None = None
    timeout_s: float = 300.0
    recipe: str = RECIPE_REFERENCE
    threads: tuple[int, ...] | None = None
    recipe_args: dict | None = None
    reduction: str = "native"
    comm_hook: str | None = None
    device: str = "cpu"
    replayable: bool = False

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise UsageError(f"device must be cpu or cuda, got {self.device!r}")
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        from sdc_forensics.reduction import REDUCTIONS

        if self.reduction not in REDUCTIONS:
            raise UsageError(f"--reduction must be one of {', '.join(REDUCTIONS)}, got {self.reduction!r}")
        if self.comm_hook is not None:
            # an error now, not in every rank
            recipe_mod.import_reference(self.comm_hook, "comm hook")
        if self.threads is not None:
            object.__setattr__(self, "threads", tuple(int(t) for t in self.threads))
            if len(self.threads) != self.world_size or min(self.threads) < 1:
                raise UsageError(
                    f"threads must give a count >= 1 for each of the {self.world_size} ranks, got {', '.join(map(str, self.threads))}"
                )
        if self.recipe_args is not None:
            object.__setattr__(self, "recipe_args", recipe_mod.check_recipe_args(self.recipe_args))
        recipe = recipe_mod.load_recipe(self.recipe, args=self.recipe_args)
        if not callable(getattr(recipe, "microbatch_ids", None)):
            raise UsageError(
                f"recipe {self.recipe} has no microbatch_ids(step, rank, world_size); the demo needs it to pick each rank's data"
            )
        if self.steps < 1:
            raise UsageError(f"--steps must be >= 1, got {self.steps}")
        if self.checkpoint_every < 1:
            raise UsageError(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")
        if not 2 <= self.world_size <= 16:
            raise UsageError(f"world size must be in 2..16, got {self.world_size}")
        if self.resume_from is None and (self.trace_dir / MANIFEST_NAME).exists():
            raise UsageError(f"{self.out_dir} already holds a demo trace; pass a new --out directory")
        if self.resume_from is not None and not self.checkpoint_path(self.resume_from).is_file():
            raise UsageError(
                f"cannot resume from checkpoint {self.resume_from}: {self.checkpoint_path(self.resume_from)} does not exist"
            )
        self._check_kill()
        for spec in self.injections:
            if spec.rank >= self.world_size and not spec.every_rank:
                raise UsageError(
                    f"fault {spec}: rank {spec.rank} does not exist in a {self.world_size}-rank run (use rank=0..{self.world_size - 1})"
                )
            if spec.location == "checkpoint-file" and spec.step not in self.checkpoint_steps:
                raise UsageError(
                    f"fault {spec}: no checkpoint {spec.step} is written (checkpoints: {', '.join(map(str, self.checkpoint_steps))})"
                )
            elif spec.location != "checkpoint-file" and not self.first_step <= spec.step < self.steps:
                raise UsageError(
                    f"fault {spec}: step {spec.step} is outside the run (steps {self.first_step}..{self.steps - 1})"
                )
        # elements and bits, against the model the recipe builds
        check_injections(self, recipe)

    def _check_kill(self) -> None:
        from sdc_forensics.demo.kill import KillPoint

        points = [p.value for p in KillPoint]
        if self.kill_point not in points:
            raise UsageError(f"kill point {self.kill_point!r} is not one of {', '.join(points)}")
        if self.kill_rank is None:
            return
        if not 0 <= self.kill_rank < self.world_size or self.kill_step is None:
            raise UsageError(f"kill_rank {self.kill_rank} needs a rank in 0..{self.world_size - 1} and a kill_step")
        if self.kill_point == KillPoint.CHECKPOINT.value:
            if self.kill_step not in self.checkpoint_steps or self.kill_step == 0:
                raise UsageError(
                    f"kill_step {self.kill_step} is not a checkpoint written after a step (checkpoints: {', '.join(map(str, self.checkpoint_steps))})"
                )
        elif not self.first_step <= self.kill_step < self.steps:
            raise UsageError(
                f"kill_step {self.kill_step} is outside the run (steps {self.first_step}..{self.steps - 1})"
            )
        if self.kill_point == KillPoint.RECORD_WRITE.value and not self.record:
            raise UsageError("kill point record-write needs the recorder (record=True)")

    def threads_of(self, rank: int) -> int:
        """Intra-op CPU threads rank ``rank`` trains with."""
        return 1 if self.threads is None else self.threads[rank]

    @property
    def first_step(self) -> int:
        return self.resume_from or 0

    @property
    def checkpoint_steps(self) -> tuple[int, ...]:
        """Checkpoints written: 0, K, 2K, ... up to ``steps`` (a resumed run: only those after N)."""
        return tuple(
            s
            for s in range(0, self.steps + 1, self.checkpoint_every)
            if self.resume_from is None or s > self.resume_from
        )

    @property
    def trace_dir(self) -> Path:
        return self.out_dir / "trace"

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoints"

    def checkpoint_path(self, step: int) -> Path:
        return self.checkpoint_dir / f"step-{step:08d}.pt"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoResult:
    """Ground truth of a demo run (what ``--json`` prints)."""

    config: DemoConfig
    fired: tuple[dict, ...]
    alarms: tuple[dict, ...]
    raised: dict | None
    checkpoints: tuple[int, ...]
    final_weights_digests: tuple[str, ...]
    killed_rank: int | None
    wall_s: float
    #: each rank's process exit code: 0, or ``ALARM_EXIT_CODE`` (``sdc_forensics.recorder.exit``)
    #: when an alarm stopped it (policy ``raise``); not in ``to_json``
    exit_codes: tuple[int | None, ...] = ()

    def to_json(self) -> dict:
        """The JSON document (``cli.output.emit_json`` adds ``schema_version``)."""
        cfg = self.config
        doc = {
            "out_dir": str(cfg.out_dir),
            "trace_dir": str(cfg.trace_dir),
            "checkpoint_dir": str(cfg.checkpoint_dir),
            "recipe": cfg.recipe,
            "world_size": cfg.world_size,
            "steps": cfg.steps,
            "first_step": cfg.first_step,
            "checkpoint_every": cfg.checkpoint_every,
            "policy": cfg.policy,
            "injected": [str(s) for s in cfg.injections],
            "fired": list(self.fired),
            "alarms": list(self.alarms),
            "raised": self.raised,
            "checkpoints": [{"step": s, "path": str(cfg.checkpoint_path(s))} for s in self.checkpoints],
            "wall_s": round(self.wall_s, 2),
        }
        # only when set: the default run's document stays as it was
        if cfg.threads is not None:
            doc["threads"] = list(cfg.threads)
        if cfg.kill_rank is not None:
            doc["killed"] = {"rank": cfg.kill_rank, "step": cfg.kill_step, "point": cfg.kill_point}
        return doc


def run_demo(
    out_dir: str | os.PathLike,
    injections=(DEFAULT_INJECTION,),
    steps: int = 40,
    checkpoint_every: int = 10,
    world_size: int = 4,
    **options,
) -> DemoResult:
    """Run the demo job and return its ground truth.

    Args:
        out_dir: output directory (created; must not already hold a trace).
        injections: fault specs (strings or :class:`FaultSpec`); ``()`` or ``("none",)`` for a clean run.
        steps, checkpoint_every, world_size: the run's size.
        **options: further :class:`DemoConfig` fields (``policy``, ``audit_every``, ...).

    Raises:
        UsageError: bad arguments. SdcError: a process failed or the run timed out.
    """
    specs = tuple(s for s in injections if isinstance(s, FaultSpec)) + parse_specs(
        [s for s in injections if not isinstance(s, FaultSpec)]
    )
    config = DemoConfig(
        out_dir=Path(out_dir),
        injections=specs,
        steps=steps,
        checkpoint_every=checkpoint_every,
        world_size=world_size,
        **options,
    )
    return run_config(config)


def run_config(config: DemoConfig) -> DemoResult:
    """Run a validated :class:`DemoConfig` (see :func:`run_demo`)."""
    config.out_dir.mkdir(parents=True, exist_ok=True)
    (config.out_dir / "demo").mkdir(exist_ok=True)
    started = time.monotonic()
    exit_codes = _launch(config)
    return dataclasses.replace(_collect(config, time.monotonic() - started), exit_codes=exit_codes)


def _launch(config: DemoConfig) -> tuple[int | None, ...]:
    """Run the ranks; their exit codes (each 0 or the alarm exit code, unless it raises)."""
    port = free_port()
    # the ranks fork from a server that imported torch, torch._dynamo and the kernels once
    context = forked.start(_worker, (config, port), config.world_size, join=False)
    try:
        failed = _wait(context.processes, time.monotonic() + config.timeout_s, config.timeout_s)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
    if config.kill_rank is not None:
        # a planned kill: the others then fail on a collective or are ended here; what
        # matters is that the armed rank died of its SIGKILL
        code = context.processes[config.kill_rank].exitcode
        if code != -signal.SIGKILL:
            detail = f" ({_failure_text(context, failed)})" if failed is not None else ""
            raise SdcError(
                f"rank {config.kill_rank} was to be killed at {config.kill_point} of step {config.kill_step} "
                f"but exited with code {code}{detail}"
            )
    elif failed is not None:
        raise SdcError(
            f"a demo process failed: {_failure_text(context, failed)}; all its processes were killed"
        ) from None
    return tuple(p.exitcode for p in context.processes)


#: Seconds the other ranks get to finish after one rank stopped on an alarm (they raise together).
_ALARM_GRACE_S = 20.0


def _wait(processes, deadline: float, timeout_s: float) -> int | None:
    """Wait for the ranks; the index of the first that failed (None: all exited 0 or
    :data:`~sdc_forensics.recorder.exit.ALARM_EXIT_CODE`, the code of a run stopped by an alarm).

    ``torch.multiprocessing``'s ``join`` ends every rank as soon as one exits non-zero, which
    would kill the ranks still writing their report after the same alarm."""
    from multiprocessing.connection import wait

    from sdc_forensics.recorder.exit import ALARM_EXIT_CODE

    stopped_at: float | None = None
    while True:
        alive = [p for p in processes if p.exitcode is None]
        failed = next((i for i, p in enumerate(processes) if p.exitcode not in (None, 0, ALARM_EXIT_CODE)), None)
        if failed is not None or not alive:
            return failed
        now = time.monotonic()
        if stopped_at is None and any(p.exitcode == ALARM_EXIT_CODE for p in processes):
            stopped_at = now
        if now > deadline:
            raise SdcError(f"the demo run did not finish within {timeout_s:.0f} s; all its processes were killed")
        if stopped_at is not None and now - stopped_at > _ALARM_GRACE_S:
            raise SdcError(
                f"ranks stopped on an alarm but rank(s) {', '.join(str(processes.index(p)) for p in alive)} did not within "
                f"{_ALARM_GRACE_S:.0f} s; all its processes were killed"
            )
        wait([p.sentinel for p in alive], timeout=0.5)


def _failure_text(context, index: int) -> str:
    """What rank ``index`` died of: its traceback's last line (written by torch's process wrapper), else its exit code."""
    import pickle

    path = context.error_files[index]
    if os.access(path, os.R_OK):
        with open(path, "rb") as handle:
            # our own child's file
            lines = [line for line in str(pickle.load(handle)).splitlines() if line.strip()]
        if lines:
            return f"rank {index}: {lines[-1].strip()}"
    code = context.processes[index].exitcode
    return f"rank {index} " + (
        f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    )


def _collect(config: DemoConfig, wall_s: float) -> DemoResult:
    reports = []
    for rank in range(config.world_size):
        path = config.out_dir / "demo" / f"rank-{rank}.json"
        if path.is_file():
            reports.append(json.loads(path.read_text(encoding="utf-8")))
    fired = tuple(f for r in reports for f in r["fired"])
    first = reports[0] if reports else {"alarms": [], "raised": None, "checkpoints": []}
    return DemoResult(
        config=config,
        fired=fired,
        alarms=tuple(first["alarms"]),
        raised=first["raised"],
        checkpoints=tuple(first["checkpoints"]),
        final_weights_digests=tuple(r.get("final_weights_digest", "") for r in reports),
        killed_rank=config.kill_rank,
        wall_s=wall_s,
    )


def _worker(rank: int, config: DemoConfig, port: int) -> None:
    """One rank: init gloo, train, report (runs in a spawned process)."""
    import torch
    import torch.distributed as dist

    # before the recorder notes it in the manifest
    torch.set_num_threads(config.threads_of(rank))
    if config.replayable:
        from sdc_forensics.recorder import replayable

        # before init_process_group, as a job calls it
        replayable()
    # the demo reports alarms itself
    logging.getLogger("sdc_forensics.recorder").setLevel(logging.ERROR)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=config.world_size,
        timeout=datetime.timedelta(seconds=max(30.0, config.timeout_s / 2)),
    )
    from sdc_forensics.recorder.exit import exit_on_alarm

    alarm = None
    # a run stopped by an alarm (policy raise) exits ALARM_EXIT_CODE, as a user's job would
    with exit_on_alarm():
        try:
            report = train_rank(config, rank)
            alarm = report.pop("_alarm", None)
            write_atomic(config.out_dir / "demo" / f"rank-{rank}.json", json.dumps(report, indent=1, sort_keys=True))
        finally:
            dist.destroy_process_group()
        if alarm is not None:
            raise alarm


def train_rank(config: DemoConfig, rank: int) -> dict:
    """The training loop of one rank (process group already initialised); returns its report
    (with the :class:`SdcAlarm` that stopped it under ``"_alarm"``, policy ``raise``)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from sdc_forensics.demo.kill import Killer
    from sdc_forensics.errors import SdcAlarm
    from sdc_forensics.recorder import Recorder, RecorderOptions
    from sdc_forensics.statedict import weights_digest
    from sdc_forensics.trace.checkpoints import hex64

    recipe = recipe_mod.load_recipe(config.recipe, args=config.recipe_args)
    device = torch.device("cuda:0" if config.device == "cuda" else "cpu")
    model, optimizer, scheduler = recipe.build(device)
    if config.resume_from is not None:
        recipe.load_checkpoint(config.checkpoint_path(config.resume_from), model, optimizer, scheduler)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    world_size = config.world_size
    # before the recorder and the comm hook: nothing of it is recorded
    if config.first_step > 0:
        rebuild_buckets(
            ddp, recipe, recipe.fetch_microbatch(recipe.microbatch_ids(config.first_step, rank, world_size)[0], device)
        )
    report: dict = {"rank": rank, "fired": [], "alarms": [], "raised": None, "checkpoints": []}
    rec = None
    if config.record:
        rec = Recorder(
            config.trace_dir,
            ddp,
            optimizer,
            recipe=config.recipe,
            recipe_args=config.recipe_args,
            inject=config.injections,
            options=RecorderOptions(
                policy=config.policy,
                audit_every=config.audit_every,
                checkpoint_every=config.checkpoint_every,
                node_of_rank=config.node_of_rank or tuple(range(world_size)),
                start_step=config.first_step,
                reduction="ordered" if config.replayable else config.reduction,
            ),
            comm_hook=recipe_mod.import_reference(config.comm_hook) if config.comm_hook else None,
        )
    elif config.comm_hook:
        ddp.register_comm_hook(None, recipe_mod.import_reference(config.comm_hook))
    killer = Killer(config.kill_point, config.kill_step, armed=config.kill_rank == rank, kill_bytes=config.kill_bytes)
    killer.attach(model, rec)

    def checkpoint(step: int) -> None:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
        killer.before_checkpoint(step, rank)
        if rec is not None:
            rec.checkpoint(step, config.checkpoint_path(step), state, save=killer.save if killer.armed else None)
        elif rank == 0:
            config.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            torch.save(state, config.checkpoint_path(step))
        report["checkpoints"].append(step)

    try:
        if config.resume_from is None:
            checkpoint(0)
        for step in range(config.first_step, config.steps):
            ids = recipe.microbatch_ids(step, rank, world_size)
            killer.begin(step, len(ids))
            with rec.step(step, microbatch_ids=ids) if rec is not None else contextlib.nullcontext() as s:
                train_step(
                    ddp,
                    optimizer,
                    recipe,
                    (recipe.fetch_microbatch(i, device) for i in ids),
                    len(ids),
                    s,
                    scheduler,
                    step=step,
                )
            killer.after_record(step)
            if (step + 1) % config.checkpoint_every == 0:
                checkpoint(step + 1)
    except SdcAlarm as alarm:
        report["raised"] = {
            "check": alarm.check,
            "step": alarm.step,
            "rank": alarm.rank,
            "host": alarm.host,
            "message": str(alarm),
        }
        # re-raised by the worker once its report is written
        report["_alarm"] = alarm
    finally:
        if rec is not None:
            report["fired"] = [dataclasses.asdict(f) for f in rec.injector.fired]
            report["alarms"] = [
                {"check": a.check, "step": a.step, "rank": a.rank, "ranks": list(a.ranks), "detail": a.detail}
                for a in rec.alarms
            ]
            rec.close()
    report["final_weights_digest"] = hex64(weights_digest(model.named_parameters()))
    return report

"""The FSDP2 reduce-scatter and NaN/Inf checks (``recorder/fsdp_monitor.py``) on a real ``fully_shard``
job, 4 gloo processes: clean steps (momentum, LayerNorm, ReLU, gradient accumulation without
sync, a bfloat16 reduce) pass; a flipped bit in one rank's reduce-scatter output, and a NaN in one
rank's local gradient, are named at their step and rank; a finite local-gradient flip is summed
consistently and passes, as the module says."""

from __future__ import annotations

import socket

import pytest
import torch

from tests.factories import gloo_job

WORLD = 4
STEPS = 6
FAULTS = {  # step -> (location, rank, what)
    2: ("reduce-scatter-output", 1, "flip"),
    3: ("local-gradient", 2, "nan"),
    4: ("local-gradient", 3, "flip"),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 96), torch.nn.ReLU(), torch.nn.LayerNorm(96), torch.nn.Linear(96, 5))


def _fsdp(rank: int, mixed: bool) -> list[dict]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from sdc_forensics.recorder.fsdp_monitor import watch

    step_now = [0]

    def inject(location: str, call: int, tensor: torch.Tensor) -> None:
        fault = FAULTS.get(step_now[0])
        if fault is None or (mixed and step_now[0] != 2) or fault[0] != location or fault[1] != rank or call != 0:
            return
        with torch.no_grad():
            flat = tensor.reshape(-1)
            if fault[2] == "nan":
                flat[0] = float("nan")
            elif flat.dtype == torch.float32:
                flat.view(torch.int32)[0] ^= 1 << 29  # an exponent bit
            else:
                flat.view(torch.int16)[0] ^= 1 << 13  # bfloat16: an exponent bit

    results = []
    model = _model()
    kwargs = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)} if mixed else {}
    for layer in (model[0], model[3]):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    monitor = watch(model, inject=inject)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        step_now[0] = step
        for micro in range(2):  # accumulate without communication on the first microbatch
            model.set_requires_gradient_sync(micro == 1)
            model(torch.randn(6, 24, generator=gen)).square().mean().backward()
        result = monitor.check(step)
        results.append(
            {
                "step": step,
                "calls": result.calls,
                "suspects": list(result.suspects),
                "checks": sorted({f.check for f in result.findings}),
                "lines": result.lines(),
            }
        )
        if any(not torch.isfinite(p.grad.to_local()).all() for p in model.parameters() if p.grad is not None):
            optimizer.zero_grad()  # a job would skip this step: keep the weights finite
            continue
        optimizer.step()
        optimizer.zero_grad()
    return results


def test_faults_in_the_reduce_scatter_and_nan_gradients_are_named_at_their_step_and_rank(found):
    ranks = [r["fsdp"] for r in found]
    assert all(r == ranks[0] for r in ranks), "every rank reaches the same result"
    by_step = {r["step"]: r for r in ranks[0]}
    assert all(r["calls"] == 3 for r in ranks[0])  # one reduce-scatter per fully_shard module, once per step
    for step in range(STEPS):
        found = by_step[step]
        if step == 2:
            assert found["suspects"] == [1] and found["checks"] == ["reduce-scatter"], found
            assert "step 2" in found["lines"][0] and f"rank 1 (host {socket.gethostname()}, cpu" in found["lines"][0]
        elif step == 3:
            assert found["suspects"] == [2] and found["checks"] == ["nonfinite-before"], found
        else:  # clean steps, and step 4's finite local-gradient flip (summed consistently: replay's case)
            assert found["suspects"] == [] and "clean" in found["lines"][0], found


def test_reducing_in_bfloat16_the_clean_steps_pass_and_a_flipped_output_is_named(found):
    ranks = [r["mixed"] for r in found]
    assert all(r == ranks[0] for r in ranks)
    for found in ranks[0]:
        assert found["suspects"] == ([1] if found["step"] == 2 else []), found


def _hsdp(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sdc_forensics.recorder.fsdp_monitor import watch

    step_now = [0]
    seen_by_user_hook = []

    def inject(location: str, call: int, tensor: torch.Tensor) -> None:
        if step_now[0] == 1 and location == "all-reduce-output" and rank == 3 and call == 0:
            with torch.no_grad():
                tensor.reshape(-1).view(torch.int32)[0] ^= 1 << 29

    results = []
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _model()
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model[0].set_all_reduce_hook(lambda t: seen_by_user_hook.append(t.numel()))  # the job's own hook is kept
    monitor = watch(model, inject=inject)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    for step in range(3):
        step_now[0] = step
        model(torch.randn(6, 24, generator=gen)).square().mean().backward()
        result = monitor.check(step)
        results.append(
            {"step": step, "suspects": list(result.suspects), "checks": sorted({f.check for f in result.findings})}
        )
        optimizer.step()
        optimizer.zero_grad()
    return {"results": results, "user_hook_calls": len(seen_by_user_hook)}


def _variants(rank: int) -> dict:
    """Settings that change what FSDP2 reduces, each run clean for 3 steps: nothing may fire.

    HSDP accumulation without the replica all-reduce on early microbatches (the last adds the
    earlier reduce-scatters before all-reducing), a gradient divide factor (reduce-scatter AVG,
    all-reduce SUM on NCCL; SUM with divisions elsewhere), and fully_shard of two modules as one group.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sdc_forensics.recorder.fsdp_monitor import watch

    out = {}
    for name in ("hsdp-accumulate", "hsdp-divide-factor", "grouped"):
        model = _model()
        mesh = (
            init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if name.startswith("hsdp") else None
        )
        kwargs = {"mesh": mesh} if mesh is not None else {}
        if name == "grouped":
            fully_shard([model[0], model[3]], **kwargs)
        else:
            for layer in (model[0], model[3]):
                fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        if name == "hsdp-divide-factor":
            model.set_gradient_divide_factor(2.0)
        now = [0]

        def flip_at_step_2(location, call, tensor, name=name, now=now):  # the accumulated all-reduce is checked too
            if name == "hsdp-accumulate" and now[0] == 2 and location == "all-reduce-output" and rank == 2:
                with torch.no_grad():
                    tensor.reshape(-1).view(torch.int32)[0] ^= 1 << 29

        monitor = watch(model, inject=flip_at_step_2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(rank % 2 if mesh is not None else rank)
        results = []
        for step in range(3):
            now[0] = step
            for micro in range(2):
                if name == "hsdp-accumulate":
                    model.set_requires_all_reduce(micro == 1)
                model(torch.randn(6, 24, generator=gen)).square().mean().backward()
            result = monitor.check(step)
            results.append([result.calls, list(result.suspects), result.lines()])
            optimizer.step()
            optimizer.zero_grad()
        out[name] = results
    return out


def _spec(rank: int) -> list:
    """A drill given as a fault spec, as the DDP recorder's --inject takes them."""
    from torch.distributed.fsdp import fully_shard

    from sdc_forensics.recorder.fsdp_monitor import watch

    model = _model()
    fully_shard(model[0])
    fully_shard(model)
    monitor = watch(model, inject=["reduce-scatter-output:step=1:rank=3:bit=29"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    suspects = []
    for step in range(3):
        model(torch.randn(6, 24, generator=gen)).square().mean().backward()
        suspects.append(list(monitor.check(step).suspects))
        optimizer.step()
        optimizer.zero_grad()
    return suspects


def _job(rank: int) -> dict:
    """The jobs one after another in one process group: one spawn of 4 processes."""
    return {
        "fsdp": _fsdp(rank, mixed=False),
        "mixed": _fsdp(rank, mixed=True),
        "hsdp": _hsdp(rank),
        "variants": _variants(rank),
        "spec": _spec(rank),
    }


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> list[dict]:
    return gloo_job(_job, WORLD, tmp_path_factory.mktemp("fsdp_monitor"))


def test_hsdp_the_replica_all_reduce_is_checked_and_a_flipped_output_is_named(found):
    ranks = [r["hsdp"] for r in found]
    assert all(r["results"] == ranks[0]["results"] for r in ranks)
    assert all(r["user_hook_calls"] == 3 for r in ranks)  # once per step: the job's hook still runs
    for found in ranks[0]["results"]:
        expected = ([3], ["all-reduce"]) if found["step"] == 1 else ([], [])
        assert (found["suspects"], found["checks"]) == expected, found


def test_accumulation_divide_factors_and_grouped_modules_raise_no_false_alarm(found):
    variants = found[0]["variants"]
    assert all(f["variants"] == variants for f in found)
    for name, steps in variants.items():
        for step, (calls, suspects, lines) in enumerate(steps):
            assert calls == (4 if name == "grouped" else 6), (name, calls)  # 2 microbatches x the parameter groups
            if name == "hsdp-accumulate" and step == 2:  # the drill: a flipped all-reduce output on rank 2
                assert suspects == [2] and "all-reduce" in lines[0], lines
                continue
            assert suspects == [] and "clean" in lines[0], (name, lines)


def test_a_fault_spec_drill_is_named_at_its_step_and_rank(found):
    assert all(f["spec"] == [[], [3], []] for f in found)


def test_a_fault_spec_at_a_location_the_monitor_does_not_have_is_refused_in_one_line():
    from sdc_forensics.errors import UsageError
    from sdc_forensics.recorder.fsdp_monitor import LOCATIONS, spec_injector

    with pytest.raises(UsageError, match="unknown location 'grad'.*reduce-scatter-output"):
        spec_injector(["grad:step=1:rank=0:bit=3"], lambda: 0)
    assert "all-reduce-output" in LOCATIONS

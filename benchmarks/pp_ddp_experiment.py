"""Pipeline parallelism x DDP against a one-process whole-model recomputation (docs/recorder.md,
"Pipeline parallelism: why it is refused today").

``python benchmarks/pp_ddp_experiment.py gpipe|1f1b PORT`` trains a 5-layer MLP split by hand into
two ``PipelineStage``s over a ``(pp=2, dp=2)`` mesh of 4 gloo processes, 4 microbatches per step,
each stage's module in ``DistributedDataParallel`` over its data-parallel group, for 3 steps; a
comm hook copies every bucket before DDP's all-reduce. Each rank recomputes its stage's
parameters' gradients with the whole model on one process (the same microbatches, accumulated in
order) from the job's current weights, and prints per step how many times the hook ran, which
cumulative microbatch sum each bucket equals, and every local-gradient, reduced-gradient and
weight difference
the last line per rank says ``exact=True`` when all were bit for bit.
"""

import os
import sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, Schedule1F1B
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

N_MB = 4


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    )


def data(dp, step):
    g = torch.Generator().manual_seed(100 + 10 * step + dp)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def run(rank, sched_name, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    full = model()
    [n for n, _ in full.named_parameters()]
    stage_mod = torch.nn.Sequential(*list(full)[:3]) if pp == 0 else torch.nn.Sequential(*list(full)[3:])
    offset = 0 if pp == 0 else 3
    ddp = DDP(stage_mod, process_group=mesh["dp"].get_group())
    pname = {id(p): f"{int(n.split('.')[0]) + offset}.{n.split('.')[1]}" for n, p in stage_mod.named_parameters()}
    local = {}
    hookcalls = [0]
    calls = []

    def hook(state, bucket):
        hookcalls[0] += 1
        calls.append({pname[id(p)]: g.detach().clone() for p, g in zip(bucket.parameters(), bucket.gradients())})
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            local[pname[id(p)]] = g.detach().clone()
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(mesh["dp"].get_group(), hook)
    stage = PipelineStage(ddp, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    loss_fn = torch.nn.functional.mse_loss
    S = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[sched_name]
    sched = S(stage, n_microbatches=N_MB, loss_fn=loss_fn)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ok = True
    ref = model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = data(dp, step)
        mine = {pname[id(p)]: p.detach().clone() for p in stage_mod.parameters()}
        allw = [None, None]
        dist.all_gather_object(allw, mine, group=mesh["pp"].get_group())
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_((allw[0] if n in allw[0] else allw[1])[n])
        opt.zero_grad(set_to_none=True)
        local.clear()
        losses = []
        if pp == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=losses)
        # replay: whole model, this rank's dp batch, n microbatches in order
        sums = {}
        permb = []
        for d in range(2):
            ref.zero_grad(set_to_none=True)
            xd, yd = data(d, step)
            rl = []
            for xm, ym in zip(xd.tensor_split(N_MB), yd.tensor_split(N_MB)):
                loss_m = loss_fn(ref(xm), ym)
                loss_m.backward()
                rl.append(loss_m.detach())
                if d == dp:
                    permb.append({n: p.grad.clone() for n, p in ref.named_parameters()})
            sums[d] = {n: p.grad.clone() for n, p in ref.named_parameters()}
            if d == dp and pp == 1:
                ok &= all(torch.equal(a, b) for a, b in zip(rl, losses))
        print("hookcalls", rank, step, hookcalls[0])
        hookcalls[0] = 0
        for ci, c in enumerate(calls):
            print(
                "call",
                rank,
                step,
                ci,
                "equals cumulative mb",
                [i for i, cum in enumerate(permb) if all(torch.equal(c[n], cum[n]) for n in c)],
            )
        calls.clear()
        for n, g in local.items():
            same = torch.equal(g, sums[dp][n])
            if not same:
                cum = [c[n] for c in permb]
                last = cum[-1] - cum[-2]
                print(
                    n,
                    "match cumulative idx",
                    [i for i, c in enumerate(cum) if torch.equal(c, g)],
                    "close",
                    [i for i, c in enumerate(cum) if torch.allclose(c, g)],
                    "last-only",
                    torch.allclose(last, g),
                    "ratio",
                    (g.norm() / cum[-1].norm()).item(),
                    "avg",
                    torch.allclose(g, (sums[0][n] + sums[1][n]) / 2),
                    "other",
                    torch.allclose(g, sums[1 - dp][n]),
                    "sum",
                    torch.allclose(g, sums[0][n] + sums[1][n]),
                )
                print(f"rank {rank} pp={pp} dp={dp} step {step} {n} local DIFF max {(g - sums[dp][n]).abs().max()}")
                ok = False
        # reduced: mean over dp of sums, then / N_MB (the schedule's scaling)
        for n, p in stage_mod.named_parameters():
            r = pname[id(p)]
            red = (sums[0][r] + sums[1][r]) / 2 / N_MB
            if not torch.equal(p.grad, red):
                print(f"rank {rank} step {step} {r} reduced DIFF max {(p.grad - red).abs().max()}")
                ok = False
        opt.step()
        # the replay's weights: apply the same reduced grads to ref
        for n, p in ref.named_parameters():
            p.grad = (sums[0][n] + sums[1][n]) / 2 / N_MB
        ref_opt.step()
        for n, p in stage_mod.named_parameters():
            if not torch.equal(p, dict(ref.named_parameters())[pname[id(p)]]):
                print(f"rank {rank} step {step} weights DIFF {pname[id(p)]}")
                ok = False
    print(f"{sched_name} rank {rank} pp={pp} dp={dp} params {sorted(local)} exact={ok}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1], int(sys.argv[2])), nprocs=4)

"""The sharded recorder end to end (``recorder/fsdp_layout.py``): real ``fully_shard`` jobs on 4
gloo processes (``sdc_forensics/demo/sharded.py``: Linear, ReLU, LayerNorm, Linear, SGD with
momentum, two microbatches accumulated without sync, DCP checkpoints at steps 0 and 3), recorded,
then analysed by the unchanged commands:

* a clean FSDP job and a clean HSDP 2 x 2 job are certified (every step replayed bit for bit,
  the ordered reduce-scatter), and a DCP checkpoint re-saved with another sharding still certifies;
* a fault at each sharded location (a rank's local gradient, its reduce-scatter output, its
  all-gathered copy of a parameter, its weight shard at rest, its update, its input) is found at
  its exact step and rank;
* the same job under DDP and under FSDP2 gives equal whole-model digests at step 0;
* HSDP's two replicas of a shard that disagree are detected (no vote can name the rank) and the
  exact replay names it; with three replicas (6 processes, heavy) the vote names it online, the
  exact replay names its location, and a clean run certifies.
* a weight shard changed at rest is located at rest (``state_at_rest``), by the replay and by the
  trace alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from sdc_forensics.cli.main import cli

from tests.factories import gloo_job

WORLD = 4
FAULTS = {  # name -> (spec, step, rank): each location at a step and rank of its own
    "local-gradient": ("local-gradient:step=2:rank=1:bit=20", 2, 1),
    "reduce-scatter-output": ("reduce-scatter-output:step=1:rank=2:bit=20", 1, 2),
    "weights": ("weights:step=2:rank=3:bit=20", 2, 3),
    "update": ("update:step=4:rank=1:bit=20", 4, 1),
    "input": ("input:step=1:rank=0:bit=20", 1, 0),
    "all-gather-output": ("all-gather-output:step=3:rank=2:bit=27", 3, 2),
    "weights-at-0": ("weights:step=0:rank=1:bit=21", 0, 1),  # before any update: against checkpoint 0's shard
}


HSDP_FAULTS = {  # HSDP 2 x 2: a shard at rest is gathered by its own replica only; an all-reduce output is one rank's
    "hsdp-weights": ("weights:step=5:rank=3:bit=31", 5, 3),
    "hsdp-all-reduce-output": ("all-reduce-output:step=2:rank=2:bit=20", 2, 2),
    "hsdp-all-gather-output": ("all-gather-output:step=2:rank=1:bit=20", 2, 1),
}
#: faults of a weight shard at rest: located there (the rest digest), not in the rank's forward/backward
AT_REST = frozenset({"weights", "weights-at-0", "hsdp-weights"})


def _jobs(rank: int, root: str, runs: list) -> dict:
    """Every run of ``runs`` (name, keyword arguments of ``train``) in one process group, in turn."""
    from sdc_forensics.demo.sharded import train

    from sdc_forensics.recorder.fsdp_fallback import TAP_ENV

    out = {}
    for name, kwargs in runs:
        kwargs = dict(kwargs)
        if kwargs.get("hsdp"):
            kwargs["hsdp"] = tuple(kwargs["hsdp"])
        kwargs["inject"] = tuple(kwargs.get("inject", ()))
        os.environ[TAP_ENV] = kwargs.pop("tap", "")  # "post-backward": as on a torch without set_custom_reduce_scatter
        try:
            out[name] = train(
                rank,
                kwargs.pop("world", WORLD),
                str(Path(root, name, "trace")),
                str(Path(root, name, "ckpt")),
                **kwargs,
            )
        finally:
            os.environ.pop(TAP_ENV, None)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_recorder")
    todo = [
        ("clean", {}),
        ("hsdp-clean", {"hsdp": [2, 2]}),
        ("hsdp-update", {"hsdp": [2, 2], "inject": ["update:step=2:rank=1:bit=20"]}),
        ("bf16-clean", {"reduce_dtype": "bfloat16"}),
        (
            "bf16-hsdp-rs",
            {"hsdp": [2, 2], "reduce_dtype": "bfloat16", "inject": ["reduce-scatter-output:step=4:rank=3:bit=10"]},
        ),
        ("mp-clean", {"param_dtype": "bfloat16", "reduce_dtype": "float32"}),  # torchtitan's default policy
        ("mp-f16", {"param_dtype": "float16", "reduce_dtype": "float32"}),
        ("f16-reduce", {"param_dtype": "float16"}),  # float16 reduction: FSDP2 divides before and after summing
        ("f16-reduce-hsdp-native", {"param_dtype": "float16", "hsdp": [2, 2], "reduction": "native"}),
        ("mp-local", {"param_dtype": "bfloat16", "inject": ["local-gradient:step=2:rank=1:bit=10"]}),
        ("fb-native", {"tap": "post-backward", "reduction": "native"}),
        ("native", {"reduction": "native"}),
        ("native-hsdp", {"reduction": "native", "hsdp": [2, 2], "reduce_dtype": "bfloat16"}),
        ("audited", {"audit_every": 2, "inject": ["local-gradient:step=2:rank=1:bit=20"]}),
        ("audited-hsdp-clean", {"audit_every": 2, "hsdp": [2, 2]}),
        (
            "fb-hsdp-local",
            {
                "tap": "post-backward",
                "reduction": "native",
                "hsdp": [2, 2],
                "inject": ["local-gradient:step=3:rank=2:bit=30"],
            },
        ),
    ]
    todo += [(name, {"inject": [spec]}) for name, (spec, _, _) in FAULTS.items()]
    todo += [(name, {"hsdp": [2, 2], "inject": [spec]}) for name, (spec, _, _) in HSDP_FAULTS.items()]
    found = gloo_job(_jobs, WORLD, root / "results", str(root), todo)
    return root, found


def _bisect(trace: Path, command: str = "bisect", *flags: str) -> tuple[int, dict]:
    result = CliRunner().invoke(cli, [command, str(trace), "--json", *flags])
    return result.exit_code, json.loads(result.stdout)


def test_a_clean_fsdp_job_is_certified_and_its_resharded_checkpoint_still_is(runs, tmp_path):
    root, found = runs
    assert all(f["clean"]["alarms"] == [] for f in found)
    code, doc = _bisect(root / "clean" / "trace", "certify")
    assert code == 0, doc
    assert [c["status"] for c in doc["checkpoints"]] == ["clean", "clean"]
    assert doc["resume_step"] == 3

    import torch.distributed.checkpoint as dcp
    from click.testing import CliRunner

    from sdc_forensics.cli.main import cli
    from sdc_forensics.demo import sharded

    model = sharded.build_model()
    optimizer = sharded.make_optimizer(model)
    sharded.load_dcp(root / "clean" / "ckpt" / "step-00000003", model, optimizer)  # 4 shards -> 1 process
    dcp.save(sharded.dcp_state(model, optimizer), checkpoint_id=str(tmp_path / "resaved"))
    result = CliRunner().invoke(
        cli, ["verify-checkpoint", str(tmp_path / "resaved"), "--trace", str(root / "clean" / "trace"), "--step", "3"]
    )
    assert result.exit_code == 0 and "CERTIFIED CLEAN" in result.output, result.output


def test_a_clean_hsdp_job_with_two_replicas_is_certified_exactly(runs):
    root, _ = runs
    code, doc = _bisect(root / "hsdp-clean" / "trace", "certify")
    assert code == 0, doc
    assert [c["status"] for c in doc["checkpoints"]] == ["clean", "clean"]
    manifest = json.loads((root / "hsdp-clean" / "trace" / "manifest.json").read_text())
    assert manifest["parallel"]["kind"] == "hsdp" and manifest["parallel"]["shape"] == [2, 2]
    assert manifest["parallel"]["dim_names"] == ["replicate", "shard"]


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_a_fault_at_each_sharded_location_is_found_at_its_step_and_rank(runs, name):
    from tests.schema_check import assert_valid

    root, _ = runs
    _, step, rank = FAULTS[name]
    code, doc = _bisect(root / name / "trace")
    assert code == 1, doc
    assert doc["first_divergent_step"] == step, doc
    assert [s["rank"] for s in doc["suspects"]] == [rank], doc["suspects"]
    assert doc["suspects"][0]["mesh"] == f"shard={rank}"  # where in the mesh
    if name in AT_REST:
        assert doc["suspects"][0]["location"] == "state_at_rest", doc["suspects"]
    assert_valid(doc, "bisect")
    code, doc = _bisect(root / name / "trace", "inspect")
    assert doc["parallel"]["kind"] == "fsdp" and doc["parallel"]["coords"] == [[r] for r in range(WORLD)]
    assert_valid(doc, "inspect")


@pytest.mark.parametrize("name", sorted(HSDP_FAULTS))
def test_hsdp_faults_are_found_at_their_step_and_rank(runs, name):
    root, _ = runs
    _, step, rank = HSDP_FAULTS[name]
    code, doc = _bisect(root / name / "trace")
    assert code == 1 and doc["first_divergent_step"] == step, doc
    assert [s["rank"] for s in doc["suspects"]] == [rank], doc["suspects"]
    if name in AT_REST:
        assert doc["suspects"][0]["location"] == "state_at_rest", doc["suspects"]


@pytest.mark.parametrize("name", ["all-gather-output", "hsdp-all-gather-output", "hsdp-weights"])
def test_the_gathered_parameters_vote_names_the_rank_online_and_in_the_trace(runs, name):
    """No replicas to vote in pure FSDP, but every rank gathers the same whole parameters: their
    digests are voted each step. A rank whose gathered copy changed is named online and by the
    trace alone; a shard changed at rest (gathered wrong by its whole replica) is named by the rest
    check, and the even split it makes of the gathered copies raises nothing more."""
    root, found = runs
    _, step, rank = {**FAULTS, **HSDP_FAULTS}[name]
    alarms = [{"step": step, "rank": rank, "check": "weights"}]
    if name == "hsdp-weights":  # and after the update, the shard's two replicas disagree (no vote names one)
        alarms.append({"step": step, "rank": -1, "check": "weights"})
    assert all(f[name]["alarms"] == alarms for f in found), [f[name] for f in found]
    code, doc = _bisect(root / name / "trace", "bisect", "--trace-only")
    assert code == 1 and doc["first_divergent_step"] == step, doc
    where = "state_at_rest" if name in AT_REST else "local_compute"  # a gathered copy changed: the rank's compute
    assert [(s["rank"], s["location"]) for s in doc["suspects"]] == [(rank, where)], doc["suspects"]


def test_the_report_names_a_sharded_suspect_with_its_mesh_coordinates(runs, tmp_path):
    from click.testing import CliRunner

    from sdc_forensics.cli.main import cli
    from tests.schema_check import assert_valid

    root, _ = runs
    for suffix in ("md", "json"):
        result = CliRunner().invoke(
            cli, ["report", str(root / "hsdp-weights" / "trace"), "-o", str(tmp_path / f"review.{suffix}")]
        )
        assert result.exit_code == 1, result.output
    assert (
        "rank 3 on host" in (tmp_path / "review.md").read_text()
        and "mesh `replicate=1, shard=1`" in (tmp_path / "review.md").read_text()
    )
    assert_valid(json.loads((tmp_path / "review.json").read_text()), "report")


def test_a_job_reducing_in_bfloat16_is_certified_exactly(runs):
    root, found = runs
    assert all(f["bf16-clean"]["alarms"] == [] for f in found)
    code, doc = _bisect(root / "bf16-clean" / "trace", "certify")
    assert code == 0 and [c["status"] for c in doc["checkpoints"]] == ["clean", "clean"], doc
    manifest = json.loads((root / "bf16-clean" / "trace" / "manifest.json").read_text())
    assert manifest["parallel"]["reduce_dtype"] == "bfloat16" and manifest["fingerprint"]["grad_dtype"] == "bfloat16"


def test_a_job_computing_in_bfloat16_is_certified_exactly_and_a_fault_in_it_found(runs):
    """``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: the replay casts the
    parameters and each fully_shard module's inputs as FSDP2 did, so every step replays bit for bit."""
    root, found = runs
    assert all(f["mp-clean"]["alarms"] == [] for f in found)
    code, doc = _bisect(root / "mp-clean" / "trace", "certify")
    assert code == 0 and [c["status"] for c in doc["checkpoints"]] == ["clean", "clean"], doc
    mesh = json.loads((root / "mp-clean" / "trace" / "manifest.json").read_text())["parallel"]
    assert (mesh["param_dtype"], mesh["reduce_dtype"]) == ("bfloat16", "float32")
    assert mesh["casts"] == [["", "bfloat16", ""], ["0", "bfloat16", ""], ["3", "bfloat16", ""]]
    code, doc = _bisect(root / "mp-local" / "trace")
    assert code == 1 and doc["first_divergent_step"] == 2 and [s["rank"] for s in doc["suspects"]] == [1], doc
    code, doc = _bisect(root / "mp-f16" / "trace", "certify")  # float16 compute, float32 reduction
    assert code == 0 and [c["status"] for c in doc["checkpoints"]] == ["clean", "clean"], doc
    for name in (
        "f16-reduce",
        "f16-reduce-hsdp-native",
    ):  # float16 reduction, pre- and post-divided; the trace alone agrees
        assert all(f[name]["alarms"] == [] for f in found)
        code, doc = _bisect(root / name / "trace", "certify")
        assert code == 0 and [c["status"] for c in doc["checkpoints"]] == ["clean", "clean"], (name, doc)
        code, doc = _bisect(root / name / "trace", "bisect", "--trace-only")
        assert code == 4 and doc["verdict"] == "clean", (name, doc)  # nothing in the trace; 4: nothing replayed


@pytest.mark.parametrize("name", ["native", "native-hsdp"])
def test_a_job_keeping_gloos_own_reduce_scatter_is_certified_exactly(runs, name):
    """``reduction="native"``: gloo reduce-scatters by its ring all-reduce of each parameter
    group's padded buffer; the trace notes the groups (the mesh's ``groups``) and the replay
    rebuilds those buffers and that order (HSDP: then the replicas' all-reduce, in bfloat16 here)."""
    root, found = runs
    assert all(f[name]["alarms"] == [] for f in found)
    groups = json.loads((root / name / "trace" / "manifest.json").read_text())["parallel"]["groups"]
    assert sorted(groups) == [[0, 1], [2, 3], [4, 5]]  # the two blocks, and the root holding the LayerNorm
    code, doc = _bisect(root / name / "trace", "certify")
    assert code == 0 and [c["status"] for c in doc["checkpoints"]] == ["clean", "clean"], doc


def test_audits_recompute_another_ranks_microbatches_and_name_the_rank_online(runs):
    """``audit_every=2`` (each rank its own node): at step 2 rank 0 recomputes rank 1's
    microbatches on a whole copy of the model, disagrees with rank 1's flipped local gradient, and
    rank 2 breaks the tie; a clean HSDP job's audits all agree."""
    root, found = runs
    assert all(f["audited"]["alarms"] == [{"step": 2, "rank": 1, "check": "audit"}] for f in found), [
        f["audited"] for f in found
    ]
    assert all(f["audited-hsdp-clean"]["alarms"] == [] for f in found)
    code, doc = _bisect(root / "audited" / "trace", "bisect", "--trace-only")
    assert code == 1 and doc["first_divergent_step"] == 2 and [s["rank"] for s in doc["suspects"]] == [1], doc
    code, doc = _bisect(root / "audited-hsdp-clean" / "trace", "certify")
    assert code == 0 and [c["status"] for c in doc["checkpoints"]] == ["clean", "clean"], doc


def test_a_bfloat16_job_replayed_without_its_casts_blames_no_rank_and_certifies_nothing(runs, tmp_path):
    """What the recorded casts are for: the same trace with ``param_dtype`` and ``casts`` struck
    from its manifest replays in float32, so every rank differs at step 0, which the common-mode
    rule names as one shared event, not four faults."""
    import shutil

    root, _ = runs
    job = tmp_path / "mp"
    shutil.copytree(root / "mp-clean", job)
    manifest = json.loads((job / "trace" / "manifest.json").read_text())
    del manifest["parallel"]["param_dtype"], manifest["parallel"]["casts"]
    (job / "trace" / "manifest.json").write_text(json.dumps(manifest))
    (job / "trace" / "ledger.jsonl").unlink(missing_ok=True)  # the certify of the original recorded its intervals
    _, doc = _bisect(job / "trace", "certify")
    assert doc["verdict"] == "inconclusive" and [c["status"] for c in doc["checkpoints"]] == ["clean", "unverified"], (
        doc
    )
    _, doc = _bisect(job / "trace", "bisect")
    assert doc["verdict"] == "inconclusive" and doc["suspects"] == [], doc


def test_a_recipe_model_without_a_module_the_job_cast_is_refused_in_one_line():
    from sdc_forensics.errors import RecipeError
    from sdc_forensics.replay.mixed import computing_as_recorded
    from sdc_forensics.trace.mesh import ShardMesh

    mesh = ShardMesh(
        kind="fsdp",
        shape=(2,),
        dim_names=("shard",),
        shard_dim=0,
        coords=((0,), (1,)),
        reduce_dtype="float32",
        param_dtype="bfloat16",
        casts=(("", "bfloat16", ""), ("blocks.0", "bfloat16", "")),
    )
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    with pytest.raises(RecipeError, match="'blocks.0'"):
        with computing_as_recorded(model, mesh):
            pass
    mesh = dataclasses.replace(mesh, casts=mesh.casts[:1])
    with computing_as_recorded(model, mesh):  # inside: bfloat16 copies, the input cast by the root's hook
        assert model[0].weight.dtype == torch.bfloat16 and model(torch.ones(1, 3)).dtype == torch.bfloat16
    assert model[0].weight.dtype == torch.float32 and model(torch.ones(1, 3)).dtype == torch.float32


def test_without_a_custom_reduce_scatter_the_gradients_read_in_post_backward_are_the_same(runs):
    """The post_backward tap (a torch without set_custom_reduce_scatter; forced here) records the
    same local gradients as the reduce-scatter tap, bit for bit, and a fault in one is named."""
    from sdc_forensics.trace.reader import Trace

    root, found = runs
    assert all(f["fb-native"]["alarms"] == [] for f in found)
    steps = {}
    for name in ("clean", "fb-native"):
        window = next(Trace.open(root / name / "trace").step_windows(1, 0, 0))
        steps[name] = window.records[0]["local_digest"].tolist()
    assert steps["clean"] == steps["fb-native"], steps  # step 0: the same weights, gradients and digests
    code, doc = _bisect(root / "fb-native" / "trace", "certify")  # gloo's own reduce-scatter, rebuilt by the replay
    assert code == 0 and [c["status"] for c in doc["checkpoints"]] == ["clean", "clean"], doc
    code, doc = _bisect(root / "fb-hsdp-local" / "trace")
    assert code == 1 and doc["first_divergent_step"] == 3 and [s["rank"] for s in doc["suspects"]] == [2], doc


def test_the_post_backward_taps_reduction_check_names_the_rank_whose_shard_is_wrong():
    """``fsdp_fallback.own_verdict``: each rank's reduced shard against the mean of every rank's
    rows of it, from the sums an all-reduce of the ranks' terms gives (numbers made here, 4 ranks,
    HSDP 2 x 2)."""
    import numpy as np

    from sdc_forensics.fingerprint.core import fingerprint
    from sdc_forensics.recorder.fsdp_fallback import own_verdict
    from sdc_forensics.recorder.fsdp_monitor import _terms
    from sdc_forensics.trace.mesh import ShardMesh

    k, gen = 8, torch.Generator().manual_seed(0)
    mesh = ShardMesh(
        kind="hsdp",
        shape=(2, 2),
        dim_names=("replicate", "shard"),
        shard_dim=1,
        coords=((0, 0), (0, 1), (1, 0), (1, 1)),
    )
    grads = [torch.randn(2, 5000, generator=gen) for _ in range(4)]  # each rank's local gradient, by shard
    row = lambda t: [*map(float, (fp := fingerprint(t, k=k)).sketch), float(fp.norm), float(fp.nonfinite)]  # noqa: E731
    total = np.array([[_terms(row(g[c]), k) for c in range(2)] for g in grads]).sum(axis=0)  # what the all-reduce sums
    mean = [sum(g[c] for g in grads) / 4 for c in range(2)]
    reduced = [row(mean[mesh.shard_of(r)]) for r in range(4)]

    def verdicts():
        return [
            (f.check, f.rank) for r in range(4) for f in own_verdict(r, mesh, total, 0, reduced[r], "float32", k, 0.25)
        ]

    assert verdicts() == []
    wrong = mean[1].clone()
    wrong[17] += 1e-2 * float(wrong.norm())
    reduced[3] = row(wrong)
    assert verdicts() == [("reduce-scatter", 3)]


def _fallback_refusals(rank: int, root: str) -> list[str]:
    from sdc_forensics.demo import sharded
    from sdc_forensics.errors import UsageError
    from sdc_forensics.recorder import Recorder, RecorderOptions
    from sdc_forensics.recorder.fsdp_fallback import TAP_ENV

    os.environ[TAP_ENV] = "post-backward"
    out = []
    for n, kwargs in enumerate(
        [{"options": RecorderOptions(reduction="ordered")}, {"inject": ["reduce-scatter-output:step=1:rank=0:bit=3"]}]
    ):
        model = sharded.shard(sharded.build_model())
        try:
            Recorder(
                Path(root, f"trace-{n}"), model, sharded.make_optimizer(model), recipe=sharded.REFERENCE, **kwargs
            ).close()
            out.append("recorded")
        except UsageError as refusal:
            out.append(str(refusal))
    out.append(_communicating_accumulation(rank, str(Path(root, "accumulating"))))
    return out


def _closed(rank: int, root: str) -> list[bool]:
    """Record one step with each tap, close, and say whether the groups have their own collective
    (and post_backward) back, and the FSDP states their own end-of-backward callback."""
    from sdc_forensics.demo import sharded
    from sdc_forensics.recorder import Recorder
    from sdc_forensics.recorder import fsdp_monitor as fm
    from sdc_forensics.recorder.fsdp_fallback import TAP_ENV

    out = []
    for tap in ("", "post-backward"):
        os.environ[TAP_ENV] = tap
        model = sharded.shard(sharded.build_model())
        states = [m._get_fsdp_state() for m in model.modules() if hasattr(m, "_get_fsdp_state")]
        own = [(g._reduce_scatter_comm, "post_backward" in vars(g)) for g in fm.param_groups(model)]
        optimizer = sharded.make_optimizer(model)
        with Recorder(Path(root, f"trace-{tap or 'comm'}"), model, optimizer, recipe=sharded.REFERENCE) as rec:
            with rec.step(0, microbatch_ids=[rank]):
                sharded.loss_of(model, sharded.microbatch(rank)).backward()
                optimizer.step()
            wrapped = all("_root_post_backward_final_callback" in vars(state) for state in states)
        out.append(
            own == [(g._reduce_scatter_comm, "post_backward" in vars(g)) for g in fm.param_groups(model)]
            and wrapped
            and not any("_root_post_backward_final_callback" in vars(state) for state in states)
        )
    os.environ.pop(TAP_ENV, None)
    return out


def test_a_closed_recorder_gives_the_model_its_own_reduce_scatter_back(tmp_path):
    assert gloo_job(_closed, WORLD, tmp_path / "results", str(tmp_path)) == [[True, True]] * WORLD


def test_what_the_post_backward_tap_cannot_record_is_refused_in_one_line_on_every_rank(tmp_path):
    found = gloo_job(_fallback_refusals, WORLD, tmp_path / "results", str(tmp_path))
    for ordered, drill, accumulating in found:
        assert "reduction='ordered'" in ordered and "set_custom_reduce_scatter" in ordered, ordered
        assert "reduce-scatter-output" in drill and "set_custom_reduce_scatter" in drill, drill
        assert "reduce-scattered twice in one step" in accumulating, accumulating


def test_a_wrong_hsdp_reduce_scatter_output_reaches_both_replicas_and_only_its_rank_is_named(runs):
    """Rank 3's reduce-scatter output is all-reduced with rank 1's (the other replica of shard 1):
    both record the same wrong shard; the recorder's own check saw rank 3's output."""
    root, found = runs
    assert {(a["step"], a["rank"], a["check"]) for a in found[0]["bf16-hsdp-rs"]["alarms"]} == {(4, 3, "allreduce")}
    code, doc = _bisect(root / "bf16-hsdp-rs" / "trace")
    assert code == 1 and doc["first_divergent_step"] == 4, doc
    assert [(s["rank"], s["mesh"]) for s in doc["suspects"]] == [(3, "replicate=1, shard=1")], doc["suspects"]


def test_two_hsdp_replicas_that_disagree_are_detected_and_the_exact_replay_names_the_rank(runs):
    root, found = runs
    assert {a["check"] for a in found[0]["hsdp-update"]["alarms"]} == {"weights"}
    assert all(a["rank"] == -1 for a in found[0]["hsdp-update"]["alarms"])  # two replicas: no vote names one
    code, doc = _bisect(root / "hsdp-update" / "trace")
    assert code == 1 and doc["first_divergent_step"] == 2, doc
    assert [s["rank"] for s in doc["suspects"]] == [1] and doc["suspects"][0]["location"] == "optimizer_update", doc


def test_the_same_job_under_ddp_and_fsdp2_gives_equal_whole_digests_at_step_0(runs):
    """What a DDP job of this model records (its weights digest; its local gradient as one
    bucket) equals what the FSDP2 job recorded from shards, computed here in one plain process."""
    from sdc_forensics.demo import sharded
    from sdc_forensics.fingerprint.core import combine_digests, digest
    from sdc_forensics.statedict import weights_digest
    from sdc_forensics.trace.checkpoints import read_checkpoint_notes
    from sdc_forensics.trace.reader import Trace

    root, _ = runs
    trace = Trace.open(root / "clean" / "trace")
    window = next(trace.step_windows(1, 0, 0))
    model = sharded.build_model()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks computed (CPU matmuls sum in an order that depends on it)
    note = next(n for n in read_checkpoint_notes(trace.path) if n.step == 0)
    assert note.weights_digest == f"{weights_digest(model.named_parameters(), trace.manifest.fingerprint.seed):016x}"
    try:
        for rank in range(WORLD):
            model.zero_grad()
            for mb in trace.microbatch_ids(window.records[0, rank]):
                sharded.loss_of(model, sharded.microbatch(int(mb))).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            assert int(window.records[0, rank]["local_digest"]) == combine_digests(
                [digest(flat, trace.manifest.fingerprint.seed)]
            )
    finally:
        torch.set_num_threads(threads)


def _hsdp3(rank: int, root: str) -> dict:
    from sdc_forensics.demo.sharded import train

    return {
        name: train(
            rank,
            6,
            str(Path(root, name, "trace")),
            str(Path(root, name, "ckpt")),
            hsdp=(3, 2),
            steps=5,
            inject=inject,
            reduction=reduction,
        )
        for name, inject, reduction in (
            ("clean", (), "ordered"),
            ("update", ("update:step=1:rank=4:bit=22",), "ordered"),
            ("native", (), "native"),
        )
    }


def test_with_three_hsdp_replicas_the_vote_names_the_rank_online_and_a_clean_run_certifies(tmp_path):
    """HSDP 3 x 2 (6 processes): the ordered reduction redoes the replicas' all-reduce in replica
    order, so the replay is exact for any number of replicas; and a job keeping gloo's own
    collectives certifies too (three replicas: the ring order of their all-reduce matters, where two
    terms add alike either way)."""
    found = gloo_job(_hsdp3, 6, tmp_path / "results", str(tmp_path))
    assert found[0]["clean"]["alarms"] == []
    assert {(a["step"], a["rank"]) for a in found[0]["update"]["alarms"]} >= {(1, 4)}
    code, doc = _bisect(tmp_path / "clean" / "trace", "certify")
    assert code == 0 and [c["status"] for c in doc["checkpoints"]] == ["clean", "clean"], doc
    code, doc = _bisect(tmp_path / "update" / "trace")
    assert code == 1 and doc["first_divergent_step"] == 1, doc
    assert [(s["rank"], s["location"], s["mesh"]) for s in doc["suspects"]] == [
        (4, "optimizer_update", "replicate=2, shard=0")
    ]
    assert found[0]["native"]["alarms"] == []
    code, doc = _bisect(tmp_path / "native" / "trace", "certify")
    assert code == 0 and [c["status"] for c in doc["checkpoints"]] == ["clean", "clean"], doc


def _communicating_accumulation(rank: int, root: str) -> str:
    from sdc_forensics.demo import sharded
    from sdc_forensics.errors import UsageError
    from sdc_forensics.recorder import Recorder, RecorderOptions

    model = sharded.shard(sharded.build_model())
    optimizer = sharded.make_optimizer(model)
    with Recorder(
        Path(root, "trace"), model, optimizer, recipe=sharded.REFERENCE, options=RecorderOptions(policy="continue")
    ) as rec:
        try:
            with rec.step(0, microbatch_ids=[2 * rank, 2 * rank + 1]):
                for mb in (
                    2 * rank,
                    2 * rank + 1,
                ):  # no set_requires_gradient_sync(False): a reduce-scatter per microbatch
                    sharded.loss_of(model, sharded.microbatch(mb)).backward()
                optimizer.step()
            return "recorded"
        except UsageError as refusal:
            return str(refusal)


def test_accumulation_that_reduce_scatters_every_microbatch_is_refused_on_every_rank(tmp_path):
    """Two reduce-scatters of one group in a step would record the sum of two pieces' terms, not
    the summed gradient's: every rank raises one line instead of writing a wrong record."""
    found = gloo_job(_communicating_accumulation, WORLD, tmp_path / "results", str(tmp_path))
    assert all("reduce-scattered twice in one step" in f and "set_requires_gradient_sync(False)" in f for f in found), (
        found
    )


def test_a_users_conv_net_with_batchnorm_certifies_though_fsdp2_keeps_each_ranks_running_statistics(tmp_path):
    """BatchNorm's buffers are not sharded and FSDP2 never broadcasts them: every rank keeps its own,
    the checkpoint holds one rank's. The weights and optimizer state replay exactly; the note says
    the buffers are not confirmed, and nothing is blamed for them."""
    from tests.recorder.fsdp_convjob import job

    assert gloo_job(job, WORLD, tmp_path / "results", str(tmp_path)) == ["ok"] * WORLD
    code, doc = _bisect(tmp_path / "trace", "certify")
    assert code == 0 and [c["status"] for c in doc["checkpoints"]] == ["clean"] * 3, doc


def _one_shard_mesh(rank: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from sdc_forensics.demo import sharded
    from sdc_forensics.errors import UsageError
    from sdc_forensics.recorder import Recorder

    model = sharded.shard(
        sharded.build_model(), init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard"))
    )
    try:
        Recorder("unused", model, sharded.make_optimizer(model))
        return "recorded"
    except UsageError as refusal:
        return str(refusal)


def test_a_mesh_whose_shard_dimension_is_one_is_refused(tmp_path):
    """HSDP (4, 1) holds whole parameters on every rank and reduce-scatters nothing: not a sharded job."""
    found = gloo_job(_one_shard_mesh, WORLD, tmp_path / "results")
    assert all("shard dimension of the mesh has size 1" in f for f in found), found

"""Issue 24: a Hugging Face ``Trainer`` job recorded with ``hf.record`` (tests/integrations/hfjob.py,
2 gloo processes on CPU, a tiny model made here) is replayed exactly and judged by the unchanged
CLI: a clean run certified clean (every checkpoint folder, by exact replay), its folders verified,
a fault injected through the adapter found at its step and rank, a resumed run read as a second
attempt. Skipped, with the reason, when the ``hf`` extra is not installed.
"""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("transformers", reason="the hf extra is not installed: pip install -e '.[hf]'")
pytest.importorskip("accelerate", reason="the hf extra is not installed: pip install -e '.[hf]'")

from tests.cli.installed import run_installed  # noqa: E402
from tests.integrations.launch import REPO, assert_ok, run_ranks  # noqa: E402

pytestmark = pytest.mark.slow
JOB = "tests.integrations.hfjob"
ENV = {"PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """6 optimizer steps of 2 microbatches each (the epoch's last step too), checkpoints 0, 3 and 6."""
    where = tmp_path_factory.mktemp("hf-clean")
    assert_ok(run_ranks(JOB, ["--trace", "trace", "--out", "out"], cwd=where))
    return where


@pytest.mark.heavy  # a 2-process Trainer run and its replay: kept out of the README's command (under 8 min)
def test_a_clean_trainer_run_is_certified_by_exact_replay(clean_run, tmp_path):
    inspected = run_installed(["inspect", "trace", "--json"], tmp_path, cwd=clean_run)
    assert inspected.returncode == 0, inspected.stderr
    doc = json.loads(inspected.stdout)
    assert doc["framework"]["name"] == "transformers" and doc["framework"]["adapter"] == "sdc_forensics.integrations.hf"
    import transformers

    assert doc["framework"]["version"] == transformers.__version__
    certified = run_installed(["certify", "trace", "--allow-numpy", "--json"], tmp_path, cwd=clean_run, env=ENV)
    assert certified.returncode == 0, certified.stderr
    result = json.loads(certified.stdout)
    assert {c["step"]: c["status"] for c in result["checkpoints"]} == {0: "clean", 3: "clean", 6: "clean"}
    assert result["resume_step"] == 6
    assert "comparison exact" in certified.stderr or "(exact)" in certified.stderr, certified.stderr


@pytest.mark.heavy  # a 2-process Trainer run and its replay: kept out of the README's command (under 8 min)
def test_a_clean_trainer_run_without_allow_numpy_is_never_called_corrupt(clean_run, tmp_path):
    """Issue 33: the Trainer's rng_state files hold numpy arrays, which the reader declines without
    --allow-numpy. Those tensors are not verified, never "absent from the file": no corrupt
    checkpoint, no storage suspect, no corruption verdict, and the answer says to pass --allow-numpy."""
    ran = run_installed(["bisect", "trace", "--json"], tmp_path, cwd=clean_run, env=ENV)
    doc = json.loads(ran.stdout)
    assert ran.returncode != 1 and doc["verdict"] != "corruption", (doc["verdict"], doc["suspects"], ran.stderr[-2000:])
    assert doc["suspects"] == [] and all(c["status"] != "corrupt" for c in doc["checkpoints"]), doc["checkpoints"]
    assert "--allow-numpy" in ran.stderr + json.dumps(doc), ran.stderr[-2000:]
    # said once, as what settles it, not only inside every checkpoint's reasons
    assert any(line.endswith("pass --allow-numpy to read and certify them") for line in doc["settle"]), doc["settle"]


@pytest.mark.heavy  # a 2-process Trainer run and its replay: kept out of the README's command (under 8 min)
def test_the_trainers_checkpoint_folders_verify(clean_run, tmp_path):
    for step in (0, 3, 6):
        folder = clean_run / "out" / f"checkpoint-{step}"
        assert (folder / "model.safetensors").is_file() and (folder / "optimizer.pt").is_file()
        alone = run_installed(["verify-checkpoint", str(folder), "--allow-numpy"], tmp_path)
        assert alone.returncode == 0, alone.stderr
        assert "VERIFIED" in alone.stderr and "not verifiable" not in alone.stderr, alone.stderr
    # with its run: the folder against its note and the replicas' majority, steps 0..2 replayed
    with_trace = run_installed(
        ["verify-checkpoint", "out/checkpoint-3", "--trace", "trace", "--allow-numpy"], tmp_path, cwd=clean_run, env=ENV
    )
    assert with_trace.returncode == 0, with_trace.stderr
    assert "content as saved" in with_trace.stderr, with_trace.stderr


@pytest.mark.heavy
def test_a_damaged_folder_is_caught_against_its_note(clean_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(clean_run, copy)
    weights = copy / "out" / "checkpoint-3" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x40  # a bit in the last tensor's bytes
    weights.write_bytes(bytes(data))
    ran = run_installed(
        ["verify-checkpoint", "out/checkpoint-3", "--trace", "trace", "--allow-numpy"], tmp_path, cwd=copy, env=ENV
    )
    assert ran.returncode == 1, ran.stderr
    assert "bytes differ from what was saved" in ran.stderr, ran.stderr


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    """6 steps with a flip in rank 1's gradient at step 4, checkpoints 0, 3 and 6, a data worker per rank
    (the sample indices travel with each batch from the worker process): read as it is, or copied first
    by a test that resumes it."""
    where = tmp_path_factory.mktemp("hf-faulty")
    argv = ["--trace", "trace", "--out", "out", "--inject", "grad:step=4:rank=1:bit=30", "--workers", "1"]
    assert_ok(run_ranks(JOB, argv, cwd=where))
    return where


@pytest.mark.heavy
def test_a_fault_injected_through_the_adapter_is_found_at_its_step_and_rank(faulty_run, tmp_path):
    ran = run_installed(["bisect", "trace", "--allow-numpy", "--json"], tmp_path, cwd=faulty_run, env=ENV)
    assert ran.returncode == 1, ran.stderr
    doc = json.loads(ran.stdout)
    assert doc["verdict"] == "corruption"
    assert doc["first_divergent_step"] == 4
    assert [s["rank"] for s in doc["suspects"]] == [1]
    statuses = {c["step"]: c["status"] for c in doc["checkpoints"]}
    assert statuses == {0: "clean", 3: "clean", 6: "tainted"}


def _hashes(folder) -> dict:
    import hashlib

    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.heavy
def test_a_resumed_trainer_run_is_a_second_attempt_and_writes_over_no_checkpoint(faulty_run, tmp_path):
    """Issue 40: attempt 0 with a flip at step 4 saves checkpoint-0, -3, -6. Resuming into the same
    output_dir would have the Trainer write checkpoint-6 over attempt 0's: refused at attach, one
    line, exit 2 on every rank, nothing written. Resumed into a new output_dir from checkpoint-3,
    attempt 1 starts at step 3, writes no checkpoint 0, leaves every file of attempt 0 byte for
    byte, and its checkpoint 6 certifies. bisect still reports attempt 0's fault: rank 1 at step 4
    with its attempt, verdict corruption, while the latest lineage (steps 3..5 re-run clean) has no
    divergent step."""
    tmp_path = tmp_path / "run"
    shutil.copytree(faulty_run, tmp_path)  # attempt 0: the faulty run, copied (the resume adds attempt 1 to it)
    before = _hashes(tmp_path / "out")
    assert {name.split("/")[0] for name in before} == {"checkpoint-0", "checkpoint-3", "checkpoint-6"}
    refused = run_ranks(JOB, ["--trace", "trace", "--out", "out", "--resume", "out/checkpoint-3"], cwd=tmp_path)
    assert [r.returncode for r in refused] == [2, 2], [r.stderr[-2000:] for r in refused]
    lines = [line for line in refused[0].stderr.splitlines() if line.startswith("sdc-forensics:")]
    assert len(lines) == 1 and "checkpoint-6" in lines[0] and "new folder" in lines[0], refused[0].stderr
    assert "Traceback" not in refused[0].stderr + refused[1].stderr and "sdc-forensics:" not in refused[1].stderr
    assert_ok(run_ranks(JOB, ["--trace", "trace", "--out", "out2", "--resume", "out/checkpoint-3"], cwd=tmp_path))
    assert _hashes(tmp_path / "out") == before
    assert sorted(p.name for p in (tmp_path / "out2").iterdir()) == ["checkpoint-6"]
    inspected = json.loads(run_installed(["inspect", "trace", "--json"], tmp_path, cwd=tmp_path).stdout)
    assert [(a["attempt"], a["start_step"]) for a in inspected["attempts"]] == [(0, 0), (1, 3)]
    ran = run_installed(["bisect", "trace", "--allow-numpy", "--json"], tmp_path, cwd=tmp_path, env=ENV)
    doc = json.loads(ran.stdout)
    statuses = {(c["step"], c["path"].split("/")[-2]): c["status"] for c in doc["checkpoints"]}
    assert statuses[(3, "out")] == "clean" and statuses[(6, "out2")] == "clean", (statuses, ran.stderr)
    assert any("re-executed by a later attempt" in note for note in doc["notes"]), doc["notes"]
    # the first attempt's fault, judged on its own records: its rank, its attempt, its step
    assert (ran.returncode, doc["verdict"], doc["first_divergent_step"]) == (1, "corruption", None), ran.stderr
    assert [(s["rank"], s.get("attempt"), s["steps"]) for s in doc["suspects"]] == [(1, 0, [4])], doc["suspects"]


@pytest.mark.heavy
def test_an_alarm_stops_the_trainer_with_exit_18_and_every_rank_closes_its_trace(tmp_path):
    """Issue 40: policy raise, a flip inside the all-reduce at step 2: the online check raises on
    every rank inside trainer.train(); the adapter closes the trace (END record, on an exception)
    before exit_on_alarm turns the alarm into exit 18. Before, the HF adapter left it open."""
    ranks = run_ranks(
        JOB,
        ["--trace", "trace", "--out", "out", "--policy", "raise", "--inject", "allreduce:step=2:rank=1:bit=30"],
        cwd=tmp_path,
    )
    assert [r.returncode for r in ranks] == [18, 18], [r.stderr[-2000:] for r in ranks]
    end = json.loads(run_installed(["inspect", "trace", "--json"], tmp_path, cwd=tmp_path).stdout)["end"]
    assert [(r["closed"], r["closed_on_error"]) for r in end["ranks"]] == [(True, True), (True, True)], end
    assert "no rank closed its trace" not in end["summary"] and end["last_step"] == 2, end


@pytest.mark.heavy
def test_a_keyboard_interrupt_inside_a_step_stops_the_trainer_and_every_rank_closes_its_trace(tmp_path):
    """Issue 40: Ctrl+C inside step 2 (KeyboardInterrupt on every rank, after the step began): the
    adapter's train() wrapper closes the trace on the way out (END record, on an exception)."""
    ranks = run_ranks(JOB, ["--trace", "trace", "--out", "out", "--interrupt-at", "2"], cwd=tmp_path)
    assert [r.returncode for r in ranks] == [1, 1], [r.stderr[-2000:] for r in ranks]
    assert all("KeyboardInterrupt" in r.stderr for r in ranks)
    end = json.loads(run_installed(["inspect", "trace", "--json"], tmp_path, cwd=tmp_path).stdout)["end"]
    assert [(r["closed"], r["closed_on_error"]) for r in end["ranks"]] == [(True, True), (True, True)], end
    assert "no rank closed its trace" not in end["summary"] and end["last_step"] == 1, end


@pytest.mark.heavy
def test_a_trainer_job_with_dropout_replays_its_masks_and_certifies(tmp_path):
    """Issue 40: dropout 0.1 (GPT2Config's default rate): the adapter seeds each microbatch's forward
    from (step seed, microbatch) and the recipe seeds its forward alike, so every step replays bit
    for bit and every checkpoint certifies."""
    assert_ok(run_ranks(JOB, ["--trace", "trace", "--out", "out", "--dropout", "0.1"], cwd=tmp_path))
    certified = run_installed(["certify", "trace", "--allow-numpy", "--json"], tmp_path, cwd=tmp_path, env=ENV)
    assert certified.returncode == 0, certified.stderr
    assert {c["step"]: c["status"] for c in json.loads(certified.stdout)["checkpoints"]} == {
        0: "clean",
        3: "clean",
        6: "clean",
    }
    assert "(exact)" in certified.stderr or "comparison exact" in certified.stderr, certified.stderr


def test_settings_the_adapter_cannot_replay_are_refused_with_one_line(tmp_path):
    """In one process (no launch): each refusal names its setting, and nothing is written."""
    from transformers import Trainer, TrainingArguments

    from sdc_forensics.errors import UsageError
    from sdc_forensics.integrations import hf
    from tests.integrations.hfjob import TinyConfig, TinyModel, make_dataset

    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=2)
    trainer = Trainer(model=TinyModel(TinyConfig()), args=args, train_dataset=make_dataset())
    with pytest.raises(UsageError, match=r"runs 1 process: the recorder records data-parallel \(DDP\) jobs"):
        hf.record(trainer, tmp_path / "trace", dataset="tests.integrations.hfjob:make_dataset")
    trainer.args.label_smoothing_factor = 0.1
    trainer.args.fp16 = True
    trainer.accelerator.gradient_state.plugin_kwargs["sync_each_batch"] = True
    trainer.args.torch_compile = True
    trainer.model.norm = __import__("torch").compile(trainer.model.norm)
    problems = hf._refusals(trainer, __import__("transformers"))
    for setting in (
        "label_smoothing_factor",
        "mixed precision",
        "sync_each_batch",
        "torch_compile",
        "torch.compile wraps 'norm'",
    ):
        assert any(setting in p for p in problems), (setting, problems)
    assert not (tmp_path / "trace").exists()


@pytest.mark.parametrize("limit, said", [(2, True), (None, False)])
def test_a_save_total_limit_is_said_at_attach(tmp_path, monkeypatch, caplog, limit, said):
    """Issue 40: save_total_limit deletes early checkpoint folders: hf.record says so on rank 0, one
    line naming the setting and `certify --follow`. One process stands in for rank 0 of a DDP job
    (its own refusal, one process, is set aside); record only wires the trainer, nothing trains."""
    from transformers import Trainer, TrainingArguments

    from sdc_forensics.integrations import hf
    from tests.integrations.hfjob import TinyConfig, TinyModel, make_dataset

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=2, save_steps=1, save_total_limit=limit
    )
    trainer = Trainer(model=TinyModel(TinyConfig()), args=args, train_dataset=make_dataset())
    real = hf._refusals
    assert [p[:22] for p in real(trainer, __import__("transformers"))] == ["the job runs 1 process"]
    monkeypatch.setattr(hf, "_refusals", lambda *a: [p for p in real(*a) if not p.startswith("the job runs 1 process")])
    monkeypatch.delenv("RANK", raising=False)
    with caplog.at_level("WARNING"):
        hf.record(trainer, tmp_path / "trace", dataset="tests.integrations.hfjob:make_dataset")
    lines = [r.getMessage() for r in caplog.records if "deletes early checkpoints" in r.getMessage()]
    if said:
        (line,) = lines
        assert (
            line.startswith("sdc-forensics: save_total_limit=2 deletes early checkpoints")
            and "certify --follow" in line
        )
    else:
        assert lines == []


def _tokenizer():
    """A word-level tokenizer built here (no download): the stock collators need one to pad. The
    job's own (hfjob.make_tokenizer): its launched ranks and the replay build it too."""
    from tests.integrations.hfjob import make_tokenizer

    return make_tokenizer()


SENTENCES = ["the cat sat", "a dog ran on the mat", "the dog"]


def _stock_collators(tokenizer):
    from transformers import DataCollatorForLanguageModeling, DataCollatorForSeq2Seq, DataCollatorWithPadding

    return {
        "language-modeling": DataCollatorForLanguageModeling(tokenizer, mlm=False),
        "with-padding": DataCollatorWithPadding(tokenizer),
        "seq2seq": DataCollatorForSeq2Seq(tokenizer),
    }


def _features(name, tokenizer):
    rows = [dict(tokenizer(s)) for s in SENTENCES]
    if name == "seq2seq":  # labels of their own length, padded with -100 by the collator
        rows = [{**r, "labels": list(reversed(r["input_ids"]))} for r in rows]
    return rows


@pytest.mark.parametrize("name", ["language-modeling", "with-padding", "seq2seq"])
def test_the_stock_collators_batch_encoding_carries_the_indices_and_the_replay_rebuilds_it(name):
    """Issue 40: each stock collator returns a BatchEncoding (a Mapping, not a dict). Training's
    IndexedCollate gives the collator's own batch plus the indices; the replay's SampleBatches
    regroups the same indices into the same batch."""
    import torch
    from transformers import BatchEncoding

    from sdc_forensics.integrations import _common
    from sdc_forensics.integrations.hf import INDEX_KEY, IndexedCollate, IndexedDataset

    tokenizer = _tokenizer()
    collator = _stock_collators(tokenizer)[name]
    rows = _features(name, tokenizer)
    expected = collator([rows[2], rows[0]])  # the collator alone, on the samples a sampler drew as [2, 0]
    assert isinstance(expected, BatchEncoding) and not isinstance(expected, dict)
    batch = IndexedCollate(collator)(IndexedDataset(rows).__getitems__([2, 0]))
    assert batch[INDEX_KEY].tolist() == [2, 0]
    assert set(batch) - {INDEX_KEY} == set(expected)
    for key, value in expected.items():
        assert torch.equal(batch[key], value), key
    replay = _common.SampleBatches(lambda i: rows[i], collator)
    ids = _common.batch_ids([2, 0])
    assert replay.fetch(_common.step_header(1), "cpu") == () and replay.fetch(ids[0], "cpu") == ()
    rebuilt = replay.fetch(ids[1], "cpu")
    assert set(rebuilt) == set(expected) and all(torch.equal(rebuilt[k], v) for k, v in expected.items())


def test_the_trainers_default_collator_from_a_tokenizer_carries_the_indices(tmp_path):
    """Trainer(processing_class=tokenizer) collates with DataCollatorWithPadding behind its column
    remover: the loader the adapter tags gives padded batches with the indices."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from sdc_forensics.integrations.hf import INDEX_KEY, IndexedCollate, IndexedDataset

    tokenizer = _tokenizer()
    rows = [{**dict(tokenizer(s)), "text": s} for s in SENTENCES]  # sentences of 3, 6 and 2 words: any two pad
    config = GPT2Config(vocab_size=16, n_positions=16, n_embd=8, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=1, per_device_train_batch_size=2
    )
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=rows, processing_class=tokenizer)
    assert type(trainer.data_collator).__name__ == "DataCollatorWithPadding"
    trainer.train_dataset = IndexedDataset(trainer.train_dataset)  # what hf.record wires (it refuses one process)
    loader = trainer.get_train_dataloader()
    inner = getattr(loader, "base_dataloader", loader)
    inner.collate_fn = IndexedCollate(inner.collate_fn)
    batch = next(iter(loader))
    assert sorted(batch[INDEX_KEY].tolist()) in ([0, 1], [0, 2], [1, 2])
    assert "text" not in batch and batch["input_ids"].shape[0] == 2 and bool((batch["attention_mask"] == 0).any())


@pytest.mark.heavy  # two 2-process Trainer runs and their replays per collator: kept out of the README's command
@pytest.mark.parametrize("collator", ["padding", "lm"])
def test_a_trainer_run_through_a_stock_collator_is_certified_and_its_fault_found(tmp_path, collator):
    """Issue 40, end to end: a GPT-2 (tiny config, default dropout 0.1) trained by 2 ranks on
    sentences of 1 to 8 words through a stock collator, whose batch is a BatchEncoding: ``padding``
    is the Trainer's default given processing_class=tokenizer and no collator (DataCollatorWithPadding
    behind its column remover, a ``label`` column renamed ``labels``), ``lm`` is
    DataCollatorForLanguageModeling(mlm=False). The clean run certifies every checkpoint by exact
    replay (the dataset function returns the rows and the collator); a flip in rank 1's gradient at
    step 4 is named by bisect at its step and rank."""
    from tests.integrations.hfjob import make_lm_text, make_padded_text

    rows, made = (make_padded_text if collator == "padding" else make_lm_text)()
    assert len({len(r["input_ids"]) for r in rows}) > 4 and "text" in rows[0]  # variable length: every batch pads
    assert (
        type(made).__name__ == {"padding": "DataCollatorWithPadding", "lm": "DataCollatorForLanguageModeling"}[collator]
    )
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    clean.mkdir()
    faulty.mkdir()
    assert_ok(run_ranks(JOB, ["--trace", "trace", "--out", "out", "--collator", collator], cwd=clean))
    certified = run_installed(["certify", "trace", "--allow-numpy", "--json"], tmp_path, cwd=clean, env=ENV)
    assert certified.returncode == 0, certified.stderr
    result = json.loads(certified.stdout)
    assert {c["step"]: c["status"] for c in result["checkpoints"]} == {0: "clean", 3: "clean", 6: "clean"}, (
        certified.stderr
    )
    assert result["resume_step"] == 6
    assert "(exact)" in certified.stderr or "comparison exact" in certified.stderr, certified.stderr

    assert_ok(
        run_ranks(
            JOB,
            ["--trace", "trace", "--out", "out", "--collator", collator, "--inject", "grad:step=4:rank=1:bit=30"],
            cwd=faulty,
        )
    )
    ran = run_installed(["bisect", "trace", "--allow-numpy", "--json"], tmp_path, cwd=faulty, env=ENV)
    assert ran.returncode == 1, ran.stderr
    doc = json.loads(ran.stdout)
    assert (doc["verdict"], doc["first_divergent_step"]) == ("corruption", 4), ran.stderr[-2000:]
    assert [(s["rank"], s["steps"]) for s in doc["suspects"]] == [(1, [4])], doc["suspects"]
    assert {c["step"]: c["status"] for c in doc["checkpoints"]} == {0: "clean", 3: "clean", 6: "tainted"}

"""Fault specs: parsing, errors, and the bit flips themselves (no processes)."""

from __future__ import annotations

import struct

import pytest
import torch

from sdc_forensics.errors import UsageError
from sdc_forensics.inject import FaultSpec, Injector, flip_bit_, parse_spec, parse_specs


def test_parse_full_spec():
    spec = parse_spec("grad:step=12:rank=1:bit=30:element=7")
    assert spec == FaultSpec(location="grad", step=12, rank=1, bit=30, element=7)
    assert str(spec) == "grad:step=12:rank=1:bit=30:element=7"
    assert parse_spec(str(spec)) == spec


def test_parse_optional_rank_for_collective_and_file():
    assert parse_spec("allreduce-all:step=3:bit=2").rank == 0
    assert parse_spec("checkpoint-file:step=10:bit=30").location == "checkpoint-file"


@pytest.mark.parametrize(
    "text, message",
    [
        ("bogus", "not of the form"),
        ("nowhere:step=1:rank=0:bit=1", "unknown location"),
        ("grad:step=1:rank=0", "lacks bit"),
        ("grad:step=x:rank=0:bit=1", "is not an integer"),
        ("grad:step=1:rank=0:bit=1:step=2", "given twice"),
        ("grad:step=1:rank=0:bit=99", "bit must be in 0..63"),
        ("grad:step=-1:rank=0:bit=1", "step must be >= 0"),
        ("grad:step=1:rank=0:bit=1:colour=red", "is not one of"),
    ],
)
def test_parse_errors_are_usage_errors(text, message):
    with pytest.raises(UsageError, match=message):
        parse_spec(text)


def test_none_means_no_injection_and_does_not_combine():
    assert parse_specs(["none"]) == ()
    with pytest.raises(UsageError, match="cannot be combined"):
        parse_specs(["none", "grad:step=1:rank=0:bit=1"])


@pytest.mark.parametrize("bit, expected", [(31, -0.4), (25, 0.4 / 16), (0, None)])
def test_flip_bit_float32(bit, expected):
    t = torch.tensor([1.0, 0.4, 2.0])
    old, new = flip_bit_(t, 1, bit)
    assert old == pytest.approx(0.4)
    raw_before = struct.unpack("<I", struct.pack("<f", 0.4))[0]
    raw_after = struct.unpack("<I", struct.pack("<f", float(t[1])))[0]
    assert raw_before ^ raw_after == 1 << bit
    if expected is not None:
        assert new == pytest.approx(expected)
    assert t[0] == 1.0 and t[2] == 2.0


def test_flip_bit_rejects_missing_bit():
    with pytest.raises(UsageError, match="does not exist"):
        flip_bit_(torch.zeros(2, dtype=torch.bfloat16), 0, 20)


def test_default_element_is_deterministic_and_in_range():
    spec = parse_spec("weights:step=5:rank=2:bit=3")
    chosen = {spec.choose_element(1000) for _ in range(3)}
    assert len(chosen) == 1 and 0 <= chosen.pop() < 1000
    other = parse_spec("weights:step=6:rank=2:bit=3")
    assert spec.choose_element(10**6) != other.choose_element(10**6)
    with pytest.raises(UsageError, match="out of range"):
        parse_spec("weights:step=5:rank=2:bit=3:element=10").choose_element(10)


def test_injector_segments_only_flip_on_the_right_rank_step_and_segment():
    specs = [parse_spec("grad:step=2:rank=1:bit=31:element=5")]
    a, b = torch.ones(4), torch.ones(4)
    Injector(specs, rank=0).corrupt_tensors("grad", 2, [a, b])
    assert (a == 1).all() and (b == 1).all()
    inj = Injector(specs, rank=1)
    inj.corrupt_tensors("grad", 1, [a, b])
    assert (b == 1).all()
    inj.corrupt_tensors("grad", 2, [a, b])
    assert b[1] == -1 and (a == 1).all()
    assert inj.fired[0].element == 5 and inj.fired[0].old == 1.0 and inj.fired[0].new == -1.0


def test_allreduce_all_applies_on_every_rank_with_the_same_element():
    spec = parse_spec("allreduce-all:step=0:rank=3:bit=30")
    out = []
    for rank in range(3):
        t = torch.full((100,), 0.5)
        Injector([spec], rank=rank).corrupt_tensors("allreduce-all", 0, [t])
        out.append(t)
    assert all(torch.equal(out[0], o) for o in out) and not torch.equal(out[0], torch.full((100,), 0.5))


def test_checkpoint_file_flip_lands_inside_tensor_data(tmp_path):
    path = tmp_path / "ck.pt"
    torch.save({"w": torch.full((256,), 0.5)}, path)
    inj = Injector([parse_spec("checkpoint-file:step=10:bit=30")], rank=0)
    inj.corrupt_checkpoint_file(10, path)
    loaded = torch.load(path, weights_only=True)["w"]
    changed = (loaded != 0.5).nonzero().flatten()
    assert len(changed) == 1 and loaded[changed[0]] > 1e30
    inj.corrupt_checkpoint_file(11, path)  # no spec for checkpoint 11: untouched
    assert len(inj.fired) == 1


def test_which_locations_hit_every_rank_is_said_once():
    """``allreduce-all`` and ``checkpoint-file`` ignore ``rank`` (parsing, who flips, the default
    element, and the demo's check of the rank against the world size all ask ``every_rank``);
    ``allreduce`` is one rank's reduced gradient."""
    from sdc_forensics.inject import EVERY_RANK_LOCATIONS, LOCATIONS

    assert EVERY_RANK_LOCATIONS == {"allreduce-all", "checkpoint-file"} and EVERY_RANK_LOCATIONS <= set(LOCATIONS)
    for location in LOCATIONS:
        spec = FaultSpec(location=location, step=1, rank=1, bit=3)
        assert spec.every_rank == (location in EVERY_RANK_LOCATIONS)
        assert [spec.applies_to(r) for r in range(3)] == ([True] * 3 if spec.every_rank else [False, True, False])
    assert not FaultSpec(location="allreduce", step=1, rank=1, bit=3).every_rank


@pytest.mark.parametrize("location, accepted", [("allreduce-all", True), ("allreduce", False), ("grad", False)])
def test_the_demo_checks_the_rank_only_where_the_flip_is_one_ranks(tmp_path, location, accepted):
    from sdc_forensics.demo.run import DemoConfig

    spec = FaultSpec(location=location, step=2, rank=9, bit=30)
    if accepted:
        DemoConfig(out_dir=tmp_path, injections=(spec,))
    else:
        with pytest.raises(UsageError, match="rank 9 does not exist in a 4-rank run"):
            DemoConfig(out_dir=tmp_path, injections=(spec,))


def test_an_input_drill_flips_a_strided_view_in_place():
    # a microbatch sliced from a longer sequence (inputs x[:, :-1], targets x[:, 1:]) is not contiguous
    whole = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    inputs, targets = whole[:, :-1], whole[:, 1:]
    injector = Injector(parse_specs(("input:step=0:rank=0:element=6:bit=30",)), rank=0)
    injector.corrupt_input(0, [inputs, targets], 0)
    # element 6 of inputs (row-major over its 2 x 5 elements) is whole[1, 1], also targets[1, 0]
    assert whole[1, 1].item() != 7.0 and targets[1, 0].item() == whole[1, 1].item()
    assert whole.flatten().tolist()[:7] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert [f.element for f in injector.fired] == [6]


@pytest.mark.parametrize("bit", [0, 2, 5, 30, 63])
def test_an_input_drill_on_token_ids_keeps_every_id_valid(bit):
    from sdc_forensics.inject import flip_id_

    # inputs and labels share one buffer, as a language model's microbatch slices them
    ids = torch.randint(40, (4, 9), generator=torch.Generator().manual_seed(bit))
    for element in range(ids[:, :-1].numel()):
        whole = ids.clone()
        inputs, labels = whole[:, :-1], whole[:, 1:]
        largest = int(inputs.max())
        spec = f"input:step=0:rank=0:element={element}:bit={bit}"
        injector = Injector(parse_specs((spec,)), rank=0)
        assert injector.corrupt_input(0, [inputs, labels], 0) == 2 * inputs.numel()
        (fired,) = injector.fired
        assert fired.old != fired.new and 0 <= fired.new <= largest, fired
        # exactly one id of the buffer changed, and the label that is the same element with it
        assert int((whole != ids).sum()) == 1 and inputs.flatten()[element].item() == fired.new
    # the rule itself: bit 2 of 3 is 7; an id whose flip would exceed the largest loses its lowest set bit
    flat = torch.tensor([3, 39, 0])
    assert flip_id_(flat, 0, 2, 39) == (3.0, 7.0)
    assert flip_id_(flat, 1, 3, 39) == (39.0, 38.0)
    assert flip_id_(flat, 2, 5, 39) == (0.0, 32.0)
    # a label's ignore marker becomes a real target, never another negative value (an index error)
    labels = torch.tensor([5, -100, 7])
    assert flip_id_(labels, 1, 3, 7) == (-100.0, 0.0) and labels.tolist() == [5, 0, 7]

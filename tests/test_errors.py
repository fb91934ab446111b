"""``sdc_forensics/errors.py``: every reader raises one error type for input it cannot parse, and
the CLI maps it to exit 3 from the class alone (no list of reader modules anywhere)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.errors import InvalidInputError, MalformedInputError, TraceError, reader, reader_class

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden-v1"


def test_an_unchecked_error_becomes_the_package_error_naming_where():
    @reader
    def parse(doc):
        return doc["missing"]

    with pytest.raises(MalformedInputError) as caught:
        parse({})
    assert isinstance(caught.value, InvalidInputError) and caught.value.exit_code == 3
    text = str(caught.value)
    assert "KeyError in tests.test_errors." in text and ".parse:" in text  # no package frame below: the reader itself
    assert "KeyError" in text and "'missing'" in text and "does not check yet" in text
    assert isinstance(caught.value.__cause__, KeyError)


def test_a_checked_error_and_a_result_pass_unchanged():
    @reader
    def parse(doc):
        if doc is None:
            raise TraceError("no document; pass one")
        return doc * 2

    assert parse(21) == 42
    with pytest.raises(TraceError, match="no document; pass one") as caught:
        parse(None)
    assert type(caught.value) is TraceError


def test_a_generator_reader_converts_what_its_iteration_raises():
    @reader
    def first_items(rows):
        for row in rows:
            yield row[0]

    rows = first_items([[1], [2], []])
    assert next(rows) == 1 and next(rows) == 2
    with pytest.raises(MalformedInputError, match="IndexError"):
        next(rows)


def test_an_error_that_is_no_parse_error_keeps_its_type():
    @reader
    def ratio(a, b):
        return a / b

    with pytest.raises(ZeroDivisionError):
        ratio(1, 0)


def test_a_new_checkpoint_reader_is_covered_without_being_listed(tmp_path):
    """Subclassing the reader base is all a new format does: its constructor and public methods
    are marked, its private helpers are not (a helper's error is caught where a caller expects it)."""
    from sdc_forensics.checkpoint.base import CheckpointReader

    class NewFormatReader(CheckpointReader):
        format = "new"

        def __init__(self, path: Path) -> None:
            super().__init__(path, path.parent)
            self._header = {"count": "three"}

        @property
        def files(self):
            return (self.path,)

        def infos(self):
            return list(range(self._header["count"]))  # a string where a count belongs

        def tensors(self):
            yield from ()

        def _helper(self):
            raise ValueError("a helper's own error")

    opened = NewFormatReader(tmp_path / "x.new")
    with pytest.raises(MalformedInputError, match="TypeError"):
        opened.infos()
    with pytest.raises(ValueError, match="a helper's own error"):
        opened._helper()


def test_every_reader_class_and_entry_point_is_marked():
    from sdc_forensics.checkpoint import base, dcp_reader, folder, formats, hf_index, safetensors_reader, torch_reader
    from sdc_forensics.decide import certificate
    from sdc_forensics.trace import checkpoints, manifest
    from sdc_forensics.trace.reader import Trace, step_threads

    classes = (
        folder.FolderReader,
        dcp_reader.DcpReader,
        hf_index.HfIndexReader,
        safetensors_reader.SafetensorsReader,
        torch_reader.TorchReader,
        base.MappedFile,
        Trace,
    )
    for cls in classes:
        assert getattr(cls.__init__, "__sdc_reader__", False), cls
    assert getattr(vars(Trace)["open"].__func__, "__sdc_reader__", False)
    functions = (
        formats.open_checkpoint,
        formats.open_file,
        formats.detect_format,
        formats.sniff_file,
        formats.main_format,
        hf_index.read_index,
        torch_reader.pickle_globals,
        manifest.read_manifest,
        checkpoints.read_checkpoint_notes,
        certificate.read_certificate,
        step_threads,
        Trace.step_windows,
        Trace.records,
    )
    for function in functions:
        assert getattr(function, "__sdc_reader__", False), function


def test_an_unchecked_error_under_the_trace_reader_is_exit_3_one_line(monkeypatch):
    """The trace reader's path through the CLI: no list in ``cli/main.py`` names it."""
    from sdc_forensics.trace import reader as trace_reader

    def unchecked(*args):
        raise IndexError("a malformed rank file no check caught")

    monkeypatch.setattr(trace_reader, "_open_rank_file", unchecked)
    result = CliRunner().invoke(cli, ["inspect", str(GOLDEN)])
    assert result.exit_code == 3, (result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "IndexError in sdc_forensics.trace.reader.open" in lines[0] and "no check caught" in lines[0]


def test_the_cli_keeps_no_list_of_readers():
    import sdc_forensics.cli.main as main

    assert not [name for name in vars(main) if "READER" in name.upper()]


def test_reader_class_leaves_private_helpers_and_plain_attributes():
    @reader_class
    class Parsed:
        limit = 3

        def __init__(self, doc):
            self.doc = doc

        def value(self):
            return self.doc["value"]

        def _raw(self):
            return self.doc["value"]

    parsed = Parsed({})
    assert Parsed.limit == 3
    with pytest.raises(MalformedInputError):
        parsed.value()
    with pytest.raises(KeyError):
        parsed._raw()

"""The report's "first divergent step" when the latest lineage has none but an earlier attempt's suspect
went wrong: a trial user's HF run resumed after a fault read "none found" beside "Suspect: rank 1 ... (steps 5)"."""

from __future__ import annotations

from types import SimpleNamespace

from sdc_forensics.present.report import none_found_sentence


def test_an_earlier_attempts_suspect_is_where_the_sentence_points():
    suspect = SimpleNamespace(attempt=0, steps=(5,))
    result = SimpleNamespace(suspects=[suspect], scope="trace checks over steps 0..15")
    text = none_found_sentence(result)
    assert text.startswith("none in the steps the latest attempt ran") and "attempt 0's step 5" in text
    assert "trace checks over steps 0..15" in text


def test_without_one_it_is_none_found_with_the_scope():
    result = SimpleNamespace(suspects=[SimpleNamespace(attempt=None, steps=(3,))], scope="trace checks over steps 0..9")
    assert none_found_sentence(result) == "none found: trace checks over steps 0..9"

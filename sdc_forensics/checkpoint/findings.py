"""Why a readable checkpoint is not certifiable: the kinds of finding verification reports.

torch-free, so that the decision (``decide/decision.py``) and trace-only commands can name
the kinds without importing the readers (torch); ``verify.py`` makes the findings.
"""

from __future__ import annotations

import enum


#: The subject of the finding that a file's tensors are named unlike its note's (``verify._another_layout``):
#: not verifiable against the note, and no replay starts from it.
ANOTHER_LAYOUT = "tensors (another layout)"


class FindingKind(str, enum.Enum):
    """Why a readable checkpoint is not certifiable."""

    NONFINITE = "nonfinite"
    DIGEST_MISMATCH = "digest-mismatch"
    MISSING_TENSOR = "missing-tensor"
    UNEXPECTED_TENSOR = "unexpected-tensor"
    WEIGHTS_NOT_MAJORITY = "weights-not-majority"
    FILE_DAMAGED = "file-damaged"
    FILE_CHECKSUM_MISMATCH = "file-checksum-mismatch"
    #: A file of the checkpoint whose content could not be checked (not loadable safely, unknown
    #: format, a link not followed): nothing says it is corrupt, nothing says it is clean.
    NOT_VERIFIABLE = "not-verifiable"

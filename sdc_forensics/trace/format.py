"""Byte layout of trace files, version 1 (see ``docs/trace-format.md`` for the prose).

A rank file ``rank-RRRRR.attempt-AAA.sdct`` is a 64-byte file header followed by fixed-size
records, little-endian, appended one at a time and never rewritten::

    header (64 bytes)
      0  8s  magic  b"SDCTRACE"
      8  u2  format_version (1)
     10  u2  header_size (64)
     12  u2  record_size (152 + 8 k)
     14  u2  sketch_k
     16  u4  rank          20  u4  attempt      24  u4  world_size   28  u4  reserved
     32  u8  seed          40  i8  created_ns   48  u8  reserved
     56  u8  checksum of bytes 0..55

    record (152 + 8 k bytes; 216 at the default k = 8)
      0 u4 magic 0x52434453 ("SDCR")   4 u2 kind   6 u2 flags
      8 i8 step   16 u4 rank   20 u4 attempt   24 i8 time_ns   32 f8 loss
     40 u8 input_digest   48 u8 microbatch_digest   56 i8 microbatch_first
     64 u4 microbatch_count   68 u4 nonfinite_local   72 u4 nonfinite_reduced   76 u4 nonfinite_weights
     80 u8 local_digest   88 u8 reduced_digest   96 u8 weights_digest
    104 f4 local_norm  108 f4 reduced_norm  112 f4 local_max_abs  116 f4 reduced_max_abs
    120 f4 weights_norm   124 i4 aux_rank   128 u8 aux_digest   136 f8 aux_value
    144 f4[k] local_sketch   144+4k f4[k] reduced_sketch   144+8k u8 checksum

The checksum of a record (and of the header) is ``fmix64(sum_t P_t * word_t mod 2**64)`` over its
little-endian 64-bit words except the last, with odd constants ``P_t``: any single corrupted
byte changes it, and it is computed for millions of records at once with numpy.

Record kinds and the meaning of their fields are in ``docs/trace-format.md``. The ``aux_*``
fields mean something per kind; in a STEP record ``aux_value`` is the intra-op CPU thread count
(``torch.get_num_threads()``) the step ran with, 0 = unknown (traces written before it was
recorded): a backward-compatible addition, the format version stays 1.

Revision 1.1 (``FORMAT_MINOR``, the manifest's ``format_minor``) adds the END record, which the
recorder appends when it closes a rank file: a file of a 1.1 trace without one was cut short (the
process was killed, or the machine died). Readers of 1.0 skip the kind; the version stays 1.
"""

from __future__ import annotations

import enum
import functools

import numpy as np

from sdc_forensics.fingerprint import constants as C

FORMAT_VERSION = 1
#: Backward-compatible revision of version 1 this package writes: 1 = rank files end with an END
#: record when the recorder closed them (``docs/trace-format.md``, "Revisions").
FORMAT_MINOR = 1
FILE_MAGIC = b"SDCTRACE"
RECORD_MAGIC = 0x52434453
HEADER_SIZE = 64
#: The largest step a trace may hold (2^53 - 1: exact as a JSON number and a float64, and far
#: beyond any training run); readers refuse larger ones, so step arithmetic never overflows int64.
MAX_STEP = (1 << 53) - 1
_CHECKSUM_STREAM = 0xC5


class Kind(enum.IntEnum):
    """Record kinds."""

    # one per rank per step: loss, input, gradients before/after all-reduce, weights
    STEP = 1
    # one per audit recomputation this rank performed
    AUDIT = 2
    # this rank's view of a checkpoint written after ``step`` completed steps
    CHECKPOINT = 3
    # an online check fired on this rank
    ALARM = 4
    # microbatch IDs of the preceding STEP or AUDIT record when not a contiguous range
    IDS = 5
    # (1.1) the recorder closed this file: last step recorded, STEP records written
    END = 6
    # a pipeline stage's hand-offs in the preceding STEP's step: aux_digest what it sent on (its
    # outputs), input_digest what it was handed back (their gradients); absent: not recorded
    HANDOFF = 7


class Flag(enum.IntFlag):
    """Bits of a record's ``flags`` field."""

    NONFINITE_LOCAL = 1 << 0
    NONFINITE_REDUCED = 1 << 1
    ALLREDUCE_MISMATCH = 1 << 2
    # this rank's weights differ from the strict majority
    WEIGHTS_DIVERGED = 1 << 3
    # replica weights were compared at this step
    WEIGHTS_CHECKED = 1 << 4
    # this rank's microbatch was audited at this step
    AUDITED = 1 << 5
    AUDIT_MISMATCH = 1 << 6
    # AUDIT record: this recomputation was the third vote
    AUDIT_TIEBREAK = 1 << 7
    # a comparison found no strict majority
    NO_MAJORITY = 1 << 8
    # microbatch IDs are first .. first + count - 1
    CONTIGUOUS_IDS = 1 << 9
    CHECKPOINT_REFUSED = 1 << 10
    # weights_digest holds this step's post-update weights
    HAS_WEIGHTS = 1 << 11
    # local/reduced gradient fields are filled
    HAS_GRADS = 1 << 12
    # END record: the recorder was closed while an exception propagated
    CLOSED_ON_ERROR = 1 << 13
    # STEP record of a sharded job: aux_digest holds the weight shard digest when the step began
    REST_WEIGHTS = 1 << 14
    GATHER_DIVERGED = (
        1 << 15
        # STEP record of a sharded job: this rank's all-gathered parameters differed from the majority's
    )


HEADER_DTYPE = np.dtype(
    [
        ("magic", "S8"),
        ("format_version", "<u2"),
        ("header_size", "<u2"),
        ("record_size", "<u2"),
        ("sketch_k", "<u2"),
        ("rank", "<u4"),
        ("attempt", "<u4"),
        ("world_size", "<u4"),
        ("reserved0", "<u4"),
        ("seed", "<u8"),
        ("created_ns", "<i8"),
        ("reserved1", "<u8"),
        ("checksum", "<u8"),
    ]
)
assert HEADER_DTYPE.itemsize == HEADER_SIZE


@functools.lru_cache(maxsize=8)
def record_dtype(sketch_k: int) -> np.dtype:
    """The numpy structured dtype of one record for ``sketch_k`` projections."""
    return np.dtype(
        [
            ("magic", "<u4"),
            ("kind", "<u2"),
            ("flags", "<u2"),
            ("step", "<i8"),
            ("rank", "<u4"),
            ("attempt", "<u4"),
            ("time_ns", "<i8"),
            ("loss", "<f8"),
            ("input_digest", "<u8"),
            ("microbatch_digest", "<u8"),
            ("microbatch_first", "<i8"),
            ("microbatch_count", "<u4"),
            ("nonfinite_local", "<u4"),
            ("nonfinite_reduced", "<u4"),
            ("nonfinite_weights", "<u4"),
            ("local_digest", "<u8"),
            ("reduced_digest", "<u8"),
            ("weights_digest", "<u8"),
            ("local_norm", "<f4"),
            ("reduced_norm", "<f4"),
            ("local_max_abs", "<f4"),
            ("reduced_max_abs", "<f4"),
            ("weights_norm", "<f4"),
            ("aux_rank", "<i4"),
            ("aux_digest", "<u8"),
            ("aux_value", "<f8"),
            ("local_sketch", "<f4", (sketch_k,)),
            ("reduced_sketch", "<f4", (sketch_k,)),
            ("checksum", "<u8"),
        ]
    )


def record_size(sketch_k: int) -> int:
    """Bytes per record."""
    return record_dtype(sketch_k).itemsize


def ids_per_record(sketch_k: int) -> int:
    """Microbatch IDs an ``IDS`` record carries (int64, from byte 32 up to the checksum)."""
    return (record_size(sketch_k) - 8 - 32) // 8


@functools.lru_cache(maxsize=16)
def _weights(num_words: int) -> np.ndarray:
    return C._stream(C.DEFAULT_SEED, _CHECKSUM_STREAM, num_words) | np.uint64(1)


def checksums(raw: np.ndarray) -> np.ndarray:
    """Checksums of records (or headers) given as a ``(N, size)`` uint8 array or structured array.

    Returns:
        ``(N,)`` uint64: the checksum each record should carry in its last 8 bytes.
    """
    raw = np.ascontiguousarray(raw)
    num = raw.shape[0]
    # (N, words - 1)
    words = raw.view(np.uint8).reshape(num, -1).view("<u8")[:, :-1]
    # einsum keeps uint64 wrap-around semantics and avoids an (N, words) temporary (7x faster)
    total = np.einsum("ij,j->i", words, _weights(words.shape[1]))
    return C.splitmix64(total)


def seal(records: np.ndarray) -> np.ndarray:
    """Fill the ``checksum`` field of structured records in place and return them."""
    records["checksum"] = checksums(records)
    return records

"""Fixed pseudo-random constants shared by every fingerprint implementation.

All constants come from SplitMix64 over a 64-bit seed, computed with numpy ``uint64``
arithmetic (wrapping is well defined there), so they are the same numbers on every machine
and every device. Nothing here imports torch: trace analysis and the numpy reference use it
directly, the torch implementation copies the arrays to the tensor's device once and caches them.

Streams (``stream`` is mixed into the seed so that streams never overlap):

* ``digest_word_weights`` / ``digest_high_weights``: ``a_i`` / ``b_i`` for ``i < BLOCK_WORDS``,
  odd 32-bit values ``= 4 i + 1 (mod 2**12)`` with random high bits (as int32).
* ``digest_block_weights``: ``c_j`` (and ``c'_j``) for block ``j``, odd 64-bit values (as int64).
* ``sketch_in_block_signs``: ``alpha_m[i]`` in ``{-1, +1}``, shape ``(BLOCK_ELEMS, k)``.
* ``sketch_block_signs``: ``beta_m[j]`` in ``{-1, +1}``, shape ``(num_blocks, k)``.
"""

from __future__ import annotations

import functools

import numpy as np

#: Words (4 bytes each) per digest block.
BLOCK_WORDS = 1024
#: Elements per sketch block.
BLOCK_ELEMS = 1024
#: Default seed of every stream; recorded in the trace manifest.
DEFAULT_SEED = 0x5DC_F0E5_1C5
#: Default number of sketch projections.
DEFAULT_SKETCH_K = 8

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)

_STREAM_WORD = 1
_STREAM_BLOCK = 2
_STREAM_LENGTH = 3
_STREAM_SKETCH_IN = 4
_STREAM_SKETCH_BLOCK = 5
_STREAM_WORD_HIGH = 6
_STREAM_BLOCK_HIGH = 7


def splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser applied elementwise to a ``uint64`` array (wrapping arithmetic)."""
    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def _stream(seed: int, stream: int, count: int, start: int = 0) -> np.ndarray:
    base = splitmix64(np.array([seed & 0xFFFF_FFFF_FFFF_FFFF], dtype=np.uint64) ^ np.uint64(stream))[0]
    idx = np.arange(start, start + count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return splitmix64(idx * _GOLDEN + base)


@functools.lru_cache(maxsize=8)
def _structured_word_weights(seed: int, stream: int) -> np.ndarray:
    # w_i = (4 i + 1) + 2**12 * r_i mod 2**32, r_i random: odd; w_i - w_j has 2-adic valuation
    # <= 11 and w_i + w_j exactly 1, for every i != j < 1024. docs/fingerprints.md uses both.
    low = np.arange(BLOCK_WORDS, dtype=np.uint64) * np.uint64(4) + np.uint64(1)
    high = (_stream(seed, stream, BLOCK_WORDS) << np.uint64(12)) & np.uint64(0xFFFF_F000)
    return (low | high).astype(np.uint32).view(np.int32)


@functools.lru_cache(maxsize=8)
def digest_word_weights(seed: int = DEFAULT_SEED) -> np.ndarray:
    """``a_i``: the low lane's multipliers, one per word position in a block, as ``int32``."""
    return _structured_word_weights(seed, _STREAM_WORD)


@functools.lru_cache(maxsize=8)
def digest_high_weights(seed: int = DEFAULT_SEED) -> np.ndarray:
    """``b_i``: the high lane's multipliers (of ``w >> 16``), as ``int32``."""
    return _structured_word_weights(seed, _STREAM_WORD_HIGH)


def _stream_at(seed: int, stream: int, indices: np.ndarray) -> np.ndarray:
    """Entries ``indices`` of a stream (``_stream(seed, stream, n)[indices]`` without the prefix)."""
    base = splitmix64(np.array([seed & 0xFFFF_FFFF_FFFF_FFFF], dtype=np.uint64) ^ np.uint64(stream))[0]
    with np.errstate(over="ignore"):
        return splitmix64(np.asarray(indices, dtype=np.uint64) * _GOLDEN + base)


def digest_block_weights_at(blocks: np.ndarray, seed: int = DEFAULT_SEED, high: bool = False) -> np.ndarray:
    """``c_j`` (or ``c'_j``) of the given block indices, as ``uint64`` (a piece's cut blocks)."""
    return _stream_at(seed, _STREAM_BLOCK_HIGH if high else _STREAM_BLOCK, blocks) | np.uint64(1)


def sketch_block_signs_at(blocks: np.ndarray, k: int, seed: int = DEFAULT_SEED) -> np.ndarray:
    """``beta`` rows of the given block indices, shape ``(len(blocks), k)``, as float32."""
    blocks = np.asarray(blocks, dtype=np.uint64).reshape(-1, 1)
    entries = (blocks * np.uint64(k) + np.arange(k, dtype=np.uint64)).reshape(-1)
    return _signs(_stream_at(seed, _STREAM_SKETCH_BLOCK, entries)).reshape(-1, k)


def digest_block_weights(num_blocks: int, seed: int = DEFAULT_SEED, high: bool = False) -> np.ndarray:
    """``c_j`` (or ``c'_j`` with ``high``): odd 64-bit multipliers for blocks ``0..num_blocks-1``, as ``int64``."""
    stream = _STREAM_BLOCK_HIGH if high else _STREAM_BLOCK
    return (_stream(seed, stream, num_blocks) | np.uint64(1)).view(np.int64)


@functools.lru_cache(maxsize=8)
def digest_length_weight(seed: int = DEFAULT_SEED) -> int:
    """``c_len``: odd 64-bit multiplier of the byte length, as a Python int in ``[0, 2**64)``."""
    return int(_stream(seed, _STREAM_LENGTH, 1)[0] | np.uint64(1))


def _signs(bits: np.ndarray) -> np.ndarray:
    return np.where((bits >> np.uint64(63)) == 0, 1.0, -1.0).astype(np.float32)


@functools.lru_cache(maxsize=16)
def sketch_in_block_signs(k: int, seed: int = DEFAULT_SEED) -> np.ndarray:
    """``alpha``: shape ``(BLOCK_ELEMS, k)``, entries ``+-1`` as float32."""
    return _signs(_stream(seed, _STREAM_SKETCH_IN, BLOCK_ELEMS * k)).reshape(BLOCK_ELEMS, k)


def sketch_block_signs(num_blocks: int, k: int, seed: int = DEFAULT_SEED) -> np.ndarray:
    """``beta``: shape ``(num_blocks, k)``, entries ``+-1`` as float32 (prefix-stable in num_blocks)."""
    return _signs(_stream(seed, _STREAM_SKETCH_BLOCK, num_blocks * k)).reshape(num_blocks, k)


_MASK64 = (1 << 64) - 1


def fmix64(value: int) -> int:
    """Final avalanche of the digest (bijective, so it keeps every difference visible).

    :func:`splitmix64` of ``value - golden``, written in Python ints: one digest finished costs a
    microsecond, not the tens a one-element numpy call does (a step finishes dozens).
    """
    z = int(value) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)

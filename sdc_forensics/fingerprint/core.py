"""Fingerprints of tensors, computed on the tensor's own device: exact digest, linear sketch, stats.

This is the one place that defines how a tensor is fingerprinted; the recorder, replay and
checkpoint verification all call it. The definitions (as math) are in ``docs/fingerprints.md``;
``reference.py`` is the numpy version the tests hold this one to, bit for bit.

Cost: the tensor is walked in chunks that stay in cache (CPU) or in large slabs (CUDA); per
chunk the digest is one wrapping int32 multiply and one row sum, the sketch one small matmul,
the stats one norm and one min/max. Nothing is copied to the host except the per-block partial
results (``numel / 1024`` values) and the final scalars.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import numpy as np
import torch

from sdc_forensics.fingerprint import constants as C

_CPU_DIGEST_ROWS = 256  # 256 blocks x 1024 words = 1 MiB int32 scratch: stays in L2 on CPU
_CPU_SKETCH_ROWS = 4096  # 16 MiB float32 slabs: large enough that per-op overhead is amortised
_CUDA_ROWS = 65536  # 256 MiB slabs on CUDA
_lock = threading.Lock()
_cache: dict[tuple, torch.Tensor] = {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fingerprint:
    """Fingerprint of one tensor (or of several, combined with :func:`combine`).

    Attributes:
        digest: exact 64-bit digest of the raw bits (position-sensitive).
        sketch: ``(k,)`` float64 linear sketch.
        norm: L2 norm (float64 accumulation of per-chunk float32 norms).
        max_abs: max |x|.
        nonfinite: count of NaN and Inf elements.
        numel: number of elements.
    """

    digest: int
    sketch: np.ndarray
    norm: float
    max_abs: float
    nonfinite: int
    numel: int


def _cached(key: tuple, make) -> torch.Tensor:
    with _lock:
        value = _cache.get(key)
        if value is None:
            value = make()
            _cache[key] = value
        return value


def _block_weights(device: torch.device, num_blocks: int, seed: int) -> torch.Tensor:
    # Prefix-stable: cache the longest table seen per device, grown in powers of two.
    key = ("c", device, seed)
    with _lock:
        table = _cache.get(key)
        if table is None or table.numel() < num_blocks:
            size = 1 << max(10, (num_blocks - 1).bit_length())
            table = torch.from_numpy(C.digest_block_weights(size, seed)).to(device)
            _cache[key] = table
    return table[:num_blocks]


def _beta(device: torch.device, num_blocks: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    key = ("beta", device, k, seed, dtype)
    with _lock:
        table = _cache.get(key)
        if table is None or table.shape[0] < num_blocks:
            size = 1 << max(10, (num_blocks - 1).bit_length())
            table = torch.from_numpy(C.sketch_block_signs(size, k, seed)).to(device=device, dtype=dtype)
            _cache[key] = table
    return table[:num_blocks]


def _raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in row-major order as a 1-D uint8 tensor on its device (no host copy)."""
    t = tensor.detach()
    if t.numel() == 0:  # an empty tensor may carry stride 0, which view() refuses
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.reshape(-1).view(torch.uint8)


def _chunk_rows(device: torch.device, cpu_rows: int) -> int:
    return _CUDA_ROWS if device.type == "cuda" else cpu_rows


def digest(tensor: torch.Tensor, seed: int = C.DEFAULT_SEED) -> int:
    """Exact digest of a tensor's raw bits, computed on its device.

    Args:
        tensor: any dense tensor (float32, bfloat16, float16, float64, integer, bool).
        seed: the fingerprint seed (recorded in the trace manifest).

    Returns:
        The 64-bit digest as a Python int. Identical on CPU and CUDA for identical bits and
        equal to :func:`sdc_forensics.fingerprint.reference.digest_bytes`.
    """
    raw = _raw_bytes(tensor)
    device = raw.device
    num_bytes = raw.numel()
    block_bytes = 4 * C.BLOCK_WORDS
    num_full = num_bytes // block_bytes
    a = _cached(("a", device, seed), lambda: torch.from_numpy(C.digest_word_weights(seed)).to(device))
    num_blocks = num_full + (1 if num_bytes % block_bytes else 0)
    block_sums = torch.empty(max(num_blocks, 1), dtype=torch.int32, device=device)
    if num_blocks == 0:
        block_sums.zero_()
    if num_full:
        main = raw[: num_full * block_bytes]
        if main.storage_offset() % 4:
            main = main.clone()
        words = main.view(torch.int32).view(num_full, C.BLOCK_WORDS)
        rows = _chunk_rows(device, _CPU_DIGEST_ROWS)
        scratch = torch.empty(min(rows, num_full), C.BLOCK_WORDS, dtype=torch.int32, device=device)
        for start in range(0, num_full, rows):
            chunk = words[start : start + rows]
            buf = scratch[: chunk.shape[0]]
            torch.mul(chunk, a, out=buf)  # wraps mod 2**32
            torch.sum(buf, dim=1, dtype=torch.int32, out=block_sums[start : start + chunk.shape[0]])
    if num_bytes % block_bytes:
        tail = torch.zeros(block_bytes, dtype=torch.uint8, device=device)
        tail[: num_bytes - num_full * block_bytes] = raw[num_full * block_bytes :]
        block_sums[num_full] = (tail.view(torch.int32) * a).sum(dtype=torch.int32)
    unsigned = block_sums[:num_blocks].to(torch.int64) & 0xFFFF_FFFF
    total = int((unsigned * _block_weights(device, num_blocks, seed)).sum().item()) if num_blocks else 0
    total = (total + num_bytes * C.digest_length_weight(seed)) % (1 << 64)
    return C.fmix64(total)


@contextlib.contextmanager
def _full_precision_matmul(device: torch.device):
    """TF32 off for the sketch matmul: TF32 would put ~1e-3 relative noise into the sketch."""
    if device.type != "cuda":
        yield
        return
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def fingerprint(
    tensor: torch.Tensor,
    *,
    k: int = C.DEFAULT_SKETCH_K,
    seed: int = C.DEFAULT_SEED,
    block_offset: int = 0,
    with_digest: bool = True,
) -> Fingerprint:
    """Digest, sketch and stats of one tensor, on its own device.

    Args:
        tensor: a floating-point tensor.
        k: number of sketch projections.
        seed: the fingerprint seed.
        block_offset: index of this tensor's first sketch block when it is one piece of a
            longer vector (a DDP bucket inside the whole gradient); keeps the pieces' sketches
            independent so that their sum is the sketch of the concatenation.
        with_digest: skip the exact digest when only the tolerant parts are needed.

    Returns:
        A :class:`Fingerprint`.
    """
    flat = tensor.detach().reshape(-1)
    device = flat.device
    acc_dtype = torch.float64 if flat.dtype == torch.float64 else torch.float32
    numel = flat.numel()
    num_blocks = max(1, -(-numel // C.BLOCK_ELEMS))
    alpha = _cached(
        ("alpha", device, k, seed, acc_dtype),
        lambda: torch.from_numpy(C.sketch_in_block_signs(k, seed)).to(device=device, dtype=acc_dtype),
    )
    beta = _beta(device, block_offset + num_blocks, k, seed, acc_dtype)[block_offset:]
    rows = _chunk_rows(device, _CPU_SKETCH_ROWS)
    sketch = torch.zeros(k, dtype=torch.float64, device=device)
    sumsq = torch.zeros((), dtype=torch.float64, device=device)
    max_abs = torch.zeros((), dtype=acc_dtype, device=device)
    num_full = numel // C.BLOCK_ELEMS
    with _full_precision_matmul(device):
        for start in range(0, num_blocks, rows):
            stop = min(start + rows, num_blocks)
            if stop <= num_full:
                block = flat[start * C.BLOCK_ELEMS : stop * C.BLOCK_ELEMS].to(acc_dtype).view(-1, C.BLOCK_ELEMS)
            else:  # the last, partial block is zero-padded
                block = torch.zeros((stop - start) * C.BLOCK_ELEMS, dtype=acc_dtype, device=device)
                piece = flat[start * C.BLOCK_ELEMS :]
                block[: piece.numel()] = piece
                block = block.view(-1, C.BLOCK_ELEMS)
            per_block = block @ alpha  # (blocks, k)
            sketch += (per_block * beta[start:stop]).sum(dim=0, dtype=torch.float64)
            flat_block = block.view(-1)
            sumsq += torch.dot(flat_block, flat_block).to(torch.float64)
            lo, hi = torch.aminmax(block)
            max_abs = torch.maximum(max_abs, torch.maximum(-lo, hi))
    norm = float(sumsq.sqrt().item())
    max_abs_value = float(max_abs.item())
    nonfinite = 0
    if not (np.isfinite(norm) and np.isfinite(max_abs_value)) and flat.is_floating_point():
        nonfinite = int((~torch.isfinite(flat)).sum().item())
        if nonfinite:
            max_abs_value = float("nan") if torch.isnan(flat).any() else float("inf")
    return Fingerprint(
        digest=digest(tensor, seed) if with_digest else 0,
        sketch=sketch.cpu().numpy(),
        norm=norm,
        max_abs=max_abs_value,
        nonfinite=nonfinite,
        numel=numel,
    )


def num_sketch_blocks(numel: int) -> int:
    """Sketch blocks a tensor of ``numel`` elements occupies (the next piece's ``block_offset``)."""
    return max(1, -(-numel // C.BLOCK_ELEMS))


def combine_digests(digests) -> int:
    """Digest of a sequence of digests, in order (a model = its parameters in a fixed order)."""
    from sdc_forensics.fingerprint.reference import digest_bytes

    return digest_bytes(np.asarray([d % (1 << 64) for d in digests], dtype="<u8"))


def combine(parts: list[Fingerprint]) -> Fingerprint:
    """Fingerprint of the concatenation of pieces fingerprinted with consecutive block offsets."""
    if not parts:
        raise ValueError("combine() needs at least one fingerprint")
    return Fingerprint(
        digest=combine_digests(p.digest for p in parts),
        sketch=np.sum([p.sketch for p in parts], axis=0),
        norm=float(np.sqrt(sum(p.norm**2 for p in parts))),
        max_abs=float(np.max([p.max_abs for p in parts])),  # NaN wins, as in fingerprint()
        nonfinite=sum(p.nonfinite for p in parts),
        numel=sum(p.numel for p in parts),
    )

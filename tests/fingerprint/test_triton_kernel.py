"""The Triton one-pass fingerprint kernel against the numpy reference, on CUDA or in Triton's interpreter.

Each case runs ``triton_kernel.partials`` and checks, independently of ``core``: the digest
(``fmix64`` of the lanes plus ``c_len * N``) bit for bit against ``reference.digest_bytes``; the
sketch against ``reference.sketch`` (the piece placed after ``block_offset`` zero blocks) within a
worst-case rounding bound; the sum of squares within its bound; max |x| and the NaN/Inf count
exactly.

Backends: ``cuda`` (marked ``cuda``, needs a GPU and triton) and ``interpreter`` (Triton's numpy
interpreter on CPU tensors). The interpreter must be switched on before the kernels are
defined, so ``test_interpreter_suite`` re-runs this file's interpreter cases in a subprocess
with ``TRITON_INTERPRET=1``; in the main process they are skipped. Without triton everything
here skips with the reason. ``test_compiles_for_hopper_and_ampere`` compiles the kernels for
sm_90 and sm_80 (ptxas, no GPU needed) and checks that no registers spill.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sdc_forensics.fingerprint import constants as C
from sdc_forensics.fingerprint import reference
from sdc_forensics.fingerprint import triton_kernel as tk

U32, U64 = 2.0**-24, 2.0**-53
HAS_TRITON = tk.triton is not None
INTERPRETED = (
    HAS_TRITON
    and os.environ.get("TRITON_INTERPRET", "") == "1"
    and type(tk._kernel32).__name__ == "InterpretedFunction"
)
NEEDS_TRITON = pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed (pip install triton; not a package dependency)"
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
BITS = {torch.float32: np.uint32, torch.bfloat16: np.uint16, torch.float16: np.uint16, torch.float64: np.uint64}
# sizes around every boundary: words (16-bit pairs), 512 (float64 tile), 1024 (sketch block), 2048 (16-bit tile)
SIZES = (1, 2, 3, 511, 512, 513, 1023, 1024, 1025, 2047, 2048, 2049, 4097, 10_001)


class Case:
    """One input: ``kind`` is ``normal`` (values), ``special`` (values with NaN/Inf/huge) or ``bits`` (random bits)."""

    def __init__(self, dtype, numel, *, kind="normal", k=8, block_offset=0, with_digest=True, start=0, seed=0):
        self.dtype, self.numel, self.kind, self.k = dtype, numel, kind, k
        self.block_offset, self.with_digest, self.start, self.seed = block_offset, with_digest, start, seed

    @property
    def id(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        return f"{name}-n{self.numel}-{self.kind}-k{self.k}-o{self.block_offset}-s{self.start}" + (
            "" if self.with_digest else "-nodigest"
        )

    def tensor(self) -> torch.Tensor:
        """The flat input: a view at element ``start`` of :meth:`buffer`."""
        return self.buffer()[self.start :]

    def buffer(self) -> torch.Tensor:
        """The whole buffer, ``start + numel`` elements (deterministic in the case's fields)."""
        rng = np.random.default_rng(self.seed * 7919 + self.numel)
        total = self.start + self.numel
        if self.kind == "bits":
            info = np.iinfo(BITS[self.dtype])
            raw = rng.integers(0, info.max, size=total, dtype=BITS[self.dtype], endpoint=True)
            signed = raw.view(np.dtype(BITS[self.dtype].__name__[1:]))
            base = torch.from_numpy(signed).view(self.dtype)
        else:
            base = torch.from_numpy(rng.standard_normal(total) * 3.0).to(self.dtype)
            if self.kind == "special" and self.numel >= 4:
                where = rng.choice(self.numel, size=4, replace=False) + self.start
                base[where[0]] = float("inf")
                base[where[1]] = float("-inf")
                base[where[2]] = 1e4 if self.dtype == torch.float16 else 1e30
                if self.numel >= 8:
                    base[where[3]] = float("nan")
        return base


def _cases() -> list[Case]:
    cases = [Case(dtype, 0) for dtype in DTYPES]
    for dtype in DTYPES:
        cases += [Case(dtype, n, seed=1) for n in SIZES]
        cases += [Case(dtype, n, kind="bits", seed=2) for n in (5, 1025, 4099)]
        cases += [Case(dtype, 3001, kind="special", block_offset=3, seed=3)]
        cases += [
            Case(dtype, 2500, block_offset=1500, k=13, seed=4)
        ]  # beta table grows past 1024 rows; k not a power of 2
        cases += [Case(dtype, 777, k=1, with_digest=False, seed=5)]
    rng = np.random.default_rng(11)
    cases += [Case(DTYPES[i % 4], int(n), seed=6 + i) for i, n in enumerate(rng.integers(1, 20_000, size=8))]
    cases += [Case(dtype, 3001, start=1, kind="special", seed=7) for dtype in DTYPES]  # odd element offset
    cases += [Case(torch.bfloat16, 4096, start=1, seed=8), Case(torch.float16, 4098, start=2, seed=9)]
    return cases


CASES = _cases()


def _gamma(n: int, u: float) -> float:
    return n * u / (1.0 - n * u)


def check_partials(out: torch.Tensor, case: Case, x: torch.Tensor) -> None:
    """``out`` (the kernel's vector, on the host) against the numpy reference for input ``x``."""
    k = case.k
    assert out.dtype == torch.float64 and out.shape == (2 + k + 3,)
    raw = x.contiguous().view(torch.uint8).numpy() if x.numel() else np.zeros(0, np.uint8)
    low, high = out[:2].view(torch.int64).tolist()
    if case.with_digest:
        total = (low + (high << 32) + raw.size * C.digest_length_weight(C.DEFAULT_SEED)) % (1 << 64)
        assert C.fmix64(total) == reference.digest_bytes(raw), "digest differs from the reference"
    else:
        assert low == high == 0
    values = x.double().numpy()
    finite = np.isfinite(values)
    assert int(out[4 + k]) == int((~finite).sum())
    if np.isnan(values).any():
        assert math.isnan(float(out[3 + k]))
    elif not finite.all():
        assert float(out[3 + k]) == math.inf
    else:
        assert float(out[3 + k]) == (float(np.abs(values).max()) if values.size else 0.0)
    if not finite.all() or case.kind == "bits":
        return  # the sketch and sumsq of NaN/Inf are NaN/Inf; nothing more to compare
    u_acc = U64 if case.dtype == torch.float64 else U32
    blocks = max(1, -(-values.size // C.BLOCK_ELEMS))
    padded = np.concatenate([np.zeros(case.block_offset * C.BLOCK_ELEMS), values])
    expected = reference.sketch(padded, k=k)
    l1 = float(np.abs(values).sum()) * (1 + _gamma(values.size, U64))
    # each float32 sum has at most 1024 terms (one per tile of a program, or 512 terms of a
    # float64 tile), then float64 sums over blocks and programs; doubled for the reference's own
    bound = 2 * ((1 + _gamma(C.BLOCK_ELEMS, u_acc)) * (1 + _gamma(blocks + 4096, U64)) - 1) * l1
    assert np.abs(out[2 : 2 + k].numpy() - expected).max() <= bound
    sumsq = float(np.sum(values**2))
    # squares: each rounded once, summed in u_acc per lane (<= 2048 terms), then float64
    assert (
        abs(float(out[2 + k]) - sumsq)
        <= 2 * ((1 + _gamma(2 * C.BLOCK_ELEMS + 2, u_acc)) * (1 + _gamma(blocks + 4096, U64)) - 1) * sumsq
    )


def _run(case: Case, device: str) -> None:
    x = case.tensor()
    on_device = case.buffer().to(device)[case.start :]  # keeps an odd storage offset
    out = tk.partials(
        on_device, k=case.k, seed=C.DEFAULT_SEED, block_offset=case.block_offset, with_digest=case.with_digest
    )
    assert out.device.type == torch.device(device).type
    check_partials(out.cpu(), case, x)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_interpreter(case):
    if not HAS_TRITON:
        pytest.skip("triton is not installed (pip install triton; not a package dependency)")
    if not INTERPRETED:
        pytest.skip("interpreter cases run in test_interpreter_suite's subprocess (TRITON_INTERPRET=1)")
    _run(case, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@NEEDS_TRITON
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cuda(case):
    assert tk.available(torch.device("cuda")) == (True, "")
    _run(case, "cuda")


@pytest.mark.slow
@NEEDS_TRITON
def test_interpreter_suite():
    """Runs the ``test_interpreter*`` cases in a subprocess with ``TRITON_INTERPRET=1`` (set before triton is imported)."""
    if INTERPRETED:
        pytest.skip("already running under the interpreter")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "TRITON_DEFAULT_FP_FUSION": os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"),
    }
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-W",
        "ignore::RuntimeWarning",
        __file__,
        "-k",
        "test_interpreter and not test_interpreter_suite",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=Path(__file__).parents[2])
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], tail


def test_available_says_why_not(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv(tk.KERNELS_ENV, "off")
    assert tk.available(torch.device("cuda")) == (False, "disabled by SDC_FORENSICS_KERNELS=off")
    monkeypatch.delenv(tk.KERNELS_ENV)
    monkeypatch.setattr(tk, "triton", None)
    monkeypatch.setattr(tk, "_IMPORT_ERROR", "triton not installed (ImportError: no module named triton)")
    usable, reason = tk.available(cpu)
    assert not usable and reason.startswith("triton not installed")
    with pytest.raises(RuntimeError, match="triton not installed"):
        tk.partials(torch.ones(3), k=8, seed=1, block_offset=0, with_digest=True)


@NEEDS_TRITON
def test_cpu_is_not_a_cuda_device():
    assert tk.available(torch.device("cpu")) == (False, "not a CUDA device")
    assert tk.supports(torch.bfloat16) and not tk.supports(torch.int64)
    with pytest.raises(TypeError, match="float32, bfloat16"):
        tk.partials(torch.arange(3), k=8, seed=1, block_offset=0, with_digest=True)


def test_module_imports_without_triton():
    """A machine without triton imports the module (the import is guarded) and gets a reason."""
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "from sdc_forensics.fingerprint import triton_kernel as tk\n"
        "import torch; ok, why = tk.available(torch.device('cuda')); assert not ok and why.startswith('triton not installed'), why\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2]
    )
    assert done.returncode == 0, done.stderr[-2000:]


@NEEDS_TRITON
@pytest.mark.parametrize("arch", [90, 80])
def test_compiles_for_hopper_and_ampere(arch, tmp_path):
    """The kernels compile to cubin for sm_90 (H100/H200) and sm_80 (A100) without a GPU, within the
    register cap and with no spills (read with the cuobjdump Triton ships, where it does)."""
    if INTERPRETED:
        pytest.skip("the interpreter replaces the compiler")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    common = {
        "numel": "i64",
        "num_tiles": "i32",
        "a_ptr": "*i32",
        "b_ptr": "*i32",
        "c_ptr": "*i64",
        "ch_ptr": "*i64",
        "alpha_ptr": "*fp32",
        "beta_ptr": "*fp32",
        "num_sblocks": "i32",
        "int_ptr": "*i64",
        "float_ptr": "*fp64",
    }
    variants = [
        (tk._kernel32, "*i32", {"UNROLL": 1}),
        (tk._kernel32, "*i32", {"UNROLL": 2}),
        (tk._kernel16, "*i32", {"IS_BF16": True, "PAIRED": False, "UNROLL": 2}),
        (tk._kernel16, "*i16", {"IS_BF16": False, "PAIRED": True, "UNROLL": 1}),
        (tk._kernel64, "*i64", {}),
    ]
    variants.append((tk._finish, "*i64", {"K": 7, "KP": 8, "ROWS": tk._FINISH_ROWS}))
    # each again over a list of tensors (partials_many)
    variants = [(kernel, data, {**extra, "LIST": False}) for kernel, data, extra in variants] + [
        (kernel, data, {**extra, "LIST": True}) for kernel, data, extra in variants
    ]
    common.update(out_ptr="*fp64", programs="i32", jobs_ptr="*i64", tensors_ptr="*i64", rows_ptr="*i64")
    for kernel, data, extra in variants:
        names = kernel.arg_names
        signature = {name: common.get(name, "constexpr") for name in names}
        signature[names[0]] = data
        constants = {"KP": 8, "WITH_DIGEST": True, **extra} if kernel is not tk._finish else extra
        source = ASTSource(
            fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in constants.items()}
        )
        try:
            compiled = tk.triton.compile(
                source,
                target=GPUTarget("cuda", arch, 32),
                options={"num_warps": tk._NUM_WARPS, "maxnreg": tk._MAX_REGISTERS},
            )
        except FileNotFoundError as error:  # no ptxas in this triton build
            pytest.skip(f"cannot compile for CUDA here: {error}")
        assert ".local" not in compiled.asm["ptx"], f"{kernel.fn.__name__} {extra}: local arrays in the PTX"
        usage = _resource_usage(compiled.asm["cubin"], tmp_path)
        if usage is not None:  # registers per thread; STACK and LOCAL: bytes per thread (spills show as STACK)
            # none on Hopper, the target; on sm_80 ptxas spills one 8-byte value of the unrolled float32
            # loop, and a list's 16-bit kernel three (the scalars it read from the job tables)
            spill_limit = 0 if arch == 90 else (32 if extra["LIST"] else 16)
            assert usage["REG"] <= tk._MAX_REGISTERS and usage["LOCAL"] == 0, (kernel.fn.__name__, extra, usage)
            assert usage["STACK"] <= spill_limit, (kernel.fn.__name__, extra, usage)


def _resource_usage(cubin: bytes, folder: Path) -> dict | None:
    """``cuobjdump -res-usage`` of a cubin (the copy Triton's wheel ships), or None without one."""
    import re

    tool = Path(tk.triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    path = folder / "kernel.cubin"
    path.write_bytes(cubin)
    listing = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True, timeout=60).stdout
    found = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", listing))
    return {key: int(value) for key, value in found.items()} if {"REG", "STACK", "LOCAL"} <= found.keys() else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_interpreter_at_the_tile_cap(monkeypatch, dtype):
    """One program per 1024 tiles (float32) or 512 (16-bit): the most terms any float32 sum gets."""
    if not INTERPRETED:
        pytest.skip("interpreter cases run in test_interpreter_suite's subprocess (TRITON_INTERPRET=1)")
    monkeypatch.setattr(tk, "_programs_for", lambda device: 1)
    numel = 1024 * 1025 + 7 if dtype == torch.float32 else 2048 * 513 + 3  # two full programs and a bit
    _run(Case(dtype, numel, block_offset=5, seed=13), "cpu")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interpreter_non_contiguous(dtype):
    """A transposed view is fingerprinted in row-major order, as the reference reads it."""
    if not INTERPRETED:
        pytest.skip("interpreter cases run in test_interpreter_suite's subprocess (TRITON_INTERPRET=1)")
    base = Case(dtype, 67 * 129, seed=16).tensor().reshape(67, 129)
    view = base.t()
    assert not view.is_contiguous()
    out = tk.partials(view, k=8, seed=C.DEFAULT_SEED, block_offset=0, with_digest=True)
    check_partials(out, Case(dtype, view.numel()), view.contiguous().reshape(-1))


@pytest.mark.parametrize("case", CASES[::5], ids=[c.id for c in CASES[::5]])
def test_interpreter_one_tile_per_iteration(monkeypatch, case):
    """The kernels' other loop shape (``_UNROLL = 1``), on every fifth case."""
    if not INTERPRETED:
        pytest.skip("interpreter cases run in test_interpreter_suite's subprocess (TRITON_INTERPRET=1)")
    monkeypatch.setattr(tk, "_UNROLL", 1)
    _run(case, "cpu")


def _cuda_ready():
    return pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs a CUDA device and triton")


@pytest.mark.cuda
@_cuda_ready()
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_large_and_at_the_tile_cap(monkeypatch, dtype):
    """Many programs (the device's SM count), then one program per tile cap."""
    for numel in (3 * (1 << 20) + 1, (1 << 24) + 5):
        _run(Case(dtype, numel, kind="special", block_offset=2, seed=12), "cuda")
        _run(Case(dtype, numel, block_offset=7, seed=14), "cuda")
    monkeypatch.setattr(tk, "_programs_for", lambda device: 1)
    _run(Case(dtype, (1 << 24) + 5, block_offset=1, seed=15), "cuda")


@pytest.mark.cuda
@_cuda_ready()
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_agrees_with_the_torch_path(monkeypatch, dtype):
    """Same digest, counts and max as ``core``'s torch path (forced) on the same GPU; sketch within rounding."""
    from sdc_forensics.fingerprint import core

    monkeypatch.setenv(tk.KERNELS_ENV, "off")  # core's fallback, not this kernel again
    torch.manual_seed(21)
    tensor = torch.randn(5_000_003, device="cuda").to(dtype)
    tensor[17] = float("inf")
    out = tk.partials(tensor, k=8, seed=C.DEFAULT_SEED, block_offset=4, with_digest=True).cpu()  # ignores the switch
    expected = core.fingerprint(tensor, block_offset=4)
    if hasattr(core, "kernel_path"):
        assert core.kernel_path(tensor.device, dtype).startswith("torch")
    low, high = out[:2].view(torch.int64).tolist()
    nbytes = tensor.numel() * tensor.element_size()
    assert (
        C.fmix64((low + (high << 32) + nbytes * C.digest_length_weight(C.DEFAULT_SEED)) % (1 << 64)) == expected.digest
    )
    assert (int(out[12]), float(out[11])) == (expected.nonfinite, expected.max_abs) == (1, math.inf)
    tensor[17] = 0
    out = tk.partials(tensor, k=8, seed=C.DEFAULT_SEED, block_offset=4, with_digest=False).cpu()
    expected = core.fingerprint(tensor, block_offset=4)
    l1 = float(tensor.double().abs().sum())
    assert np.abs(out[2:10].numpy() - expected.sketch).max() <= 4 * 1024 * U32 * l1
    assert float(out[11]) == expected.max_abs and int(out[12]) == 0
    assert math.isclose(math.sqrt(float(out[10])), expected.norm, rel_tol=1e-4)


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_replay_finds_a_demo_incident(demo_run):
    """bisect replays a (CPU, gloo) demo run on CUDA and names the injected step and rank.

    The demo itself trains on CPU only (``demo/run.py`` initialises gloo on CPU), so the incident
    is recorded there; the replay, the part that runs on a GPU in production, runs on CUDA.
    """
    from sdc_forensics.forensics.bisect import bisect
    from sdc_forensics.replay.options import BisectOptions

    out = demo_run("grad:step=4:rank=2:bit=30", steps=6, checkpoint_every=3)
    result = bisect(out / "trace", BisectOptions(checkpoints_dir=out / "checkpoints", device="cuda"))
    assert (result.verdict.value, result.first_divergent_step) == ("corruption", 4)
    [suspect] = result.suspects
    assert (suspect.rank, suspect.location.value) == (2, "local_compute")
    # another device than training's: within the sketch tolerance (on CPU, forced: 5 steps, the same verdict)
    assert (result.replayed.comparison, result.replayed.steps_replayed) == ("tolerant", 5)


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_replay_of_a_clean_demo_finds_nothing(demo_run):
    """A clean run replayed on CUDA names no suspect and no divergent step.

    Compared within tolerance (another device than training's), a replay cannot certify the run
    bit for bit, so the verdict is "inconclusive", as a CPU replay forced to tolerant gives.
    """
    from sdc_forensics.forensics.bisect import bisect
    from sdc_forensics.replay.options import BisectOptions

    out = demo_run("none", steps=6, checkpoint_every=3)
    result = bisect(out / "trace", BisectOptions(checkpoints_dir=out / "checkpoints", device="cuda"))
    assert (result.verdict.value, result.first_divergent_step, result.suspects) == ("inconclusive", None, ())
    assert (result.replayed.comparison, result.replayed.steps_replayed) == ("tolerant", 6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interpreter_many_tensors_in_one_launch_are_each_ones_own_launch_bit_for_bit(dtype):
    """``partials_many``: a list (sizes around the tile and block boundaries, an empty one, odd
    16-bit lengths and storage offsets, block offsets of their own) in one launch gives each
    tensor's :func:`partials` row bit for bit, and the reference's numbers."""
    if not INTERPRETED:
        pytest.skip("interpreter cases run in test_interpreter_suite's subprocess (TRITON_INTERPRET=1)")
    _check_many(dtype, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@NEEDS_TRITON
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_many_tensors_in_one_launch_are_each_ones_own_launch_bit_for_bit(dtype):
    _check_many(dtype, "cuda")


def _check_many(dtype: torch.dtype, device: str) -> None:
    sizes = (1, 1023, 1024, 1025, 0, 2049, 4097, 10_001, 3)
    cases = [Case(dtype, n, block_offset=(3 * i) % 5, start=i % 2, seed=40 + i) for i, n in enumerate(sizes)]
    flats = [case.buffer().to(device)[case.start :] for case in cases]
    for k, with_digest in ((8, True), (1, True), (3, False)):
        many = tk.partials_many(
            flats,
            k=k,
            seed=C.DEFAULT_SEED,
            block_offsets=[c.block_offset for c in cases],
            with_digest=with_digest,
            digest_block_offsets=[0] * len(cases),
        )
        assert many.shape == (len(cases), 2 + k + 3)
        for row, case, flat in zip(many, cases, flats):
            one = tk.partials(flat, k=k, seed=C.DEFAULT_SEED, block_offset=case.block_offset, with_digest=with_digest)
            assert torch.equal(row.view(torch.int64), one.view(torch.int64)), (case.id, k)
    for row, case in zip(many.cpu(), cases):
        check_partials(
            row,
            Case(
                dtype,
                case.numel,
                k=3,
                block_offset=case.block_offset,
                with_digest=False,
                start=case.start,
                seed=case.seed,
            ),
            case.tensor(),
        )


def test_interpreter_fingerprints_async_takes_a_list_in_one_launch(monkeypatch):
    """``core.fingerprints_async`` on the Triton path (the interpreter standing in for CUDA):
    one ``partials_many`` launch per dtype, and the fingerprints of one launch per tensor, bit
    for bit (a model's parameters: the weights pass; a bucket's or a shard's pieces)."""
    if not INTERPRETED:
        pytest.skip("interpreter cases run in test_interpreter_suite's subprocess (TRITON_INTERPRET=1)")
    from sdc_forensics.fingerprint import core

    monkeypatch.setattr(core, "kernel_path", lambda device="cpu", dtype=torch.float32: "triton-cuda")
    launches = []
    real = tk.partials_many
    monkeypatch.setattr(tk, "partials_many", lambda flats, **kw: launches.append(len(flats)) or real(flats, **kw))
    tensors = [Case(torch.float32, n, seed=n).tensor() for n in (5, 1024, 3000)] + [
        Case(torch.bfloat16, n, seed=n).tensor() for n in (7, 2048)
    ]
    offsets = [0, 1, 2, 3, 4]
    many = core.resolve(core.fingerprints_async(tensors, k=8, block_offsets=offsets))
    one = core.resolve([core.fingerprint_async(t, k=8, block_offset=o) for t, o in zip(tensors, offsets)])
    assert sorted(launches) == [2, 3]
    for a, b in zip(many, one):
        assert a.digest == b.digest and np.array_equal(a.sketch, b.sketch) and a.norm == b.norm
        assert (a.max_abs, a.nonfinite, a.numel) == (b.max_abs, b.nonfinite, b.numel)


def test_interpreter_a_failed_list_launch_falls_back_to_one_launch_each(monkeypatch):
    """A list launch that fails (a Triton that cannot compile it, say) loses no fingerprint."""
    if not INTERPRETED:
        pytest.skip("interpreter cases run in test_interpreter_suite's subprocess (TRITON_INTERPRET=1)")
    from sdc_forensics.fingerprint import core

    monkeypatch.setattr(core, "kernel_path", lambda device="cpu", dtype=torch.float32: "triton-cuda")

    def broken(flats, **kwargs):
        raise RuntimeError("no list launch here")

    monkeypatch.setattr(tk, "partials_many", broken)
    tensors = [Case(torch.float32, n, seed=n).tensor() for n in (5, 3000)]
    many = core.resolve(core.fingerprints_async(tensors, k=8))
    one = core.resolve([core.fingerprint_async(t, k=8) for t in tensors])
    assert [(a.digest, a.sketch.tolist()) for a in many] == [(b.digest, b.sketch.tolist()) for b in one]

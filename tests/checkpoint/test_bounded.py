"""Bounded cost on any input (issue #9, part 5): the hostile checkpoint corpus, each case with its
exit code, its peak memory and its wall time asserted.

Every case runs ``sdc-forensics ...`` in a child forked from one driver process that has already
imported torch and the CLI and verified the valid cases once, so a case's peak memory is its own:
``VmHWM`` at the end minus ``VmRSS`` at the start of the child (``/proc/self/status``, the peak
reset at the fork), asserted as the excess over a tiny valid file's (``BASELINE``); its time is
the child's wall time. The crafted files are built once per module. Figures measured while writing this (2 cores,
load ~10; before = the code of ab0758b): ``zeros(1).expand(2**28)`` 1.3 GB before, refused in
~0 MB now; a 0.5 MB member inflating to 512 MiB 1.3 GB before, refused before inflating; 20,000
one-element DCP chunks 3 min 40 s before (quadratic overlap check), < 1 s of checks now;
200,000 empty safetensors tensors 22 s and 240 MB before, linear now (the test compares 25,000
with 100,000); the issue's 1.5 M-entry, 90 MB header is refused before it is parsed.

Over 400 lines on purpose: one table of hostile cases and the limits each must stay within.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.factories import tree_sha256

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Case:
    """One run of the CLI on a crafted input, and what it must cost."""

    name: str
    args: tuple[str, ...]
    code: int  # expected exit code
    says: str  # on stderr (the one error line when code is 3)
    max_mb: float  # peak memory over the child's start
    max_s: float  # wall time (generous: 2 shared cores)
    watch: Path  # every file under it must be unchanged


# ---------------------------------------------------------------------------------------------
# Builders


def _torch_members() -> dict[str, bytes]:
    """The small members of a real torch.save archive (version, byteorder, ...), names without prefix."""
    import io

    buf = io.BytesIO()
    torch.save(torch.zeros(1), buf)
    with zipfile.ZipFile(buf) as archive:
        prefix = archive.namelist()[0].split("/")[0] + "/"
        return {m.filename[len(prefix) :]: archive.read(m) for m in archive.infolist() if "data" not in m.filename}


class _Storage:
    """Stands for storage ``0`` of ``numel`` floats in a hand-written ``data.pkl``."""

    def __init__(self, numel: int) -> None:
        self.numel = numel


class _Tensor:
    def __init__(self, numel: int) -> None:
        self.storage = _Storage(numel)

    def __reduce__(self):
        import collections

        return torch._utils._rebuild_tensor_v2, (
            self.storage,
            0,
            (self.storage.numel,),
            (1,),
            False,
            collections.OrderedDict(),
        )


class _RunsCode:
    def __reduce__(self):
        return os.system, ("echo this must never run",)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):  # what torch.save writes for a storage
        return ("storage", torch.FloatStorage, "0", "cpu", obj.numel) if isinstance(obj, _Storage) else None


def _data_pkl(numel: int) -> bytes:
    import io

    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump({"w": _Tensor(numel)})
    return buf.getvalue()


def _deflated_zeros(num_mib: int) -> tuple[bytes, int]:
    """A raw deflate stream of ``num_mib`` MiB of zeros and their CRC-32, without compressing them
    all: a block ended by a full flush encodes the same from a fresh state, so it can be repeated."""
    import zlib

    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    one = compressor.compress(bytes(MiB)) + compressor.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(num_mib):
        crc = zlib.crc32(bytes(MiB), crc)
    return one * num_mib + compressor.flush(), crc


def _torch_zip(
    path: Path, *, numel: int, storage: bytes, pkl: bytes | None = None, deflate: str = "", zeros_mib: int = 0
) -> Path:
    """A torch.save-layout archive written member by member. ``deflate`` names the member
    (``data/0`` or ``data.pkl``) to compress; with ``zeros_mib`` it holds that many MiB of zeros,
    written pre-compressed (0.5 MB for 512 MiB)."""
    members = {"data.pkl": _data_pkl(numel) if pkl is None else pkl, **_torch_members(), "data/0": storage}
    stream = b""
    if zeros_mib:
        stream, crc = _deflated_zeros(zeros_mib)
        members[deflate] = stream  # stored as is, then declared deflated below
    with zipfile.ZipFile(path, "w") as archive:
        for name, content in members.items():
            compress = zipfile.ZIP_DEFLATED if name == deflate and not zeros_mib else zipfile.ZIP_STORED
            archive.writestr(f"archive/{name}", content, compress_type=compress)
    if zeros_mib:
        _patch_member(path, f"archive/{deflate}", method=zipfile.ZIP_DEFLATED, crc=crc, size=zeros_mib * MiB)
    return path


def _patch_member(path: Path, member: str, *, size: int, method: int | None = None, crc: int | None = None) -> None:
    """Rewrite ``member``'s compression method, CRC-32 and uncompressed size in its local header and
    its central directory entry (a lying zip, or one holding pre-compressed bytes)."""
    raw = bytearray(path.read_bytes())
    name = member.encode()
    with zipfile.ZipFile(path) as archive:
        local = archive.getinfo(member).header_offset
    central = raw.find(b"PK\x01\x02")
    while raw[central + 46 : central + 46 + len(name)] != name:  # central entry: name at +46
        central = raw.find(b"PK\x01\x02", central + 4)
    for header, at_method, at_crc, at_size in ((local, 8, 14, 22), (central, 10, 16, 24)):
        if method is not None:
            struct.pack_into("<H", raw, header + at_method, method)
        if crc is not None:
            struct.pack_into("<I", raw, header + at_crc, crc)
        struct.pack_into("<I", raw, header + at_size, size)
    path.write_bytes(bytes(raw))


def _safetensors_many(path: Path, count: int) -> Path:
    """A valid safetensors file listing ``count`` empty float32 tensors (no data bytes)."""
    body = ",".join(f'"t{i:07d}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}' for i in range(count))
    header = ("{" + body + "}").encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    return path


def _dcp(folder: Path, *, chunks: int, layout: str) -> Path:
    """A DCP checkpoint of one float32 tensor ``w`` of ``chunks`` elements, described as that many
    one-element chunks. ``layout``: ``shared`` (every chunk's item is the same 4 bytes), ``overlap``
    (distinct items; the last chunk overlaps another), ``tiling`` (distinct 4-byte items, a valid
    tiling whose items are not torch.save archives), ``shared-list`` (``chunks`` tensors share one
    chunk list), ``bigger-than-item`` (two chunks of 2^29 elements in 4-byte items)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.zeros(4)}, checkpoint_id=str(folder), no_dist=True)
    meta = pickle.loads((folder / ".metadata").read_bytes())
    data = next(folder.glob("*.distcp"))
    start = data.stat().st_size
    w = meta.state_dict_metadata["w"]
    size = 2**30 if layout == "bigger-than-item" else chunks
    w.size = torch.Size([size])
    step = size // 2 if layout == "bigger-than-item" else 1
    w.chunks = [ChunkStorageMetadata(offsets=torch.Size([i]), sizes=torch.Size([step])) for i in range(0, size, step)]
    if layout == "overlap":
        w.chunks[-1] = ChunkStorageMetadata(offsets=torch.Size([chunks - 2]), sizes=torch.Size([1]))
    with open(data, "ab") as fh:
        fh.write(bytes(4 * len(w.chunks)))
    meta.storage_data = {
        MetadataIndex("w", c.offsets, i): _StorageInfo(data.name, start if layout == "shared" else start + 4 * i, 4)
        for i, c in enumerate(w.chunks)
    }
    if layout == "shared-list":
        for k in range(chunks):
            meta.state_dict_metadata[f"v{k}"] = dataclasses.replace(w, chunks=w.chunks)  # the same list object
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    return folder


def _pickle_bomb(path: Path, levels: int = 30) -> Path:
    """2^levels references to one tensor through lists that are each other's children twice."""
    node: object = [torch.ones(1)]
    for _ in range(levels):
        node = [node, node]
    torch.save({"state": node}, path)
    return path


def _hub(tmp: Path) -> tuple[Path, Path]:
    """A huggingface_hub cache repository: snapshots/REV/FILE -> ../../blobs/HASH; (snapshot, repo)."""
    repo = tmp / "hub" / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    save_file({"w": torch.randn(4, 4)}, blobs / "aaaa")
    (blobs / "bbbb").write_text(json.dumps({"model_type": "tiny"}))
    os.symlink("../../blobs/aaaa", snapshot / "model.safetensors")
    os.symlink("../../blobs/bbbb", snapshot / "config.json")
    return snapshot, repo


# ---------------------------------------------------------------------------------------------
# The corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Case]:
    tmp = tmp_path_factory.mktemp("bounded")
    cases: list[Case] = []

    def add(
        name: str,
        target: Path,
        code: int,
        says: str,
        *,
        extra: tuple[str, ...] = (),
        max_mb: float = 64,
        max_s: float = 20,
        watch: Path | None = None,
    ) -> None:
        cases.append(
            Case(
                name=name,
                args=("verify-checkpoint", str(target), *extra),
                code=code,
                says=says,
                max_mb=max_mb,
                max_s=max_s,
                watch=watch or target,
            )
        )

    add("small-valid-file", _save(tmp / "small.pt", {"w": torch.ones(8)}), 0, "VERIFIED")

    # tensor views whose declared extent exceeds their storage: refused before any allocation
    for power in (28, 36):
        path = tmp / f"expand{power}.pt"
        torch.save({"w": torch.zeros(1).expand(2**power)}, path)
        add(f"expand-2^{power}", path, 3, "--max-inflate-bytes")
    path = tmp / "expand24.pt"
    torch.save({"w": torch.zeros(1).expand(2**24)}, path)  # 64 MiB: under the default 256 MiB allowance
    add("expand-2^24-under-the-limit", path, 0, "VERIFIED", max_mb=64 * 3 + 48)
    add("expand-2^24-over-a-lower-limit", path, 3, "--max-inflate-bytes", extra=("--max-inflate-bytes", "32MiB"))

    # zip bombs: never inflated in full
    bomb = _torch_zip(
        tmp / "bomb.pt", numel=2**27, storage=b"", deflate="data/0", zeros_mib=512
    )  # the 0.5 MB -> 512 MiB
    add("zip-storage-0.5MB-to-512MiB", bomb, 3, "is compressed")
    path = _torch_zip(tmp / "pkl-declared.pt", numel=4, storage=bytes(16), deflate="data.pkl")
    _patch_member(path, "archive/data.pkl", size=512 * MiB)
    add("zip-pickle-declares-512MiB", path, 3, "declares 512.0 MiB")
    path = _torch_zip(tmp / "pkl-lying.pt", numel=4, storage=bytes(16), pkl=b"", deflate="data.pkl", zeros_mib=64)
    _patch_member(path, "archive/data.pkl", size=1024)
    add(
        "zip-pickle-inflates-past-its-declared-size", path, 3, "CRC-32 of member archive/data.pkl does not match"
    )  # read to 1 KiB only

    # many tensors: linear, and refused past --max-tensors before the parse
    many_small = _safetensors_many(tmp / "many25k.safetensors", 25_000)
    many = _safetensors_many(tmp / "many100k.safetensors", 100_000)
    add("safetensors-25k-empty-tensors", many_small, 0, "VERIFIED", max_mb=48, max_s=30)
    add("safetensors-100k-empty-tensors", many, 0, "VERIFIED", max_mb=150, max_s=60)
    add("safetensors-100k-over-max-tensors", many, 3, "--max-tensors", extra=("--max-tensors", "50000"))
    huge = _safetensors_many(tmp / "many1500k.safetensors", 1_500_000)  # the issue's ~99 MB header (here 90 MB)
    add(
        "safetensors-1.5M-entry-90MB-header",
        huge,
        3,
        "--max-tensors",
        max_mb=2.5 * huge.stat().st_size / MiB + 64,
        max_s=30,
    )

    # DCP: the 20,000 one-element chunks (2.4 MB of metadata): the tiling check is linear now;
    # and our own: items sharing bytes, tensors sharing one chunk list, chunks larger than their items
    for layout, chunks, says in (
        ("overlap", 20_000, "overlap"),
        ("tiling", 20_000, "not a torch.save archive"),
        ("shared", 2_000, "share bytes"),
        ("shared-list", 2_000, "shares its chunk list"),
        ("bigger-than-item", 2, "more than the 4 bytes of its item"),
    ):
        add(f"dcp-{chunks}-chunks-{layout}", _dcp(tmp / f"dcp-{layout}", chunks=chunks, layout=layout), 3, says)

    # a pickle that refers to the same lists over and over: 2^30 paths to walk from a 2 KB file
    add("pickle-bomb-shared-lists", _pickle_bomb(tmp / "bomb-lists.pt"), 3, "pickle bomb")

    # numpy RNG state: refused by default, naming the opt-in; accepted with it; the opt-in allows nothing else
    rng = _save(
        tmp / "rng_state.pth",
        {"python": __import__("random").getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()},
    )
    add("numpy-rng-refused-by-default", rng, 3, "--allow-numpy")
    add("numpy-rng-with-allow-numpy", rng, 0, "VERIFIED", extra=("--allow-numpy",))
    evil = _torch_zip(
        tmp / "numpy-and-os.pt",
        numel=4,
        storage=bytes(16),
        pkl=pickle.dumps({"rng": np.random.get_state(), "x": _RunsCode()}, protocol=2),
    )
    add("allow-numpy-still-refuses-os-system", evil, 3, f"{os.system.__module__}.system", extra=("--allow-numpy",))

    # symbolic links: a hub cache snapshot is followed; a link out of the checkpoint only into --allow-root
    snapshot, repo = _hub(tmp)
    add("hub-snapshot-folder", snapshot, 0, "VERIFIED", watch=repo)
    add("hub-snapshot-file", snapshot / "model.safetensors", 0, "VERIFIED", watch=repo)
    outside = tmp / "elsewhere"
    outside.mkdir()
    save_file({"w": torch.ones(3)}, outside / "model.safetensors")
    linked = tmp / "linked-model"
    linked.mkdir()
    os.symlink(outside / "model.safetensors", linked / "model.safetensors")
    add("model-linked-out-of-the-folder", linked, 3, "--allow-root", watch=tmp / "elsewhere")
    add(
        "model-linked-out-with-allow-root",
        linked,
        0,
        "VERIFIED",
        extra=("--allow-root", str(outside)),
        watch=tmp / "elsewhere",
    )
    sharded = tmp / "sharded"
    sharded.mkdir()
    save_file({"w": torch.ones(3)}, outside / "model-00001-of-00001.safetensors")
    os.symlink(outside / "model-00001-of-00001.safetensors", sharded / "model-00001-of-00001.safetensors")
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}})
    )
    add(
        "hf-index-shard-linked-out",
        sharded / "model.safetensors.index.json",
        3,
        "--allow-root",
        watch=tmp / "elsewhere",
    )
    dcp_linked = tmp / "dcp-linked"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch.distributed.checkpoint as dcp

        dcp.save({"w": torch.ones(6)}, checkpoint_id=str(dcp_linked), no_dist=True)
    data = next(dcp_linked.glob("*.distcp"))
    shutil.move(data, outside / data.name)
    os.symlink(outside / data.name, data)
    add("dcp-data-file-linked-out", dcp_linked, 3, "--allow-root", watch=tmp / "elsewhere")
    add(
        "dcp-data-file-linked-out-with-allow-root",
        dcp_linked,
        0,
        "VERIFIED",
        extra=("--allow-root", str(outside)),
        watch=tmp / "elsewhere",
    )
    return {case.name: case for case in cases}


def _save(path: Path, obj) -> Path:
    torch.save(obj, path)
    return path


# ---------------------------------------------------------------------------------------------
# The driver: import once, fork one child per case

_DRIVER = r"""
import json, os, sys, time, traceback
import numpy, torch, safetensors.torch
import torch.distributed.checkpoint.metadata, torch.distributed.checkpoint.filesystem
from sdc_forensics.cli.main import cli
import sdc_forensics.cli.verify_cmd, sdc_forensics.checkpoint.folder, sdc_forensics.checkpoint.verify
import sdc_forensics.forensics.verify_run, sdc_forensics.present.verify, sdc_forensics.forensics.bisect

def status(field):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":")) / 1024  # MiB

cases, out_dir, warm = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
# Warm up: the valid cases once in the driver, so that what the CLI imports on first use (each
# reader's modules, rich, torch.load's internals; their size depends on the installed versions)
# is loaded before the fork and a child's peak is its case's own cost
with open(os.devnull, "w") as null:
    saved = os.dup(1), os.dup(2)
    os.dup2(null.fileno(), 1); os.dup2(null.fileno(), 2)
    for case in warm:
        try:
            cli.main(case, prog_name="sdc-forensics", standalone_mode=True)
        except SystemExit:
            pass
    sys.stdout.flush(); sys.stderr.flush()
    os.dup2(saved[0], 1); os.dup2(saved[1], 2)
for i, case in enumerate(cases):
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        try:
            for fd, name in ((1, "stdout"), (2, "stderr")):
                os.dup2(os.open(os.path.join(out_dir, f"{i}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            with open("/proc/self/clear_refs", "w") as fh:  # VmHWM := VmRSS (the driver's warm-up peak is not the case's)
                fh.write("5")
            start = status("VmRSS")
            try:
                cli.main(case, prog_name="sdc-forensics", standalone_mode=True)
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:
                traceback.print_exc()
                code = -1
            sys.stdout.flush(); sys.stderr.flush()
            with open(os.path.join(out_dir, f"{i}.json"), "w") as fh:
                json.dump({"code": code, "peak_mb": status("VmHWM") - start}, fh)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    with open(os.path.join(out_dir, f"{i}.json")) as fh:
        result = json.load(fh)
    result["wall_s"] = time.perf_counter() - started
    with open(os.path.join(out_dir, f"{i}.json"), "w") as fh:
        json.dump(result, fh)
"""


@dataclasses.dataclass(frozen=True)
class Ran:
    code: int
    peak_mb: float
    wall_s: float
    stdout: str
    stderr: str
    unchanged: bool


@pytest.fixture(scope="module")
def ran(corpus, tmp_path_factory) -> dict[str, Ran]:
    out = tmp_path_factory.mktemp("bounded-out")
    names = list(corpus)
    before = {name: tree_sha256(corpus[name].watch) for name in names}
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "COLUMNS": "200"}  # numpy's BLAS pool: no idle thread across fork
    warm = [list(corpus[n].args) for n in names if corpus[n].code == 0]
    subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps([list(corpus[n].args) for n in names]), str(out), json.dumps(warm)],
        check=True,
        env=env,
        timeout=600,
        cwd=Path(__file__).resolve().parents[2],
    )
    results = {}
    for i, name in enumerate(names):
        doc = json.loads((out / f"{i}.json").read_text())
        results[name] = Ran(
            code=doc["code"],
            peak_mb=doc["peak_mb"],
            wall_s=doc["wall_s"],
            stdout=(out / f"{i}.stdout").read_text(),
            stderr=(out / f"{i}.stderr").read_text(),
            unchanged=tree_sha256(corpus[name].watch) == before[name],
        )
    lines = [f"{name:45s} exit {r.code}  peak {r.peak_mb:7.1f} MiB  {r.wall_s:6.2f} s" for name, r in results.items()]
    print("\n" + "\n".join(lines))  # the figures, with -s
    return results


CASE_NAMES = [
    "small-valid-file",
    "expand-2^28",
    "expand-2^36",
    "expand-2^24-under-the-limit",
    "expand-2^24-over-a-lower-limit",
    "zip-storage-0.5MB-to-512MiB",
    "zip-pickle-declares-512MiB",
    "zip-pickle-inflates-past-its-declared-size",
    "safetensors-25k-empty-tensors",
    "safetensors-100k-empty-tensors",
    "safetensors-100k-over-max-tensors",
    "safetensors-1.5M-entry-90MB-header",
    "dcp-20000-chunks-overlap",
    "dcp-20000-chunks-tiling",
    "dcp-2000-chunks-shared",
    "dcp-2000-chunks-shared-list",
    "dcp-2-chunks-bigger-than-item",
    "pickle-bomb-shared-lists",
    "numpy-rng-refused-by-default",
    "numpy-rng-with-allow-numpy",
    "allow-numpy-still-refuses-os-system",
    "hub-snapshot-folder",
    "hub-snapshot-file",
    "model-linked-out-of-the-folder",
    "model-linked-out-with-allow-root",
    "hf-index-shard-linked-out",
    "dcp-data-file-linked-out",
    "dcp-data-file-linked-out-with-allow-root",
]


#: The reference case: what the CLI's first verification in a process costs (lazy imports, thread
#: pools, allocator arenas) depends on the installed versions: 19 MiB on the development VM, 64 MiB
#: in CI's fresh environment (numpy 2.4, rich 15). Each other case's bound is on its excess over it.
BASELINE = "small-valid-file"
BASELINE_MAX_MB = 256


@pytest.mark.parametrize("name", CASE_NAMES)
def test_hostile_case_exit_code_memory_and_time(corpus, ran, name):
    case, result = corpus[name], ran[name]
    assert result.code == case.code, (name, result.code, result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    assert case.says in " ".join(result.stderr.split()), result.stderr[-2000:]
    if case.code == 3:  # one line saying what is wrong and what to do, nothing on stdout
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        assert result.stdout == ""
    if name == BASELINE:
        assert result.peak_mb < BASELINE_MAX_MB, f"{name}: peak {result.peak_mb:.1f} MiB >= {BASELINE_MAX_MB} MiB"
    else:  # what the input costs beyond verifying a tiny valid file through the same CLI, in this environment
        excess = result.peak_mb - ran[BASELINE].peak_mb
        assert excess < case.max_mb, (
            f"{name}: peak {result.peak_mb:.1f} MiB, {excess:.1f} over {BASELINE} >= {case.max_mb} MiB"
        )
    assert result.wall_s < case.max_s, f"{name}: {result.wall_s:.1f} s >= {case.max_s} s"
    assert result.unchanged, "the input files changed"


def test_every_case_is_listed(corpus):
    assert sorted(CASE_NAMES) == sorted(corpus)


def test_many_tensors_cost_grows_linearly(ran):
    """4x the tensors: at most ~4x the memory and time (quadratic would be 16x)."""
    small, large = ran["safetensors-25k-empty-tensors"], ran["safetensors-100k-empty-tensors"]
    assert large.peak_mb <= 5 * small.peak_mb + 16, (small.peak_mb, large.peak_mb)
    assert large.wall_s <= 8 * small.wall_s + 3, (small.wall_s, large.wall_s)


def test_the_refusals_name_the_option_that_raises_the_limit(ran):
    assert "SDC_FORENSICS_MAX_INFLATE_BYTES" in ran["expand-2^28"].stderr.replace("\n", "")
    assert "--allow-root" in " ".join(ran["model-linked-out-of-the-folder"].stderr.split())

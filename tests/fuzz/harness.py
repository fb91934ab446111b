"""What every fuzz property checks, and the byte mutations they share.

A property builds one hostile input in a fresh scratch directory and hands the call that reads
it to :func:`hostile_call`, which asserts the contract of issue #9 in-process:

* the call returns, or raises one of the package's documented error classes (the ones the CLI
  turns into one ``error:`` line and exit 3: ``CheckpointError``, ``TraceError``,
  ``InvalidInputError``); any other exception propagates and fails the property, with its
  traceback, as it would have reached the user;
* the message is one short line (the CLI prints it as is);
* it takes at most :data:`HANG_BOUND_S` seconds (a ``SIGALRM`` interrupts it: a hang is reported,
  not waited for) on top of hypothesis's ``deadline``, and adds at most
  :data:`MEMORY_BOUND_BYTES` of address space (``RLIMIT_AS``, for the call only: an input that
  makes a reader over-allocate fails with ``MemoryError`` instead of exhausting the machine);
* it prints nothing on stderr, not even Python's "Exception ignored in ..." (a second line);
* nothing is opened for writing, removed or renamed under the input's directory (a Python audit
  hook watches ``open``, ``os.open``, ``os.remove``...), and every file is byte-identical after.

Timings and counts per input kind go to :data:`STATS`, which ``benchmarks/fuzz.py`` prints.

Over 400 lines on purpose: the mutators and the one rule every command must keep under them
(one line, a documented exit code, nothing written), together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import shutil
import signal
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from tests.factories import tree_sha256

#: Seconds one example may take before it counts as a hang (interrupted by SIGALRM).
HANG_BOUND_S = float(os.environ.get("SDC_FUZZ_HANG_S", "20"))
#: The longest error message accepted as "one clear line".
MAX_MESSAGE_CHARS = 1500
#: Address space one call may add (RLIMIT_AS, lowered for the call only): an input that makes a
#: reader allocate more fails its property with MemoryError instead of exhausting a shared machine.
MEMORY_BOUND_BYTES = int(os.environ.get("SDC_FUZZ_MEMORY_BYTES", str(4 << 30)))


class Hang(BaseException):
    """Raised by the alarm inside a call that ran past :data:`HANG_BOUND_S` (not an ``Exception``,
    so no ``except Exception`` in the code under test can swallow it)."""


@dataclasses.dataclass
class KindStats:
    """Examples run, refusals and the slowest example of one input kind."""

    examples: int = 0
    refused: int = 0
    max_s: float = 0.0
    total_s: float = 0.0


STATS: dict[str, KindStats] = {}


# ---------------------------------------------------------------------------------------------
# Watching for writes


_WATCHED: list[str] = []  # directory prefixes (with a trailing separator) under which nothing may be written
_WRITES: list[str] = []
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_CHANGE_EVENTS = {
    "os.remove",
    "os.rename",
    "os.rmdir",
    "os.truncate",
    "os.chmod",
    "os.utime",
    "os.link",
    "os.symlink",
    "shutil.rmtree",
    "shutil.move",
    "os.mkdir",
}


def _under_watch(path: Any) -> bool:
    if isinstance(path, int) or path is None:
        return False
    try:
        text = os.fsdecode(os.fspath(path))
    except TypeError:
        return False
    full = os.path.abspath(text) + os.sep
    return any(full.startswith(prefix) for prefix in _WATCHED)


def _audit(event: str, args: tuple) -> None:
    if not _WATCHED:
        return
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None, None))[:3]
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _WRITE_FLAGS
        )
        if writes and _under_watch(path):
            _WRITES.append(f"{event} {path!r} mode={mode!r} flags={flags!r}")
    elif event in _CHANGE_EVENTS and args and _under_watch(args[0]):
        _WRITES.append(f"{event} {args[0]!r}")


_HOOKED = False


def _install_hook() -> None:
    global _HOOKED
    if not _HOOKED:
        sys.addaudithook(_audit)  # cannot be removed; inert while nothing is watched
        _HOOKED = True


@contextlib.contextmanager
def _no_writes_under(root: Path):
    _install_hook()
    _WATCHED.append(os.path.abspath(root) + os.sep)
    _WRITES.clear()
    try:
        yield
    finally:
        _WATCHED.pop()


@contextlib.contextmanager
def _alarm(seconds: float):
    """Raise :class:`Hang` in the main thread after ``seconds`` (no-op off the main thread)."""
    if (
        seconds <= 0
        or not hasattr(signal, "setitimer")
        or signal.getsignal(signal.SIGALRM) not in (signal.SIG_DFL, None)
    ):
        yield
        return

    def ring(signum, frame):
        raise Hang(f"still running after {seconds:.0f} s")

    try:
        previous = signal.signal(signal.SIGALRM, ring)
    except ValueError:  # not the main thread
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _memory_cap(extra_bytes: int):
    """Lower the soft RLIMIT_AS to what the process maps now plus ``extra_bytes`` (Linux only)."""
    try:
        import resource

        with open("/proc/self/statm") as fh:
            mapped = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        yield
        return
    cap = mapped + extra_bytes
    if (
        extra_bytes <= 0
        or (hard != resource.RLIM_INFINITY and cap > hard)
        or (soft != resource.RLIM_INFINITY and cap > soft)
    ):
        yield
        return
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextlib.contextmanager
def _stderr_to(found: list[str]):
    """Collect what the call prints on ``sys.stderr`` (a reader prints nothing: only the CLI does),
    and what Python would print there as "Exception ignored in ..." (a ``__del__`` failing,
    CPython's own ``SystemError`` s): on the CLI either is a second line beside the error."""
    import io

    previous_hook, previous_stderr, captured = sys.unraisablehook, sys.stderr, io.StringIO()

    def hook(info) -> None:
        found.append(
            f"{type(info.exc_value).__name__}: {info.exc_value} ({info.err_msg or 'Exception ignored'} {info.object!r:.80})"
        )

    sys.unraisablehook, sys.stderr = hook, captured
    try:
        yield
    finally:
        sys.unraisablehook, sys.stderr = previous_hook, previous_stderr
        if captured.getvalue().strip():
            found.append(captured.getvalue().strip()[:300])


# ---------------------------------------------------------------------------------------------
# The contract


def hostile_call(kind: str, call: Callable[[], Any], *, allowed: tuple[type[BaseException], ...], watch: Path) -> Any:
    """Run ``call`` on a hostile input under ``watch`` and check the contract (module docstring).

    Args:
        kind: the input kind, for :data:`STATS` (``pt``, ``safetensors``, ``trace``...).
        call: reads the input (the reader, the verification, the analysis).
        allowed: the documented error classes ``call`` may raise.
        watch: the directory holding the input (and only it): nothing under it may change.

    Returns:
        What ``call`` returned, or the allowed exception it raised.
    """
    before = tree_sha256(watch)
    stats = STATS.setdefault(kind, KindStats())
    outcome: Any = None
    printed: list[str] = []
    started = time.perf_counter()
    try:
        with _no_writes_under(watch), _memory_cap(MEMORY_BOUND_BYTES), _alarm(HANG_BOUND_S), _stderr_to(printed):
            outcome = call()
    except Hang as exc:
        raise AssertionError(f"{kind}: the call did not finish: {exc} (a hang)") from None
    except allowed as exc:
        outcome = exc
        message = str(exc)
        assert message.strip(), f"{type(exc).__name__} with an empty message"
        assert "Traceback" not in message, message[:500]
        assert len(message) <= MAX_MESSAGE_CHARS, (
            f"a {len(message)}-character message is not one clear line: {message[:300]}…"
        )
        stats.refused += 1
    finally:
        elapsed = time.perf_counter() - started
        stats.examples += 1
        stats.total_s += elapsed
        stats.max_s = max(stats.max_s, elapsed)
    assert not printed, f"{kind}: the call printed to stderr (an extra line beside the CLI's one): {printed[:2]}"
    assert not _WRITES, f"{kind}: the input was opened for writing or changed: {_WRITES[:3]}"
    assert tree_sha256(watch) == before, f"{kind}: an input file changed"
    return outcome


# ---------------------------------------------------------------------------------------------
# Scratch directories: one per example, under a module's directory, removed after the example


class Scratch:
    """Fresh directories under ``root``: ``with scratch() as folder:`` (removed on exit)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._count = itertools.count()

    @contextlib.contextmanager
    def __call__(self):
        folder = self.root / f"case-{next(self._count)}"
        folder.mkdir()
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Byte mutations


#: Little-endian integers that sit on boundaries: sizes, offsets and counts set to these are
#: where readers overflow, wrap or over-allocate.
INTERESTING = (
    0,
    1,
    0x7F,
    0x80,
    0xFF,
    0x7FFF,
    0x8000,
    0xFFFF,
    0x7FFFFFFF,
    0x80000000,
    0xFFFFFFFF,
    2**53,
    2**63 - 1,
    2**63,
    2**64 - 1,
)
_WIDTHS = {2: "<H", 4: "<I", 8: "<Q"}


def _apply(data: bytes, op: tuple) -> bytes:
    name = op[0]
    n = len(data)
    if name == "flip":
        _, at, mask = op
        if not n:
            return data
        at %= n
        return data[:at] + bytes([data[at] ^ mask]) + data[at + 1 :]
    if name == "truncate":
        return data[: op[1] % (n + 1)]
    if name == "cut_head":
        return data[op[1] % (n + 1) :]
    if name == "delete":
        _, at, length = op
        at = at % (n + 1)
        return data[:at] + data[at + length :]
    if name == "insert":
        _, at, blob = op
        at = at % (n + 1)
        return data[:at] + blob + data[at:]
    if name == "splice":  # copy a slice of the file over another place (a torn or misdirected write)
        _, src, dst, length = op
        if not n:
            return data
        src, dst = src % n, dst % n
        chunk = data[src : src + length]
        return data[:dst] + chunk + data[dst + len(chunk) :]
    if name == "integer":
        _, at, width, value = op
        packed = struct.pack(_WIDTHS[width], value % (1 << (8 * width)))
        if n < width:
            return data
        at %= n - width + 1
        return data[:at] + packed + data[at + width :]
    if name == "duplicate":
        _, at, length = op
        at = at % (n + 1)
        return data[:at] + data[at : at + length] + data[at:]
    raise ValueError(f"unknown mutation {op!r}")


def mutate(data: bytes, ops: list[tuple]) -> bytes:
    """``data`` with ``ops`` (from :func:`mutations`) applied in order."""
    for op in ops:
        data = _apply(data, op)
    return data


def _offset(hot: tuple[int, ...]) -> st.SearchStrategy[int]:
    """Anywhere, or close to a structure (a zip signature, a length field, a header) of the file."""
    anywhere = st.integers(min_value=0, max_value=1 << 20)
    if not hot:
        return anywhere
    near = st.tuples(st.sampled_from(hot), st.integers(min_value=-8, max_value=64)).map(lambda p: max(0, p[0] + p[1]))
    return st.one_of(near, anywhere)


def mutations(hot: tuple[int, ...] = (), max_ops: int = 4) -> st.SearchStrategy[list[tuple]]:
    """Lists of 1..``max_ops`` byte mutations: bit flips, truncations, missing heads, deletions,
    insertions, splices, boundary integers written over fields, duplicated ranges.

    Offsets are taken modulo the data's length when applied, and lean towards ``hot`` offsets.
    """
    at = _offset(hot)
    length = st.integers(min_value=1, max_value=256)
    op = st.one_of(
        st.tuples(st.just("flip"), at, st.sampled_from([0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0xFF])),
        st.tuples(st.just("truncate"), at),
        st.tuples(st.just("cut_head"), st.integers(min_value=1, max_value=64)),
        st.tuples(st.just("delete"), at, length),
        st.tuples(st.just("insert"), at, st.binary(min_size=1, max_size=32)),
        st.tuples(st.just("splice"), at, at, length),
        st.tuples(
            st.just("integer"), at, st.sampled_from([2, 4, 8]), st.sampled_from(INTERESTING) | st.integers(0, 2**64 - 1)
        ),
        st.tuples(st.just("duplicate"), at, length),
    )
    return st.lists(op, min_size=1, max_size=max_ops)


def signature_offsets(data: bytes, signatures: tuple[bytes, ...]) -> tuple[int, ...]:
    """Every offset in ``data`` where one of ``signatures`` starts (zip headers, JSON keys...)."""
    found = []
    for signature in signatures:
        start = data.find(signature)
        while start >= 0:
            found.append(start)
            start = data.find(signature, start + 1)
    return tuple(sorted(found))


# ---------------------------------------------------------------------------------------------
# JSON values


def json_values(max_leaves: int = 10) -> st.SearchStrategy[Any]:
    """Any JSON value, with the awkward ones well represented: huge and negative integers,
    non-finite floats (``json.dumps`` writes ``NaN``/``Infinity``, which ``json.loads`` reads),
    strings with NUL, surrogates, rich markup and path separators."""
    text = st.one_of(
        st.text(max_size=12),
        st.sampled_from(
            [
                "",
                "\x00",
                "[/]",
                "[bold]x",
                "..",
                "/",
                "../../etc/passwd",
                "\ud800",
                "x" * 300,
                "0" * 16,
                "clean",
                "float32",
                "mean",
                "nonfinite",
                "F32",
            ]
        ),
    )
    scalar = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.sampled_from([-1, 0, 1, 2**31, 2**53, 2**53 + 1, 2**63 - 1, 2**63, 2**64]),
        st.floats(allow_nan=True, allow_infinity=True),
        text,
    )
    return st.recursive(
        scalar,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
        max_leaves=max_leaves,
    )


# ---------------------------------------------------------------------------------------------
# Field edits of a JSON document


def json_paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys and indices) to a value inside ``doc``, the root ``()`` included."""
    paths = [prefix]
    if isinstance(doc, dict):
        for key, value in doc.items():
            paths += json_paths(value, prefix + (key,))
    elif isinstance(doc, list):
        for index, value in enumerate(doc):
            paths += json_paths(value, prefix + (index,))
    return paths


def edit_json(doc: Any, edits: list[tuple]) -> Any:
    """A copy of ``doc`` with ``edits`` (from :func:`json_edits`) applied in order: ``("set", i, v)``
    replaces the value at path number ``i``, ``("drop", i, _)`` removes it, ``("add", i, v)`` adds a
    key (to an object) or an item (to a list) there."""
    import copy

    doc = copy.deepcopy(doc)
    for action, pick, value in edits:
        value = copy.deepcopy(value)  # sampled_from hands out one shared object: never insert it twice
        paths = json_paths(doc)
        path = paths[pick % len(paths)]
        if not path:
            if action == "set":
                doc = value
            continue
        parent = doc
        for step in path[:-1]:
            parent = parent[step]
        last = path[-1]
        if action == "set":
            parent[last] = value
        elif action == "drop":
            del parent[last]
        elif action == "add" and isinstance(parent[last], dict):
            parent[last][f"k{pick}"] = value
        elif action == "add" and isinstance(parent[last], list):
            parent[last].append(value)
    return doc


def json_edits(max_edits: int = 3, values: st.SearchStrategy | None = None) -> st.SearchStrategy[list[tuple]]:
    """Lists of 1..``max_edits`` edits for :func:`edit_json`."""
    value = values if values is not None else json_values(6)
    return st.lists(
        st.tuples(st.sampled_from(["set", "set", "drop", "add"]), st.integers(0, 1 << 16), value),
        min_size=1,
        max_size=max_edits,
    )

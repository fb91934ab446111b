"""Parse untrusted JSON input files at their boundary: decode, then check every field's type.

Every file sdc-forensics reads may be damaged or hostile (a flipped byte, a crafted header). The
readers decode JSON with :func:`load_json`, which turns every way decoding can fail (invalid
UTF-8 or JSON, nesting deep enough to exhaust Python's stack, an integer of thousands of digits)
into one :class:`ValueError` with a short reason, and read decoded objects through
:class:`Fields`, which checks each field's type (and range) and raises the reader's own error
class (``TraceError``, ``InvalidInputError``...) naming the file, the field and what was found.
Nothing past the parse boundary then meets a number where it expects a string.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

#: Nesting limit for free-form JSON values (``extra``, ``determinism``): far above anything
#: sdc-forensics writes, far below Python's recursion limit (printing or re-encoding stays safe).
MAX_DEPTH = 32

_REQUIRED = object()


def load_json(data: bytes | str, *, object_pairs_hook: Callable[[list], Any] | None = None) -> Any:
    """Decode ``data`` (UTF-8 bytes, a buffer such as a memoryview of a map, or text) as JSON.

    Args:
        object_pairs_hook: ``json.loads``'s: builds each object from its ``(key, value)`` pairs
            (a reader can keep compact records, or stop a huge parse early by raising).

    Raises:
        ValueError: with a short reason: not UTF-8, not JSON, an integer too long to convert, or
            nested deeper than Python can decode. (Fields check the nesting of free-form values.)
    """
    try:
        # no intermediate copy
        text = str(data, "utf-8") if isinstance(data, (bytes, bytearray, memoryview)) else data
        doc = json.loads(text, object_pairs_hook=object_pairs_hook)
    except RecursionError:
        raise ValueError("JSON nested too deeply to decode") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8: {exc.reason} at byte {exc.start}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(" ".join(str(exc).split())[:200]) from None
    # an integer literal beyond Python's int_max_str_digits (4,300 by default)
    except ValueError as exc:
        if "digits" not in str(exc):
            raise ValueError(" ".join(str(exc).split())[:200]) from None
        raise ValueError(f"an integer of more than {sys.get_int_max_str_digits()} digits") from None
    return doc


def depth(value: Any, stop: int | None = None) -> int:
    """Nesting depth of a decoded JSON value (a scalar is 0), without recursion; stops at ``stop``."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        level += 1
        deepest = max(deepest, level)
        if stop is not None and deepest >= stop:
            return deepest
        stack.extend((child, level) for child in children)
    return deepest


def describe(value: Any) -> str:
    """A short description of a JSON value for an error message: its JSON type and a clipped repr.

    Containers are described by size and huge integers by digit count, never printed: either
    may be too large to print (Python refuses to convert an integer of 4,300+ digits to text).
    """
    if value is None:
        return "null"
    if isinstance(value, dict):
        return f"an object of {len(value)} keys"
    if isinstance(value, list):
        if len(value) <= 8 and all(
            isinstance(v, (str, float, bool, type(None))) or (is_int(v) and abs(v) < 10**30) for v in value
        ):
            text = repr(value)
            return f"the list {text[:60]}{'…' if len(text) > 60 else ''}"
        return f"a list of {len(value)} items"
    if is_int(value) and abs(value) >= 10**30:
        return (
            f"an integer of {len(str(abs(value)))} digits"
            if abs(value) < 10**4000
            else "an integer of thousands of digits"
        )
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        type(value), type(value).__name__
    )
    text = repr(value)
    return f"{kind} {text[:40]}{'…' if len(text) > 40 else ''}"


def is_int(value: Any) -> bool:
    """A JSON integer (``bool`` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


class Fields:
    """Typed reads of one decoded JSON object from an untrusted file.

    Args:
        doc: the decoded value; anything but an object raises at once.
        where: what the object is, for messages (``manifest.json, attempt 0, rank 2``).
        error: the exception class to raise (an :class:`~sdc_forensics.errors.InvalidInputError`).
        hint: what to do, appended to every message.

    Every getter takes the key and, optionally, a default used when the key is absent; a key
    that is present with the wrong type (or out of range) raises ``error`` naming it.
    """

    def __init__(self, doc: Any, where: str, error: Callable[[str], Exception], hint: str) -> None:
        self.where, self.error, self.hint = where, error, hint
        if not isinstance(doc, dict):
            raise self.error(f"{where} must be a JSON object, found {describe(doc)}; {hint}")
        self.doc = doc

    def fail(self, key: str, expected: str, value: Any) -> Exception:
        """The error for field ``key``, which should be ``expected`` but is ``value``."""
        return self.error(f'{self.where}: "{key}" must be {expected}, found {describe(value)}; {self.hint}')

    def _get(self, key: str, default: Any) -> Any:
        if key in self.doc:
            return self.doc[key]
        if default is _REQUIRED:
            raise self.error(f'{self.where} has no "{key}"; {self.hint}')
        return default

    def int(
        self, key: str, default: Any = _REQUIRED, *, lo: int | None = None, hi: int | None = None, none: bool = False
    ):
        """An integer in ``[lo, hi]`` (or null, when ``none``)."""
        value = self._get(key, default)
        if value is None and none:
            return None
        expected = "an integer" + (" or null" if none else "")
        if lo is not None and hi is not None:
            expected = f"an integer in {lo}..{hi}" + (" or null" if none else "")
        elif lo is not None:
            expected = f"an integer >= {lo}" + (" or null" if none else "")
        if not is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
            raise self.fail(key, expected, value)
        return value

    def str(self, key: str, default: Any = _REQUIRED, *, none: bool = False, max_len: int = 1 << 16):
        """A string of at most ``max_len`` characters (or null, when ``none``)."""
        value = self._get(key, default)
        if value is None and none:
            return None
        if not isinstance(value, str):
            raise self.fail(key, "a string" + (" or null" if none else ""), value)
        if len(value) > max_len:
            raise self.error(
                f'{self.where}: "{key}" is a string of {len(value)} characters, longer than {max_len}; {self.hint}'
            )
        return value

    def bool(self, key: str, default: Any = _REQUIRED) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, "true or false", value)
        return value

    def list(self, key: str, default: Any = _REQUIRED) -> list:
        value = self._get(key, default)
        # a default
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise self.fail(key, "a list", value)
        return value

    def ints(self, key: str, default: Any = _REQUIRED, *, lo: int | None = None) -> tuple[int, ...]:
        """A list of integers (each ``>= lo``)."""
        items = self.list(key, default)
        bad = [v for v in items if not is_int(v) or (lo is not None and v < lo)]
        if bad:
            raise self.fail(key, "a list of integers" + (f" >= {lo}" if lo is not None else ""), bad[0])
        return tuple(items)

    def strs(self, key: str, default: Any = _REQUIRED) -> tuple[str, ...]:
        """A list of strings."""
        items = self.list(key, default)
        bad = [v for v in items if not isinstance(v, str)]
        if bad:
            raise self.fail(key, "a list of strings", bad[0])
        return tuple(items)

    def obj(self, key: str, default: Any = _REQUIRED, *, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
        """A free-form object, nested at most ``max_depth`` levels."""
        value = self._get(key, default)
        if not isinstance(value, dict):
            raise self.fail(key, "an object", value)
        if depth(value, max_depth + 1) > max_depth:
            raise self.error(f'{self.where}: "{key}" is nested more than {max_depth} levels deep; {self.hint}')
        return dict(value)

    def str_map(self, key: str, default: Any = _REQUIRED) -> dict[str, str]:
        """An object whose values are all strings."""
        value = self._get(key, default)
        if not isinstance(value, dict):
            raise self.fail(key, "an object of strings", value)
        bad = [v for v in value.values() if not isinstance(v, str)]
        if bad:
            raise self.fail(key, "an object of strings", bad[0])
        return dict(value)

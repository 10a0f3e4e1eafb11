"""What a sub-document path means: the path syntax, and each lookup and mutation applied to a
parsed JSON document, with kv_engine's statuses (docs/SubDocument.md). Pure functions over
Python values; the wire is `subdoc.py`'s, the document's storage the server's.

Paths (N1QL syntax): components separated by ``.``; ``[n]`` after a component (or at the
start, for a document that is an array) indexes an array, ``[-1]`` is its last element (other
negative indexes are invalid); a backtick-quoted part of a component may contain ``.``, ``[``
and ``]`` (two backticks are one literal backtick); JSON escapes in a component are decoded.
A syntax error is SUBDOC_PATH_EINVAL, more than SUBDOC_PATH_COMPONENTS_MAX components
SUBDOC_PATH_E2BIG. Walking a path: a key on something that is not an object, or an index on
something that is not an array, is SUBDOC_PATH_MISMATCH; a missing key or an index out of
range SUBDOC_PATH_ENOENT.

Documents are parsed with their numbers kept as written when Python would print them
otherwise (``1.50``, ``1E5``, ``-0``, 30-digit integers): an untouched part of a document keeps
its values exactly. A mutated document is written back compactly (no insignificant
whitespace). A document deeper than SUBDOC_DOC_DEPTH_MAX levels is SUBDOC_DOC_E2DEEP; a value
that would make it deeper SUBDOC_VALUE_ETOODEEP. Values to insert must be JSON
(SUBDOC_VALUE_CANTINSERT); an array operation's value may be several comma-separated values.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from changefeed import limits
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.status import Status

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1
_INTEGER = re.compile(r"-?[0-9]+")
_RAW_INT_DIGITS_MAX = 30  # longer integers stay text (Python caps int parsing at 4300 digits)
_MISSING: Final = object()

Component = str | int


class SubdocError(Exception):
    """A path operation failed with ``status`` (a SUBDOC_* status)."""

    def __init__(self, status: Status, message: str = "") -> None:
        super().__init__(f"{status.name}: {message}" if message else status.name)
        self.status = status


class RawNumber:
    """A JSON number kept as written, because Python would print its value otherwise."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"RawNumber({self.text!r})"

    def as_int(self) -> int | None:
        """The integer it writes, or None for a fraction or an exponent."""
        return int(self.text) if _INTEGER.fullmatch(self.text) else None


# -- JSON -------------------------------------------------------------------------------------


def _parse_float(text: str) -> float | RawNumber:
    value = float(text)
    return value if repr(value) == text else RawNumber(text)


def _parse_int(text: str) -> int | RawNumber:
    if len(text) > _RAW_INT_DIGITS_MAX:
        return RawNumber(text)
    value = int(text)
    return value if str(value) == text else RawNumber(text)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_json(data: bytes | str) -> Any:
    """Parse strict JSON (UTF-8, no NaN or Infinity), numbers kept as written.

    Raises:
        ValueError: not JSON. RecursionError: nested beyond what the parser can follow.
    """
    text = data.decode("utf-8") if isinstance(data, bytes) else data
    return json.loads(
        text,
        parse_float=_parse_float,
        parse_int=_parse_int,
        parse_constant=_no_constant,
    )


def parse_document(body: bytes) -> Any:
    """A document's body for path operations.

    Raises:
        SubdocError: SUBDOC_DOC_NOTJSON, or SUBDOC_DOC_E2DEEP for a document nested deeper than
            SUBDOC_DOC_DEPTH_MAX.
    """
    try:
        root = parse_json(body)
    except RecursionError:
        raise SubdocError(Status.SUBDOC_DOC_E2DEEP, "document too deep") from None
    except ValueError:  # UnicodeDecodeError and JSONDecodeError included
        raise SubdocError(Status.SUBDOC_DOC_NOTJSON) from None
    if depth(root) > limits.SUBDOC_DOC_DEPTH_MAX:
        raise SubdocError(Status.SUBDOC_DOC_E2DEEP, "document too deep")
    return root


def parse_value(value: bytes, *, several: bool = False) -> list[Any]:
    """The value(s) a mutation inserts: one JSON value, or with ``several`` one or more
    comma-separated values (an array operation's). Raises SubdocError(VALUE_CANTINSERT)."""
    try:
        text = value.decode("utf-8")
        parsed = parse_json(f"[{text}]") if several else [parse_json(text)]
    except (ValueError, RecursionError):
        raise SubdocError(Status.SUBDOC_VALUE_CANTINSERT, "value is not JSON") from None
    if not parsed:
        raise SubdocError(Status.SUBDOC_VALUE_CANTINSERT, "no value")
    return list(parsed)


def dumps(value: Any) -> bytes:
    """Compact JSON; numbers parsed as `RawNumber` written as they came."""
    try:
        return _dumps(value, ascii_only=False).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (a JSON "\ud800" escape): keep it escaped
        return _dumps(value, ascii_only=True).encode("ascii")


def _dumps(value: Any, *, ascii_only: bool) -> str:
    try:
        return json.dumps(value, ensure_ascii=ascii_only, separators=(",", ":"), allow_nan=False)
    except TypeError:  # a RawNumber somewhere
        return "".join(_dump_parts(value, ascii_only))


def _dump_parts(value: Any, ascii_only: bool) -> list[str]:
    """The slow path of `dumps`: iterative, so a deep document cannot exhaust the stack."""
    out: list[str] = []
    stack: list[Any] = [value]
    while stack:  # bounded: each node is pushed once
        item = stack.pop()
        if isinstance(item, _Literal | RawNumber):
            out.append(item.text)
        elif isinstance(item, dict):
            parts: list[Any] = [_Literal("{")]
            for i, (k, v) in enumerate(item.items()):
                prefix = "," if i else ""
                parts += [_Literal(prefix + json.dumps(k, ensure_ascii=ascii_only) + ":"), v]
            parts.append(_Literal("}"))
            stack.extend(reversed(parts))
        elif isinstance(item, list):
            parts = [_Literal("[")]
            for i, v in enumerate(item):
                if i:
                    parts.append(_Literal(","))
                parts.append(v)
            parts.append(_Literal("]"))
            stack.extend(reversed(parts))
        else:
            out.append(json.dumps(item, ensure_ascii=ascii_only, allow_nan=False))
    return out


class _Literal:
    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def depth(value: Any) -> int:
    """Nesting levels of containers: 0 for a scalar, 1 for ``{}`` or ``[1]``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:  # bounded: each node is pushed once
        node, level = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, level + 1)
        stack.extend((child, level + 1) for child in children)
    return deepest


def is_primitive(value: Any) -> bool:
    return not isinstance(value, dict | list)


# -- paths ------------------------------------------------------------------------------------


def parse_path(raw: bytes) -> list[Component]:
    """A path's components: strings (keys) and integers (array indexes, -1 the last).

    Raises:
        SubdocError: PATH_EINVAL for bad syntax, PATH_E2BIG for too many components.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SubdocError(Status.SUBDOC_PATH_EINVAL, "path is not UTF-8") from None
    components: list[Component] = []
    i, n = 0, len(text)
    need_key = False  # after a ".", a key must follow
    while i < n:  # bounded: every step consumes at least one character
        if text[i] == "[":
            if need_key:
                raise SubdocError(Status.SUBDOC_PATH_EINVAL, "'.' before '['")
            i = _read_index(text, i, components)
        else:
            key, i = _read_key(text, i)
            components.append(key)
        need_key = False
        if i < n:
            if text[i] == ".":
                i += 1
                need_key = True
            elif text[i] != "[":
                raise SubdocError(Status.SUBDOC_PATH_EINVAL, f"unexpected {text[i]!r}")
        if len(components) > limits.SUBDOC_PATH_COMPONENTS_MAX:
            raise SubdocError(Status.SUBDOC_PATH_E2BIG, "too many path components")
    if need_key:
        raise SubdocError(Status.SUBDOC_PATH_EINVAL, "path ends with '.'")
    return components


def _read_index(text: str, i: int, components: list[Component]) -> int:
    end = text.find("]", i)
    if end < 0:
        raise SubdocError(Status.SUBDOC_PATH_EINVAL, "unclosed '['")
    inner = text[i + 1 : end]
    if inner == "-1":
        components.append(-1)
    elif inner.isascii() and inner.isdigit() and len(inner) <= 10:
        components.append(int(inner))
    else:
        raise SubdocError(Status.SUBDOC_PATH_EINVAL, f"bad array index {inner[:16]!r}")
    return end + 1


def _read_key(text: str, i: int) -> tuple[str, int]:
    chars: list[str] = []
    n = len(text)
    while i < n:  # bounded: every step consumes at least one character
        c = text[i]
        if c == "`":
            i += 1
            while True:  # bounded by n
                if i >= n:
                    raise SubdocError(Status.SUBDOC_PATH_EINVAL, "unclosed '`'")
                if text[i] == "`":
                    if i + 1 < n and text[i + 1] == "`":
                        chars.append("`")
                        i += 2
                        continue
                    i += 1
                    break
                chars.append(text[i])
                i += 1
            continue
        if c in ".[":
            break
        if c == "]":
            raise SubdocError(Status.SUBDOC_PATH_EINVAL, "unexpected ']'")
        chars.append(c)
        i += 1
    key = "".join(chars)
    if not key:
        raise SubdocError(Status.SUBDOC_PATH_EINVAL, "empty path component")
    if "\\" in key:
        try:
            decoded = json.loads(f'"{key}"')
        except ValueError:
            raise SubdocError(Status.SUBDOC_PATH_EINVAL, "bad JSON escape in path") from None
        key = str(decoded)
    return key, i


def _child(node: Any, component: Component) -> Any:
    if isinstance(component, str):
        if not isinstance(node, dict):
            raise SubdocError(Status.SUBDOC_PATH_MISMATCH, f"{component!r} of a non-object")
        if component not in node:
            raise SubdocError(Status.SUBDOC_PATH_ENOENT, f"no {component!r}")
        return node[component]
    if not isinstance(node, list):
        raise SubdocError(Status.SUBDOC_PATH_MISMATCH, f"[{component}] of a non-array")
    return node[_index(node, component)]


def _index(array: list[Any], index: int) -> int:
    if index == -1:
        if not array:
            raise SubdocError(Status.SUBDOC_PATH_ENOENT, "[-1] of an empty array")
        return len(array) - 1
    if index >= len(array):
        raise SubdocError(Status.SUBDOC_PATH_ENOENT, f"[{index}] beyond {len(array)}")
    return index


def walk(root: Any, components: list[Component]) -> Any:
    node = root
    for component in components:
        node = _child(node, component)
    return node


def _parent(root: Any, components: list[Component], *, mkdir: bool) -> Any:
    """The container the last component is in; with ``mkdir``, missing intermediate keys of
    objects are created as empty objects (never array elements)."""
    node = root
    for component in components[:-1]:
        if mkdir and isinstance(component, str) and isinstance(node, dict):
            node = node.setdefault(component, {})
        else:
            node = _child(node, component)
    return node


def _check_depth(levels: int, values: list[Any]) -> None:
    """``values`` placed inside ``levels`` containers must not pass the depth limit."""
    if levels + max(depth(v) for v in values) > limits.SUBDOC_DOC_DEPTH_MAX:
        raise SubdocError(Status.SUBDOC_VALUE_ETOODEEP, "the document would be too deep")


# -- lookups ----------------------------------------------------------------------------------


def lookup(root: Any, opcode: int, path: bytes) -> bytes:
    """SUBDOC_GET (the value as JSON), SUBDOC_EXISTS (b"") or SUBDOC_GET_COUNT (the number of
    entries of an object or array, as decimal text).

    Raises:
        SubdocError: the path's status.
    """
    node = walk(root, parse_path(path))
    if opcode == Opcode.SUBDOC_GET:
        return dumps(node)
    if opcode == Opcode.SUBDOC_EXISTS:
        return b""
    assert opcode == Opcode.SUBDOC_GET_COUNT, opcode
    if not isinstance(node, dict | list):
        raise SubdocError(Status.SUBDOC_PATH_MISMATCH, "count of a scalar")
    return str(len(node)).encode()


# -- mutations --------------------------------------------------------------------------------


def mutate(root: Any, opcode: int, path: bytes, value: bytes, *, mkdir: bool) -> bytes | None:
    """Apply one mutation to ``root`` in place (a working copy: on any error the caller drops
    it). Returns the value the path answers (a counter's new value), else None.

    Raises:
        SubdocError: the path's status.
    """
    components = parse_path(path)
    if opcode in (Opcode.SUBDOC_DICT_ADD, Opcode.SUBDOC_DICT_UPSERT):
        _dict_set(root, components, parse_value(value)[0], opcode, mkdir=mkdir)
    elif opcode == Opcode.SUBDOC_REPLACE:
        _replace(root, components, parse_value(value)[0])
    elif opcode == Opcode.SUBDOC_DELETE:
        _delete(root, components)
    elif opcode in (Opcode.SUBDOC_ARRAY_PUSH_LAST, Opcode.SUBDOC_ARRAY_PUSH_FIRST):
        values = parse_value(value, several=True)
        array = _array(root, components, mkdir=mkdir)
        _check_depth(len(components) + 1, values)
        if opcode == Opcode.SUBDOC_ARRAY_PUSH_LAST:
            array.extend(values)
        else:
            array[:0] = values
    elif opcode == Opcode.SUBDOC_ARRAY_INSERT:
        _insert(root, components, parse_value(value, several=True))
    elif opcode == Opcode.SUBDOC_ARRAY_ADD_UNIQUE:
        _add_unique(root, components, value, mkdir=mkdir)
    elif opcode == Opcode.SUBDOC_COUNTER:
        return _counter(root, components, value, mkdir=mkdir)
    else:
        raise AssertionError(f"not a path mutation: {opcode:#x}")
    return None


def _last(components: list[Component]) -> Component:
    if not components:
        raise SubdocError(Status.SUBDOC_PATH_EINVAL, "the path must not be empty")
    return components[-1]


def _dict_set(
    root: Any, components: list[Component], value: Any, opcode: int, *, mkdir: bool
) -> None:
    key = _last(components)
    if not isinstance(key, str):
        raise SubdocError(Status.SUBDOC_PATH_EINVAL, "a dictionary path ends with a key")
    parent = _parent(root, components, mkdir=mkdir)
    if not isinstance(parent, dict):
        raise SubdocError(Status.SUBDOC_PATH_MISMATCH, "the parent is not an object")
    if opcode == Opcode.SUBDOC_DICT_ADD and key in parent:
        raise SubdocError(Status.SUBDOC_PATH_EEXISTS, f"{key!r} exists")
    _check_depth(len(components), [value])
    parent[key] = value


def _replace(root: Any, components: list[Component], value: Any) -> None:
    last = _last(components)
    parent = _parent(root, components, mkdir=False)
    _child(parent, last)  # must exist
    _check_depth(len(components), [value])
    if isinstance(last, str):
        parent[last] = value
    else:
        parent[_index(parent, last)] = value


def _delete(root: Any, components: list[Component]) -> None:
    last = _last(components)
    parent = _parent(root, components, mkdir=False)
    _child(parent, last)  # must exist
    if isinstance(last, str):
        del parent[last]
    else:
        del parent[_index(parent, last)]


def _array(root: Any, components: list[Component], *, mkdir: bool) -> list[Any]:
    """The array a push or add-unique targets; with ``mkdir`` a missing one (under an object
    key) is created."""
    try:
        node = walk(root, components)
    except SubdocError as error:
        last = components[-1] if components else None
        if error.status != Status.SUBDOC_PATH_ENOENT or not mkdir or not isinstance(last, str):
            raise
        parent = _parent(root, components, mkdir=True)
        if not isinstance(parent, dict):
            raise SubdocError(Status.SUBDOC_PATH_MISMATCH, "the parent is not an object") from None
        node = parent.setdefault(last, [])
    if not isinstance(node, list):
        raise SubdocError(Status.SUBDOC_PATH_MISMATCH, "not an array")
    return node


def _insert(root: Any, components: list[Component], values: list[Any]) -> None:
    index = _last(components)
    if not isinstance(index, int) or index < 0:
        raise SubdocError(Status.SUBDOC_PATH_EINVAL, "an insert path ends with [n], n >= 0")
    parent = _parent(root, components, mkdir=False)
    if not isinstance(parent, list):
        raise SubdocError(Status.SUBDOC_PATH_MISMATCH, "not an array")
    if index > len(parent):
        raise SubdocError(Status.SUBDOC_PATH_ENOENT, f"[{index}] beyond {len(parent)}")
    _check_depth(len(components), values)
    parent[index:index] = values


def _add_unique(root: Any, components: list[Component], value: bytes, *, mkdir: bool) -> None:
    values = parse_value(value)
    if not is_primitive(values[0]):
        raise SubdocError(Status.SUBDOC_VALUE_CANTINSERT, "add-unique takes a primitive")
    array = _array(root, components, mkdir=mkdir)
    if not all(is_primitive(v) for v in array):
        raise SubdocError(Status.SUBDOC_PATH_MISMATCH, "the array holds non-primitives")
    text = dumps(values[0])
    if any(dumps(v) == text for v in array):
        raise SubdocError(Status.SUBDOC_PATH_EEXISTS, "the value is in the array")
    _check_depth(len(components) + 1, values)
    array.append(values[0])


def _counter(root: Any, components: list[Component], value: bytes, *, mkdir: bool) -> bytes:
    delta = _delta(value)
    last = _last(components)
    parent = _parent(root, components, mkdir=mkdir)
    try:
        current = _child(parent, last)
    except SubdocError as error:
        if error.status != Status.SUBDOC_PATH_ENOENT or not isinstance(last, str):
            raise
        current = _MISSING
    if current is _MISSING:  # a missing key of an object: created with the delta
        assert isinstance(parent, dict) and isinstance(last, str), (parent, last)
        parent[last] = delta
        return str(delta).encode()
    number = current.as_int() if isinstance(current, RawNumber) else current
    if isinstance(number, bool) or not isinstance(number, int):
        raise SubdocError(Status.SUBDOC_PATH_MISMATCH, "not an integer")
    if not INT64_MIN <= number <= INT64_MAX:
        raise SubdocError(Status.SUBDOC_NUM_ERANGE, "the number is not an int64")
    result = number + delta
    if not INT64_MIN <= result <= INT64_MAX:
        raise SubdocError(Status.SUBDOC_VALUE_CANTINSERT, "the result overflows an int64")
    if isinstance(last, str):
        parent[last] = result
    else:
        parent[_index(parent, last)] = result
    return str(result).encode()


def _delta(value: bytes) -> int:
    text = value.decode("ascii", errors="replace")
    if not _INTEGER.fullmatch(text) or len(text) > 20:
        raise SubdocError(Status.SUBDOC_DELTA_EINVAL, "the delta is not an integer")
    delta = int(text)
    if delta == 0 or not INT64_MIN <= delta <= INT64_MAX:
        raise SubdocError(Status.SUBDOC_DELTA_EINVAL, "the delta is 0 or not an int64")
    return delta

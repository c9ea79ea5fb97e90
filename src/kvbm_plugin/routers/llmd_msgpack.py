"""msgpack decoded as llm-d decodes it: ``vmihailenco/msgpack/v5``'s ``DecodeInterface`` (what
``msgpack.Unmarshal`` into ``any`` gives), every integer keeping its Go type.

llm-d's vLLM adapter (llm-d-router @ebab6879, ``pkg/kvevents/engineadapter``) unmarshals each
event into ``any`` and then switches on Go types: ``getHashAsUint64`` accepts only ``uint64``,
``int64`` and ``[]byte``, and ``DecodeInterface`` types a positive fixint ``int8``, ``0xcc``
``uint8``, ``0xce`` ``uint32`` and so on, by the width the encoder chose. Python's decoders drop
that width, so :mod:`kvbm_plugin.routers.llmd_model` decodes with this one. Test-only; pure Python.
"""

from __future__ import annotations

import struct
from typing import Any


class GoInt(int):
    """An integer with the Go type ``DecodeInterface`` gives it (``int8`` .. ``uint64``)."""

    go: str

    def __new__(cls, value: int, go: str) -> GoInt:
        obj = super().__new__(cls, value)
        obj.go = go
        return obj


class GoDecodeError(ValueError):
    """What llm-d's decoder or adapter would reject (the whole batch is then dropped)."""


_FIXED = {0xCC: (">B", "uint8"), 0xCD: (">H", "uint16"), 0xCE: (">I", "uint32"),
          0xCF: (">Q", "uint64"), 0xD0: (">b", "int8"), 0xD1: (">h", "int16"),
          0xD2: (">i", "int32"), 0xD3: (">q", "int64"), 0xCA: (">f", "float32"),
          0xCB: (">d", "float64")}


def go_decode(data: bytes) -> Any:
    """One msgpack value as llm-d's decoder sees it (trailing bytes are ignored, as
    ``msgpack.Unmarshal`` does)."""
    value, _ = _decode(memoryview(data), 0)
    return value


def _take(buf: memoryview, pos: int, n: int) -> tuple[bytes, int]:
    if pos + n > len(buf):
        raise GoDecodeError("msgpack: unexpected EOF")
    return bytes(buf[pos:pos + n]), pos + n


def _decode(buf: memoryview, pos: int) -> tuple[Any, int]:  # noqa: C901 - one branch a code
    code, pos = _take(buf, pos, 1)
    c = code[0]
    if c <= 0x7F or c >= 0xE0:
        return GoInt(c if c <= 0x7F else c - 256, "int8"), pos
    if 0x80 <= c <= 0x8F:
        return _map(buf, pos, c & 0x0F)
    if 0x90 <= c <= 0x9F:
        return _array(buf, pos, c & 0x0F)
    if 0xA0 <= c <= 0xBF:
        raw, pos = _take(buf, pos, c & 0x1F)
        return raw.decode("utf-8", "surrogateescape"), pos
    if c == 0xC0:
        return None, pos
    if c in (0xC2, 0xC3):
        return c == 0xC3, pos
    if c in _FIXED:
        fmt, go = _FIXED[c]
        raw, pos = _take(buf, pos, struct.calcsize(fmt))
        value = struct.unpack(fmt, raw)[0]
        return (value if go.startswith("float") else GoInt(value, go)), pos
    lengths = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4,
               0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4}
    if c not in lengths:
        raise GoDecodeError(f"msgpack: unsupported code 0x{c:02x} (ext types are not decoded)")
    raw, pos = _take(buf, pos, lengths[c])
    n = int.from_bytes(raw, "big")
    if c in (0xC4, 0xC5, 0xC6):
        return _take(buf, pos, n)
    if c in (0xD9, 0xDA, 0xDB):
        raw, pos = _take(buf, pos, n)
        return raw.decode("utf-8", "surrogateescape"), pos
    return _array(buf, pos, n) if c in (0xDC, 0xDD) else _map(buf, pos, n)


def _array(buf: memoryview, pos: int, n: int) -> tuple[list[Any], int]:
    out = []
    for _ in range(n):
        value, pos = _decode(buf, pos)
        out.append(value)
    return out, pos


def _map(buf: memoryview, pos: int, n: int) -> tuple[dict[str, Any], int]:
    out: dict[str, Any] = {}
    for _ in range(n):
        key, pos = _decode(buf, pos)
        if not isinstance(key, str):
            raise GoDecodeError(f"msgpack: map key {key!r} is not a string")
        out[key], pos = _decode(buf, pos)
    return out, pos


__all__ = ["GoDecodeError", "GoInt", "go_decode"]

"""The block-style YAML of an engine's options file, read without PyYAML.

``kvbm-plugin yaml`` writes nested mappings of plain scalars with comments; ``doctor
--llm-api-options`` and ``consolidate --llm-api-options`` must read that on a fresh install,
where PyYAML (TensorRT-LLM's dependency, not ours) may be missing. :func:`parse` reads that
subset: ``key: value`` and ``key:`` + an indented block, ``- item`` lists of scalars, ``#``
comments, scalars ``true/false`` (any case), ``null``/``~``, integers, floats and quoted or
plain strings. Anything else (flow style ``{...}``/``[...]`` except ``{}``/``[]``, anchors,
multi-line strings, tabs) raises :class:`MiniYamlError` naming the line, so the caller can
ask for PyYAML. Standard library only; any thread.
"""

from __future__ import annotations

import re
from typing import Any


class MiniYamlError(ValueError):
    """The text is outside the subset :func:`parse` reads (the message names the line)."""


_INT = re.compile(r"[-+]?(0|[1-9][0-9_]*)")
_FLOAT = re.compile(r"[-+]?([0-9][0-9_]*)?\.[0-9]+([eE][-+]?[0-9]+)?|[-+]?[0-9]+[eE][-+]?[0-9]+")


def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
    return line.rstrip()


def _scalar(text: str, lineno: int) -> Any:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text in ("{}", "[]"):
        return {} if text == "{}" else []
    if text[:1] in ("{", "[", "&", "*", "|", ">", "!", "'", '"'):
        raise MiniYamlError(f"line {lineno}: {text[:40]!r} needs a full YAML parser")
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "~", ""):
        return None
    if _INT.fullmatch(text):
        return int(text.replace("_", ""))
    if _FLOAT.fullmatch(text):
        return float(text.replace("_", ""))
    return text


def parse(text: str) -> Any:
    """The document in ``text`` (a mapping, a list or a scalar); MiniYamlError otherwise."""
    lines = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        if "\t" in raw[:len(raw) - len(raw.lstrip())]:
            raise MiniYamlError(f"line {lineno}: a tab in the indentation")
        line = _strip_comment(raw)
        if line.strip() in ("", "---"):
            continue
        lines.append((len(line) - len(line.lstrip()), line.strip(), lineno))
    if not lines:
        return None
    value, end = _block(lines, 0, lines[0][0])
    if end != len(lines):
        raise MiniYamlError(f"line {lines[end][2]}: unexpected indentation")
    return value


def _block(lines: list[tuple[int, str, int]], i: int, indent: int) -> tuple[Any, int]:
    if lines[i][1].startswith("- ") or lines[i][1] == "-":
        out: list[Any] = []
        while i < len(lines) and lines[i][0] == indent and lines[i][1][:1] == "-":
            item = lines[i][1][1:].strip()
            if not item or ":" in item and item[:1] not in "'\"":
                raise MiniYamlError(f"line {lines[i][2]}: only lists of scalars are read")
            out.append(_scalar(item, lines[i][2]))
            i += 1
        return out, i
    mapping: dict[str, Any] = {}
    while i < len(lines) and lines[i][0] == indent:
        _, content, lineno = lines[i]
        key, sep, rest = content.partition(":")
        if not sep or not key or (rest and rest[0] != " "):
            raise MiniYamlError(f"line {lineno}: expected 'key: value', got {content[:40]!r}")
        key = str(_scalar(key, lineno))
        i += 1
        if rest.strip():
            mapping[key] = _scalar(rest, lineno)
        elif i < len(lines) and lines[i][0] > indent:
            mapping[key], i = _block(lines, i, lines[i][0])
        else:
            mapping[key] = None
    if i < len(lines) and lines[i][0] > indent:
        raise MiniYamlError(f"line {lines[i][2]}: unexpected indentation")
    return mapping, i

"""Matching a call's structure against a buffer that may end early: every tool parser reads its
tags with these, so that text that may still become a tag is held back, never decided early."""
from __future__ import annotations

from dataclasses import dataclass

WS = object()          # zero or more whitespace characters
FULL, PARTIAL, FAIL = "full", "partial", "fail"
MAX_NAME = 256         # a function or parameter name longer than this is not one


@dataclass(frozen=True)
class Name:
    """A function/parameter name up to ``close``; with ``known``, only those names match."""
    close: str
    known: frozenset[str] | None = None


def match(buf: str, pos: int, parts: tuple) -> tuple[str, int, list[str]]:
    """Match ``parts`` (literals, ``WS``, ``Name``) at ``buf[pos:]``: full (with the end and the
    names read), partial (the buffer ended while it could still match) or fail."""
    names: list[str] = []
    p = pos
    for part in parts:
        if part is WS:
            while p < len(buf) and buf[p].isspace():
                p += 1
        elif isinstance(part, str):
            if buf.startswith(part, p):
                p += len(part)
            elif part.startswith(buf[p:]):
                return PARTIAL, p, names
            else:
                return FAIL, p, names
        else:
            q = p
            while True:
                if buf.startswith(part.close, q):
                    break
                if q == len(buf) or part.close.startswith(buf[q:]):
                    return PARTIAL, q, names
                if buf[q] in "<>\n" or q - p >= MAX_NAME:
                    return FAIL, q, names
                q += 1
            name = buf[p:q].strip()
            if not name or (part.known is not None and name not in part.known):
                return FAIL, q, names
            names.append(name)
            p = q + len(part.close)
    if p == len(buf) and parts and parts[-1] is WS:
        return PARTIAL, p, names
    return FULL, p, names


def match_any(buf: str, pos: int, alternatives: tuple[tuple, ...]) -> tuple[str, int, int, list[str]]:
    """The first alternative that matches fully, else partial if any may still match, else fail;
    returns (status, which alternative, end, names)."""
    partial = False
    for i, parts in enumerate(alternatives):
        status, end, names = match(buf, pos, parts)
        if status == FULL:
            return FULL, i, end, names
        partial |= status == PARTIAL
    return (PARTIAL if partial else FAIL), -1, pos, []


def held(buf: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of ``buf`` that is the start of one of ``tags``."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(buf)), best, -1):
            if buf.endswith(tag[:n]):
                best = n
                break
    return best

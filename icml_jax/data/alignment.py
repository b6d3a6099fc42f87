"""Token-level lexical alignment of two tokenizations of the same text (VocAgnoLM, Shin et al., ICML
2025; ``docs/methods/vocagnolm.md``). Host-side numpy, for the data pipeline.

Student token i covers characters [a_i, b_i), teacher token j covers [c_j, d_j), both sorted and
non-overlapping. Student token i maps to the teacher tokens whose spans overlap it,
{j : c_j < b_i and d_j > a_i}, which is the contiguous range [start_i, end_i] with
start_i = searchsorted(d, a_i, "right") and end_i = searchsorted(c, b_i, "left") - 1; it is mapped
when that range is not empty. A zero-width student token (a special token such as BOS) is never
mapped. For the jitted loss, ``windows`` turns the ranges into fixed-width index windows.
"""
from __future__ import annotations

import numpy as np


def align(student_spans, teacher_spans):
    """(start [N], end [N] inclusive, mapped [N] bool) for spans [N, 2] and [M, 2] (characters)."""
    s = np.asarray(student_spans, np.int64).reshape(-1, 2)
    t = np.asarray(teacher_spans, np.int64).reshape(-1, 2)
    a, b = s[:, 0], s[:, 1]
    c, d = t[:, 0], t[:, 1]
    if (np.diff(c) < 0).any() or (np.diff(d) < 0).any():
        raise ValueError("teacher spans must be sorted by position")
    start = np.searchsorted(d, a, side="right")
    end = np.searchsorted(c, b, side="left") - 1
    mapped = (start <= end) & (b > a)
    return start.astype(np.int32), end.astype(np.int32), mapped


def char_of_byte(text: str) -> np.ndarray:
    """[num_utf8_bytes + 1] int64: the index of the character each UTF-8 byte of ``text`` belongs
    to, and len(text) for the end offset (a byte that is not a continuation byte starts a character)."""
    b = np.frombuffer(text.encode("utf-8"), np.uint8)
    return np.append(np.cumsum((b & 0xC0) != 0x80) - 1, len(text)).astype(np.int64)


def byte_char_spans(text: str) -> np.ndarray:
    """Character spans [num_utf8_bytes, 2] of byte-level tokens: every byte of a multi-byte
    character covers that whole character."""
    c = char_of_byte(text)[:-1]
    return np.stack([c, c + 1], 1)


def windows(start, end, mapped, span_pad: int):
    """Fixed-width windows for a jitted gather: (index [N, span_pad] int32, valid [N, span_pad]
    bool, truncated share of the mapped tokens whose range is longer than ``span_pad``)."""
    start, end, mapped = np.asarray(start), np.asarray(end), np.asarray(mapped, bool)
    idx = start[..., None] + np.arange(span_pad)
    valid = (idx <= end[..., None]) & mapped[..., None]
    long = mapped & (end - start + 1 > span_pad)
    return idx.astype(np.int32), valid, float(long.sum() / max(mapped.sum(), 1))

"""Preference data: read TRL-style JSONL pairs, tokenise them, and batch them with grain.

Axis letters: N examples (pairs or single sequences), B rows per process
(``global_batch_size // process_count``), T ``seq_len``; the pair axis has size 2
(index 0 = chosen, 1 = rejected).

File format (huggingface TRL's "standard" preference format, one JSON object per line):
  explicit prompt  ``{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}``
  implicit prompt  ``{"chosen": "The sky is blue.", "rejected": "The sky is green."}`` -- the
                   prompt is extracted from the shared beginning (``extract_implicit_prompt``).
Other scalar fields (e.g. numeric ``score_chosen`` / ``score_rejected``) are kept as they are;
non-scalar extra fields are dropped. Conversational rows (lists of ``{"role", "content"}``
messages) need a chat template and are not supported: render them to strings first.

Sequence layout. A (prompt, response) pair becomes one sequence
``[bos] + encode(prompt) + encode(response) + [eos]`` (eos only if ``add_eos``), right-padded with
``pad_id`` to T. Prompt and response are encoded separately and concatenated, so the response's
tokens never merge with the prompt's. Truncation, in this order:
  1. ``max_prompt_len > 0``: the prompt keeps its last ``max_prompt_len`` tokens;
  2. a sequence longer than T: the prompt is cut from the left (bos stays) but keeps >= 1 token
     (if it had any); in a pair both sequences keep the same prompt, cut for the longer response;
  3. still too long: the response is cut from the right (its eos goes first) and keeps >= 1 token.
``seq_len < 3`` cannot fit bos + 1 prompt token + 1 response token and is refused.

Encoded arrays (numpy int32; single sequences are [N, T], pairs [N, 2, T]):
  inputs         the token sequence the model reads; pad_id in padding.
  segment_ids    1 on real tokens, 0 on padding.
  positions      0 .. len-1 on real tokens, 0 on padding.
  response_mask  1 on the response tokens (including the appended eos), 0 on bos, prompt, padding.
  lengths        [N] (pairs [N, 2]) number of real tokens.
  scores         pairs only, float32 [N, 2] (score_chosen, score_rejected), when every row has both.

Alignment convention: per-token log-probs are aligned with ``inputs``:
``logp[..., t] = log p(inputs[..., t] | inputs[..., :t])`` for t >= 1 (logp[..., 0] is unused), so
``sum(logp * response_mask, -1)`` is the response's log-likelihood -- bos is never in the mask, so
t = 0 never counts. A reward model reads its score at index ``lengths - 1`` (the last real token:
eos with ``add_eos``, else the response's last token).

Batches (``pair_train_iterator`` / ``eval_batches``): dicts of numpy arrays with a leading axis B,
every encoded key plus ``weight`` float32 [B] (1.0 for real examples, 0.0 for eval padding rows).
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from icml_jax.atomic import write_atomic
from icml_jax.data.pipeline import _process_slice

PAIR_KEYS = ("inputs", "segment_ids", "positions", "response_mask", "lengths")
SCORE_FIELDS = ("score_chosen", "score_rejected")
_SCALARS = (str, int, float, bool, type(None))


class PreferenceDataError(ValueError):
    """A malformed preference file or row; the message names ``path:line``, field and fix."""


# ----------------------------------------------------------------------------------------- reading


def extract_implicit_prompt(chosen: str, rejected: str) -> tuple[str, str, str]:
    """Splits two full texts into (prompt, chosen response, rejected response).

    The prompt is the longest common prefix of the two texts, cut back to the last whitespace
    character inside it; that whitespace character and everything after it belong to the
    responses, so both responses start at a word boundary and are non-empty:
    ``("The sky is blue.", "The sky is green.") -> ("The sky is", " blue.", " green.")`` and
    ``("The sky is blue", "The sky isn't") -> ("The sky", " is blue", " isn't")``. Without
    whitespace in the common prefix the prompt is ``""``.

    TRL's ``extract_prompt`` (strings) agrees on the common case (the texts first differ just
    after a space, which moves to the responses) but otherwise splits at the first differing
    character, even inside a word (``"... bl" + "ue"`` vs ``"... bl" + "ack"``), and leaves an empty
    response when one text is a prefix of the other; we cut back to whitespace instead.
    """
    k = 0
    for a, b in zip(chosen, rejected):
        if a != b:
            break
        k += 1
    j = k - 1
    while j >= 0 and not chosen[j].isspace():
        j -= 1
    j = max(j, 0)
    return chosen[:j], chosen[j:], rejected[j:]


def _describe(value: Any) -> str:
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return "null" if value is None else type(value).__name__


def _check_row(row: Any, where: str) -> dict[str, Any]:
    """Validates one parsed JSON value; returns the normalised row."""
    if not isinstance(row, dict):
        raise PreferenceDataError(
            f"{where}: expected a JSON object with fields 'chosen' and 'rejected' (and optionally "
            f"'prompt'), got {_describe(row)}; write one object per line.")
    for field in ("chosen", "rejected"):
        if field not in row:
            hint = (" This looks like TRL's unpaired format (prompt/completion/label), which is "
                    "not supported; pair a preferred and a dispreferred completion per row."
                    if "completion" in row else "")
            raise PreferenceDataError(
                f"{where}: missing field {field!r} (fields: {sorted(row)}); every row needs "
                f"string fields 'chosen' and 'rejected'.{hint}")
    for field in ("prompt", "chosen", "rejected"):
        if field not in row:
            continue
        value = row[field]
        if isinstance(value, list) or (isinstance(value, dict) and "content" in value):
            raise PreferenceDataError(
                f"{where}: field {field!r} is conversational (a list of messages); that needs a "
                "chat template, which is not supported here. Render the conversation to a string "
                "first (e.g. with the tokenizer's chat template) and store the text.")
        if not isinstance(value, str):
            raise PreferenceDataError(
                f"{where}: field {field!r} must be a string, got {_describe(value)}; store the "
                "text as a JSON string.")
    for field in SCORE_FIELDS:
        if field in row:
            v = row[field]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise PreferenceDataError(
                    f"{where}: field {field!r} must be a finite number, got {v!r}; drop the "
                    "field or store the score as a JSON number.")
    if row["chosen"] == row["rejected"]:
        raise PreferenceDataError(
            f"{where}: fields 'chosen' and 'rejected' are identical, so the pair carries no "
            "preference; remove the row or fix one of the two responses.")
    if "prompt" in row:
        prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
    else:
        prompt, chosen, rejected = extract_implicit_prompt(row["chosen"], row["rejected"])
    for field, value in (("chosen", chosen), ("rejected", rejected)):
        if not value:
            raise PreferenceDataError(
                f"{where}: field {field!r} is an empty response; every response needs at least "
                "one character (remove the row or fill in the response).")
    out = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    out.update({k: v for k, v in row.items() if k not in out and isinstance(v, _SCALARS)})
    return out


def read_preference_jsonl(path: str) -> list[dict[str, Any]]:
    """Reads a preference JSONL file (formats in the module docstring).

    Returns:
      one dict per non-blank line, ``{"prompt": str, "chosen": str, "rejected": str, ...}`` where
      ``...`` are the row's other scalar fields, unchanged.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      PreferenceDataError: a malformed row (message: ``path:line: field: what is wrong; fix``),
        a directory instead of a file, or a file without rows.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"preference file {path!r} does not exist; point the config at a "
                                "JSONL file with one {prompt, chosen, rejected} object per line.")
    if not os.path.isfile(path):
        raise PreferenceDataError(f"preference file {path!r} is a directory; point the config at "
                                  "a .jsonl file.")
    rows = _read_rows(path, _check_row)
    if not rows:
        raise PreferenceDataError(f"{path}: no preference rows (the file is empty or only blank "
                                  "lines); write one {prompt, chosen, rejected} object per line.")
    return rows


def _read_rows(path: str, check) -> list[dict[str, Any]]:
    """``check(parsed JSON value, "path:line")`` for every non-blank line of a JSONL file."""
    rows = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise PreferenceDataError(f"{where}: not valid UTF-8 (byte {e.start}); save the "
                                          "file as UTF-8.") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PreferenceDataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); "
                                          "each line must be one JSON object.") from None
            rows.append(check(row, where))
    return rows


def _require_fields(row: Any, where: str, fields: tuple, need: str) -> None:
    """A JSON object with every one of ``fields``, else an error at ``where`` saying ``need``."""
    if not isinstance(row, dict):
        raise PreferenceDataError(f"{where}: expected a JSON object with fields "
                                  f"{', '.join(map(repr, fields))}, got {_describe(row)}.")
    for field in fields:
        if field not in row:
            raise PreferenceDataError(f"{where}: missing field {field!r} (fields: {sorted(row)}); "
                                      f"every row needs {need}.")


def _read_file(path: str, check, what: str, fields: tuple) -> list[dict[str, Any]]:
    """The checked rows of the JSONL file ``path`` (a ``what`` file of ``fields`` objects)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} file {path!r} does not exist (or is a folder); point the "
                                f"config at a JSONL file of {{{', '.join(fields)}}} objects.")
    rows = _read_rows(path, check)
    if not rows:
        raise PreferenceDataError(f"{path}: no rows (the file is empty or only blank lines).")
    return rows


def _check_unpaired(row: Any, where: str) -> dict[str, Any]:
    _require_fields(row, where, ("prompt", "completion", "label"),
                    "'prompt' and 'completion' strings and a boolean (or 0/1) 'label'")
    label = row["label"]
    if not (isinstance(label, bool) or (isinstance(label, int) and label in (0, 1))):
        raise PreferenceDataError(f"{where}: field 'label' must be true/false (or 1/0), got "
                                  f"{label!r}.")
    return _check_completion({**row, "label": bool(label)}, where)


def read_unpaired_jsonl(path: str) -> list[dict[str, Any]]:
    """Reads TRL's unpaired preference format (KTO-style): one ``{"prompt": str, "completion": str,
    "label": bool}`` object per line (label = the completion is desirable / correct); other
    scalar fields are kept. Errors as ``read_preference_jsonl``'s (``path:line: ...``)."""
    return _read_file(path, _check_unpaired, "labelled-completion", ("prompt", "completion", "label"))


def _check_completion(row: Any, where: str) -> dict[str, Any]:
    """A prompt-completion row (other scalar fields kept, a ``label`` first when present)."""
    _require_fields(row, where, ("prompt", "completion"), "'prompt' and 'completion' strings")
    for field in ("prompt", "completion"):
        if not isinstance(row[field], str):
            raise PreferenceDataError(f"{where}: field {field!r} must be a string, got "
                                      f"{_describe(row[field])}; store the text as a JSON string.")
    if not row["completion"]:
        raise PreferenceDataError(f"{where}: field 'completion' is empty; every completion needs "
                                  "at least one character.")
    out = {"prompt": row["prompt"], "completion": row["completion"]}
    if "label" in row:
        out["label"] = row["label"]
    out.update({k: v for k, v in row.items() if k not in out and isinstance(v, _SCALARS)})
    return out


def read_completion_jsonl(path: str) -> list[dict[str, Any]]:
    """Reads TRL's prompt-completion (SFT) format: one ``{"prompt": str, "completion": str}``
    object per line; other scalar fields (e.g. a ``domain`` tag) are kept. Errors as
    ``read_preference_jsonl``'s (``path:line: ...``)."""
    return _read_file(path, _check_completion, "prompt-completion", ("prompt", "completion"))


def _check_stepwise(row: Any, where: str) -> dict[str, Any]:
    _require_fields(row, where, ("prompt", "completions", "labels"),
                    "a 'prompt' string, a list of step strings 'completions' and one boolean per "
                    "step in 'labels' (TRL's stepwise-supervision format)")
    if not isinstance(row["prompt"], str):
        raise PreferenceDataError(f"{where}: field 'prompt' must be a string, got "
                                  f"{_describe(row['prompt'])}.")
    steps, labels = row["completions"], row["labels"]
    if not isinstance(steps, list) or not steps or not all(isinstance(s, str) and s for s in steps):
        raise PreferenceDataError(f"{where}: field 'completions' must be a non-empty list of "
                                  f"non-empty strings (the steps), got {_describe(steps)}.")
    if not isinstance(labels, list) or len(labels) != len(steps) or not all(
            isinstance(x, bool) or (isinstance(x, int) and x in (0, 1)) for x in labels):
        raise PreferenceDataError(f"{where}: field 'labels' must hold one true/false (or 1/0) per "
                                  f"step ({len(steps)} steps), got {_describe(labels)}.")
    return {"prompt": row["prompt"], "completions": list(steps), "labels": [bool(x) for x in labels]}


def read_stepwise_jsonl(path: str) -> list[dict[str, Any]]:
    """Reads TRL's stepwise-supervision format: one ``{"prompt": str, "completions": [str, ...],
    "labels": [bool, ...]}`` object per line (one label per step: the step is correct). Errors as
    ``read_preference_jsonl``'s (``path:line: ...``)."""
    return _read_file(path, _check_stepwise, "step-labelled", ("prompt", "completions", "labels"))


def encode_steps(rows: Sequence[Mapping[str, Any]], tokenizer: Any, seq_len: int, *,
                 max_steps: int, max_prompt_len: int = 0,
                 separator: str = "\n") -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Stepwise rows -> padded arrays, as TRL's PRMTrainer tokenises them: ``[bos] + prompt +
    (step_1 + separator) + (step_2 + separator) + ...``, each step's label on the LAST token of
    its ``step + separator``. The prompt keeps its last tokens: at most ``max_prompt_len`` (0 = no
    limit) and few enough for the first step to fit (at least one). Steps that do not fit in
    ``seq_len`` whole are dropped (with their labels), and so are steps beyond ``max_steps``.

    Returns (arrays, stats): ``inputs``, ``segment_ids``, ``positions``, ``response_mask`` (the step
    tokens) int32 [N, T], ``lengths`` int32 [N], ``step_end`` int32 [N, K] (the labelled slots),
    ``step_mask`` int32 [N, K], ``step_label`` float32 [N, K] (K = ``max_steps``); stats ``{"n",
    "truncated_prompt", "dropped_steps", "rows_with_dropped_steps"}``."""
    _check_encode_args(seq_len, max_prompt_len)
    if not isinstance(max_steps, (int, np.integer)) or max_steps < 1:
        raise ValueError(f"max_steps={max_steps!r} (config.steps.max_steps) must be an integer >= 1")
    N, K = len(rows), int(max_steps)
    out = _empty((N, seq_len), tokenizer.pad_id)
    del out["lengths"]
    out.update(lengths=np.zeros(N, np.int32), step_end=np.zeros((N, K), np.int32),
               step_mask=np.zeros((N, K), np.int32), step_label=np.zeros((N, K), np.float32))
    stats = {"n": N, "truncated_prompt": 0, "dropped_steps": 0, "rows_with_dropped_steps": 0}
    for i, row in enumerate(rows):
        prompt = list(tokenizer.encode(row["prompt"]))
        steps = [list(tokenizer.encode(s + separator)) for s in row["completions"]]
        # the prompt keeps its last tokens: max_prompt_len, and room for the first step (>= 1 kept)
        keep = max(min(len(prompt), 1), seq_len - 1 - len(steps[0]))
        if max_prompt_len:
            keep = min(keep, max_prompt_len)
        if keep < len(prompt):
            prompt, stats["truncated_prompt"] = prompt[len(prompt) - keep:], stats["truncated_prompt"] + 1
        ids, k = [tokenizer.bos_id] + prompt, 0
        for step_ids, label in zip(steps, row["labels"]):
            if k == K or len(ids) + len(step_ids) > seq_len:
                break
            ids += step_ids
            out["step_end"][i, k], out["step_mask"][i, k] = len(ids) - 1, 1
            out["step_label"][i, k] = float(label)
            k += 1
        stats["dropped_steps"] += len(row["completions"]) - k
        stats["rows_with_dropped_steps"] += k < len(row["completions"])
        n = len(ids)
        out["inputs"][i, :n] = ids
        out["segment_ids"][i, :n] = 1
        out["positions"][i, :n] = np.arange(n)
        out["response_mask"][i, 1 + len(prompt):n] = 1
        out["lengths"][i] = n
    return out, stats


def _json_value(v: Any) -> Any:
    return v.item() if isinstance(v, np.generic) else v


def write_preference_jsonl(path: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """Writes rows in the explicit-prompt form, atomically (temp file + ``os.replace``).

    Each row needs string ``prompt``, ``chosen`` and ``rejected``; its other fields are written
    after them (numpy scalars as plain numbers). ``read_preference_jsonl`` reads the file back to
    the same rows (non-scalar extra fields aside, which the reader drops).
    """
    _write_rows(path, rows, {"prompt": str, "chosen": str, "rejected": str})


def write_unpaired_jsonl(path: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """Writes ``{"prompt", "completion", "label"}`` rows atomically; ``read_unpaired_jsonl`` reads
    them back."""
    _write_rows(path, [{**r, "label": bool(r["label"])} if "label" in r else r for r in rows],
                {"prompt": str, "completion": str, "label": bool})


def write_stepwise_jsonl(path: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """Writes TRL's stepwise rows ``{"prompt", "completions": [steps], "labels": [bools]}``
    atomically, each checked by the rules ``read_stepwise_jsonl`` applies (errors name the row)."""
    checked = [_check_stepwise(r, f"{path}: row {i}") for i, r in enumerate(rows)]
    _write_rows(path, checked, {"prompt": str, "completions": list, "labels": list})


def _write_rows(path: str, rows: Sequence[Mapping[str, Any]], fields: Mapping[str, type]) -> None:
    lines = []
    for i, row in enumerate(rows):
        for field, kind in fields.items():
            if not isinstance(row.get(field), kind):
                raise PreferenceDataError(
                    f"{path}: row {i}: field {field!r} must be a "
                    f"{ {str: 'string', bool: 'boolean', list: 'list'}[kind]}, got "
                    f"{_describe(row.get(field))}; every written row needs {sorted(fields)}.")
        out = {k: row[k] for k in fields}
        out.update({k: _json_value(v) for k, v in row.items() if k not in out})
        lines.append(json.dumps(out, ensure_ascii=False) + "\n")
    write_atomic(path, lambda f: f.writelines(lines), fsync=True)


# ---------------------------------------------------------------------------------------- encoding


def _check_encode_args(seq_len: int, max_prompt_len: int) -> None:
    if not isinstance(seq_len, (int, np.integer)) or seq_len < 3:
        raise ValueError(
            f"seq_len={seq_len!r} (config.data.seq_len) is too short for a preference sequence: "
            "it needs >= 3 tokens (bos, >= 1 prompt token, >= 1 response token).")
    if not isinstance(max_prompt_len, (int, np.integer)) or max_prompt_len < 0:
        raise ValueError(f"max_prompt_len={max_prompt_len!r} must be an integer >= 0 (0 = no "
                         "prompt limit).")


def _fit(prompt: list[int], responses: list[list[int]], seq_len: int,
         max_prompt_len: int) -> tuple[list[int], list[list[int]], bool, list[bool]]:
    """Truncates one shared prompt and its responses to fit ``seq_len`` (rules in the docstring)."""
    prompt_cut = False
    if max_prompt_len and len(prompt) > max_prompt_len:
        prompt, prompt_cut = prompt[len(prompt) - max_prompt_len:], True
    room = seq_len - 1 - max(len(r) for r in responses)
    keep = max(min(len(prompt), 1), room)
    if keep < len(prompt):
        prompt, prompt_cut = prompt[len(prompt) - keep:], True
    budget = seq_len - 1 - len(prompt)  # >= 1 because seq_len >= 3 and len(prompt) <= 1 here
    return prompt, [r[:budget] for r in responses], prompt_cut, [len(r) > budget for r in responses]


def _fill(out: dict[str, np.ndarray], idx: tuple, bos: int, prompt: list[int],
          response: list[int]) -> None:
    n_p, n = len(prompt), 1 + len(prompt) + len(response)
    out["inputs"][idx + (slice(0, n),)] = [bos] + prompt + response
    out["segment_ids"][idx + (slice(0, n),)] = 1
    out["positions"][idx + (slice(0, n),)] = np.arange(n)
    out["response_mask"][idx + (slice(1 + n_p, n),)] = 1
    out["lengths"][idx] = n


def _empty(shape: tuple[int, ...], pad_id: int) -> dict[str, np.ndarray]:
    out = {k: np.zeros(shape, np.int32) for k in PAIR_KEYS if k != "lengths"}
    out["inputs"][...] = pad_id
    out["lengths"] = np.zeros(shape[:-1], np.int32)
    return out


def _response_ids(tokenizer: Any, text: str, add_eos: bool, what: str) -> list[int]:
    ids = list(tokenizer.encode(text)) + ([tokenizer.eos_id] if add_eos else [])
    if not ids:
        raise ValueError(f"{what} encodes to no tokens (empty response and add_eos=False); a "
                         "response needs >= 1 token to be scored.")
    return ids


def encode_responses(prompts: Sequence[str], responses: Sequence[str], tokenizer: Any,
                     seq_len: int, *, max_prompt_len: int = 0,
                     add_eos: bool = True) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Encodes (prompt, response) pairs as single sequences (layout in the module docstring).

    Args:
      prompts, responses: N strings each.
      tokenizer: from ``build_tokenizer`` (``encode``, ``bos_id``, ``eos_id``, ``pad_id``).
      seq_len: T (>= 3).
      max_prompt_len: > 0 keeps only the prompt's last ``max_prompt_len`` tokens.
      add_eos: append ``eos_id`` to every response (part of the response mask).

    Returns:
      (arrays, stats): ``inputs``, ``segment_ids``, ``positions``, ``response_mask`` int32 [N, T]
      and ``lengths`` int32 [N]; stats ``{"n": N, "truncated_prompt": k, "truncated_response": m}``
      counting the sequences whose prompt / response was cut.
    """
    _check_encode_args(seq_len, max_prompt_len)
    if len(prompts) != len(responses):
        raise ValueError(f"encode_responses got {len(prompts)} prompts but {len(responses)} "
                         "responses; pass one prompt per response.")
    if not prompts:
        raise ValueError("encode_responses got no examples.")
    out = _empty((len(prompts), seq_len), tokenizer.pad_id)
    stats = {"n": len(prompts), "truncated_prompt": 0, "truncated_response": 0}
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        p, (r,), p_cut, (r_cut,) = _fit(
            list(tokenizer.encode(prompt)),
            [_response_ids(tokenizer, response, add_eos, f"response {i}")], seq_len, max_prompt_len)
        _fill(out, (i,), tokenizer.bos_id, p, r)
        stats["truncated_prompt"] += p_cut
        stats["truncated_response"] += r_cut
    return out, stats


def encode_pairs(rows: Sequence[Mapping[str, Any]], tokenizer: Any, seq_len: int, *,
                 max_prompt_len: int = 0,
                 add_eos: bool = True) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Encodes preference rows as (chosen, rejected) sequence pairs sharing one prompt.

    Args:
      rows: N dicts with string ``prompt``, ``chosen``, ``rejected`` (``read_preference_jsonl``).
      tokenizer, seq_len, max_prompt_len, add_eos: as in ``encode_responses``. The prompt is cut
        once per pair (for the longer response) so chosen and rejected see the same context.

    Returns:
      (arrays, stats): ``inputs``, ``segment_ids``, ``positions``, ``response_mask`` int32
      [N, 2, T], ``lengths`` int32 [N, 2] (index 0 = chosen, 1 = rejected), plus ``scores`` float32
      [N, 2] when every row has numeric ``score_chosen`` and ``score_rejected``. stats:
      ``{"n": N, "truncated_prompt": pairs whose prompt was cut, "truncated_response": pairs with a
      cut response, "truncated_chosen": ..., "truncated_rejected": ...}``.
    """
    _check_encode_args(seq_len, max_prompt_len)
    if not rows:
        raise ValueError("encode_pairs got no rows.")
    out = _empty((len(rows), 2, seq_len), tokenizer.pad_id)
    stats = {"n": len(rows), "truncated_prompt": 0, "truncated_response": 0,
             "truncated_chosen": 0, "truncated_rejected": 0}
    for i, row in enumerate(rows):
        for field in ("prompt", "chosen", "rejected"):
            if not isinstance(row.get(field), str):
                raise PreferenceDataError(f"row {i}: field {field!r} must be a string, got "
                                          f"{_describe(row.get(field))}; read rows with "
                                          "read_preference_jsonl.")
        responses = [_response_ids(tokenizer, row[f], add_eos, f"row {i} field {f!r}")
                     for f in ("chosen", "rejected")]
        p, rs, p_cut, r_cuts = _fit(list(tokenizer.encode(row["prompt"])), responses, seq_len,
                                    max_prompt_len)
        for j, r in enumerate(rs):
            _fill(out, (i, j), tokenizer.bos_id, p, r)
        stats["truncated_prompt"] += p_cut
        stats["truncated_response"] += any(r_cuts)
        stats["truncated_chosen"] += r_cuts[0]
        stats["truncated_rejected"] += r_cuts[1]
    if all(isinstance(row.get(f), (int, float, np.number)) and not isinstance(row.get(f), bool)
           for row in rows for f in SCORE_FIELDS):
        out["scores"] = np.array([[row[f] for f in SCORE_FIELDS] for row in rows], np.float32)
    return out, stats


# ---------------------------------------------------------------------------------------- batching


def _num_rows(arrays: Mapping[str, np.ndarray]) -> int:
    if not arrays:
        raise ValueError("got an empty dict of arrays; pass the output of encode_pairs / "
                         "encode_responses.")
    sizes = {k: np.shape(v)[0] if np.ndim(v) else None for k, v in arrays.items()}
    if len(set(sizes.values())) != 1 or None in sizes.values() or not next(iter(sizes.values())):
        raise ValueError(
            f"arrays must share a non-empty leading axis N, got leading sizes {sizes}.")
    return next(iter(sizes.values()))


class _RowSource:
    """Random-access source: element i is ``{key: array[i]}``."""

    def __init__(self, arrays: Mapping[str, np.ndarray]):
        self._n = _num_rows(arrays)
        self._arrays = {k: np.asarray(v) for k, v in arrays.items()}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {k: v[i] for k, v in self._arrays.items()}

    def __repr__(self) -> str:
        return f"_RowSource(n={self._n}, keys={sorted(self._arrays)})"


class _SliceAndWeigh(grain.transforms.Map):
    """Keeps this process's rows [start, start + size) of a global batch and adds ``weight``."""

    def __init__(self, start: int, size: int):
        self.start, self.size = start, size

    def map(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {k: v[self.start:self.start + self.size] for k, v in batch.items()}
        out["weight"] = np.ones((self.size,), np.float32)
        return out


def pair_train_iterator(arrays: Mapping[str, np.ndarray], global_batch_size: int, seed: int, *,
                        process_index: int | None = None,
                        process_count: int | None = None) -> grain.DatasetIterator:
    """Endless, shuffled training batches of the rows of ``arrays``.

    Epoch e is a permutation of the N rows seeded by (seed, e); epochs are concatenated and cut
    into global batches of ``global_batch_size`` rows (a batch may straddle two epochs; no row is
    dropped). Every process builds the same global batch and keeps rows ``[p * B, (p + 1) * B)``.

    Args:
      arrays: dict of arrays with a common leading axis N (``encode_pairs`` / ``encode_responses``).
      global_batch_size: rows across all processes; must divide by process_count.
      seed: shuffling seed; equal seeds give identical batches.
      process_index, process_count: default to ``jax.process_index() / process_count()``.

    Returns:
      a grain ``DatasetIterator`` (``get_state()`` / ``set_state()``; save it with
      ``grain.checkpoint.CheckpointSave``) of dicts: every key of ``arrays`` with shape
      [B, *array.shape[1:]] and its dtype, plus ``weight`` float32 [B] of ones.
    """
    start, size = _process_slice(global_batch_size, process_index, process_count)
    ds = grain.MapDataset.source(_RowSource(arrays)).shuffle(seed=int(seed)).repeat(None)
    ds = ds.batch(global_batch_size, drop_remainder=True).map(_SliceAndWeigh(start, size))
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))


class SubsetIterator:
    """Endless shuffled global batches of the rows of ``arrays`` restricted to a selection (all
    rows until ``select`` is called): EVIC's sampler (``icml_jax/train/evic.py``).

    Selection round r draws epochs e = 0, 1, ... each a permutation of the selected rows seeded by
    (seed, r, e), concatenated and cut into global batches of ``global_batch_size`` rows (a batch
    may straddle two epochs); every process keeps rows ``[p * B, (p + 1) * B)`` as in
    ``pair_train_iterator``. ``get_state`` is JSON (round, rows drawn in it, the selection as
    hex-packed bits), so a checkpoint resumes mid-round exactly. Batches: every key of ``arrays``
    as [B, ...] plus ``weight`` float32 [B] of ones."""

    def __init__(self, arrays: Mapping[str, np.ndarray], global_batch_size: int, seed: int, *,
                 process_index: int | None = None, process_count: int | None = None):
        self.start, self.size = _process_slice(global_batch_size, process_index, process_count)
        self.n = _num_rows(arrays)
        self.arrays = {k: np.asarray(v) for k, v in arrays.items()}
        self.batch, self.seed = int(global_batch_size), int(seed)
        self._set(np.ones(self.n, bool), 0, 0)

    def _set(self, mask: np.ndarray, round_id: int, drawn: int) -> None:
        self.mask, self.round, self.drawn = mask, int(round_id), int(drawn)
        self._rows, self._epoch, self._order = np.flatnonzero(mask), -1, None

    @property
    def selection(self) -> np.ndarray:
        return self.mask.copy()

    def select(self, mask, round_id: int) -> None:
        """Draws from the rows where ``mask`` (bool [N], >= 1 set) holds, starting round
        ``round_id`` (its own shuffles) at its first row."""
        mask = np.asarray(mask, bool)
        if mask.shape != (self.n,) or not mask.any():
            raise ValueError(f"a selection must be a bool [{self.n}] mask with at least one row "
                             f"set, got shape {mask.shape} with {int(mask.sum())} set")
        self._set(mask.copy(), round_id, 0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, self.round, epoch])
            self._order, self._epoch = self._rows[rng.permutation(len(self._rows))], epoch
        return self._order

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        m = len(self._rows)
        k = self.drawn + np.arange(self.batch)
        picks = np.empty(self.batch, np.int64)
        for epoch in np.unique(k // m):  # a batch spans one epoch, or two at a boundary
            at = k // m == epoch
            picks[at] = self._epoch_order(int(epoch))[k[at] % m]
        self.drawn += self.batch
        rows = picks[self.start:self.start + self.size]
        out = {k: v[rows] for k, v in self.arrays.items()}
        out["weight"] = np.ones((self.size,), np.float32)
        return out

    def get_state(self) -> dict:
        return {"round": self.round, "drawn": self.drawn,
                "selection": np.packbits(self.mask).tobytes().hex(), "rows": self.n}

    def set_state(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("rows") != self.n or "selection" not in state:
            raise ValueError(f"the saved data state is not a selection over {self.n} rows (it was "
                             "written for other data or another config.task); resume with the "
                             "same data file and task")
        bits = np.frombuffer(bytes.fromhex(state["selection"]), np.uint8)
        self._set(np.unpackbits(bits)[:self.n].astype(bool), state["round"], state["drawn"])


def eval_batches(arrays: Mapping[str, np.ndarray], batch_size: int, *, max_batches: int = 0,
                 process_index: int | None = None,
                 process_count: int | None = None) -> list[dict[str, np.ndarray]]:
    """The rows of ``arrays`` in order, in global batches of exactly ``batch_size`` rows.

    The last batch is completed with copies of row 0 whose ``weight`` is 0.0 (real rows have 1.0),
    so a weighted sum over all batches counts every example exactly once. ``max_batches > 0``
    keeps that many batches evenly spaced over the data (like ``pipeline.make_eval_batches``).
    Each batch is sliced per process as in ``pair_train_iterator``.

    Returns:
      a list of dicts: every key of ``arrays`` as [B, ...] plus ``weight`` float32 [B].
    """
    start, size = _process_slice(batch_size, process_index, process_count)
    n = _num_rows(arrays)
    num = -(-n // batch_size)
    order = np.concatenate([np.arange(n), np.zeros(num * batch_size - n, np.int64)])
    weight = (np.arange(num * batch_size) < n).astype(np.float32)
    keep = range(num)
    if max_batches and 0 < max_batches < num:
        keep = np.unique(np.linspace(0, num - 1, max_batches).round().astype(int))
    batches = []
    for b in keep:
        rows = slice(b * batch_size + start, b * batch_size + start + size)
        batch = {k: np.asarray(v)[order[rows]] for k, v in arrays.items()}
        batch["weight"] = weight[rows]
        batches.append(batch)
    return batches

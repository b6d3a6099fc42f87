"""Run MedXpertQA on a trained workdir or an HF model folder and write a JSON + Markdown report.

    python -m icml_jax.evaluate --checkpoint=runs/demo --text=medxpertqa_text_input.jsonl \
        --mode=letter_loglik --out=reports/demo
    python -m icml_jax.evaluate --hf=path/to/hf_folder --text=text.jsonl --mm=mm.jsonl \
        --mode=cot_extract --rationale_tokens=512 --out=reports/hf
    python -m icml_jax.evaluate --baseline=oracle --text=text.jsonl --out=reports/oracle

``--mode=cot_extract`` is the official protocol (two-turn zero-shot chain of thought at
temperature 0, then the official answer extraction); ``letter_loglik`` picks the option letter of
highest log-likelihood after the answer-only prompt (for models too small to reason).
``--baseline=oracle|random`` needs no model (the harness checks). The MM subset's images are not
given to the model (text-only decoders): its rows are reported as "MM (images ignored)".

Every input is checked before JAX is imported (the model flags, the data files row by row, the
output folder); a bad one is one line on stderr naming the file, line and field. The report is
``OUT/medxpertqa.json`` (totals, breakdowns per question type, medical task and body system, and
every prediction) and ``OUT/medxpertqa.md``, each written atomically.
"""
from __future__ import annotations

import logging as std_logging
import os
import sys

from absl import app, flags

from icml_jax import logs, xla_env
from icml_jax.atomic import write_atomic
from icml_jax.data import medxpertqa as mx
from icml_jax.sample import SampleError, load_params, read_model
from icml_jax.train import workdir as workdir_lib
from icml_jax.train.metrics import write_json

MODES = ("cot_extract", "letter_loglik")  # = analysis.medxpertqa.MODES (imported after the checks)
BASELINES = ("oracle", "random")

FLAGS = flags.FLAGS
# --checkpoint, --hf and --seed are icml_jax.sample's flags (defined when it is imported above)
flags.DEFINE_string("baseline", None, "oracle | random: answer without a model (harness checks)")
flags.DEFINE_string("text", None, "MedXpertQA Text JSONL (10 options)")
flags.DEFINE_string("mm", None, "MedXpertQA MM JSONL (5 options; images are not used)")
flags.DEFINE_string("mode", "cot_extract", "cot_extract (official) | letter_loglik (tiny models)")
flags.DEFINE_string("out", None, "report folder: medxpertqa.json and medxpertqa.md")
flags.DEFINE_integer("limit", 0, "evaluate only the first N questions of each file (0 = all)")
flags.DEFINE_integer("batch_size", 8, "rows per jitted batch")
flags.DEFINE_integer("rationale_tokens", 256, "cot_extract: tokens of the turn-1 rationale at most")
flags.DEFINE_integer("answer_tokens", 32, "cot_extract: tokens of the turn-2 answer at most")


class EvaluateError(RuntimeError):
    """A problem with the inputs, reported as one line without a traceback."""


def check_flags(f) -> None:
    """Everything about the flags that needs no file."""
    sources = [n for n in ("checkpoint", "hf", "baseline") if getattr(f, n)]
    if len(sources) != 1:
        raise EvaluateError("pass exactly one of --checkpoint=WORKDIR, --hf=PATH or "
                            "--baseline=oracle|random")
    if f.baseline and f.baseline not in BASELINES:
        raise EvaluateError(f"--baseline={f.baseline}: expected one of {list(BASELINES)}")
    if f.mode not in MODES:
        raise EvaluateError(f"--mode={f.mode}: expected one of {list(MODES)}")
    if not (f.text or f.mm):
        raise EvaluateError("pass --text=FILE and/or --mm=FILE (the MedXpertQA JSONL files)")
    if not f.out:
        raise EvaluateError("pass --out=DIR, the folder for medxpertqa.json and medxpertqa.md")
    for name in ("batch_size", "rationale_tokens", "answer_tokens"):
        if getattr(f, name) < 1:
            raise EvaluateError(f"--{name}={getattr(f, name)} must be >= 1")
    if f.limit < 0:
        raise EvaluateError(f"--limit={f.limit} must be >= 0 (0 = all)")


def load_subsets(f) -> dict[str, tuple[str, list[mx.Question]]]:
    out = {}
    for subset in ("text", "mm"):
        path = getattr(f, subset)
        if not path:
            continue
        if not os.path.isfile(path):
            raise EvaluateError(f"--{subset}={path}: no such file")
        out[subset] = (path, mx.load_jsonl(path, subset, limit=f.limit or None))
    return out


def prepare_out(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise EvaluateError(f"--out={path}: cannot create the folder ({e.strerror})") from None
    if not os.access(path, os.W_OK):
        raise EvaluateError(f"--out={path}: the folder is not writable; pass another --out")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def markdown(report: dict) -> str:
    lines = [f"# MedXpertQA: {report['model']}", "",
             f"mode `{report['mode']}`; accuracy = share of questions whose extracted letter equals "
             "the label (no answer counts as wrong); rows cut: scored or generated rows whose context "
             "lost its start to fit the model (letter_loglik: one row per option; cot_extract: two "
             "per question).", "",
             "| subset | questions | correct | accuracy | chance | no answer | rows cut |",
             "|---|---|---|---|---|---|---|"]
    for s in report["subsets"].values():
        lines.append(f"| {s['label']} | {s['n']} | {s['correct']} | {_pct(s['accuracy'])} | "
                     f"{_pct(s['chance'])} | {s['no_answer']} | {s['rows_cut']} |")
    for key in mx.BREAKDOWNS:
        lines += ["", f"## By {key.replace('_', ' ')}", "", "| subset | group | questions | accuracy |",
                  "|---|---|---|---|"]
        for s in report["subsets"].values():
            for group, c in s[f"by_{key}"].items():
                lines.append(f"| {s['label']} | {group} | {c['n']} | {_pct(c['accuracy'])} |")
    return "\n".join(lines) + "\n"


def run(f) -> dict:
    """Checks the inputs, then answers every question; returns the report written to --out."""
    check_flags(f)
    subsets = load_subsets(f)
    model_cfg = params = tok = None
    where = f"baseline: {f.baseline}"
    prepare_out(f.out)
    if not f.baseline:  # a workdir is only checked here; an HF folder is loaded (JAX)
        model_cfg, params, tok, where = read_model(f.checkpoint, f.hf)
    if not f.baseline:
        xla_env.use_compilation_cache()  # imports JAX: only once the inputs are known to be good
        if params is None:
            params, where = load_params(f.checkpoint, model_cfg)
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top

    lm = None
    if not f.baseline:
        from icml_jax.analysis import medxpertqa as answerers  # pylint: disable=g-import-not-at-top
        from icml_jax.analysis.lm_scoring import TextLM  # pylint: disable=g-import-not-at-top
        lm = TextLM(model_cfg, params, tok, batch_size=f.batch_size)
    report = {"benchmark": "MedXpertQA", "model": where,
              "mode": f.baseline and f"baseline:{f.baseline}" or f.mode,
              "settings": {k: getattr(f, k) for k in ("limit", "batch_size", "rationale_tokens",
                                                        "answer_tokens", "seed")},
              "subsets": {}, "predictions": {}}
    for subset, (path, qs) in subsets.items():
        records = [{} for _ in qs]
        before = lm.truncated if lm else 0
        if f.baseline == "oracle":
            preds = mx.oracle_answers(qs)
        elif f.baseline == "random":
            preds = mx.random_answers(qs, f.seed)
        elif f.mode == "letter_loglik":
            with tqdm(total=sum(len(q.options) for q in qs), desc=f"{subset} letter_loglik",
                      unit="row") as bar:
                preds, table = answerers.letter_loglik_answers(lm, qs, progress=bar.update)
            records = [{"letter_logps": t} for t in table]
        else:
            with tqdm(total=2 * len(qs), desc=f"{subset} cot_extract (2 turns)", unit="row") as bar:
                preds, records = answerers.cot_answers(
                    lm, qs, rationale_tokens=f.rationale_tokens, answer_tokens=f.answer_tokens,
                    progress=bar.update)
        acc = mx.accuracy_report(qs, preds)
        label = "Text" if subset == "text" else "MM (images ignored)"
        report["subsets"][subset] = {"label": label, "file": os.path.abspath(path),
                                     "chance": mx.chance(subset),
                                     "rows_cut": (lm.truncated - before) if lm else 0} | acc
        report["predictions"][subset] = [
            {"id": q.id, "label": q.label, "prediction": p, "correct": p == q.label,
             "question_type": q.question_type} | r for q, p, r in zip(qs, preds, records)]
    write_json(os.path.join(f.out, "medxpertqa.json"), report)
    write_atomic(os.path.join(f.out, "medxpertqa.md"), markdown(report))
    for s in report["subsets"].values():
        print(f"{s['label']}: {s['correct']}/{s['n']} = {_pct(s['accuracy'])} "
              f"(chance {_pct(s['chance'])}, no answer {s['no_answer']})")
    print(f"wrote {os.path.join(f.out, 'medxpertqa.json')} and medxpertqa.md")
    return report


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logs.show_own_logs(others=std_logging.ERROR)
    xla_env.use_default_flags()
    try:
        run(FLAGS)
    except (EvaluateError, SampleError, workdir_lib.WorkdirError, mx.MedXpertQAError,
            FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    xla_env.restart_with_hugepages()  # before absl reads a --flagfile, which may be a pipe
    app.run(main)

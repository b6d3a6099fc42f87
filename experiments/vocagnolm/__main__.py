"""VocAgnoLM reproduction at CPU scale: teacher-guided token selection on a noisy math corpus.

  python -m experiments.vocagnolm --workdir=DIR [--preset=tiny|default]

Corpus: arithmetic word problems with worked solutions ("Q: Ann has 34 pears, gets 25 more, gives
away 18. How many now?\\nA: 34+25=59\\n59-18=41\\nAnswer: 41\\n"), drawn from
``icml_jax.data.arithmetic`` chains of 1 or 2 steps over + and - (2-digit numbers, results <= 99),
and general text (pieces of the embedded Shakespeare works). The teacher is a decoder with a
SentencePiece tokenizer, both trained on clean problems plus general text; a byte-level teacher of
the same shape on the same documents serves same-tokenizer Rho-1. The student is a smaller
byte-level decoder, pretrained on general text, then continually trained (``configs/vocagnolm.py``,
task ``vocagnolm``) on other problems whose solution lines are each, with probability ``noise``,
corrupted: wrong arithmetic (the result off by 1, 2 or 10) or a junk line of the same length.
Arms, all from the same pretrained student for the same steps: CE on all tokens, VocAgnoLM (top
40%, max, unmapped in), a random 40%, the top 40% by student loss, same-tokenizer Rho-1 (byte
teacher), and the ablations mean aggregation and unmapped excluded; seeds set the data order (and
the random arm's draws).

Measured on held-out clean problems: greedy exact match of the "Answer:" line, the share of
outputs that carry one (format), and the NLL of the clean solutions in nats per byte given the
question. Gates: each teacher's loss per character on the clean solution lines of the noisy corpus
is below its loss on the corrupted lines (it can tell them apart), and the CE student writes the
format on at least half the held-out problems. Also reported: where each selection rule's picks
fall (the share inside corrupted lines) under the pretrained and the trained CE student. Outputs: DIR/results.csv, DIR/results.md,
DIR/results.png, DIR/config.json.
"""
import functools
import os
import sys

import numpy as np

from experiments.common import (cached, digest, gate_lines, git_commit, markdown_table, mean_spread, pm,
                                preset, record, round_up, run_overrides, save_figure, start, train_run,
                                write_atomic, write_csv, write_json)
from experiments.toedit.__main__ import write_corpus

QUIET = {"train.samples": 0, "train.progress": False}
STUDENT_MODEL = dict(d_model=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, ffn_dim=384)
TINY_MODEL = dict(d_model=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16, ffn_dim=64)
PRESETS = {
    "tiny": preset(
        teacher=dict(model=TINY_MODEL, train=dict(steps=6, batch_size=4, warmup_steps=1, log_every=3,
                                                  eval_every=6, eval_batches=1, checkpoint_every=6)),
        pretrain=dict(model=TINY_MODEL, train=dict(steps=4, batch_size=4, warmup_steps=1, log_every=2,
                                                   eval_every=4, eval_batches=1, checkpoint_every=4)),
        student=dict(model=TINY_MODEL, train=dict(steps=4, batch_size=4, warmup_steps=1, log_every=2,
                                                  eval_every=4, eval_batches=1, checkpoint_every=4)),
        spm_vocab=400, teacher_docs=48, general_docs=16, student_docs=32, test_docs=8, piece_len=64,
        noise=0.3, seeds=(0,), arms=("ce", "vocagnolm")),
    "default": preset(
        teacher=dict(model=dict(d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, ffn_dim=384),
                     train=dict(steps=500, batch_size=16, lr=3e-3, warmup_steps=40, log_every=100, eval_every=500,
                                eval_batches=2, checkpoint_every=500)),
        pretrain=dict(model=STUDENT_MODEL, train=dict(steps=300, batch_size=16, lr=3e-3, warmup_steps=30, log_every=100,
                                                      eval_every=300, eval_batches=2, checkpoint_every=300)),
        student=dict(model=STUDENT_MODEL, train=dict(steps=300, batch_size=16, lr=3e-3, warmup_steps=20, log_every=25,
                                                     eval_every=300, eval_batches=2, checkpoint_every=300)),
        spm_vocab=768, teacher_docs=4000, general_docs=1000, student_docs=3000, test_docs=256, piece_len=96,
        noise=0.3, seeds=(0, 1),
        arms=("ce", "vocagnolm", "random", "student_topk", "rho1", "vocagnolm_mean", "vocagnolm_no_unmapped")),
}
# arm -> (label, config.loss overrides, teacher: "spm" | "byte" | None)
ARMS = {
    "ce": ("CE, all tokens", dict(voc_mode="ce"), None),
    "vocagnolm": ("VocAgnoLM (top 40%, max, unmapped in)", dict(voc_mode="guided"), "spm"),
    "random": ("random 40%", dict(voc_mode="random"), None),
    "student_topk": ("top 40% by student loss", dict(voc_mode="student_topk"), None),
    "rho1": ("Rho-1, same tokenizer (byte teacher)", dict(voc_mode="rho1"), "byte"),
    "vocagnolm_mean": ("VocAgnoLM, mean aggregation", dict(voc_mode="guided", voc_agg="mean"), "spm"),
    "vocagnolm_no_unmapped": ("VocAgnoLM, unmapped excluded", dict(voc_mode="guided", voc_include_unmapped=False),
                              "spm"),
}
FIELDS = ("arm", "seed", "exact_match", "format_rate", "clean_nll", "selected_share", "final_loss")

NAMES = ("Ann", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gia", "Hugo", "Ivy", "Jon", "Kai", "Lea")
ITEMS = ("apples", "pears", "coins", "stamps", "shells", "cards", "marbles", "books")
JUNK = "abcdefghijklmnopqrstuvwxyz0123456789 +-=#%*"


# ----------------------------------------------------------------------------- corpus

def problems(seed: int, n_train: int, n_test: int):
    """Distinct 1- and 2-step +/- chains of 2-digit numbers (results <= 99); no test expression
    is in the training list."""
    from icml_jax.data import arithmetic
    out = [arithmetic.make_splits(seed + k, n_train // 2 + (k == 1) * (n_train % 2), n_test // 2 + (k == 1) *
                                  (n_test % 2), num_steps=k, digits=2, operators="+-", max_value=99)
           for k in (1, 2)]
    return out[0][0] + out[1][0], out[0][1] + out[1][1]


def question(p, rng) -> str:
    name, item = NAMES[rng.integers(len(NAMES))], ITEMS[rng.integers(len(ITEMS))]
    moves = ", ".join(f"gets {b} more" if op == "+" else f"gives away {b}" for _, op, b, _ in p.steps)
    return f"Q: {name} has {p.steps[0][0]} {item}, {moves}. How many now?\nA: "


def solution_lines(p) -> list[str]:
    return [f"{a}{op}{b}={r}\n" for a, op, b, r in p.steps] + [f"Answer: {p.answer}\n"]


def corrupt(line: str, rng) -> str:
    """Wrong arithmetic (the line's result off by 1, 2 or 10, never negative) or junk of the same length."""
    if rng.random() < 0.5:
        cut = max(line.rfind("="), line.rfind(" ")) + 1
        r, delta = int(line[cut:]), int(rng.choice([-10, -2, -1, 1, 2, 10]))
        return f"{line[:cut]}{r + delta if r + delta >= 0 else r + abs(delta)}\n"
    return "".join(rng.choice(list(JUNK), len(line) - 1)) + "\n"


def math_docs(probs, seed: int, noise: float):
    """(texts, [[corrupted line spans (characters)] per doc], clean solution line spans per doc)."""
    rng = np.random.default_rng(seed)
    texts, bad, good = [], [], []
    for p in probs:
        text, b, g = question(p, rng), [], []
        for line in solution_lines(p):
            hit = rng.random() < noise
            if hit:
                line = corrupt(line, rng)
            (b if hit else g).append((len(text), len(text) + len(line)))
            text += line
        texts.append(text)
        bad.append(b)
        good.append(g)
    return texts, bad, good


def general_pieces(n: int, length: int, split: str = "train") -> list[str]:
    from experiments.morphkv.__main__ import text_pool
    text = text_pool(split)
    step = max(len(text) // max(n, 1), length)
    return [text[i * step:i * step + length] for i in range(n) if i * step + length <= len(text)]


# ----------------------------------------------------------------------------- scoring

@functools.lru_cache(maxsize=4)
def _scorer(model_cfg):
    """Jitted per-token NLL [B, T] of (inputs, targets) under one architecture."""
    import jax

    from icml_jax.losses.logps import token_logprobs
    from icml_jax.models.decoder import build_model
    model = build_model(model_cfg)
    return jax.jit(lambda p, x, y: -token_logprobs(model.apply({"params": p}, x), y))


def token_nll(model_cfg, params, tok, texts, width: int, batch: int = 64):
    """(nll [N, W] of every target, spans [N] per doc: the targets' character spans; EOS last)."""
    import ml_collections
    fn = _scorer(ml_collections.FrozenConfigDict(model_cfg))
    rows, spans = [], []
    for t in texts:
        ids, sp = tok.encode_with_spans(t)
        rows.append(np.concatenate([[tok.bos_id], ids, [tok.eos_id]])[:width + 1])
        spans.append(sp)
    x = np.zeros((len(rows), width), np.int32)
    y = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        x[i, :len(r) - 1], y[i, :len(r) - 1] = r[:-1], r[1:]
    pad = -len(rows) % batch
    x, y = np.pad(x, ((0, pad), (0, 0))), np.pad(y, ((0, pad), (0, 0)))
    out = np.concatenate([np.asarray(fn(params, x[s:s + batch], y[s:s + batch])) for s in range(0, len(x), batch)])
    return out[:len(rows)], spans


def loss_per_char(nll, spans, regions) -> float:
    """Summed loss of the tokens starting inside ``regions`` (per doc lists of character spans)
    over those regions' characters."""
    total = chars = 0.0
    for n, sp, reg in zip(nll, spans, regions):
        sp = sp[:len(n)]
        for lo, hi in reg:
            inside = (sp[:, 0] >= lo) & (sp[:, 0] < hi)
            total += float(n[:len(sp)][inside].sum())
            chars += hi - lo
    return total / max(chars, 1)


def evaluate(model_cfg, params, tok, test, test_rng_seed: int) -> dict:
    """Greedy exact match, format rate and clean-solution NLL (nats per byte) on the held-out problems."""
    import jax

    from icml_jax.inference.decode import generate
    rng = np.random.default_rng(test_rng_seed)
    qs = [question(p, rng) for p in test]
    sols = ["".join(solution_lines(p)) for p in test]
    prompts = [[tok.bos_id] + tok.encode(q) for q in qs]
    new = max(len(s.encode()) for s in sols) + 4
    out = generate(model_cfg, params, prompts, key=jax.random.key(0), max_new_tokens=new, temperature=0.0,
                   stop_tokens=(tok.eos_id,), pad_id=tok.pad_id)
    got = [tok.decode(np.asarray(t)) for t in out.tokens]
    answers = [_answer(g) for g in got]
    docs = [q + s for q, s in zip(qs, sols)]
    nll, _ = token_nll(model_cfg, params, tok, docs, round_up(max(len(d.encode()) for d in docs) + 1, 16))
    sol_nll = [n[len(q.encode()):len(q.encode()) + len(s.encode())].mean() for n, q, s in zip(nll, qs, sols)]
    return dict(exact_match=float(np.mean([a == p.answer for a, p in zip(answers, test)])),
                format_rate=float(np.mean([a is not None for a in answers])),
                clean_nll=float(np.mean(sol_nll)), sample=got[0])


def _answer(text: str):
    for line in text.splitlines():
        if line.startswith("Answer: ") and line[8:].strip().isdigit():
            return int(line[8:].strip())
    return None


# ----------------------------------------------------------------------------- driver

def lm_config(exp, role: str, corpus: str, seq_len: int, seed: int = 0, tokenizer: str = ""):
    from icml_jax.config_utils import load_config
    cfg = load_config("configs/lm.py:small", unlocked=True)
    over = {**run_overrides(exp[role]), **QUIET, "seed": seed, "data.name": "jsonl", "data.path": corpus,
            "data.seq_len": seq_len, "model.max_seq_len": max(seq_len, 256)}
    if tokenizer:
        over.update({"data.tokenizer.type": "sentencepiece", "data.tokenizer.model_path": tokenizer,
                     "model.vocab_size": round_up(exp.spm_vocab, 128)})
    cfg.update_from_flattened_dict(over)
    return cfg


def student_config(exp, arm: str, seed: int, corpus: str, seq: dict, pre_dir: str, teachers: dict):
    """The continual-training run of one arm (``configs/vocagnolm.py``), from the pretrained student."""
    from icml_jax.config_utils import load_config
    _, loss, teacher = ARMS[arm]
    cfg = load_config("configs/vocagnolm.py:default", unlocked=True)
    cfg.update_from_flattened_dict({
        **run_overrides(exp.student), **QUIET, "seed": seed, "data.path": corpus, "data.seq_len": seq["byte"],
        "model.max_seq_len": max(seq["byte"], 256), "train.init_from": pre_dir,
        **{f"loss.{k}": v for k, v in loss.items()},
        **({"loss.voc_teacher": teachers[teacher][0]} if teacher else {}),
        **({"loss.voc_teacher_seq_len": seq["spm"]} if teacher == "spm" else {})})
    return cfg


def selection_shares(exp, corpus: str, seq: dict, pre_dir: str, teachers: dict, bad, students: dict) -> dict:
    """What each selective arm's rule picks from the noisy corpus under fixed student params, in
    training-size batches: {arm: {params name: share of the picked tokens inside corrupted lines}}
    plus ``base`` (that share among all tokens) and ``multi`` (mapped tokens whose teacher range
    spans more than one teacher token, where the aggregation matters)."""
    import jax

    from icml_jax.train.checkpoint import restore_model_params
    from icml_jax.train.trainer import build_task
    out = {}
    for arm in [a for a in ("vocagnolm", "rho1", "student_topk") if a in exp.arms]:
        task = build_task(student_config(exp, arm, 0, corpus, seq, pre_dir, teachers), (1, 1, 1))
        a = task.train_arrays
        N, T = a["targets"].shape
        hit = np.zeros((N, T), bool)  # target i of row r is byte i of the (ASCII) document
        for r, spans in enumerate(bad):
            for lo, hi in spans:
                hit[r, lo:min(hi, T)] = True
        valid = a["segment_ids"] > 0
        out["base"] = float((hit & valid).sum() / valid.sum())
        if arm == "vocagnolm":
            m = a["voc_mapped"] & valid
            out["multi"] = float((a["voc_window"].sum(-1)[m] > 1).mean())
        pick = jax.jit(lambda p, b: task.weights(task.token_nll(p, b)[0], b)[0])
        B = exp.student.train.batch_size
        out[arm] = {}
        for name, sd in students.items():
            params = restore_model_params(sd, task.config.model)[0]
            w = np.concatenate([np.asarray(pick(params, {**{k: v[s:s + B] for k, v in a.items()},
                                                         "weight": np.ones(B, np.float32)}))
                                for s in range(0, N - B + 1, B)]) > 0
            out[arm][name] = float((w & hit[:len(w)]).sum() / max(w.sum(), 1))
    return out


def main(argv=None):
    args, exp, elapsed = start(__doc__, PRESETS, argv)
    from icml_jax.data.tokenizers import ByteTokenizer, train_sentencepiece
    from icml_jax.train.checkpoint import restore_model_params
    wd = args.workdir
    byte = ByteTokenizer()
    # the corpora: teacher (clean math + general text), student pretraining (general text),
    # student continual training (noisy math), held-out clean problems
    train_p, test_p = problems(0, exp.teacher_docs + exp.student_docs, exp.test_docs)
    rng = np.random.default_rng(1)
    order = rng.permutation(len(train_p))
    teacher_p = [train_p[i] for i in order[:exp.teacher_docs]]
    student_p = [train_p[i] for i in order[exp.teacher_docs:]]
    general = general_pieces(exp.general_docs + exp.general_docs, exp.piece_len)
    teacher_math, _, _ = math_docs(teacher_p, 2, 0.0)
    teacher_texts = teacher_math + general[:exp.general_docs]
    teacher_texts = [teacher_texts[i] for i in np.random.default_rng(3).permutation(len(teacher_texts))]
    noisy, bad, good = math_docs(student_p, 4, exp.noise)
    paths = {k: os.path.join(wd, f"corpus_{k}.jsonl") for k in ("teacher", "general", "noisy")}
    write_corpus(paths["teacher"], teacher_texts)
    write_corpus(paths["general"], general[exp.general_docs:])
    write_corpus(paths["noisy"], noisy)
    spm_prefix = os.path.join(wd, f"spm_{digest([teacher_texts, exp.spm_vocab], 8)}", "spm")
    if not os.path.exists(spm_prefix + ".model"):
        train_sentencepiece(teacher_texts, spm_prefix, vocab_size=exp.spm_vocab)
    from icml_jax.data.tokenizers import SentencePieceTokenizer
    spm = SentencePieceTokenizer(spm_prefix + ".model")
    # sequence lengths: the longest document (+ bos/eos) in each tokenizer
    n_spm = max(len(spm.encode(t)) for t in teacher_texts + noisy) + 1
    n_byte = max(len(t.encode()) for t in teacher_texts + noisy) + 1
    seq = dict(spm=round_up(n_spm, 8), byte=round_up(n_byte, 8))
    teachers = {}
    kinds = ("spm", "byte") if "rho1" in exp.arms else ("spm",)  # the byte teacher serves Rho-1 only
    for kind, tok_path in (("spm", spm.model_path), ("byte", ""))[:len(kinds)]:
        cfg = lm_config(exp, "teacher", paths["teacher"], seq[kind], tokenizer=tok_path)
        tdir = os.path.join(wd, f"teacher_{kind}_{digest([teacher_texts, exp.teacher.to_dict()], 8)}")
        _, trows, secs = train_run(cfg, tdir)
        teachers[kind] = (tdir, cfg, secs)
    pre_cfg = lm_config(exp, "pretrain", paths["general"], seq["byte"])
    pre_dir = os.path.join(wd, f"pretrain_{digest([general, exp.pretrain.to_dict()], 8)}")
    train_run(pre_cfg, pre_dir)
    # pilot gate 1: each teacher's loss on clean vs corrupted solution lines of the noisy corpus
    pilot = {}
    for kind, tok in (("spm", spm), ("byte", byte))[:len(kinds)]:
        tdir, cfg, _ = teachers[kind]
        params = restore_model_params(tdir, cfg.model)[0]
        nll, spans = token_nll(cfg.model, params, tok, noisy, seq[kind])  # one document a row
        pilot[kind] = dict(clean=loss_per_char(nll, spans, good), corrupted=loss_per_char(nll, spans, bad))
    pilot["student_pretrained"] = evaluate(pre_cfg.model, restore_model_params(pre_dir, pre_cfg.model)[0], byte,
                                           test_p, 5)
    rows, ce_dir = [], None
    for arm in exp.arms:
        for seed in exp.seeds:
            cfg = student_config(exp, arm, seed, paths["noisy"], seq, pre_dir, teachers)
            sd = os.path.join(wd, "students", f"{arm}_{digest([noisy, cfg.to_dict()], 8)}_seed{seed}")
            ce_dir = sd if arm == "ce" and ce_dir is None else ce_dir
            _, trows, _ = train_run(cfg, sd)

            def measure():
                params = restore_model_params(sd, cfg.model)[0]
                return evaluate(cfg.model, params, byte, test_p, 5)
            res = cached(os.path.join(sd, "eval.json"), [test_p[0].expression, len(test_p)], measure)
            rows.append(dict(arm=arm, seed=seed, exact_match=res["exact_match"], format_rate=res["format_rate"],
                             clean_nll=res["clean_nll"],
                             selected_share=float(np.mean([r["selected_share"] for r in trows])),
                             final_loss=trows[-1]["ce_all"]))
    picks = selection_shares(exp, paths["noisy"], seq, pre_dir, teachers, bad,
                             {"pretrained student": pre_dir, "CE student (seed 0, end)": ce_dir})
    ce_format = np.mean([r["format_rate"] for r in rows if r["arm"] == "ce"])
    gates = {f"{k} teacher: clean solution lines {pilot[k]['clean']:.3f} < corrupted lines "
             f"{pilot[k]['corrupted']:.3f} nats/char": bool(pilot[k]["clean"] < pilot[k]["corrupted"])
             for k in kinds}
    gates[f"CE student writes the format on >= 50% of held-out problems ({ce_format:.0%})"] = bool(ce_format >= 0.5)
    corrupted_share = sum(hi - lo for b in bad for lo, hi in b) / sum(len(t) for t in noisy)
    meta = dict(preset=args.preset, commit=git_commit(), minutes=elapsed() / 60, seq=seq, spm_vocab=spm.vocab_size,
                pilot=pilot, corrupted_char_share=corrupted_share, selection=picks,
                corrupted_line_share=sum(map(len, bad)) / sum(len(b) + len(g) for b, g in zip(bad, good)),
                spm_tokens_per_byte=sum(len(spm.encode(t)) for t in noisy) / sum(len(t.encode()) for t in noisy),
                teacher_minutes={k: v[2] / 60 for k, v in teachers.items()})
    write_csv(os.path.join(wd, "results.csv"), rows, FIELDS)
    write_atomic(os.path.join(wd, "results.md"), markdown(exp, meta, rows, gates))
    write_json(os.path.join(wd, "config.json"), dict(exp=record(exp, ("teacher", "pretrain", "student")), meta=meta,
                                                     gates=gates))
    plot(exp, rows, os.path.join(wd, "results.png"))
    print(open(os.path.join(wd, "results.md")).read())
    return rows


# ----------------------------------------------------------------------------- report

def summary(exp, rows):
    out = []
    for arm in exp.arms:
        rs = [r for r in rows if r["arm"] == arm]
        em, em_se, _ = mean_spread([r["exact_match"] for r in rs])
        nll, nll_se, _ = mean_spread([r["clean_nll"] for r in rs])
        fmt, _, _ = mean_spread([r["format_rate"] for r in rs])
        sel, _, _ = mean_spread([r["selected_share"] for r in rs])
        out.append(dict(arm=arm, label=ARMS[arm][0], em=em, em_se=em_se, nll=nll, nll_se=nll_se, fmt=fmt, sel=sel))
    return out


def markdown(exp, meta, rows, gates):
    s = summary(exp, rows)
    by = {r["arm"]: r for r in s}
    table = [[r["label"], pm(r["em"], r["em_se"]), f"{r['fmt']:.0%}", pm(r["nll"], r["nll_se"], nd=4),
              f"{r['sel']:.2f}"] for r in s]
    p = meta["pilot"]
    T, P, S = exp.teacher, exp.pretrain, exp.student
    lines = [
        "# VocAgnoLM: teacher-guided token selection across vocabularies on a noisy math corpus", "",
        f"`python -m experiments.vocagnolm --preset={meta['preset']}` · commit {meta['commit']} · "
        f"{meta['minutes']:.1f} min.", "",
        f"Teachers: {T.model.num_layers} layers, d {T.model.d_model}, {T.train.steps} steps × {T.train.batch_size} "
        f"packed rows on {exp.teacher_docs} clean word problems + {exp.general_docs} Shakespeare pieces; one with a "
        f"SentencePiece tokenizer of {meta['spm_vocab']} pieces trained on that corpus "
        f"({meta['spm_tokens_per_byte']:.2f} tokens per byte of the noisy corpus), one byte-level (for Rho-1). "
        f"Student: byte-level, {S.model.num_layers} layers, d {S.model.d_model}, pretrained {P.train.steps} steps on "
        f"general text, then {S.train.steps} steps × {S.train.batch_size} documents of the noisy corpus "
        f"({exp.student_docs} problems; {meta['corrupted_line_share']:.0%} of the solution lines corrupted, "
        f"{meta['corrupted_char_share']:.0%} of its characters) per arm and seed, seeds {list(exp.seeds)}; "
        f"± = standard error over seeds. Held-out: {exp.test_docs} clean problems never trained on.", "",
        f"Pilots: teacher loss per character on the noisy corpus' clean solution lines / corrupted lines: "
        + ", ".join(f"{'SentencePiece' if k == 'spm' else 'byte'} {p[k]['clean']:.3f} / {p[k]['corrupted']:.3f}"
                    for k in ("spm", "byte") if k in p) + ". The pretrained student before the math corpus: exact match "
        f"{p['student_pretrained']['exact_match']:.3f}, format {p['student_pretrained']['format_rate']:.0%}, "
        f"clean-solution NLL {p['student_pretrained']['clean_nll']:.4f}.", "",
        *gate_lines(gates, "A gate failed: the comparison below cannot show the paper's effect; read it as a record "
                           "of this run only."),
        markdown_table(["arm", "exact match ± se", "format", "clean-solution NLL (nats/byte) ± se",
                        "trained share of tokens"], table), "",
        *selection_lines(meta["selection"]),
        "Exact match: the greedy continuation's `Answer:` line equals the true answer. Trained share: the mean "
        "selected share of the valid tokens over the logged training steps. Every arm runs the same steps over "
        "the same documents; the selective arms back-propagate through about 40% of the tokens (plus the unmapped "
        "ones, here only each document's EOS, since every byte lies inside some teacher piece).", ""]
    if "ce" in by:
        lines += [reading(by, meta["selection"].get("multi", float("nan"))), ""]
    return "\n".join(lines)


def reading(by: dict, multi: float) -> str:
    """The results.md paragraph: each arm against CE on both metrics, in combined standard errors."""
    c = by["ce"]

    def vs(a, b, k, nd):
        se = np.hypot(a[k + "_se"], b[k + "_se"])
        return f"{a[k] - b[k]:+.{nd}f}" + (f" ({(a[k] - b[k]) / se:+.1f} combined se)" if se > 0 else "")
    others = [a for a in by if a != "ce"]
    em = [abs(by[a]["em"] - c["em"]) / np.hypot(by[a]["em_se"], c["em_se"]) for a in others
          if np.hypot(by[a]["em_se"], c["em_se"]) > 0]
    out = ("Reading: clean-solution NLL against CE: "
           + "; ".join(f"{by[a]['label']} {vs(by[a], c, 'nll', 4)}" for a in others) + ". Exact match: "
           + ", ".join(f"{by[a]['em']:.3f}" for a in by) + " (arms in table order)"
           + (f"; the largest gap to CE is {max(em):.1f} combined se." if em else "."))
    if "vocagnolm_mean" in by:
        same = by["vocagnolm_mean"]["nll"] == by["vocagnolm"]["nll"]
        out += (f" Mean aggregation: {multi:.2%} of the mapped student tokens span more than one teacher token "
                "(a byte of ASCII text always lies inside one piece), so mean and max select "
                + ("the same tokens and the two runs are identical." if same else "almost the same tokens."))
    return out


def selection_lines(sel: dict) -> list:
    arms = [a for a in ("vocagnolm", "rho1", "student_topk") if a in sel]
    if not arms:
        return []
    names = list(sel[arms[0]])
    return [f"Where the selection goes: the share of the picked tokens that lie in corrupted solution lines "
            f"(all tokens: {sel['base']:.1%}), each rule applied to the whole noisy corpus in training-size "
            "batches under fixed student params. Mapped student tokens whose range spans more than one teacher "
            f"token: {sel.get('multi', float('nan')):.2%}.", "",
            markdown_table(["rule"] + names, [[ARMS[a][0]] + [f"{sel[a][n]:.1%}" for n in names] for a in arms]), ""]


def plot(exp, rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = summary(exp, rows)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    y = np.arange(len(s))
    for ax, k, name in ((axes[0], "em", "greedy exact match"), (axes[1], "nll", "clean-solution NLL (nats/byte)")):
        ax.barh(y, [r[k] for r in s], xerr=[r[k + "_se"] for r in s], color="tab:blue")
        ax.set_yticks(y, [r["label"] for r in s] if ax is axes[0] else [""] * len(s), fontsize=7)
        ax.set_xlabel(name)
        ax.invert_yaxis()
        if k == "nll":
            lo = min(r[k] for r in s)
            ax.set_xlim(lo * 0.9, max(r[k] for r in s) * 1.02)
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    main(sys.argv[1:])

"""ToEdit reproduction: human vs synthetic mixes vs token-edited human text at equal token budgets.

  TFDS_DATA_DIR=/tmp/tfds python -m experiments.toedit --workdir=DIR [--preset=tiny|default]

Human corpus H: ``docs`` pieces of ``piece_len`` characters cut in order from the train works of
the embedded Shakespeare corpus (byte tokens). A prior decoder is trained on H with the normal
trainer. From it: the synthetic corpus S (each human piece's first ``prefix`` characters continued
by the prior at T = 1 to the same length, so S is length-matched to H piece by piece) and the
ToEdit corpora ToEdit_p(H) (``icml_jax.analysis.toedit``: tokens the prior gives probability >= p
are resampled from softmax(top-k log-probs / beta), k = 8), for each (p, beta) in ``edits``. Students (one per arm
and seed; the seed sets the initialisation and data order) are trained on H, on H+S mixes where a
share of the pieces is replaced by their synthetic twins, on S alone, and on each ToEdit corpus,
all for the same steps × batch × length (equal token budgets). Measured: NLL in nats per byte on
held-out human text (pieces of the validation works), distinct-2 of each training corpus and its
bigram KL to H, the edit rates. Iterative chains (the spec's variant: generation n's prior is
generation n - 1's student, generation 1 = the arms above): the synthetic chain trains generation
n on S_n, the pieces' prefixes continued by the generation n - 1 student; the edit chain trains it
on ToEdit(H) at ``chain_edit`` = (p, beta) with the generation n - 1 student as the prior; for
``generations`` generations and the ``chain_seeds``. Gates: the prior and the H student beat the unigram entropy of H
on held-out text (they learned beyond letter frequencies), and ToEdit changed >= 1% of the tokens
at some p. Outputs: DIR/results.csv, DIR/results.md, DIR/nll.png, DIR/config.json.
"""
import functools
import json
import os
import sys

import numpy as np

from experiments.common import (digest, gate_lines, git_commit, markdown_table, mean_spread, pm, preset, record, run_overrides,
                                save_figure, start, train_run, write_atomic, write_csv, write_json)

QUIET = {"train.samples": 0, "train.progress": False}
PRESETS = {
    "tiny": preset(
        prior=dict(model=dict(d_model=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16, ffn_dim=64),
                   train=dict(steps=8, batch_size=4, warmup_steps=2, log_every=4, eval_every=8, eval_batches=1,
                              checkpoint_every=8)),
        student=dict(model=dict(d_model=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16, ffn_dim=64),
                     train=dict(steps=6, batch_size=4, warmup_steps=2, log_every=3, eval_every=6, eval_batches=1,
                                checkpoint_every=6)),
        docs=24, piece_len=63, prefix=16, shares=(0.5,), edits=((0.9, 1.0),), seeds=(0,), eval_pieces=8, gate_edit=0.0,
        generations=2, chain_edit=(0.9, 1.0), chain_seeds=(0,)),
    "default": preset(
        prior=dict(model=dict(d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, ffn_dim=384),
                   train=dict(steps=800, batch_size=16, lr=3e-3, warmup_steps=50, log_every=100, eval_every=400,
                              eval_batches=4, checkpoint_every=400)),
        student=dict(model=dict(d_model=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, ffn_dim=384),
                     train=dict(steps=400, batch_size=16, lr=3e-3, warmup_steps=40, log_every=200, eval_every=400,
                                eval_batches=2, checkpoint_every=400)),
        docs=2000, piece_len=127, prefix=32, shares=(0.25, 0.5, 0.75), edits=((0.99, 1.0), (0.9, 1.0), (0.9, 1.5)), seeds=(0, 1, 2),
        eval_pieces=256, gate_edit=0.01, generations=3, chain_edit=(0.9, 1.5), chain_seeds=(0, 1)),
}
FIELDS = ("arm", "generation", "share", "p", "beta", "seed", "nll", "edit_rate", "changed_rate", "distinct2",
          "bigram_kl")


# ----------------------------------------------------------------------------- corpora

def pieces(split: str, n: int, length: int) -> list[str]:
    """``n`` consecutive ``length``-character pieces of the ``split`` works (ASCII only)."""
    from experiments.morphkv.__main__ import text_pool
    text = text_pool(split)
    if len(text) < n * length:
        raise ValueError(f"the {split} works hold {len(text)} characters, fewer than {n} x {length}")
    return [text[i * length:(i + 1) * length] for i in range(n)]


def write_corpus(path: str, docs) -> None:
    write_atomic(path, "".join(json.dumps({"text": d}) + "\n" for d in docs))


def bigram_stats(docs, ref_counts=None):
    """(distinct-2, KL(corpus bigrams || reference bigrams) in nats, counts [256, 256]); add-0.5
    smoothing over the bigrams either corpus uses."""
    counts = np.zeros((256, 256))
    total = distinct = 0
    for d in docs:
        b = np.frombuffer(d.encode("utf-8"), np.uint8)
        np.add.at(counts, (b[:-1], b[1:]), 1)
        total += max(len(b) - 1, 0)
    distinct = int((counts > 0).sum())
    if ref_counts is None:
        return distinct / max(total, 1), 0.0, counts
    support = (counts > 0) | (ref_counts > 0)
    p = (counts[support] + 0.5) / (counts[support] + 0.5).sum()
    q = (ref_counts[support] + 0.5) / (ref_counts[support] + 0.5).sum()
    return distinct / max(total, 1), float((p * np.log(p / q)).sum()), counts


def synthesize(model_cfg, params, tok, human, prefix: int, seed: int):
    """Each human piece's first ``prefix`` characters continued by the prior at T = 1 to the piece's
    length in bytes (no stop token: length-matched)."""
    import jax

    from icml_jax.inference.decode import generate
    rows = [[tok.bos_id] + tok.encode(h[:prefix]) for h in human]
    new = len(human[0].encode()) - prefix
    out = generate(model_cfg, params, rows, key=jax.random.key(seed), max_new_tokens=new, temperature=1.0,
                   pad_id=tok.pad_id)
    return [h[:prefix] + tok.decode(np.asarray(t)[:new]) for h, t in zip(human, out.tokens)]


@functools.lru_cache(maxsize=4)
def _scorer(model_cfg):
    """A jitted per-token log-prob function of one architecture (compiled once for every student)."""
    import jax

    from icml_jax.losses.logps import token_logprobs
    from icml_jax.models.decoder import build_model
    model = build_model(model_cfg)
    return jax.jit(lambda p, x: token_logprobs(model.apply({"params": p}, x[:, :-1]), x[:, 1:]))


def held_out_nll(model_cfg, params, tok, texts) -> float:
    """Mean NLL (nats per byte) of the held-out human pieces, each scored after BOS."""
    import ml_collections
    toks = np.stack([[tok.bos_id] + tok.encode(t) for t in texts]).astype(np.int32)
    return float(-np.asarray(_scorer(ml_collections.FrozenConfigDict(model_cfg))(params, toks)).mean())


# ----------------------------------------------------------------------------- driver

def run_config(exp, role: str, corpus: str, seed: int, seq_len: int):
    from icml_jax.config_utils import load_config
    cfg = load_config("configs/lm.py:small", unlocked=True)
    cfg.update_from_flattened_dict({**run_overrides(exp[role]), **QUIET, "seed": seed, "data.name": "jsonl",
                                    "data.path": corpus, "data.seq_len": seq_len, "model.max_seq_len": seq_len})
    return cfg


def arms(exp):
    """(name, share of synthetic pieces, ToEdit (p, beta) or None) of every student arm."""
    return ([("human", 0.0, None)] + [(f"mix {s:.0%}", s, None) for s in exp.shares] + [("synthetic", 1.0, None)]
            + [(edit_arm_name(p, b), 0.0, (p, b)) for p, b in exp.edits])


def edit_arm_name(p, b) -> str:
    return f"toedit p={p:g}" + ("" if b == 1 else f" beta={b:g}")


def chains(exp, students, student, corpus, human, held, tok, h_counts, wd):
    """Generations 2 .. ``exp.generations`` of the synthetic and edit chains (rows like the arms')."""
    import jax

    from icml_jax.analysis import toedit
    p, b = exp.chain_edit
    conf = toedit.ToEditConfig(p=p, k=8, beta=b)
    if (p, b) not in [tuple(e) for e in exp.edits] or not set(exp.chain_seeds) <= set(exp.seeds):
        raise ValueError(f"chain_edit={exp.chain_edit} must be one of edits={exp.edits} and chain_seeds "
                         f"{exp.chain_seeds} a subset of seeds {exp.seeds} (generation 1 is those arms)")
    rows = []
    for seed in exp.chain_seeds:
        prev = {"synthetic chain": students[("synthetic", seed)], "toedit chain": students[(edit_arm_name(p, b), seed)]}
        for gen in range(2, exp.generations + 1):
            for name, (cfg, params) in list(prev.items()):
                rate = chg = ""
                if name == "synthetic chain":
                    docs = synthesize(cfg.model, params, tok, human, exp.prefix, seed=1000 * gen + seed)
                else:
                    out, hit, drop = toedit.edit_corpus(cfg.model, params, corpus, jax.random.key(1000 * gen + seed),
                                                        conf, toedit.banned_for(tok, cfg.model.vocab_size))
                    docs = toedit.edited_texts(tok, corpus, out, drop)
                    st = toedit.edit_stats(corpus, corpus.tokens, out, hit, drop, conf)
                    rate, chg = st["edit_rate"], st["changed_rate"]
                path = os.path.join(wd, f"corpus_{name.replace(' ', '_')}_gen{gen}_seed{seed}.jsonl")
                write_corpus(path, docs)
                d2, kl, _ = bigram_stats(docs, h_counts)
                _, cfg2, params2 = student(path, docs, seed)
                prev[name] = (cfg2, params2)
                rows.append(dict(arm=name, generation=gen, share="", p=p if rate != "" else "",
                                 beta=b if rate != "" else "", seed=seed,
                                 nll=held_out_nll(cfg2.model, params2, tok, held), edit_rate=rate,
                                 changed_rate=chg, distinct2=d2, bigram_kl=kl))
    return rows


def main(argv=None):
    args, exp, elapsed = start(__doc__, PRESETS, argv)
    import jax

    from icml_jax.analysis import toedit
    from icml_jax.data.pipeline import tokenize_source
    from icml_jax.data.tokenizers import ByteTokenizer
    from icml_jax.train.checkpoint import restore_model_params
    tok = ByteTokenizer()
    seq_len = exp.piece_len + 1  # BOS + piece + EOS: one chunk per piece
    human = pieces("train", exp.docs, exp.piece_len)
    held = pieces("validation", exp.eval_pieces, exp.piece_len)
    wd = args.workdir
    h_path = os.path.join(wd, "corpus_human.jsonl")
    write_corpus(h_path, human)
    prior_cfg = run_config(exp, "prior", h_path, 0, seq_len)
    prior_dir = os.path.join(wd, f"prior_{digest(human, 8)}")  # a run is reused only on the same text
    train_run(prior_cfg, prior_dir)
    prior = restore_model_params(prior_dir, prior_cfg.model)[0]
    synthetic = synthesize(prior_cfg.model, prior, tok, human, exp.prefix, seed=0)
    corpus = tokenize_source([{"text": h} for h in human], tok, seq_len)
    mismatch = float(np.mean([len(s.encode()) != len(h.encode()) for s, h in zip(synthetic, human)]))
    edited, rates, changed = {}, {}, {}
    for p in exp.edits:
        conf = toedit.ToEditConfig(p=p[0], k=8, beta=p[1])
        out, hit, drop = toedit.edit_corpus(prior_cfg.model, prior, corpus, jax.random.key(1), conf,
                                            toedit.banned_for(tok, prior_cfg.model.vocab_size))
        edited[p] = toedit.edited_texts(tok, corpus, out, drop)
        st = toedit.edit_stats(corpus, corpus.tokens, out, hit, drop, conf)
        rates[p], changed[p] = st["edit_rate"], st["changed_rate"]
    _, _, h_counts = bigram_stats(human)
    rng = np.random.default_rng(0)
    order = rng.permutation(exp.docs)  # which pieces a mix takes from S: the first share of this order
    rows, students = [], {}

    def student(path, docs, seed):
        """Trains (or reuses) the student of corpus ``path`` (texts ``docs``) -> (dir, cfg, params)."""
        cfg = run_config(exp, "student", path, seed, seq_len)
        sd = os.path.join(wd, "students", f"{os.path.basename(path)[7:-6]}_{digest(docs, 8)}_seed{seed}")
        train_run(cfg, sd)
        return sd, cfg, restore_model_params(sd, cfg.model)[0]

    for name, share, p in arms(exp):
        if p is not None:
            docs = edited[p]
        else:
            synth = set(order[:int(round(share * exp.docs))].tolist())
            docs = [synthetic[i] if i in synth else human[i] for i in range(exp.docs)]
        path = os.path.join(wd, f"corpus_{name.replace(' ', '_').replace('%', 'pct').replace('=', '')}.jsonl")
        write_corpus(path, docs)
        d2, kl, _ = bigram_stats(docs, h_counts)
        for seed in exp.seeds:
            sd, cfg, params = student(path, docs, seed)
            students[(name, seed)] = (cfg, params)
            rows.append(dict(arm=name, generation=1, share=share, p=p[0] if p else "", beta=p[1] if p else "",
                             seed=seed, nll=held_out_nll(cfg.model, params, tok, held),
                             edit_rate=rates.get(p, ""), changed_rate=changed.get(p, ""), distinct2=d2,
                             bigram_kl=kl))
    rows += chains(exp, students, student, corpus, human, held, tok, h_counts, wd)
    freq = np.bincount(np.frombuffer("".join(human).encode(), np.uint8), minlength=256) / len("".join(human))
    unigram = float(-(freq[freq > 0] * np.log(freq[freq > 0])).sum())
    prior_nll = held_out_nll(prior_cfg.model, prior, tok, held)
    h_nll = np.mean([r["nll"] for r in rows if r["arm"] == "human"])
    gates = {f"prior held-out NLL {prior_nll:.3f} < unigram entropy {unigram:.3f}": bool(prior_nll < unigram),
             f"human student held-out NLL {h_nll:.3f} < unigram entropy": bool(h_nll < unigram),
             f"ToEdit changes >= {exp.gate_edit:.0%} of the tokens at some p "
             f"({', '.join(f'p={p:g} beta={b:g}: {r:.2%}' for (p, b), r in changed.items())})":
                 bool(max(changed.values()) >= exp.gate_edit)}
    meta = dict(preset=args.preset, commit=git_commit(), minutes=elapsed() / 60, prior_nll=prior_nll,
                unigram=unigram, edit_rates={str(p): r for p, r in rates.items()},
                changed_rates={str(p): r for p, r in changed.items()}, synthetic_length_mismatch=mismatch,
                tokens_per_student=exp.student.train.steps * exp.student.train.batch_size * seq_len)
    write_csv(os.path.join(wd, "results.csv"), rows, FIELDS)
    write_atomic(os.path.join(wd, "results.md"), markdown(exp, meta, rows, gates))
    write_json(os.path.join(wd, "config.json"), dict(exp=record(exp, ("prior", "student")), meta=meta, gates=gates))
    plot(exp, rows, os.path.join(wd, "nll.png"))
    print(open(os.path.join(wd, "results.md")).read())
    return rows


# ----------------------------------------------------------------------------- report

def summary(exp, rows):
    out = []
    for name, share, p in arms(exp):
        rs = [r for r in rows if r["arm"] == name]
        m, se, _ = mean_spread([r["nll"] for r in rs])
        out.append(dict(arm=name, share=share, p=p, nll=m, se=se, edit_rate=rs[0]["edit_rate"],
                        changed_rate=rs[0]["changed_rate"],
                        distinct2=rs[0]["distinct2"], bigram_kl=rs[0]["bigram_kl"]))
    return out


def markdown(exp, meta, rows, gates):
    s = summary(exp, rows)
    h = next(r for r in s if r["arm"] == "human")
    table = [[r["arm"], f"{r['edit_rate']:.1%}" if r["edit_rate"] != "" else "—",
              f"{r['changed_rate']:.2%}" if r["changed_rate"] != "" else "—", pm(r["nll"], r["se"], nd=4),
              f"{r['nll'] - h['nll']:+.4f}", f"{r['distinct2']:.4f}", f"{r['bigram_kl']:.4f}"] for r in s]
    mixes = [r for r in s if r["p"] is None]
    mono = all(a["nll"] < b["nll"] for a, b in zip(mixes, mixes[1:]))  # means only; the se are in the table
    edits = [r for r in s if r["p"] is not None]
    lines = [
        "# ToEdit: human vs synthetic vs token-edited training data at equal token budgets", "",
        f"`python -m experiments.toedit --preset={meta['preset']}` · commit {meta['commit']} · "
        f"{meta['minutes']:.1f} min.", "",
        f"H = {exp.docs} pieces of {exp.piece_len} characters of the Shakespeare train works. Prior: "
        f"{exp.prior.model.num_layers} layers, d {exp.prior.model.d_model}, {exp.prior.train.steps} steps on H "
        f"(held-out NLL {meta['prior_nll']:.3f} nats/byte; unigram entropy of H {meta['unigram']:.3f}). S = each piece's "
        f"first {exp.prefix} characters continued by the prior at T = 1 to the same length. ToEdit: k = 8, beta = 1 unless the arm names another, "
        f"original-prefix teacher forcing. Students: {exp.student.model.num_layers} layers, d "
        f"{exp.student.model.d_model}, {exp.student.train.steps} steps × {exp.student.train.batch_size} rows × "
        f"{exp.piece_len + 1} tokens ({meta['tokens_per_student']:,} tokens) per arm and seed, seeds "
        f"{list(exp.seeds)}; ± = standard error over seeds. Held-out: {exp.eval_pieces} pieces of the validation "
        "works, NLL in nats per byte.", "",
        *gate_lines(gates, "A gate failed: the comparison below cannot show the paper's effect; read it as a "
                           "record of this run only."),
        markdown_table(["training data", "resampled", "changed", "held-out human NLL ± se", "vs human",
                        "distinct-2", "bigram KL to H"], table), "",
        "Resampled = share of the text tokens ToEdit redrew (P ≥ p); changed = share that differ afterwards (a redraw "
        "at beta = 1 returns the original token with probability ≥ p). distinct-2 and the bigram KL (add-0.5 "
        "smoothing) describe each arm's training corpus, not the students. The prior, S and the edits are drawn "
        "once; the ± covers the students' seeds (initialisation and data order) only. The JSONL source sets aside "
        "a hash-chosen share of the pieces (the same line numbers in every arm) for its validation and test "
        f"splits, so students see the rest. Synthetic pieces whose byte length differs from their human twin "
        f"(a sampled special id dropped, or a non-ASCII byte decoded as U+FFFD): "
        f"{meta['synthetic_length_mismatch']:.1%}.", "",
        f"Reading: held-out NLL {'rises monotonically' if mono else 'does not rise monotonically'} with the "
        f"synthetic share (human {mixes[0]['nll']:.4f} → synthetic {mixes[-1]['nll']:.4f}); ToEdit "
        + "; ".join(f"{r['arm'][7:]}: {r['nll'] - h['nll']:+.4f} vs human "
                    f"({(r['nll'] - h['nll']) / max(np.hypot(r['se'], h['se']), 1e-9):+.1f} combined se)"
                    for r in edits)
        + ".", ""]
    return "\n".join(lines + chain_lines(exp, rows, h))


def chain_table(exp, rows):
    """{chain name: [(generation, mean NLL, se, mean changed share or None)]}; generation 1 is the
    synthetic arm / the chain's edit arm, restricted to the chain seeds."""
    p, b = exp.chain_edit
    first = {"synthetic chain": "synthetic", "toedit chain": edit_arm_name(p, b)}
    out = {}
    for name, gen1 in first.items():
        out[name] = []
        for gen in range(1, exp.generations + 1):
            rs = [r for r in rows if r["seed"] in exp.chain_seeds
                  and (r["arm"] == gen1 if gen == 1 else (r["arm"] == name and r["generation"] == gen))]
            m, se, _ = mean_spread([r["nll"] for r in rs])
            ch = [r["changed_rate"] for r in rs if r["changed_rate"] != ""]
            out[name].append((gen, m, se, float(np.mean(ch)) if ch else None))
    return out


def chain_lines(exp, rows, h):
    t = chain_table(exp, rows)
    p, b = exp.chain_edit
    table = [[g, pm(sm, sse, nd=4), pm(em, ese, nd=4), f"{ech:.2%}" if ech is not None else "—"]
             for (g, sm, sse, _), (_, em, ese, ech) in zip(t["synthetic chain"], t["toedit chain"])]
    syn = [x[1] for x in t["synthetic chain"]]
    edt = [x[1] for x in t["toedit chain"]]
    return [
        f"## Iterative chains (generation n's prior = generation n − 1's student; seeds {list(exp.chain_seeds)})", "",
        f"Synthetic chain: generation n trains on the human prefixes continued by generation n − 1 at T = 1 "
        f"(generation 1 = the synthetic arm). Edit chain: generation n trains on ToEdit(H) with p = {p:g}, "
        f"beta = {b:g}, prior = generation n − 1 (generation 1 = that ToEdit arm). Same token budget per "
        f"generation; human-trained students: {h['nll']:.4f}.", "",
        markdown_table(["generation", "synthetic chain NLL ± se", "edit chain NLL ± se", "edit chain changed"], table),
        "",
        f"Reading: the synthetic chain goes {' → '.join(f'{x:.4f}' for x in syn)} "
        f"({'rising every generation' if all(a < c for a, c in zip(syn, syn[1:])) else 'not rising every generation'}, "
        f"{syn[-1] - syn[0]:+.4f} from generation 1 to {exp.generations}); the edit chain goes "
        f"{' → '.join(f'{x:.4f}' for x in edt)} ({edt[-1] - edt[0]:+.4f}).", ""]


def plot(exp, rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = summary(exp, rows)
    mixes = [r for r in s if r["p"] is None]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, pts in chain_table(exp, rows).items():
        ax2.errorbar([x[0] for x in pts], [x[1] for x in pts], [x[2] for x in pts], fmt="o-", label=name)
    ax2.axhline(next(r["nll"] for r in s if r["arm"] == "human"), color="gray", ls="--", label="human")
    ax2.set_xlabel("generation")
    ax2.set_ylabel("held-out human NLL (nats/byte)")
    ax2.legend(fontsize=8)
    ax.errorbar([r["share"] for r in mixes], [r["nll"] for r in mixes], [r["se"] for r in mixes], fmt="o-",
                label="human + synthetic mix")
    for r in s:
        if r["p"] is not None:
            ax.errorbar([0.0], [r["nll"]], [r["se"]], fmt="s", label=f"ToEdit {r['arm'][7:]} ({r['changed_rate']:.2%} changed)")
    ax.set_xlabel("synthetic share of the training pieces")
    ax.set_ylabel("held-out human NLL (nats/byte)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    main(sys.argv[1:])

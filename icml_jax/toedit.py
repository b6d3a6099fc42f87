"""``python -m icml_jax.toedit``: ToEdit a corpus with a trained prior (``icml_jax/analysis/toedit.py``).

  python -m icml_jax.toedit --checkpoint=WORKDIR --out=edited.jsonl [--split=train] [--p=0.99]
      [--k=8] [--beta=1.0] [--compare=ge] [--drop_below=0] [--seed=0] [--data_name=] [--data_path=]

Every setting and the output path are checked before JAX loads; a bad one stops with one line.
"""
from __future__ import annotations

import os
import sys

from icml_jax.data import sources
from icml_jax.analysis.toedit import (COMPARES, ToEditConfig, banned_for, edit_corpus, edit_stats,
                                      edited_texts, write_edited)


def _parse(argv):
    import argparse  # pylint: disable=g-import-not-at-top
    ap = argparse.ArgumentParser(prog="python -m icml_jax.toedit",
                                 description="ToEdit: resample the tokens a prior finds predictable.")
    ap.add_argument("--checkpoint", required=True, help="training workdir of the prior")
    ap.add_argument("--out", required=True, help="edited corpus, JSONL (must not exist)")
    ap.add_argument("--split", default="train")
    ap.add_argument("--data_name", default="", help="another corpus (config.data.name semantics)")
    ap.add_argument("--data_path", default="", help="its config.data.path")
    ap.add_argument("--p", type=float, default=0.99)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--beta", type=float, default=1.0)
    ap.add_argument("--compare", default="ge", choices=COMPARES)
    ap.add_argument("--drop_below", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch_size", type=int, default=16)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = _parse(argv)
    from icml_jax import xla_env  # pylint: disable=g-import-not-at-top
    xla_env.restart_with_hugepages()  # before the checks below read the corpus (they would run twice)
    from icml_jax.train import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
    cfg = ToEditConfig(args.p, args.k, args.beta, args.compare, args.drop_below)
    try:  # everything checkable before JAX loads anything
        config, tok = workdir_lib.read_workdir(args.checkpoint)
        cfg.check(config.model.vocab_size)
        if args.batch_size < 1:
            raise ValueError(f"--batch_size={args.batch_size} must be >= 1")
        for path in (args.out, args.out + ".stats.json"):
            if os.path.exists(path):
                raise ValueError(f"{path} exists; pick a new --out (an edited corpus is never overwritten)")
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
            raise ValueError(f"--out={args.out}: its folder does not exist")
        data_cfg = config.data
        if args.data_name:
            data_cfg.name = args.data_name
        if args.data_path:
            data_cfg.path = args.data_path
        source = sources.get_split_source(data_cfg, args.split)  # reads the text, not JAX
    except (ValueError, OSError, workdir_lib.WorkdirError) as e:
        raise SystemExit(f"toedit: {str(e).strip()}") from None
    xla_env.use_defaults()
    import jax  # pylint: disable=g-import-not-at-top

    from icml_jax.data.pipeline import tokenize_source  # pylint: disable=g-import-not-at-top
    corpus = tokenize_source(source, tok, min(int(data_cfg.seq_len), int(config.model.max_seq_len)))
    try:
        params, step = workdir_lib.latest_params(args.checkpoint, config.model)
    except workdir_lib.WorkdirError as e:
        raise SystemExit(f"toedit: {e}") from None
    tokens, hit, dropped = edit_corpus(config.model, params, corpus, jax.random.key(args.seed), cfg,
                                       banned_for(tok, config.model.vocab_size), args.batch_size)
    stats = edit_stats(corpus, corpus.tokens, tokens, hit, dropped, cfg)
    stats.update(prior=f"{args.checkpoint} step {step}", split=args.split, seed=args.seed,
                 corpus=f"{data_cfg.name}:{data_cfg.path}" if data_cfg.path else data_cfg.name)
    write_edited(args.out, edited_texts(tok, corpus, tokens, dropped), stats)
    print(f"toedit: {stats['documents']} documents, {stats['scored_tokens']} tokens, edit rate "
          f"{stats['edit_rate']:.2%} (changed {stats['changed_rate']:.2%}) -> {args.out}")
    return stats


if __name__ == "__main__":
    main(sys.argv[1:])

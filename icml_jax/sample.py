"""Print continuations of prompts from a trained workdir or an HF model folder (KV-cache decoding).

    python -m icml_jax.sample --checkpoint=runs/demo --prompt="ROMEO." --max_new_tokens=200
    python -m icml_jax.sample --hf=path/to/hf_folder --prompt="Hello" --prompt="Once" \
        --temperature=0.7 --top_p=0.9 --num_samples=2

``--checkpoint`` reads WORKDIR/config.json (written by the trainer) and restores only the params of
the newest readable step under WORKDIR/checkpoints (an unreadable step is skipped with a warning;
nothing is moved or deleted). ``--hf`` loads the weights with ``icml_jax.interop.load_hf`` and the
tokenizer from the folder's ``tokenizer.json``.
"""
from __future__ import annotations

import logging as std_logging
import os
import sys

from absl import app, flags

from icml_jax import logs, xla_env
from icml_jax.data.tokenizers import continuation_text, prompt_ids  # noqa: F401 (re-exported)
from icml_jax.train import workdir as workdir_lib  # no JAX: the inputs are checked first

# JAX, flax and orbax are imported only once the inputs have been checked (config.json, the
# checkpoints/ folder, the prompts' lengths), so a mistyped command fails in well under a second.

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "a training workdir (with config.json and checkpoints/)")
flags.DEFINE_string("hf", None, "an HF model folder (config.json, model.safetensors, tokenizer.json)")
flags.DEFINE_multi_string("prompt", None, "prompt text; repeat the flag for several prompts")
flags.DEFINE_integer("max_new_tokens", 200, "tokens to generate per sample at most")
flags.DEFINE_float("temperature", 0.8, "sampling temperature; 0 = greedy")
flags.DEFINE_integer("top_k", 0, "keep only the k most likely tokens (0 = off)")
flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass (1 = off)")
flags.DEFINE_integer("seed", 0, "random seed")
flags.DEFINE_integer("num_samples", 1, "samples per prompt")


class SampleError(RuntimeError):
    """A problem with the inputs, reported as one line without a traceback."""


def load_hf_folder(path: str):
    try:
        from icml_jax.interop import load_hf, load_hf_tokenizer  # pylint: disable=g-import-not-at-top
    except ImportError as e:
        raise SampleError(f"--hf is not available: icml_jax.interop could not be imported ({e})") from e
    if not os.path.isdir(path):
        raise SampleError(f"--hf={path}: no such folder")
    try:
        model_cfg, params = load_hf(path)
        return model_cfg, params, load_hf_tokenizer(path, require_eos=False), path
    except (ValueError, KeyError, OSError) as e:  # interop errors name the file and the tensor
        raise SampleError(f"--hf={path}: {str(e).strip(chr(34) + chr(39))}") from None


def check_model_flags(checkpoint: str | None, hf: str | None) -> None:
    if bool(checkpoint) == bool(hf):
        raise SampleError("pass exactly one of --checkpoint=WORKDIR or --hf=PATH")


def read_model(checkpoint: str | None, hf: str | None):
    """(model_cfg, params, tokenizer, where) of ``--checkpoint`` or ``--hf``. A workdir is only read
    and checked here, without JAX (params None: ``load_params`` once the other inputs are good);
    an HF folder is loaded whole. Shared by ``sample``, ``evaluate`` and the lm-eval adapter."""
    check_model_flags(checkpoint, hf)
    if checkpoint:
        config, tok = workdir_lib.read_workdir(checkpoint)
        return config.model, None, tok, checkpoint
    return load_hf_folder(hf)


def load_params(checkpoint: str, model_cfg):
    """(params of the newest readable step, "WORKDIR step N")."""
    params, step = workdir_lib.latest_params(checkpoint, model_cfg)
    return params, f"{checkpoint} step {step}"


def run(argv_flags) -> list[str]:
    """Checks the inputs, then loads the model; prints and returns one continuation per
    (prompt, sample)."""
    f = argv_flags
    check_model_flags(f.checkpoint, f.hf)
    if not f.prompt:
        raise SampleError('pass at least one --prompt="..."')
    if f.num_samples < 1:
        raise SampleError(f"--num_samples={f.num_samples} must be >= 1")
    model_cfg, params, tok, where = read_model(f.checkpoint, f.hf)
    encoded = [prompt_ids(tok, p) for p in f.prompt]
    for p, e in zip(f.prompt, encoded):
        if not e:
            raise SampleError(f"prompt {p!r} encodes to no tokens (the tokenizer's template adds none); "
                              "give a non-empty prompt")
    for p, e in zip(f.prompt, encoded):
        if len(e) + f.max_new_tokens > model_cfg.max_seq_len:
            raise SampleError(
                f"prompt {p[:40]!r}... is {len(e)} tokens; with --max_new_tokens={f.max_new_tokens} "
                f"that exceeds the model's max_seq_len={model_cfg.max_seq_len}; shorten the prompt or "
                "lower --max_new_tokens")
    xla_env.use_compilation_cache()  # imports JAX: only once the inputs are known to be good
    if params is None:
        params, where = load_params(f.checkpoint, model_cfg)
    stops = tuple(getattr(tok, "eos_ids", (tok.eos_id,)))
    if not stops:
        print(f"warning: the tokenizer has no EOS token: every sample runs to --max_new_tokens="
              f"{f.max_new_tokens}", file=sys.stderr)
    rows = [e for e in encoded for _ in range(f.num_samples)]
    import jax  # pylint: disable=g-import-not-at-top

    from icml_jax.inference import decode  # pylint: disable=g-import-not-at-top
    try:
        out = decode.generate(model_cfg, params, rows, key=jax.random.key(f.seed),
                              max_new_tokens=f.max_new_tokens, temperature=f.temperature,
                              top_k=f.top_k, top_p=f.top_p, stop_tokens=stops, pad_id=tok.pad_id)
    except ValueError as e:
        raise SampleError(str(e)) from e
    print(f"# {where}: {len(rows)} sample(s), temperature={f.temperature} top_k={f.top_k} "
          f"top_p={f.top_p} seed={f.seed}")
    texts = []
    for i, (row, n) in enumerate(zip(out.tokens, out.lengths)):
        ids = row[:n].tolist()
        if ids and ids[-1] in stops:
            ids = ids[:-1]
        text = continuation_text(tok, f.prompt[i // f.num_samples], rows[i], ids)
        texts.append(text)
        print(f"--- sample {i % f.num_samples + 1} of prompt {i // f.num_samples + 1} ---\n{text}")
    return texts


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logs.show_own_logs(others=std_logging.ERROR)  # orbax logs restores at INFO/WARNING
    xla_env.use_default_flags()  # before the first JAX computation (the cache: once the inputs are checked)
    try:
        run(FLAGS)
    except (SampleError, workdir_lib.WorkdirError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    xla_env.restart_with_hugepages()  # before absl reads a --flagfile, which may be a pipe
    app.run(main)

"""Entry point: ``python -m icml_jax.main --config=configs/lm.py:PRESET --workdir=DIR [--config.a.b=v]``.

Rerunning the same command in the same workdir resumes from the latest checkpoint.
"""
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/lm.py:small.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    from icml_jax.train import checkpoint as ckpt_lib
    from icml_jax.train import trainer

    try:
        trainer.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    except (ValueError, FileNotFoundError, ckpt_lib.CheckpointError,
            trainer.NonFiniteLossError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


def run():
    """app.run with config-override mistakes reported in one line instead of a traceback."""
    try:
        app.run(main)
    except (KeyError, AttributeError) as e:
        if flags.FLAGS.is_parsed():  # not a flag-parsing failure: a real bug, keep the traceback
            raise
        bad = [a for a in sys.argv[1:] if a.startswith("--config.")]
        msg = str(e).strip("'\"").replace("\\n", " ").replace("\\'", "'").replace('\\"', '"')
        print(f"error: unknown config key in {' '.join(bad) or 'the config'}: {msg}. "
              "List the valid keys with `python -c \"from icml_jax.config_utils import load_config; "
              "print(load_config('CONFIG.py:PRESET'))\"`.", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run()

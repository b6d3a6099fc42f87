"""EleutherAI's lm-evaluation-harness (``lm_eval``, the ``eval`` extra) on our models
(docs/evaluation.md).

``IcmlJaxLM`` is an ``lm_eval.api.model.LM`` registered as ``icml_jax``; it answers
``loglikelihood``, ``loglikelihood_rolling`` and ``generate_until`` with
``icml_jax.analysis.lm_scoring.TextLM`` (batched, jitted, fixed shapes in power-of-two length
buckets). Run the harness through this module so that the registration happens first:

    python -m icml_jax.lm_eval_adapter run --model icml_jax \
        --model_args checkpoint=runs/demo --batch_size 16 --tasks hellaswag --limit 100
    python -m icml_jax.lm_eval_adapter run --model icml_jax --model_args hf=path/to/hf_folder \
        --tasks my_task --include_path path/to/task_yamls

or from Python: ``lm_eval.simple_evaluate(model=IcmlJaxLM(checkpoint="runs/demo"), tasks=[...])``.
Model arguments: ``checkpoint=WORKDIR`` or ``hf=FOLDER`` (loaded as ``python -m icml_jax.sample``
loads them), ``max_gen_toks`` (default 256),
``min_bucket`` (shortest padded length, default 32), ``seed`` (sampling when a task asks for it).
The rows per jitted batch are the harness's own ``--batch_size`` (its default, 1, is slow: pass
8-64; "auto" means 8).
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

from tqdm import tqdm

from icml_jax.sample import load_params, read_model

try:
    import lm_eval.models  # noqa: F401 (the built-in models' lazy entries: lm-eval adds them only
    # to an empty registry, so registering ours first would hide `hf`, `vllm`, ...)
    from lm_eval.api.model import LM as _Base
    from lm_eval.api.registry import register_model
except ImportError:  # lm_eval is optional (the `eval` extra): the class still works on its own
    _Base = object

    def register_model(*_names):
        return lambda cls: cls

NAME = "icml_jax"
# what lm-eval's command line adds to every model's arguments besides batch_size (ignored here)
_HARNESS_KEYS = {"device", "max_batch_size"}


class IcmlJaxLM(_Base):
    """Our decoder behind lm-eval's three request kinds (module docstring). ``requests`` are
    ``lm_eval.api.instance.Instance`` objects; only their ``args`` are read."""

    def __init__(self, checkpoint: str | None = None, hf: str | None = None, *,
                 model=None, batch_size: int | str = 8, max_gen_toks: int = 256,
                 min_bucket: int = 32, seed: int = 0, **_harness_kwargs):
        """``model``: an already loaded ``(model_cfg, params, tokenizer)`` instead of a path.
        ``_harness_kwargs``: what the harness adds for every model (device, max_batch_size, ...),
        ignored: the params already live where JAX put them."""
        if _Base is not object:
            super().__init__()
        unknown = sorted(set(_harness_kwargs) - _HARNESS_KEYS)
        if unknown:
            raise ValueError(f"icml_jax model_args: unknown {unknown}; expected checkpoint= or hf=, "
                             "max_gen_toks=, min_bucket=, seed= (rows per batch: --batch_size)")
        if model is None:
            model_cfg, params, tok, where = read_model(checkpoint, hf)
            if params is None:
                params, where = load_params(checkpoint, model_cfg)
        else:
            (model_cfg, params, tok), where = model, "in-memory model"
        from icml_jax.analysis.lm_scoring import TextLM  # pylint: disable=g-import-not-at-top
        bs = 8 if batch_size in ("auto", None) else int(str(batch_size).split(":")[0])
        self.lm = TextLM(model_cfg, params, tok, batch_size=bs, min_bucket=int(min_bucket),
                         seed=int(seed))
        self.where, self.max_gen_toks = where, int(max_gen_toks)

    def _cache(self, kind: str, requests, results) -> None:
        hook = getattr(self, "cache_hook", None)
        if hook is not None:
            for req, res in zip(requests, results):
                hook.add_partial(kind, req.args, res)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        with tqdm(total=len(requests), desc="loglikelihood", disable=disable_tqdm) as bar:
            out = self.lm.loglikelihood([tuple(r.args[:2]) for r in requests], progress=bar.update)
        self._cache("loglikelihood", requests, out)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        with tqdm(total=len(requests), desc="loglikelihood_rolling", disable=disable_tqdm) as bar:
            out = self.lm.loglikelihood_rolling([r.args[0] for r in requests], progress=bar.update)
        self._cache("loglikelihood_rolling", requests, out)
        return out

    def _settings(self, gen_kwargs: dict) -> tuple[tuple[str, ...], int, float]:
        kw = dict(gen_kwargs or {})
        until = kw.pop("until", None) or []
        until = (until,) if isinstance(until, str) else tuple(until)
        max_new = int(kw.pop("max_gen_toks", self.max_gen_toks))
        temperature = float(kw.pop("temperature", 0.0) or 0.0)
        if not kw.pop("do_sample", temperature > 0):
            temperature = 0.0
        return until, max_new, temperature

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests with the same (until, max_gen_toks, temperature) are decoded together."""
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(self._settings(r.args[1]), []).append(i)
        out: list[str] = [""] * len(requests)
        with tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm) as bar:
            for (until, max_new, temperature), idx in groups.items():
                texts = self.lm.generate([requests[i].args[0] for i in idx], max_new, until=until,
                                         temperature=temperature, progress=bar.update)
                for i, t in zip(idx, texts):
                    out[i] = t
        self._cache("generate_until", requests, out)
        return out


if __name__ != "__main__":  # run as a script, the importable module registers it (below)
    register_model(NAME)(IcmlJaxLM)


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's own command line, with ``icml_jax`` registered."""
    if _Base is object:
        sys.exit("error: lm_eval is not installed; pip install -c constraints.txt -e '.[eval]'")
    from lm_eval.__main__ import cli_evaluate  # pylint: disable=g-import-not-at-top
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    from icml_jax import lm_eval_adapter  # pylint: disable=g-import-not-at-top,import-self
    lm_eval_adapter.main()

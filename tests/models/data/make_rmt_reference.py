"""How ``rmt_reference.npz`` was made (run once, by hand; not part of the test suite).

It runs the authors' RMT (``RMTModel`` in ``src/models/rmt/`` of bmac3/residual-matrix-transformer
at commit 1afac0c; their code is NOT in this repository) on the parity config below and
dumps inputs, weights and outputs:

    git --git-dir=<mirror of that repo> archive HEAD src | tar -x -C /tmp/rmt_ref
    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install "jax[cpu]==0.4.35" haliax==1.3 equinox==0.11.8 jmp jaxtyping \
        msgspec optax==0.2.4
    PYTHONPATH=/tmp/rmt_ref /tmp/refvenv/bin/python make_rmt_reference.py OUT.npz

(jax 0.4.35: haliax 1.3 imports ``jax._src.tree_util.BuiltInKeyEntry``, gone in later jax; their
package's ``src/__init__`` imports grain / datasets / transformers for the data pipeline, which
are replaced by ``MagicMock`` modules here; the model does not use them. ``query_zero_init`` is
passed as False: in their code that branch calls ``weight.at[...]``, which haliax 1.3's
NamedArray lacks, and its result is discarded anyway (``qkv_linear.set`` returns a new module that
is never assigned), so skipping it changes nothing — ``init_query_absmax`` shows the query slice
is random at init either way.)

Config: V = 7, L = 2, R = 2, Dv = 4, Dk = 3, N_ff = 6, float64 throughout
(``jax_enable_x64``, full_dtype = half_dtype = float64), reference defaults otherwise (ALiBi,
RMSNorm eps 1e-6, logits / (layer+1), muP multipliers 1). Every array leaf of the model — the
query slice and the unembedding included — is overwritten with 0.5·N(0, 1) (norm gains with
1 + 0.3·N(0, 1)) so the comparison is non-trivial. Input tokens [1, 4, 2, 6], targets
[4, 2, 6, 3], causal mask.

Stored: ``tokens``, ``targets``, ``logits`` [4, 7], ``ce`` (mean CE), ``logz2`` (mean log Z²),
``zloss`` (mean of CE + 1e-4·log Z², the reference's training objective), and every weight as
``w/<path>`` with its haliax axis names in ``axes/<path>`` (input axes first, then output axes;
stacked layers have a leading ``Layer`` axis). Also ``init_logits_max``: max |logit| of the
model as initialised (zero unembedding), and ``init_query_absmax``: max |query slice| at init
(the reference's query zeroing is a no-op, so it is not 0).
"""
import sys
from unittest import mock

import numpy as np

for _name in ("grain", "grain.python", "datasets", "transformers"):
    sys.modules[_name] = mock.MagicMock()


def main(out_path):
    import jax
    jax.config.update("jax_enable_x64", True)
    import haliax as hax
    import jax.numpy as jnp
    from src.models.rmt import RMTConfig, RMTModel
    from src.nn import z_loss, cross_entropy_loss

    cfg = RMTConfig.init(vocab_size=7, rank=2, reskey_dim=3, resval_dim=4, n_layers=2, n_neurons=6,
                         query_zero_init=False,  # see the docstring: that branch is a no-op
                         half_dtype=jnp.float64, full_dtype=jnp.float64)
    model = RMTModel.init(cfg, jax.random.PRNGKey(0))
    Pos, KVPos = hax.Axis("Pos", 4), hax.Axis("KVPos", 4)
    tokens = np.array([1, 4, 2, 6], np.int32)
    targets = np.array([4, 2, 6, 3], np.int32)
    ids = hax.NamedArray(jnp.asarray(tokens), (Pos,))
    tgt = hax.NamedArray(jnp.asarray(targets), (Pos,))
    causal = np.tril(np.ones((4, 4), bool))
    mask = hax.NamedArray(jnp.asarray(causal), (Pos, KVPos))

    out = {"tokens": tokens, "targets": targets}
    out["init_logits_max"] = np.array(float(jnp.max(jnp.abs(model(ids, mask).array))))
    qkv = model.module.rmt_stack.stacked.attention.module.qkv_linear.param.weight
    out["init_query_absmax"] = np.array(float(jnp.max(jnp.abs(qkv[{"QKV": 0}].array))))

    is_named = lambda x: isinstance(x, hax.NamedArray)  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_named)
    rng = np.random.RandomState(0)
    new = []
    for path, leaf in leaves:
        if not is_named(leaf):
            new.append(leaf)
            continue
        key = jax.tree_util.keystr(path)
        noise = rng.randn(*leaf.array.shape)
        w = 1.0 + 0.3 * noise if ".norm." in key else 0.5 * noise
        out[f"w/{key}"] = w
        out[f"axes/{key}"] = np.array([a.name for a in leaf.axes])
        new.append(hax.NamedArray(jnp.asarray(w, jnp.float64), leaf.axes))
    model = jax.tree_util.tree_unflatten(treedef, new)

    logits = model(ids, mask)
    out["logits"] = np.asarray(logits.array)
    out["ce"] = np.array(float(cross_entropy_loss(logits, "Vocab", tgt).mean().scalar()))
    out["zloss"] = np.array(float(z_loss(logits, "Vocab", tgt).mean().scalar()))
    logz = jax.nn.logsumexp(np.asarray(logits.array), axis=-1)
    out["logz2"] = np.array(float(np.mean(np.asarray(logz) ** 2)))
    np.savez(out_path, **out)
    for k, v in out.items():
        print(k, v.shape, v if v.size < 8 else "")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "rmt_reference.npz")

"""Per-layer block layouts (models/hetero.py): the parent's own layout is the parent, parameter
counts are exact, KV-cache decoding equals the full forward, bad layouts fail before any work,
and a heterogeneous run resumes exactly.

Inits and forwards are jitted (tests/README.md: an eager init compiles every primitive), and each
layout's init is made once per module (``_init``)."""
import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta

from icml_jax.config_utils import load_config
from icml_jax.inference.decode import generate
from icml_jax.models import build_model, contract, hetero
from icml_jax.models.residual import standard_param_count
from icml_jax.analysis.flops import train_flops_per_token
from tests.train.helpers import train_in_process, train_losses


def _cfg(attention="", ffn=""):
    m = load_config("configs/lm.py:tiny", unlocked=True).model  # 2 layers, 4 heads, 2 KV heads, F 64
    m.blocks.attention, m.blocks.ffn = attention, ffn
    return m


TOKENS = jnp.asarray(np.random.RandomState(0).randint(3, 250, (2, 12)))


_INITS = {}  # model config (JSON) -> its params


def _init(m):
    """``m``'s params for ``TOKENS``' shape (one jitted init per distinct model config, shared by
    the tests: read them, never change them in place)."""
    key = m.to_json_best_effort(sort_keys=True)
    if key not in _INITS:
        _INITS[key] = meta.unbox(jax.jit(build_model(m).init)(jax.random.key(1), TOKENS)["params"])
    return _INITS[key]


def _forward(m, params, tokens, **kw):
    """``build_model(m).apply({"params": params}, tokens, **kw)``, jitted."""
    return jax.jit(functools.partial(build_model(m).apply, **kw))({"params": params}, tokens)


def test_the_parents_own_layout_is_the_parent():
    parent = _cfg()
    p = _init(parent)
    same = _cfg("2,2", "64,64")
    assert hetero.is_hetero(same) and not hetero.is_hetero(parent)
    want = _forward(parent, p, TOKENS)
    got = _forward(same, p, TOKENS)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert standard_param_count(same) == standard_param_count(parent)
    assert train_flops_per_token(same, 12) == train_flops_per_token(parent, 12)


@pytest.mark.parametrize("attention,ffn", [("1,linear", "noop,32"), ("noop,4", "linear,16")])
def test_param_count_is_exact_and_variants_have_their_shapes(attention, ffn):
    m = _cfg(attention, ffn)
    p = _init(m)
    assert sum(x.size for x in jax.tree.leaves(p)) == standard_param_count(m)
    for i, (a, f) in enumerate(hetero.layout(m)):
        layer = p[f"layer_{i}"]
        if a == "noop":
            assert "attn" not in layer and "attn_norm" not in layer
        elif a == "linear":
            assert layer["attn"]["kernel"].shape == (32, 32)
        else:
            assert layer["attn"]["qkv"].shape[1] == a
        if f == "noop":
            assert "mlp" not in layer
        elif f == "linear":
            assert layer["mlp"]["kernel"].shape == (32, 32)
        else:
            assert layer["mlp"]["wo"].shape == (f, 32)
    # KV bytes only from softmax-attention layers
    kv = hetero.kv_bytes_per_token(m, bytes_per_value=4)
    assert kv == sum(2 * a * 8 * 4 for a, _ in hetero.layout(m) if isinstance(a, int))


def test_noop_layers_leave_the_stream_alone_and_hidden_states_are_sown():
    m = _cfg("noop,noop", "noop,noop")
    p = _init(m)
    logits, st = _forward(m, p, TOKENS, mutable=["hidden"])
    emb = p["io"]["embedding"][TOKENS]
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(st["hidden"][f"h_{i}"][0]), np.asarray(emb))
    assert set(p) == {"io"}  # nothing but the embedding and the final norm


def test_kv_cache_decoding_equals_the_full_forward():
    m = _cfg("1,linear", "32,noop")
    p = _init(m)
    prompt = [5, 6, 7, 8, 9]
    out = generate(m, p, [prompt, [11, 12]], key=jax.random.key(0), max_new_tokens=5, temperature=0)
    seq = jnp.asarray([prompt + list(out.tokens[0])])
    full = _forward(m, p, seq)
    np.testing.assert_array_equal(np.argmax(np.asarray(full[0, len(prompt) - 1:-1]), -1), out.tokens[0])


@pytest.mark.parametrize("attention,ffn,extra,msg", [
    ("1,2,1", "", {}, "3 entries for num_layers=2"),
    ("3,2", "", {}, "does not divide num_heads"),
    ("", "64,wide", {}, "entry 1 is 'wide'"),
    ("1,linear", "", {"scan_layers": True}, "config.model.scan_layers"),
    ("1,linear", "", {"lowrank": 4}, "config.model.lowrank"),
])
def test_bad_layouts_fail_with_the_key(attention, ffn, extra, msg):
    m = _cfg(attention, ffn)
    m.update(extra)
    with pytest.raises(ValueError, match=msg):
        contract.validate(m)


def test_save_initial_writes_a_step_0_run_that_trains_and_resumes_exactly(tmp_path,
                                                                          session_tfds_dir):
    """save_initial writes step 0 of a heterogeneous run (and refuses a used workdir and params
    of another layout); the trainer resumes that run from step 0; a copy of it stopped after
    step 2 resumes exactly (the same losses and params). One run serves both properties."""
    from icml_jax.train import trainer
    from icml_jax.train.checkpoint import restore_model_params
    from tests.train.helpers import cli_config
    args = ("--config.train.steps=4", "--config.train.checkpoint_every=2", "--config.train.eval_every=4",
            "--config.train.samples=0", "--config.model.blocks.attention=1,linear",
            "--config.model.blocks.ffn=noop,32")
    cfg = cli_config("configs/lm.py:tiny", *args)
    cfg.data.data_dir = session_tfds_dir
    params = _init(cfg.model)
    params = jax.tree.map(lambda x: np.asarray(x) + 0.5, params)  # not what a fresh init would make
    ref = tmp_path / "ref"
    trainer.save_initial(cfg, str(ref), params)
    got, step = restore_model_params(str(ref), cfg.model)
    assert step == 0
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), got, params)
    with pytest.raises(ValueError, match="already holds checkpoints"):
        trainer.save_initial(cfg, str(ref), params)
    bad = _cfg("2,2", "64,64")
    with pytest.raises(ValueError, match="do not fit config.model"):
        cfg2 = cli_config("configs/lm.py:tiny", *args[:4])
        trainer.save_initial(cfg2, str(tmp_path / "other"), _init(bad) | {"extra": {"w": np.zeros(2)}})
    assert not os.path.exists(tmp_path / "other")

    state, summary = train_in_process(ref, *args, data_dir=session_tfds_dir, with_state=True)
    assert summary["start_step"] == 0 and os.path.exists(ref / "checkpoints" / "2")
    assert state.params["layer_1"]["attn"]["kernel"].shape == (32, 32)
    stopped = tmp_path / "stopped"
    shutil.copytree(ref, stopped)
    shutil.rmtree(stopped / "checkpoints" / "4")
    state2, summary = train_in_process(stopped, *args, data_dir=session_tfds_dir, with_state=True)
    assert summary["start_step"] == 2
    want, got = train_losses(ref), train_losses(stopped)
    np.testing.assert_allclose([got[s] for s in (3, 4)], [want[s] for s in (3, 4)], rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6),
                 state2.params, state.params)
    assert os.path.exists(stopped / "checkpoints" / "4")


def test_counts_include_qkv_biases_and_a_model_without_attention_decodes():
    m = _cfg("1,2", "32,64")
    m.qkv_bias = True
    assert sum(x.size for x in jax.tree.leaves(_init(m))) == standard_param_count(m)
    parent = _cfg()
    parent.qkv_bias = True
    assert sum(x.size for x in jax.tree.leaves(_init(parent))) == standard_param_count(parent)
    m = _cfg("linear,noop", "32,noop")  # no softmax attention anywhere: no KV cache at all
    p = _init(m)
    out = generate(m, p, [[5, 6, 7]], key=jax.random.key(0), max_new_tokens=3, temperature=0)
    full = _forward(m, p, jnp.asarray([[5, 6, 7] + list(out.tokens[0])]))
    np.testing.assert_array_equal(np.argmax(np.asarray(full[0, 2:-1]), -1), out.tokens[0])


def test_building_a_scanned_heterogeneous_model_fails():
    m = _cfg("1,2", "")
    m.scan_layers = True
    with pytest.raises(ValueError, match="scan_layers"):
        build_model(m).init(jax.random.key(0), TOKENS)

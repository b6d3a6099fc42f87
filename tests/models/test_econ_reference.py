"""ECON modules (icml_jax/models/econ.py): numerical parity with the authors' own code, executed.

How ``data/econ_reference.npz`` was made (once, by hand; not part of the suite). The generator,
``make_fixture.py``, lives outside this repository, because the project does not copy reference
code and the script imports it. It took the authors' repository tmlr-group/ECON at commit 3dafaef,
extracted ``src/modules`` (``git archive HEAD src/modules``), imported and EXECUTED, unchanged,
with torch 2.13 (CPU) in float64 (``.double()``):

* ``BeliefNetwork`` (src/modules/agents/transformer_agent.py, with its ``PositionalEncoding`` and
  ``TransformerBlock``),
* ``BeliefEncoder`` (src/modules/belief_encoder.py),
* ``LLMQMixer.forward`` (src/modules/mixer/mix_llm.py).

Only imports the forward passes never use were stubbed: ``modules.llm.llm_wrapper`` (the LLM API
client the mixer's constructor instantiates) and ``loguru``. All three modules ran in eval mode
(dropout off: the reference's 0.1 is constructed and switched off by ``.eval()``; ours has none)
on UNPADDED tokens (no pad id drawn, ``mask=None``: the reference's padding mask is buggy, quirk
11 of docs/methods/econ.md). Our Flax modules were initialised for their shapes, every leaf was
overwritten from numpy seed 20250709 (kernels N(0, 1/fan_in), embeddings N(0, 1), biases
0.3·N(0, 1), LayerNorm scales 1 + 0.3·N(0, 1), all rounded to float32-representable values) and
copied into the reference modules (``load_state_dict``; every reference parameter is set except
the mixer's ``commitment_eval`` / ``reward_weight_network``, which its forward does not use).

Sizes: batch 2, n_agents 3, 6 tokens, vocab 16, hidden 16, belief 8, 2 heads, 2 layers
(BeliefNetwork); belief 8, 2 heads (BeliefEncoder); the mixer's effective reference widths
(mixing 32, F_i 64, w_i 32, hypernet hidden 128, 2 heads over the 2-d actions), commitment dim 6.
The reference ran as the pipeline does: one (shared) belief network over all 6 sequences ->
beliefs [2, 3, 8] -> encoder -> E -> mixer(q, e = (T, p), E). Stored: ``tokens``; our params as
``params/{net,enc,mix}/<flax path>`` (float32, exact); the reference outputs ``ref/*`` in
float64 (belief, q, temperature, top_p, their logits, the group E, q_tot, F_i, F_i projected for
L_SD, the mixing weights |w1|, |w2| via forward hooks, and its float32 positional table).
"""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from icml_jax.models import econ as M

DATA = os.path.join(os.path.dirname(__file__), "data", "econ_reference.npz")
BELIEF_KEYS = ("belief", "q", "temperature", "top_p", "t_logit", "p_logit")
ALL_KEYS = BELIEF_KEYS + ("group", "q_tot", "features", "features_sd", "w1", "w2")


@functools.cache
def _fixture():
    z = np.load(DATA)
    size = {k[5:]: int(z[k]) for k in z.files if k.startswith("size/")}
    params = {m: {k[len(f"params/{m}/"):]: z[k] for k in z.files if k.startswith(f"params/{m}/")}
              for m in ("net", "enc", "mix")}
    ref = {k[4:]: z[k] for k in z.files if k.startswith("ref/")}
    return size, z["tokens"], params, ref


def _modules(s):
    net = M.BeliefNetwork(vocab_size=s["vocab"], hidden_dim=s["hidden"], belief_dim=s["belief"],
                          heads=s["heads"], layers=s["layers"], max_len=s["L"], pad_id=0)
    enc = M.BeliefEncoder(belief_dim=s["belief"], heads=s["enc_heads"])
    mix = M.Mixer(s["N"], s["commit_dim"], mixing_dim=s["mixing_dim"], feature_dim=s["feature_dim"],
                  hyper_hidden=s["hyper_hidden"], action_heads=s["action_heads"])
    return net, enc, mix


def _run(dtype):
    """Our three modules on the fixture: each fed the reference's upstream outputs (module
    isolation), plus ours chained end to end (tokens -> q_tot). One jitted program."""
    s, tokens, params, ref = _fixture()
    net, enc, mix = _modules(s)
    B, N, L = s["B"], s["N"], s["L"]
    p = {m: traverse_util.unflatten_dict({k: jnp.asarray(v, dtype) for k, v in d.items()}, sep="/")
         for m, d in params.items()}
    r = {k: jnp.asarray(ref[k], dtype) for k in ("belief", "q", "temperature", "top_p", "group")}

    @jax.jit
    def run(p, r, tokens):
        o = net.apply({"params": p["net"]}, tokens.reshape(B * N, L))
        o = {k: o[k].reshape((B, N) + o[k].shape[1:]) for k in BELIEF_KEYS}
        o["group"] = enc.apply({"params": p["enc"]}, r["belief"])
        m = mix.apply({"params": p["mix"]}, r["q"], jnp.stack([r["temperature"], r["top_p"]], -1), r["group"])
        o.update({k: m[k] for k in ("q_tot", "features", "features_sd", "w1", "w2")})
        g = enc.apply({"params": p["enc"]}, o["belief"])  # chained: our beliefs, our E
        o["q_tot_chained"] = mix.apply({"params": p["mix"]}, o["q"],
                                       jnp.stack([o["temperature"], o["top_p"]], -1), g)["q_tot"]
        return o

    out = run(p, r, jnp.asarray(tokens))
    assert all(v.dtype == dtype for v in jax.tree.leaves(out))
    return jax.tree.map(np.asarray, out), ref


def _check(out, ref, rel):
    """|ours - reference| <= rel·max|reference| per output (the values are O(0.4..16))."""
    for k in ALL_KEYS + ("q_tot_chained",):
        want = ref["q_tot" if k == "q_tot_chained" else k]
        assert out[k].shape == want.shape, k
        np.testing.assert_allclose(out[k], want, rtol=0, atol=rel * np.abs(want).max(), err_msg=k)


def test_fixture_is_nontrivial():
    """The reference outputs exercise what they should: T, p inside their ranges but not at the
    bounds, both ELU branches used (q_tot of both signs), nonzero mixing weights."""
    _, tokens, _, ref = _fixture()
    assert tokens.min() > 0  # no pad token
    assert 0.5 < ref["temperature"].min() and ref["temperature"].max() < 1.9
    assert 0.15 < ref["top_p"].min() and ref["top_p"].max() < 0.85
    assert ref["q_tot"].min() < 0 < ref["q_tot"].max() and np.abs(ref["q_tot"]).max() > 1
    assert ref["w1"].min() > 0 and ref["w2"].min() > 0
    assert np.ptp(ref["belief"], axis=1).min() > 1e-3  # agents differ


def test_positional_table_matches_reference_to_one_float32_ulp():
    """Both codes build the sinusoidal table in float32; their sin/cos differ by <= 1 ulp."""
    s, _, _, ref = _fixture()
    table = np.asarray(M.sinusoidal_positions(s["L"], s["hidden"]), np.float64)
    np.testing.assert_allclose(table, ref["pos_table"], rtol=0, atol=2.0 ** -24)


def test_float32_matches_reference():
    """Our default (float32) path vs the float64 reference: observed max error <= 6e-7 of each
    output's scale (F_i: 1.4e-6 on values up to 2.4; q_tot: 1.8e-6 on values up to 16), i.e. a
    few float32 ulps accumulated over ~10 layers; bound 1e-5 of the scale."""
    out, ref = _run(jnp.float32)
    _check(out, ref, rel=1e-5)


def test_float64_matches_reference_to_roundoff(monkeypatch):
    """In 64-bit mode, with the reference's positional table swapped in (the only float32 piece
    of either computation; with our own table the belief outputs differ by ~5e-9, the 1-ulp
    table difference propagated), every output equals the reference to round-off (observed
    <= 4e-15, the chained q_tot 1.1e-14 on values up to 16; bound 1e-12 of the scale)."""
    s, _, _, ref = _fixture()
    monkeypatch.setattr(M, "sinusoidal_positions", lambda n, d: jnp.asarray(ref["pos_table"][:n]))
    with jax.enable_x64(True):
        out, ref = _run(jnp.float64)
    _check(out, ref, rel=1e-12)

"""KV-cache decoding (icml_jax/inference/decode.py): exactness against full recomputation, left
padding, sampling filters and statistics, stop tokens, keys, errors, HF parity.

Models and reference forwards are built once per setting (``functools.cache``) and compiled as one
program each; tests that share a model config and generate() arguments share its compile."""
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from icml_jax.config_utils import load_config
from icml_jax.inference import decode
from icml_jax.inference.decode import generate, sample_logits, top_k_filter, top_p_filter
from icml_jax.models.decoder import build_model, unrolled

PROMPT = [1, 40, 51, 62, 73, 84, 95]


def _model(position="rope", scan_layers=False, window=0, seed=0, scale=4.0):
    """(config.model, params) of the tiny decoder (a fresh copy of the config every call)."""
    cfg, params = _built_model(position, scan_layers, window, seed, scale)
    return ml_collections.ConfigDict(cfg.to_dict()), params


@functools.cache
def _built_model(position, scan_layers, window, seed, scale):
    cfg = load_config("configs/lm.py:tiny", unlocked=True).model
    cfg.position, cfg.scan_layers, cfg.sliding_window = position, scan_layers, window
    return cfg, _init_params(cfg, seed, scale)


def _init_params(cfg, seed, scale=4.0):
    """The params of ``build_model(cfg)``, scaled: larger weights than init_std give peaked,
    well-separated logits (no argmax near-ties). The init is one jitted program (eagerly, every
    primitive compiles on its own) with the seed and scale traced, shared by every config with the
    same param tree: a sliding window and the parameter-free positions (RoPE, NoPE, ALiBi) add no
    param, so those configs initialise as the RoPE model without a window."""
    init_cfg = ml_collections.ConfigDict(cfg.to_dict())
    init_cfg.sliding_window = 0
    if init_cfg.position in ("rope", "nope", "alibi"):
        init_cfg.position = "rope"
    return _init_fn(ml_collections.FrozenConfigDict(init_cfg))(jax.random.key(seed), scale)


@functools.cache
def _init_fn(cfg: ml_collections.FrozenConfigDict):
    model = build_model(cfg)
    return jax.jit(lambda key, scale: jax.tree.map(
        lambda x: x * scale, model.init(key, jnp.zeros((1, 8), jnp.int32))["params"]))


@functools.cache
def _last_logits_fn(cfg: ml_collections.FrozenConfigDict):
    """The full (non-cached) forward's logits at slot i of row 0; i is traced (one compile)."""
    model = build_model(cfg)
    return jax.jit(lambda p, t, i: model.apply({"params": p}, t)[0, i])


def _reference_greedy(cfg, params, prompt, n):
    """Greedy decoding by recomputing the full (non-cached) forward at every step, on a fixed
    right-padded buffer (causal: later slots cannot change earlier logits; one compile)."""
    fwd = _last_logits_fn(ml_collections.FrozenConfigDict(cfg))
    buf = np.zeros((1, len(prompt) + n), np.int32)
    buf[0, :len(prompt)] = prompt
    toks, logits = [], []
    for i in range(n):
        lg = np.asarray(fwd(params, jnp.asarray(buf), len(prompt) + i - 1))
        toks.append(int(lg.argmax()))
        logits.append(lg)
        buf[0, len(prompt) + i] = toks[-1]
    return np.asarray(toks), np.stack(logits)


@pytest.mark.parametrize("position", ["rope", "nope"])
@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("window", [0, 5])
def test_cached_greedy_equals_full_forward(position, scan_layers, window):
    cfg, params = _model(position, scan_layers, window)
    n = 12  # > window: the sliding window actually drops keys
    want, want_logits = _reference_greedy(cfg, params, PROMPT, n)
    out = generate(cfg, params, [PROMPT], key=jax.random.key(0), max_new_tokens=n, temperature=0,
                   return_logits=True)
    np.testing.assert_array_equal(out.tokens[0], want)
    assert out.lengths.tolist() == [n]
    np.testing.assert_allclose(out.logits[0], want_logits, atol=1e-4, rtol=1e-5)


def test_scanned_model_decodes_through_its_scanned_loop_when_asked():
    """``config.model.decode_unrolled=False`` keeps a scan_layers model's scanned decode loop (the
    stacked cache; no per-layer weight copy): the same tokens and logits as the full forward, as
    the default unrolled decode gives them (``test_cached_greedy_equals_full_forward``)."""
    cfg, params = _model("rope", True, 5)
    # the full forward ignores decode_unrolled: its reference shares the default config's compile
    want, want_logits = _reference_greedy(cfg, params, PROMPT, 12)
    cfg.decode_unrolled = False
    decode_cfg, split = unrolled(cfg)
    assert split == 0 and decode_cfg.scan_layers
    out = generate(cfg, params, [PROMPT], key=jax.random.key(0), max_new_tokens=12, temperature=0,
                   return_logits=True)
    np.testing.assert_array_equal(out.tokens[0], want)
    np.testing.assert_allclose(out.logits[0], want_logits, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("position", ["fope", "alibi"])
def test_cached_greedy_equals_full_forward_other_positions(position):
    """Position embeddings added later work through the same module interface, unchanged here."""
    cfg, params = _model(position, window=5)
    want, _ = _reference_greedy(cfg, params, PROMPT, 10)
    out = generate(cfg, params, [PROMPT, [1, 3]], key=jax.random.key(0), max_new_tokens=10,
                   temperature=0)
    np.testing.assert_array_equal(out.tokens[0], want)


@pytest.mark.parametrize("position", ["rope", "nope"])
def test_step_logits_equal_full_forward_1e5(position):
    cfg, params = _model(position, scale=1.0)  # init-scale weights: logits of order 1
    n = 12  # as test_cached_greedy_equals_full_forward: the same generate() compile
    _, want_logits = _reference_greedy(cfg, params, PROMPT, n)
    out = generate(cfg, params, [PROMPT], key=jax.random.key(0), max_new_tokens=n, temperature=0,
                   return_logits=True)
    np.testing.assert_allclose(out.logits[0], want_logits, atol=1e-5, rtol=0)
    logp = jax.nn.log_softmax(jnp.asarray(want_logits), -1)
    np.testing.assert_allclose(out.logprobs[0], logp[np.arange(n), out.tokens[0]], atol=1e-5)


@pytest.mark.parametrize("scan_layers,window", [(False, 0), (True, 4)])
def test_left_padded_batch_rows_equal_alone(scan_layers, window):
    cfg, params = _model(scan_layers=scan_layers, window=window, seed=3)
    prompts = [[1, 7], PROMPT, [1, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150,
                                160, 170, 180]]  # 2, 7 and 18 tokens (18 -> next bucket)
    batch = generate(cfg, params, prompts, key=jax.random.key(0), max_new_tokens=10, temperature=0)
    for b, p in enumerate(prompts):
        alone = generate(cfg, params, [p], key=jax.random.key(0), max_new_tokens=10, temperature=0)
        np.testing.assert_array_equal(batch.tokens[b], alone.tokens[0], err_msg=f"row {b}")
        np.testing.assert_allclose(batch.logprobs[b], alone.logprobs[0], atol=1e-5)


def test_one_compile_per_bucket():
    cfg, params = _model(seed=5)
    kw = dict(key=jax.random.key(0), max_new_tokens=4, temperature=0)
    generate(cfg, params, [[1, 2, 3]], **kw)
    n = decode._generate._cache_size()
    generate(cfg, params, [[1, 2, 3, 4, 5, 6, 7, 8, 9]], **kw)  # same bucket (16)
    generate(cfg, params, [[1] * 16], **kw)
    assert decode._generate._cache_size() == n
    generate(cfg, params, [[1] * 17], **kw)  # next bucket
    assert decode._generate._cache_size() == n + 1
    # compiled through xla_env.decode_jit, with the YNN options (the test process has our flags)
    from icml_jax import xla_env
    assert list(decode._generate.variants) == [tuple((xla_env.decode_compiler_options() or {}).items())]


def test_top_k_one_equals_greedy():
    cfg, params = _model(seed=1, scale=1.0)  # flat logits: plain sampling would differ
    prompts = [PROMPT, [1, 9, 9]]
    greedy = generate(cfg, params, prompts, key=jax.random.key(0), max_new_tokens=10, temperature=0)
    topk = generate(cfg, params, prompts, key=jax.random.key(7), max_new_tokens=10, temperature=1.5,
                    top_k=1)
    np.testing.assert_array_equal(topk.tokens, greedy.tokens)
    free = generate(cfg, params, prompts, key=jax.random.key(7), max_new_tokens=10, temperature=1.5)
    assert (free.tokens != greedy.tokens).any()


def test_top_p_filter_keeps_smallest_set_with_mass_p():
    probs = np.array([0.05, 0.4, 0.1, 0.3, 0.15])  # sorted: .4 .3 .15 .1 .05
    logits = jnp.log(jnp.asarray([probs], jnp.float32))
    filt = jax.jit(top_p_filter)  # p traced: one compile for every p
    kept = lambda p: (np.asarray(filt(logits, p))[0] > -1e29).nonzero()[0].tolist()
    assert kept(0.3) == [1]  # the top token alone already has mass 0.4 >= 0.3
    assert kept(0.4) == [1]
    assert kept(0.5) == [1, 3]  # .4 < .5, .4 + .3 >= .5
    assert kept(0.7) == [1, 3]
    assert kept(0.8) == [1, 3, 4]  # .7 < .8
    assert kept(0.86) == [1, 2, 3, 4]
    assert kept(1.0) == [0, 1, 2, 3, 4]
    # kept logits are unchanged
    np.testing.assert_array_equal(np.asarray(filt(logits, 0.5))[0, [1, 3]],
                                  np.asarray(logits)[0, [1, 3]])


def test_top_k_filter():
    logits = jnp.asarray([[0.1, 3.0, -1.0, 2.0, 0.5], [5.0, 4.0, 3.0, 2.0, 1.0]], jnp.float32)
    filt = jax.jit(top_k_filter)  # k traced: one compile for every k
    kept = np.asarray(filt(logits, 2)) > -1e29
    assert kept[0].nonzero()[0].tolist() == [1, 3] and kept[1].nonzero()[0].tolist() == [0, 1]
    assert (np.asarray(filt(logits, 5)) > -1e29).all()


# sample_logits as generate() runs it: one program per sampler mode (the temperature is traced)
_sample = jax.jit(sample_logits, static_argnums=2)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_distribution(temperature):
    logits = jnp.asarray([1.0, 2.0, 0.0, -1.0, 1.5], jnp.float32)
    n = 40_000
    mode = decode.SamplerMode(greedy=False, use_top_k=False, use_top_p=False)
    toks = _sample(jax.random.key(42), jnp.tile(logits, (n, 1)), mode, temperature, 0, 1.0)
    freq = np.bincount(np.asarray(toks), minlength=5) / n
    want = np.asarray(jax.nn.softmax(logits / temperature))
    np.testing.assert_allclose(freq, want, atol=0.015)  # ~5 sigma at n = 40k


def test_top_p_sampling_stays_in_nucleus():
    logits = jnp.log(jnp.asarray([0.05, 0.4, 0.1, 0.3, 0.15], jnp.float32))
    mode = decode.SamplerMode(greedy=False, use_top_k=False, use_top_p=True)
    toks = np.asarray(_sample(jax.random.key(0), jnp.tile(logits, (20_000, 1)), mode, 1.0, 0, 0.6))
    freq = np.bincount(toks, minlength=5) / toks.size
    assert set(np.unique(toks).tolist()) == {1, 3}
    np.testing.assert_allclose(freq[[1, 3]], [4 / 7, 3 / 7], atol=0.02)  # renormalised


def test_stop_tokens_stop_the_row_and_pad_after():
    cfg, params = _model(seed=2)
    prompts = [PROMPT, [1, 5, 6]]
    free = generate(cfg, params, prompts, key=jax.random.key(0), max_new_tokens=10, temperature=0)
    stop = int(free.tokens[0, 3])
    first = [int(np.argmax(row == stop)) if (row == stop).any() else None for row in free.tokens]
    out = generate(cfg, params, prompts, key=jax.random.key(0), max_new_tokens=10, temperature=0,
                   stop_tokens=(stop,), pad_id=0)
    for b, f in enumerate(first):
        if f is None:
            np.testing.assert_array_equal(out.tokens[b], free.tokens[b])
            assert out.lengths[b] == 10
        else:
            np.testing.assert_array_equal(out.tokens[b, :f + 1], free.tokens[b, :f + 1])
            assert (out.tokens[b, f + 1:] == 0).all() and out.lengths[b] == f + 1
            assert (out.logprobs[b, f + 1:] == 0).all()
    # every row stops -> the loop ends early and the rest is pad
    both = generate(cfg, params, [PROMPT], key=jax.random.key(0), max_new_tokens=10, temperature=0,
                    stop_tokens=(int(free.tokens[0, 0]),), pad_id=3)
    assert both.lengths.tolist() == [1] and (both.tokens[0, 1:] == 3).all()


def test_same_key_same_samples_different_key_different():
    cfg, params = _model(seed=4, scale=1.0)
    kw = dict(max_new_tokens=16, temperature=1.0, top_p=0.95)
    a = generate(cfg, params, [PROMPT, PROMPT], key=jax.random.key(11), **kw)
    b = generate(cfg, params, [PROMPT, PROMPT], key=jax.random.key(11), **kw)
    c = generate(cfg, params, [PROMPT, PROMPT], key=jax.random.key(12), **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert (a.tokens != c.tokens).any()
    assert (a.tokens[0] != a.tokens[1]).any()  # rows draw independently


def test_errors():
    cfg, params = _model()
    kw = dict(key=jax.random.key(0), temperature=0)
    with pytest.raises(ValueError, match="max_seq_len=128"):
        generate(cfg, params, [[1] * 120], max_new_tokens=10, **kw)
    with pytest.raises(ValueError, match="max_len=20"):
        generate(cfg, params, [[1] * 15], max_new_tokens=10, max_len=20, **kw)
    with pytest.raises(ValueError, match="empty"):
        generate(cfg, params, [[1, 2], []], max_new_tokens=4, **kw)
    with pytest.raises(ValueError, match="outside the model's vocab"):
        generate(cfg, params, [[1, 999]], max_new_tokens=4, **kw)
    with pytest.raises(ValueError, match="top_p"):
        generate(cfg, params, [[1, 2]], max_new_tokens=4, key=jax.random.key(0), top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(cfg, params, [[1, 2]], max_new_tokens=0, **kw)
    # exactly at the limit works (bucket shrinks to fit)
    out = generate(cfg, params, [[1] * 120], max_new_tokens=8, **kw)
    assert out.tokens.shape == (1, 8)


# ----------------------------------------------------------------------------- HF parity

def _hf_model(kind, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    dims = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                initializer_range=0.2)
    if kind == "llama":
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=False, **dims))
    elif kind == "qwen2":
        m = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=True, **dims))
        with torch.no_grad():  # HF initialises the q/k/v biases to zero; make them matter
            for layer in m.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
    else:
        m = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=4, **dims))
    m.eval()
    m.save_pretrained(tmp_path)
    return m


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_greedy_matches_transformers(kind, tmp_path):
    import torch
    from icml_jax.interop import load_hf
    hf = _hf_model(kind, tmp_path)
    cfg, params = load_hf(str(tmp_path))
    n = 12
    long, short = [5, 17, 33, 90, 4, 8, 61], [7, 9, 11]
    with torch.no_grad():
        ref1 = hf.generate(torch.tensor([short]), do_sample=False, max_new_tokens=n, pad_token_id=0)
        ids = torch.tensor([long, [0] * 4 + short])
        mask = torch.tensor([[1] * 7, [0] * 4 + [1] * 3])
        ref2 = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                           pad_token_id=0)
    one = generate(cfg, params, [short], key=jax.random.key(0), max_new_tokens=n, temperature=0)
    two = generate(cfg, params, [long, short], key=jax.random.key(0), max_new_tokens=n,
                   temperature=0)
    np.testing.assert_array_equal(one.tokens[0], ref1[0, 3:].numpy())
    np.testing.assert_array_equal(two.tokens, ref2[:, 7:].numpy())


@pytest.mark.parametrize("batch,kv_heads,scan", [(1, 1, False), (1, 2, False), (2, 1, False), (2, 2, False),
                                                 (2, 2, True)])
def test_decode_loop_updates_each_cache_once_and_copies_none(batch, kv_heads, scan):
    """The compiled while loop of ``generate`` touches each layer's K and V cache once per step:
    the only cache-sized results in its body are one in-place update per cache (no copy, no
    transpose, no second update). At batch 1 with (B, G) stored as two axes, XLA computed every
    update twice and copied each cache two to four times per step (``attention.KVCache``). Compiled
    with the decode loop's own options (``xla_env.decode_jit``) under the suite's XLA flags; the same
    count holds with XLA's default optimisation level (checked once). One KV head at batch 1 (the
    cache without a leading axis) is also checked against the full forward, token for token.

    A ``scan_layers`` model decodes unrolled (``decoder.unrolled``), as ``generate`` builds it: its
    stacked params are split inside the program, before the loop (no weight is sliced in the loop
    body: checked, and it fails when the split moves into the step), and the loop body then holds
    the same 2L in-place updates (under ``nn.scan`` each layer's cache slice was copied out,
    updated and written back: extra cache-sized copies per layer per step)."""
    import re

    from icml_jax import xla_env
    from icml_jax.models import hooks
    cfg = load_config("configs/lm.py:tiny", unlocked=True).model
    cfg.update(dict(num_layers=2, num_heads=2 * kv_heads, num_kv_heads=kv_heads, scan_layers=scan))
    params = _init_params(cfg, seed=0)
    assert ("layers" in params) == scan
    if batch == 1 and kv_heads == 1:
        want, want_logits = _reference_greedy(cfg, params, PROMPT, 6)
        out = generate(cfg, params, [PROMPT], key=jax.random.key(0), max_new_tokens=6, temperature=0,
                       return_logits=True)
        np.testing.assert_array_equal(out.tokens[0], want)
        np.testing.assert_allclose(out.logits[0], want_logits, atol=1e-4, rtol=1e-5)
    P, N = 4, 8
    tokens, positions, segments = decode.pad_prompts([[1, 2, 3]] * batch, P, 0)
    decode_cfg, split = unrolled(cfg)
    assert split == (cfg.num_layers if scan else 0) and not decode_cfg.scan_layers
    model, edit_args = hooks.split_model(build_model(decode_cfg, decode=True))
    jitted = jax.jit(decode._generate.__wrapped__, compiler_options=xla_env.decode_compiler_options(),
                     static_argnames=("model", "max_new", "mode", "return_logits", "return_stats", "split"))
    hlo = jitted.lower(model, params, None, tokens, positions, segments, jax.random.key(0), jnp.float32(1.0),
                       jnp.int32(0), jnp.float32(1.0), jnp.asarray([-1], jnp.int32), jnp.int32(0), edit_args,
                       max_new=N, mode=decode.SamplerMode(True, False, False),
                       return_logits=False, split=split).compile().as_text()
    body_name = re.search(r"body=%?([\w.\-]+)", hlo).group(1)
    start = hlo.index(f"\n%{body_name} ")
    body = hlo[start:hlo.index("\n}\n", start)].split("\n")
    size = batch * kv_heads * cfg.head_dim * (P + N)
    sized = [(m.group(2), line) for line in body
             if (m := re.match(r"\s*(?:ROOT )?%([\w.\-]+) = f32\[([\d,]+)\]\S* ([\w\-]+)\(", line))
             and np.prod([int(d) for d in m.group(2).split(",")]) == size and m.group(3) != "get-tuple-element"]
    assert len(sized) == 2 * cfg.num_layers, "\n".join(line.strip()[:160] for _, line in sized)
    assert all(re.search(r"dynamic.update.slice", line) for _, line in sized), sized
    if scan:  # the stacked params are split once, before the loop: no layer's weight is sliced in it
        weights = {tuple(x.shape[1:]) for x in jax.tree.leaves(params["layers"]) if x.ndim > 2}
        sliced = [line for line in body if (m := re.match(r"\s*(?:ROOT )?%\S+ = f32\[([\d,]+)\]", line))
                  and tuple(int(d) for d in m.group(1).split(",")) in weights and "slice" in line]
        assert weights and not sliced, sliced

"""HF interop: logit parity with transformers (torch, CPU), export loadable by transformers,
exact round trips, sharded loading on 8 fake devices, clear errors, tokenizer round trip."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from icml_jax.interop import hf as hf_lib  # noqa: E402
from icml_jax.interop import load_hf, load_hf_tokenizer, save_hf  # noqa: E402
from icml_jax.models import build_model  # noqa: E402
from tests.jax_env import subprocess_env

# the module's saved HF models (and the torch/transformers import) are built on one xdist worker
pytestmark = pytest.mark.xdist_group("hf_interop")

V, T = 128, 16
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=V, intermediate_size=96, max_position_embeddings=64, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
FAMILIES = {  # name -> (config class, overrides, architecture)
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True), "LlamaForCausalLM"),
    "llama_untied": ("LlamaConfig", dict(tie_word_embeddings=False,
                                         rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
                     "LlamaForCausalLM"),
    "llama3_scaling": ("LlamaConfig", dict(tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE),
                       "LlamaForCausalLM"),
    "llama_linear": ("LlamaConfig", dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4,
                                                          "factor": 2.0}), "LlamaForCausalLM"),
    "mistral_window": ("MistralConfig", dict(sliding_window=5), "MistralForCausalLM"),
    "qwen2_bias": ("Qwen2Config", dict(tie_word_embeddings=True), "Qwen2ForCausalLM"),
}


def _randomize(model, seed):
    """Non-trivial values everywhere (HF initialises norms to 1 and biases to 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)


def _hf_model(family, seed=0, dtype=torch.float32):
    cls_name, over, arch = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**SMALL, **over)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).eval()
    _randomize(model, seed)
    model.config._attn_implementation = "eager"
    return model.to(dtype)


def _tokens(seed=0, B=2):
    return np.random.RandomState(seed).randint(0, V, (B, T))


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def _our_logits(model_cfg, params, tokens):
    model = build_model(model_cfg)  # compiled: one program, not one per op
    return np.asarray(jax.jit(lambda p, t: model.apply({"params": p}, t))(params, jnp.asarray(tokens)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (folder written by save_pretrained, HF logits on _tokens())."""
    cache = {}

    def get(family):
        if family not in cache:
            model = _hf_model(family)
            path = str(tmp_path_factory.mktemp(family))
            model.save_pretrained(path)
            cache[family] = (path, _hf_logits(model, _tokens()))
        return cache[family]

    return get


@pytest.mark.parametrize("scan_layers", [False, True], ids=["loop", "scan"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_hf(saved, family, scan_layers):
    path, ref = saved(family)
    model_cfg, params = load_hf(path, scan_layers=scan_layers)
    assert model_cfg.scan_layers == scan_layers
    assert ("layers" in params) == scan_layers
    np.testing.assert_allclose(_our_logits(model_cfg, params, _tokens()), ref, atol=1e-4, rtol=0)


def test_config_mapping(saved):
    m, _ = load_hf(saved("llama3_scaling")[0])
    assert (m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.ffn_dim) == (
        64, 2, 4, 2, 16, 96)
    assert (m.vocab_size, m.max_seq_len, m.norm_eps, m.tie_embeddings) == (V, 64, 1e-5, False)
    assert m.rope_scaling.to_dict() == dict(type="llama3", factor=8.0, low_freq_factor=1.0,
                                            high_freq_factor=4.0, original_max_position=16)
    assert load_hf(saved("mistral_window")[0])[0].sliding_window == 5
    q, _ = load_hf(saved("qwen2_bias")[0])
    assert q.qkv_bias and q.tie_embeddings and q.sliding_window == 0


def test_legacy_rope_fields():
    """transformers-4 style config.json: top-level rope_theta + rope_scaling with ``type``."""
    from icml_jax.interop import from_hf_config
    hf = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2,
              num_attention_heads=4, vocab_size=V, intermediate_size=96, rope_theta=123.0,
              rope_scaling={"type": "linear", "factor": 4.0})
    m = from_hf_config(hf)
    assert (m.rope_theta, m.rope_scaling.type, m.rope_scaling.factor) == (123.0, "linear", 4.0)
    assert (m.num_kv_heads, m.head_dim) == (4, 16)  # defaults: MHA, hidden // heads


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_loads_in_transformers_and_round_trips(saved, tmp_path, family):
    path, ref = saved(family)
    arch = FAMILIES[family][2]
    model_cfg, params = load_hf(path)
    out = save_hf(str(tmp_path / "export"), model_cfg, params, arch)
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(hf2).__name__ == arch
    np.testing.assert_allclose(_hf_logits(hf2, _tokens()), ref, atol=1e-4, rtol=0)
    cfg2, params2 = load_hf(out)
    assert cfg2.to_dict() == model_cfg.to_dict()
    chex.assert_trees_all_equal(jax.device_get(params2), jax.device_get(params))
    # the exported tensors are bit-identical to the original HF ones
    a, b = load_file(os.path.join(path, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    a.pop("lm_head.weight", None) if model_cfg.tie_embeddings else None
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_scanned_params_export(saved, tmp_path):
    path, ref = saved("qwen2_bias")
    model_cfg, params = load_hf(path, scan_layers=True)
    out = save_hf(str(tmp_path / "e"), model_cfg, params, "Qwen2ForCausalLM")
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    np.testing.assert_allclose(_hf_logits(hf2, _tokens()), ref, atol=1e-4, rtol=0)


def test_sharded_checkpoint_both_ways(saved, tmp_path):
    """save_hf with max_shard_size writes shards + index; both transformers and load_hf read them."""
    path, ref = saved("llama_untied")
    model_cfg, params = load_hf(path)
    out = save_hf(str(tmp_path / "sharded"), model_cfg, params, max_shard_size=40_000)
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 2
    assert not os.path.exists(os.path.join(out, "model.safetensors"))
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    np.testing.assert_allclose(_hf_logits(hf2, _tokens()), ref, atol=1e-4, rtol=0)
    cfg2, params2 = load_hf(out)
    chex.assert_trees_all_equal(jax.device_get(params2), jax.device_get(params))
    # transformers' own sharded layout loads too
    hf_sharded = str(tmp_path / "hf_sharded")
    hf2.save_pretrained(hf_sharded, max_shard_size="40KB")
    assert os.path.exists(os.path.join(hf_sharded, "model.safetensors.index.json"))
    np.testing.assert_allclose(_our_logits(*load_hf(hf_sharded), _tokens()), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("tdt, ours", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16")])
def test_half_precision_checkpoint_exact(tmp_path, tdt, ours):
    """bf16 (via ml_dtypes) / fp16 storage is read bit-exactly and kept with param_dtype='auto'."""
    model = _hf_model("llama_untied", seed=3, dtype=tdt)
    model.save_pretrained(str(tmp_path / "half"))
    model_cfg, params = load_hf(str(tmp_path / "half"), param_dtype="auto")
    assert model_cfg.param_dtype == ours
    emb = params["io"]["embedding"]
    assert emb.dtype == jnp.dtype(ours)
    want = model.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(emb, np.float32), want)
    q = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()  # [H*K, D]
    np.testing.assert_array_equal(np.asarray(params["layer_1"]["attn"]["qkv"][:, 1, 0], np.float32),
                                  q[2 * 16:3 * 16].T)  # head h = g*R + r = 1*2 + 0
    # export keeps the bits; a float32 load of the same checkpoint is exact too
    out = save_hf(str(tmp_path / "out"), model_cfg, params)
    back = load_file(os.path.join(out, "model.safetensors"))
    assert back["model.embed_tokens.weight"].dtype == tdt
    assert torch.equal(back["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    _, p32 = load_hf(str(tmp_path / "half"))
    assert p32["io"]["embedding"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(p32["io"]["embedding"]), want)


def test_decode_mode_matches_hf_with_sliding_window(saved):
    """Loaded params in KV-cache decode mode (prefill + one token at a time) give HF's logits."""
    path, ref = saved("mistral_window")
    model_cfg, params = load_hf(path)
    tokens = _tokens()
    model = build_model(model_cfg, decode=True)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((2, T), jnp.int32))["cache"]
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # an empty cache is all zeros
    pos = jnp.broadcast_to(jnp.arange(T), (2, T))
    prefill = 6
    step = jax.jit(lambda p, c, t, ps: model.apply({"params": p, "cache": c}, t, ps, mutable=["cache"]))
    logits, state = step(params, cache, tokens[:, :prefill], pos[:, :prefill])
    outs = [np.asarray(logits)]
    for t in range(prefill, T):
        logits, state = step(params, state["cache"], tokens[:, t:t + 1], pos[:, t:t + 1])
        outs.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(outs, axis=1), ref, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------ atomic save


def test_save_is_atomic(saved, tmp_path, monkeypatch):
    model_cfg, params = load_hf(saved("llama_tied")[0])
    dest = tmp_path / "dest"
    calls = []

    def boom(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        return real(*a, **k)

    real = hf_lib.write_safetensors
    monkeypatch.setattr(hf_lib, "write_safetensors", boom)
    with pytest.raises(OSError, match="disk full"):
        save_hf(str(dest), model_cfg, params, max_shard_size=40_000)
    assert os.listdir(tmp_path) == [], "a failed save left files behind"
    monkeypatch.setattr(hf_lib, "write_safetensors", real)
    save_hf(str(dest), model_cfg, params)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_hf(str(dest), model_cfg, params)
    save_hf(str(dest), model_cfg, params, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["dest"]
    assert sorted(os.listdir(dest)) == ["config.json", "model.safetensors"]


# ------------------------------------------------------------------------------------------ errors


def _copy(saved, tmp_path, family="llama_untied"):
    dst = str(tmp_path / "ckpt")
    shutil.copytree(saved(family)[0], dst)
    return dst


def _edit_config(path, **changes):
    p = os.path.join(path, "config.json")
    cfg = json.load(open(p))
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    json.dump(cfg, open(p, "w"))


def _edit_tensors(path, fn):
    p = os.path.join(path, "model.safetensors")
    tensors = load_file(p)
    fn(tensors)
    save_file(tensors, p, metadata={"format": "pt"})


@pytest.mark.parametrize("changes, match", [
    (dict(architectures=["GPT2LMHeadModel"]), r"unsupported architecture \['GPT2LMHeadModel'\].*"
                                              r"LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (dict(attention_bias=True), "attention_bias=true is not supported for LlamaForCausalLM"),
    (dict(mlp_bias=True), "mlp_bias=true is not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
     r"rope scaling type 'yarn' is not implemented.*\['default', 'linear', 'llama3'\]"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
     "rope scaling type 'dynamic'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor=0.5"),
    (dict(num_hidden_layers=None), "required field 'num_hidden_layers' is missing"),
], ids=["arch", "act", "attn_bias", "mlp_bias", "yarn", "dynamic", "partial_rotary", "missing_field"])
def test_unsupported_config_errors(saved, tmp_path, changes, match):
    path = _copy(saved, tmp_path)
    _edit_config(path, **changes)
    with pytest.raises(ValueError, match=match) as e:
        load_hf(path)
    assert "config.json" in str(e.value)


def test_qwen2_sliding_window_error(saved, tmp_path):
    path = _copy(saved, tmp_path, "qwen2_bias")
    _edit_config(path, use_sliding_window=True, sliding_window=4, max_window_layers=0,
                 layer_types=["sliding_attention"] * 2)
    with pytest.raises(ValueError, match="Qwen2 use_sliding_window=true .* not supported"):
        load_hf(path)


def test_missing_tensor_error(saved, tmp_path):
    path = _copy(saved, tmp_path)
    _edit_tensors(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['model.layers.1.mlp.up_proj.weight'\]"):
        load_hf(path)


def test_wrong_shape_error(saved, tmp_path):
    path = _copy(saved, tmp_path)

    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16]
    _edit_tensors(path, shrink)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape \[16, 64\] "
                                         r"in .*model.safetensors but config.json implies \[32, 64\]"):
        load_hf(path)


def test_extra_tensor_error(saved, tmp_path):
    path = _copy(saved, tmp_path)

    def add_bias(t):
        t["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    _edit_tensors(path, add_bias)
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\) \['model.layers.0.self_attn.o_proj.bias'\]"):
        load_hf(path)


def test_ignorable_buffers_and_tied_duplicate_are_accepted(saved, tmp_path):
    path = _copy(saved, tmp_path, "llama_tied")

    def add(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    _edit_tensors(path, add)
    load_hf(path)

    def differ(t):
        t["lm_head.weight"] = t["lm_head.weight"] + 1.0
    _edit_tensors(path, differ)
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        load_hf(path)


def test_missing_files_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, vocab_size=V, intermediate_size=96)))
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        load_hf(str(tmp_path))


@pytest.mark.parametrize("change, arch, match", [
    (dict(position="nope"), "LlamaForCausalLM", "position='nope'"),
    (dict(residual="rmt"), "LlamaForCausalLM", "residual='rmt'"),
    (dict(mlp=dict(activation="relu")), "LlamaForCausalLM", "activation='relu'"),
    (dict(qkv_bias=True), "LlamaForCausalLM", "qkv_bias=True needs architecture='Qwen2ForCausalLM'"),
    (dict(sliding_window=4), "Qwen2ForCausalLM", "sliding_window=4 needs architecture='MistralForCausalLM'"),
    (dict(), "GPTNeoXForCausalLM", "unsupported architecture"),
    (dict(rope_floor_clip=True), "LlamaForCausalLM", "rope_floor_clip=True"),
], ids=["position", "residual", "activation", "qkv_bias", "window", "arch", "floor_clip"])
def test_export_errors(saved, tmp_path, change, arch, match):
    model_cfg, params = load_hf(saved("llama_tied")[0])
    model_cfg.update(change)
    with pytest.raises(ValueError, match=match):
        save_hf(str(tmp_path / "out"), model_cfg, params, arch)
    assert not os.path.exists(tmp_path / "out")


def test_export_param_mismatch_error(saved, tmp_path):
    model_cfg, params = load_hf(saved("llama_tied")[0])
    model_cfg.ffn_dim = 100
    with pytest.raises(ValueError, match=r"wrong shape .*layer_0/mlp/wi: expected \(64, 2, 100\), "
                                         r"found \(64, 2, 96\)"):
        save_hf(str(tmp_path / "out"), model_cfg, params)


def test_qwen2_export_of_bias_free_model_writes_zero_biases(saved, tmp_path):
    path, ref = saved("llama_tied")
    model_cfg, params = load_hf(path)
    out = save_hf(str(tmp_path / "q"), model_cfg, params, "Qwen2ForCausalLM")
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert torch.count_nonzero(hf2.model.layers[0].self_attn.q_proj.bias) == 0
    np.testing.assert_allclose(_hf_logits(hf2, _tokens()), ref, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------ sharded (8 devices)

_SHARDED = textwrap.dedent("""
    import json, sys
    import jax, numpy as np, ml_collections
    from jax.sharding import PartitionSpec as P
    from icml_jax.interop import load_hf
    from icml_jax.models import build_model
    from icml_jax.sharding import make_mesh
    path = sys.argv[1]
    assert jax.device_count() == 8, jax.device_count()
    mesh = make_mesh(ml_collections.ConfigDict(dict(data=2, fsdp=2, tensor=2)))
    tokens = np.asarray(json.loads(sys.argv[2]))
    out = {}
    for scan in (False, True):  # both layouts in one process (a JAX start costs 5-10 CPU-s)
        cfg, params = load_hf(path, mesh=mesh, scan_layers=scan)
        res = out["scan" if scan else "loop"] = {}
        for leaf in ["io/embedding", "io/lm_head", ("layers" if scan else "layer_0") + "/attn/qkv",
                     ("layers" if scan else "layer_0") + "/mlp/wi"]:
            node = params
            for k in leaf.split("/"):
                node = node[k]
            spec = [list(a) if isinstance(a, tuple) else a for a in node.sharding.spec]
            res[leaf] = [spec + [None] * (node.ndim - len(spec)), len(node.sharding.device_set),
                         node.addressable_shards[0].data.shape]
        with mesh:
            logits = jax.jit(lambda p, t: build_model(cfg).apply({"params": p}, t))(params, tokens)
        res["logits"] = np.asarray(logits).tolist()
    try:  # 2 kv heads cannot split over tensor=4: clear error before any tensor is read
        load_hf(path, mesh=make_mesh(ml_collections.ConfigDict(dict(data=1, fsdp=2, tensor=4))))
    except ValueError as e:
        out["indivisible_error"] = str(e)
    print("RESULT" + json.dumps(out))
""")


def test_sharded_load_on_8_fake_devices(saved):
    """load_hf onto a data x fsdp x tensor mesh of 8 fake devices, with and without scanned layers
    (one subprocess runs both): the leaves' shardings follow the rules and the logits match HF."""
    path, ref = saved("llama_untied")
    env = subprocess_env(8)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _SHARDED, path, json.dumps(_tokens().tolist())],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.split("RESULT", 1)[1])
    for scan in (False, True):
        out = result["scan" if scan else "loop"]
        lead = [None] if scan else []  # the stacked layer axis is replicated ("layers" -> None)
        # rules: embed->fsdp, vocab/mlp/kv_heads->tensor; each shard holds 1/4 of the [V, D] table
        assert out["io/embedding"] == [["tensor", "fsdp"], 8, [V // 2, 32]]
        assert out["io/lm_head"] == [["fsdp", "tensor"], 8, [32, V // 2]]
        layer = "layers" if scan else "layer_0"
        assert out[f"{layer}/attn/qkv"] == [lead + ["fsdp", "tensor", None, None], 8,
                                            ([2] if scan else []) + [32, 1, 4, 16]]
        assert out[f"{layer}/mlp/wi"] == [lead + ["fsdp", None, "tensor"], 8,
                                          ([2] if scan else []) + [32, 2, 48]]
        np.testing.assert_allclose(np.asarray(out["logits"]), ref, atol=1e-4, rtol=0)
    assert "do not divide evenly over mesh {'data': 1, 'fsdp': 2, 'tensor': 4}" in result["indivisible_error"]
    assert "layer_0/attn/" in result["indivisible_error"]


# ---------------------------------------------------------------------------------------- tokenizer


def _write_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["To be, or not to be, that is the question.", "Whether 'tis nobler in the mind"] * 20
    tok.train_from_iterator(corpus, trainer)
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    return tok


def test_tokenizer_round_trip(tmp_path):
    folder = str(tmp_path / "tok")
    raw = _write_tokenizer(folder)
    json.dump({"bos_token": "<s>", "eos_token": {"content": "</s>"}}, open(
        os.path.join(folder, "tokenizer_config.json"), "w"))
    json.dump({"eos_token_id": [2, 0], "pad_token_id": 0}, open(
        os.path.join(folder, "generation_config.json"), "w"))
    tok = load_hf_tokenizer(folder)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (raw.get_vocab_size(), 1, 2, 0)
    assert tok.eos_ids == (2,)  # tokenizer_config.json wins over generation_config.json
    for text in ["To be, or not to be", "unseen wörds ✓ and  spaces\n"]:
        ids = tok.encode(text)
        assert all(isinstance(i, int) for i in ids) and tok.bos_id not in ids
        assert tok.decode(ids) == text
        assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == text
        np.testing.assert_array_equal(tok.encode_np(text), ids)


def test_tokenizer_ids_from_config_json_and_errors(tmp_path):
    folder = str(tmp_path / "tok")
    _write_tokenizer(folder)
    with pytest.raises(ValueError, match="no eos token found"):
        load_hf_tokenizer(folder)
    json.dump({"eos_token_id": 2}, open(os.path.join(folder, "config.json"), "w"))
    tok = load_hf_tokenizer(folder)
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (2, 2, 2)  # bos/pad fall back to eos
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_hf_tokenizer(str(tmp_path))



def _word_tokenizer(folder, template: bool):
    """A Metaspace word-level tokenizer (SentencePiece-style spacing, < V ids); with ``template``
    its post-processor prepends <s> as Llama's does, without it adds nothing as Qwen2's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    words = ["<unk>", "<s>", "</s>", "▁To", "▁be,", "▁or", "▁not", "▁to", "▁be", "▁that", "▁is",
             "▁the", "▁question", "▁Hello", "▁world"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    if template:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    return os.path.join(folder, "tokenizer.json")


@pytest.mark.parametrize("template", [False, True])
def test_prompts_are_encoded_as_transformers_encodes_them(tmp_path, template):
    """encode_prompt / sample.prompt_ids follow the tokenizer's own template (BOS for a Llama-style
    post-processor, nothing for a Qwen2-style one), as transformers' tokenizer(text) does."""
    from transformers import PreTrainedTokenizerFast
    from icml_jax.sample import prompt_ids
    folder = str(tmp_path / "tok")
    file = _word_tokenizer(folder, template)
    json.dump({"eos_token": "</s>"}, open(os.path.join(folder, "tokenizer_config.json"), "w"))
    tok = load_hf_tokenizer(folder)
    hf = PreTrainedTokenizerFast(tokenizer_file=file)
    for text in ["To be, or not to be", "Hello world"]:
        assert prompt_ids(tok, text) == hf(text)["input_ids"]
        assert (prompt_ids(tok, text)[0] == 1) == template


def test_greedy_continuation_of_text_prompt_equals_transformers(saved, tmp_path):
    """A Qwen2 checkpoint with a template-free tokenizer: the prompt text goes in as transformers
    encodes it (no BOS prepended) and the greedy continuation equals transformers.generate's."""
    import shutil
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from icml_jax.inference.decode import generate
    from icml_jax.sample import load_hf_folder, prompt_ids
    folder = str(tmp_path / "qwen2")
    shutil.copytree(saved("qwen2_bias")[0], folder)
    file = _word_tokenizer(folder, template=False)
    model_cfg, params, tok, _ = load_hf_folder(folder)
    text = "To be, or not to be that is"
    ids = prompt_ids(tok, text)
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=file)
    assert ids == hf_tok(text)["input_ids"] and tok.bos_id not in ids[:1]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             pad_token_id=0)[0, len(ids):].tolist()
    ours = generate(model_cfg, params, [ids], key=jax.random.key(0), max_new_tokens=8, temperature=0)
    assert ours.tokens[0].tolist() == ref


def test_missing_eos_warns_and_continuation_keeps_the_decoders_spacing(tmp_path):
    """Without an EOS anywhere the tokenizer loads with a warning (require_eos=False: generation
    runs to its limit); the printed continuation has the spacing of the whole sequence's decode."""
    from icml_jax.sample import continuation_text
    folder = str(tmp_path / "tok")
    _word_tokenizer(folder, template=False)
    with pytest.raises(ValueError, match="no eos token found"):
        load_hf_tokenizer(folder)
    with pytest.warns(UserWarning, match="no eos token found"):
        tok = load_hf_tokenizer(folder, require_eos=False)
    assert tok.eos_ids == () and tok.eos_id == -1
    p = tok.encode_prompt("Hello")
    assert tok.decode(tok.encode("world")) == "world"  # alone, the leading space is gone
    assert continuation_text(tok, "Hello", p, tok.encode("world")) == "Hello world"

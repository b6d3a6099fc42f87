"""HF ``config.json`` <-> our ``config.model`` (Llama / Mistral / Qwen2 families).

Every function raises ``ValueError`` naming the field, the value and what to do when a setting
cannot be honoured; nothing is silently dropped.
"""
from __future__ import annotations

import os
from typing import Any

import ml_collections

ARCHITECTURES = {  # HF architecture -> model_type
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
ROPE_TYPES = ("default", "linear", "llama3")  # HF rope_type names we implement
_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                "torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def lm_base_config() -> ml_collections.ConfigDict:
    """``configs/lm.py``'s ``base_config()`` (model keys, mesh rules), without a preset."""
    import importlib.util  # pylint: disable=g-import-not-at-top

    from icml_jax.config_utils import REPO_ROOT  # pylint: disable=g-import-not-at-top

    spec = importlib.util.spec_from_file_location(
        "config_lm_base", os.path.join(REPO_ROOT, "configs", "lm.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.base_config()


def base_model_config() -> ml_collections.ConfigDict:
    """``base_config().model`` of configs/lm.py (so every key the model reads exists)."""
    return lm_base_config().model


def architecture_of(hf: dict[str, Any], where: str) -> str:
    archs = hf.get("architectures") or []
    if not archs:
        mt = hf.get("model_type")
        archs = [a for a, t in ARCHITECTURES.items() if t == mt][:1]
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ValueError(f"{where}: unsupported architecture {archs or hf.get('model_type')!r}; "
                         f"supported: {sorted(ARCHITECTURES)}. Convert the checkpoint to one of "
                         "these families or add a mapping in icml_jax/interop/hf_params.py.")
    return archs[0]


def _rope_params(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The flat rope dict from either transformers-5 ``rope_parameters`` or legacy
    ``rope_theta`` + ``rope_scaling`` fields."""
    rp = hf.get("rope_parameters")
    if rp is None:
        rp = dict(hf.get("rope_scaling") or {})
        rp.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if any(isinstance(v, dict) for v in rp.values()):
        raise ValueError(f"{where}: per-layer-type rope_parameters {rp} are not supported; "
                         "one rope setting for all layers is required")
    rp = dict(rp)
    if "rope_theta" not in rp:
        rp["rope_theta"] = hf.get("rope_theta", 10000.0)
    rp["rope_type"] = rp.get("rope_type", rp.get("type", "default")) or "default"
    return rp


def _apply_rope(m: ml_collections.ConfigDict, hf: dict[str, Any], where: str) -> None:
    rp = _rope_params(hf, where)
    m.rope_theta = float(rp["rope_theta"])
    prf = rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        raise ValueError(f"{where}: partial_rotary_factor={prf} is not supported (our RoPE rotates the "
                         "whole head); only 1.0 can be loaded")
    t = rp["rope_type"]
    if t not in ROPE_TYPES:
        raise ValueError(f"{where}: rope scaling type {t!r} is not implemented; supported rope_type "
                         f"values: {list(ROPE_TYPES)}. Remove the scaling from config.json (changes "
                         "the model) or add it to icml_jax/models/positions.py")
    m.rope_scaling.type = "none" if t == "default" else t
    if t in ("linear", "llama3"):
        m.rope_scaling.factor = float(rp["factor"])
    if t == "llama3":
        m.rope_scaling.low_freq_factor = float(rp["low_freq_factor"])
        m.rope_scaling.high_freq_factor = float(rp["high_freq_factor"])
        m.rope_scaling.original_max_position = int(rp["original_max_position_embeddings"])


def _check_unsupported(hf: dict[str, Any], arch: str, where: str) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act={act!r} is not supported; our swiglu MLP uses silu "
                         "(config.model.mlp.activation='swiglu')")
    if hf.get("mlp_bias"):
        raise ValueError(f"{where}: mlp_bias=true is not supported (our MLP has no biases)")
    if arch != "Qwen2ForCausalLM" and hf.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias=true is not supported for {arch}: it adds a bias "
                         "to o_proj too, and our attention only has Qwen2-style q/k/v biases")
    if arch == "Qwen2ForCausalLM":
        sliding = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
        if hf.get("use_sliding_window") or sliding:
            raise ValueError(f"{where}: Qwen2 use_sliding_window=true (per-layer sliding windows, "
                             f"layer_types={hf.get('layer_types')}) is not supported; only full "
                             "attention Qwen2 checkpoints can be loaded")
    if arch == "MistralForCausalLM":
        types = set(hf.get("layer_types") or [])
        if len(types) > 1:
            raise ValueError(f"{where}: mixed layer_types {sorted(types)} are not supported")


def from_hf_config(hf: dict[str, Any], where: str = "config.json") -> ml_collections.ConfigDict:
    """Maps an HF config dict to our ``config.model`` (a fresh, unlocked ConfigDict)."""
    arch = architecture_of(hf, where)
    _check_unsupported(hf, arch, where)
    try:
        m = base_model_config()
        m.vocab_size = int(hf["vocab_size"])
        m.d_model = int(hf["hidden_size"])
        m.num_layers = int(hf["num_hidden_layers"])
        m.num_heads = int(hf["num_attention_heads"])
        m.num_kv_heads = int(hf.get("num_key_value_heads") or m.num_heads)
        m.head_dim = int(hf.get("head_dim") or m.d_model // m.num_heads)
        m.ffn_dim = int(hf["intermediate_size"])
        m.max_seq_len = int(hf.get("max_position_embeddings", 2048))
        m.norm_eps = float(hf.get("rms_norm_eps", 1e-6))
    except KeyError as e:
        raise ValueError(f"{where}: required field {e.args[0]!r} is missing") from e
    if m.num_heads % m.num_kv_heads:
        raise ValueError(f"{where}: num_attention_heads={m.num_heads} is not a multiple of "
                         f"num_key_value_heads={m.num_kv_heads}")
    m.tie_embeddings = bool(hf.get("tie_word_embeddings", False))
    m.position, m.mlp.activation, m.residual = "rope", "swiglu", "standard"
    _apply_rope(m, hf, where)
    m.qkv_bias = arch == "Qwen2ForCausalLM"
    m.sliding_window = int(hf.get("sliding_window") or 0) if arch == "MistralForCausalLM" else 0
    return m


def checkpoint_dtype(hf: dict[str, Any]) -> str | None:
    """The stored dtype named in config.json (``dtype`` or legacy ``torch_dtype``), ours-spelled."""
    name = hf.get("dtype", hf.get("torch_dtype"))
    return _DTYPE_NAMES.get(str(name)) if name else None


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def to_hf_config(m: ml_collections.ConfigDict, architecture: str, dtype: str,
                 token_ids: dict[str, Any] | None = None) -> dict[str, Any]:
    """Our ``config.model`` -> an HF config dict for ``architecture`` (transformers-5 layout:
    ``rope_parameters``). Raises ValueError when ``m`` cannot be expressed in that architecture."""
    where = f"save_hf(architecture={architecture!r})"
    _require(architecture in ARCHITECTURES,
             f"{where}: unsupported architecture; choose one of {sorted(ARCHITECTURES)}")
    _require(m.residual == "standard", f"{where}: config.model.residual={m.residual!r} has no HF "
             "equivalent; only the 'standard' residual stream can be exported")
    _require(m.position == "rope", f"{where}: config.model.position={m.position!r} has no HF "
             "equivalent in these families; only 'rope' can be exported")
    _require(not m.rope_floor_clip, f"{where}: config.model.rope_floor_clip=True "
             "(zeroed low frequencies) has no HF equivalent; export a model trained without it")
    _require(m.mlp.activation == "swiglu", f"{where}: config.model.mlp.activation="
             f"{m.mlp.activation!r} cannot be exported; these families use 'swiglu' (silu-gated)")
    rs = m.rope_scaling or ml_collections.ConfigDict({"type": "none"})
    _require(rs.type in ("none", "linear", "llama3"),
             f"{where}: config.model.rope_scaling.type={rs.type!r} cannot be exported")
    qkv_bias, window = bool(m.qkv_bias), int(m.sliding_window or 0)
    _require(not qkv_bias or architecture == "Qwen2ForCausalLM",
             f"{where}: config.model.qkv_bias=True needs architecture='Qwen2ForCausalLM' "
             f"({architecture} has no q/k/v-only biases)")
    _require(not window or architecture == "MistralForCausalLM",
             f"{where}: config.model.sliding_window={window} needs architecture='MistralForCausalLM'")
    rope: dict[str, Any] = {"rope_type": "default" if rs.type == "none" else rs.type,
                            "rope_theta": float(m.rope_theta)}
    if rs.type in ("linear", "llama3"):
        rope["factor"] = float(rs.factor)
    if rs.type == "llama3":
        rope.update(low_freq_factor=float(rs.low_freq_factor), high_freq_factor=float(rs.high_freq_factor),
                    original_max_position_embeddings=int(rs.original_max_position))
    hf: dict[str, Any] = {
        "architectures": [architecture], "model_type": ARCHITECTURES[architecture],
        "vocab_size": int(m.vocab_size), "hidden_size": int(m.d_model),
        "intermediate_size": int(m.ffn_dim), "num_hidden_layers": int(m.num_layers),
        "num_attention_heads": int(m.num_heads), "num_key_value_heads": int(m.num_kv_heads),
        "head_dim": int(m.head_dim), "hidden_act": "silu",
        "max_position_embeddings": int(m.max_seq_len), "rms_norm_eps": float(m.norm_eps),
        "tie_word_embeddings": bool(m.tie_embeddings), "rope_parameters": rope,
        "attention_dropout": 0.0, "use_cache": True, "dtype": dtype,
    }
    if architecture == "LlamaForCausalLM":
        hf.update(attention_bias=False, mlp_bias=False)
    elif architecture == "MistralForCausalLM":
        hf["sliding_window"] = window or None
    else:
        hf.update(use_sliding_window=False, sliding_window=None,
                  max_window_layers=int(m.num_layers), layer_types=["full_attention"] * int(m.num_layers))
    for k, v in (token_ids or {}).items():
        if v is not None:
            hf[k] = v
    return hf

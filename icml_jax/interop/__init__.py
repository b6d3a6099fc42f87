"""Hugging Face checkpoint interop: Llama / Mistral / Qwen2 safetensors <-> our Decoder.

    from icml_jax.interop import load_hf, save_hf, load_hf_tokenizer
    model_cfg, params = load_hf("path/to/hf_folder")            # sharded over all local devices
    logits = build_model(model_cfg).apply({"params": params}, tokens_BT)
    save_hf("out_dir", model_cfg, params, "LlamaForCausalLM")   # loads with AutoModelForCausalLM
    tok = load_hf_tokenizer("path/to/hf_folder")                # our Tokenizer protocol

Config (``config.json`` -> ``config.model``): vocab_size -> vocab_size, hidden_size -> d_model,
num_hidden_layers -> num_layers, num_attention_heads -> num_heads, num_key_value_heads ->
num_kv_heads, head_dim (or hidden_size // heads) -> head_dim, intermediate_size -> ffn_dim,
max_position_embeddings -> max_seq_len, rms_norm_eps -> norm_eps, tie_word_embeddings ->
tie_embeddings, rope_parameters (or legacy rope_theta + rope_scaling) -> rope_theta and
rope_scaling.{type: none|linear|llama3, factor, low_freq_factor, high_freq_factor,
original_max_position}, Qwen2 -> qkv_bias=True, Mistral sliding_window -> sliding_window.

Weights (L layers, i < L; H = G * R query heads, query head h = g * R + r; HF Linear weights are
[out, in], ours [in, out]; all transforms are exact reshapes/transposes):

  HF tensor                                    our path (``layer_{i}/`` or scanned ``layers/``)   transform
  model.embed_tokens.weight        [V, D]      io/embedding            [V, D]                  identity
  model.norm.weight                [D]         io/final_norm/scale     [D]                     identity
  lm_head.weight                   [V, D]      io/lm_head              [D, V]                  transpose (untied only)
  model.layers.i.input_layernorm.weight [D]    attn_norm/scale         [D]                     identity
  ...self_attn.q_proj.weight       [H*K, D]    attn/qkv[:, :, :R]      [D, G, R, K]            .T, reshape
  ...self_attn.k_proj.weight       [G*K, D]    attn/qkv[:, :, R]       [D, G, K]               .T, reshape
  ...self_attn.v_proj.weight       [G*K, D]    attn/qkv[:, :, R+1]     [D, G, K]               .T, reshape
  ...self_attn.{q,k,v}_proj.bias   [H*K],[G*K] attn/qkv_bias           [G, R+2, K]             reshape, same slots (Qwen2)
  ...self_attn.o_proj.weight       [D, H*K]    attn/out                [G, R, K, D]            .T, reshape
  ...post_attention_layernorm.weight [D]       mlp_norm/scale          [D]                     identity
  ...mlp.gate_proj.weight          [F, D]      mlp/wi[:, 0]            [D, F]                  .T
  ...mlp.up_proj.weight            [F, D]      mlp/wi[:, 1]            [D, F]                  .T
  ...mlp.down_proj.weight          [D, F]      mlp/wo                  [F, D]                  .T

RoPE: both sides use the half-split (rotate_half) layout, so q/k need no permutation.
Ignored on import: ``*.rotary_emb.inv_freq`` buffers, and ``lm_head.weight`` of a tied model when it
equals the embedding. Qwen2 export of a model without ``qkv_bias`` writes zero biases.
Not supported (clear ValueError): other architectures, hidden_act != silu, mlp_bias, Llama/Mistral
attention_bias (it also biases o_proj), rope types other than default/linear/llama3,
partial_rotary_factor != 1, Qwen2 use_sliding_window / sliding layer_types; on export: non-rope
positions, non-swiglu MLPs, non-standard residual streams, qkv_bias outside Qwen2, sliding windows
outside Mistral. Export is single-process (each param is gathered to the host, one at a time).

Heterogeneous children (``config.model.blocks``, Puzzle) export in the parent's uniform shape,
padded exactly by ``hf.uniform_params``: FFN width F_l < ffn_dim -> zero gate/up columns and down
rows; G_l KV heads (G_l dividing num_kv_heads = G) -> slot j holds child head j // (G / G_l), q and
o in their head order; no-op attention / FFN -> norm of ones, zero o_proj / down_proj. The checkpoint
keeps the child's function, not its savings. ``linear`` blocks, widths above ffn_dim and G_l not
dividing G are refused before anything is written.
"""
from icml_jax.interop.hf import Checkpoint, load_hf, save_hf  # noqa: F401
from icml_jax.interop.hf_config import ARCHITECTURES, from_hf_config, to_hf_config  # noqa: F401
from icml_jax.interop.tokenizer import HFTokenizer, load_hf_tokenizer  # noqa: F401

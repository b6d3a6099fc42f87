"""Language-model pre-training on the embedded Shakespeare corpus (or your own text).

Run:
  python -m icml_jax.main --config=configs/lm.py:small --workdir=runs/lm_small
  python -m icml_jax.main --config=configs/lm.py:tiny --workdir=/tmp/t --config.train.steps=20

Presets: ``tiny`` (tests, seconds), ``small`` (the demo, a few minutes on 2 CPU cores),
``20m`` (~20M parameters, benchmarks), ``base`` (a starting point for accelerators).
"""
import ml_collections


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.task = "lm"

    c.model = ml_collections.ConfigDict()
    c.model.vocab_size = 384  # >= tokenizer vocab; a multiple of 128 so it shards on `tensor`
    c.model.d_model = 256
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 64
    c.model.ffn_dim = 704
    c.model.max_seq_len = 1024
    c.model.norm_eps = 1e-5
    c.model.tie_embeddings = True
    c.model.init_std = 0.02
    c.model.position = "rope"  # registry: icml_jax.models.positions (rope|fope|alibi|nope)
    c.model.rope_theta = 10000.0
    c.model.rope_scaling = ml_collections.ConfigDict()
    c.model.rope_scaling.type = "none"  # none | linear | llama3 (HF rope_type semantics)
    c.model.rope_scaling.factor = 1.0
    c.model.rope_scaling.low_freq_factor = 1.0  # llama3 only
    c.model.rope_scaling.high_freq_factor = 4.0  # llama3 only
    c.model.rope_scaling.original_max_position = 8192  # llama3 only
    # Floor clipping (FoPE, and optionally RoPE): frequencies w < rope_floor_ratio * 2*pi / L are
    # dropped, L = train_seq_len (0 = max_seq_len; set it when max_seq_len allows longer evals).
    c.model.train_seq_len = 0
    c.model.rope_floor_clip = False  # rope only: zero the clipped frequencies (fope always clips)
    c.model.rope_floor_ratio = 1.0
    c.model.fope = ml_collections.ConfigDict()  # position="fope" only; see docs/methods/fope.md
    c.model.fope.init_gain = 0.3  # g of the eye + xavier-normal init
    c.model.fope.init_std = "xavier"  # xavier: g*sqrt(2/(D_out*(D_in+G))) (reference) | gain: g
    c.model.fope.learnable = False  # reference default: fixed coefficients
    c.model.fope.pad_sin_value = 1.0  # reference pads sin with 1; 0 = position-free channels
    c.model.fope.dout_divisor = 4  # D_out = min(D_in, head_dim // dout_divisor)
    c.model.qkv_bias = False  # Qwen2-style biases on the q/k/v projections
    c.model.sliding_window = 0  # 0 = off; else a key is visible only if q_pos - k_pos < window
    # softmax attention: "einsum" (ours, float32 logits), "xla" (jax.nn.dot_product_attention's XLA
    # path, same numbers) or "cudnn" (its cuDNN flash-attention kernel; NVIDIA GPUs, bf16/fp16)
    c.model.attention_impl = "einsum"
    # einsum path without a cache: queries in blocks of this many (at most 8 blocks), the key
    # blocks they are causally masked from skipped (same numbers, less work); 0 = one block
    c.model.attention_block = 64
    # decode-time KV cache (icml_jax/inference/kv_policies.py): full | streaming | h2o | snapkv |
    # morphkv; slots N per (row, KV head) (snapkv: its prompt budget), window W, StreamingLLM
    # sinks, MorphKV fuse (sum | max), SnapKV pooling kernel
    c.model.kv_policy = ml_collections.ConfigDict(
        dict(name="full", slots=0, window=32, sinks=4, fuse="sum", pool=5))
    c.model.mlp = ml_collections.ConfigDict()
    # registry icml_jax.models.mlp: swiglu | relu_glu | relu | relu2 | gelu | gelu_tanh
    c.model.mlp.activation = "swiglu"
    c.model.mlp.sparse_compare = "lt"  # sparse inference zeroes |a| < t/||w|| (reference); "le": <=
    # decode: > 0 = batch-1 gathered sparse FFN over this many candidate neurons (static; gated
    # MLPs + a sparsity tree only; models/sparse_ffn.py); 0 = off (masked dense MLP)
    c.model.mlp.sparse_capacity = 0
    # > 0: every attention / MLP projection also has rank-r factors, y = x W + (x A) B (the
    # sparse + low-rank layers of TLR pruning, models/lowrank.py); standard residual only
    c.model.lowrank = 0
    # per-layer blocks (Puzzle children, models/hetero.py): "" = every layer as above, or one entry
    # per layer, comma-separated: attention = KV heads | linear | noop; ffn = width | linear | noop
    c.model.blocks = ml_collections.ConfigDict(dict(attention="", ffn=""))
    c.model.residual = "standard"  # registry icml_jax.models.residual: standard | rmt
    # Residual Matrix Transformer (residual="rmt"; docs/methods/rmt.md). It reuses num_layers (L),
    # num_heads (R, = num_kv_heads), head_dim (Dv), ffn_dim (N_ff), vocab_size; d_model is unused.
    c.model.rmt = ml_collections.ConfigDict()
    c.model.rmt.key_dim = 32  # Dk: the residual is a Dk x Dv matrix per token
    c.model.rmt.position = "alibi"  # alibi (reference) | learned (paper App. C.1)
    c.model.rmt.norm = "rms_matrix"  # rms_matrix: RMS over all Dk*Dv entries (reference) | layernorm
    c.model.rmt.inverse_layer_scaling = True  # attention logits / (layer + 1) (reference)
    c.model.rmt.param = "mup"  # mup (reference, zero unembedding) | lecun (paper variant study)
    c.model.rmt.query_zero_init = False  # reference's zeroing is a no-op; True applies it
    # dtype of the residual matrices X between layers: "" = config.model.dtype (reference);
    # "bfloat16" stores X in half the bytes (norms, adds and dots still accumulate in float32)
    c.model.rmt.residual_dtype = ""
    # muP (rmt.param="mup"): base widths define the width ratios (0 = the model's own width, so
    # ratio 1, as the reference's train script runs); hidden kernels' lr is divided by the ratio.
    c.model.rmt.base_rank = 0  # base R
    c.model.rmt.base_key_dim = 0  # base Dk
    c.model.rmt.base_value_dim = 0  # base Dv
    c.model.rmt.base_ffn_dim = 0  # base N_ff
    c.model.rmt.input_multiplier = 1.0  # embedding output multiplier
    c.model.rmt.output_multiplier = 1.0  # unembedding multiplier (divided by the E*R width ratio)
    c.model.rmt.attn_multiplier = 1.0  # attention logits x attn_multiplier * sqrt(base Dv) / Dv
    c.model.dtype = "float32"  # compute dtype: float32 | bfloat16
    c.model.param_dtype = "float32"
    c.model.remat = "none"  # none | full | dots (save matmul outputs)
    c.model.scan_layers = False
    # decode a scan_layers model with its layers unrolled (generate, scored_decode, CoS): no per-layer
    # KV-cache copy per step, at the cost of one per-layer copy of the weights per call and a longer
    # compile; False decodes through the scanned loop (decoder.unrolled)
    c.model.decode_unrolled = True

    c.data = ml_collections.ConfigDict()
    c.data.name = "shakespeare"  # shakespeare | text_files | jsonl | tfds:<name>[:<version>]
    c.data.path = ""  # folder of .txt files or a .jsonl file for text_files / jsonl
    c.data.text_key = "text"  # JSONL field, or the TFDS feature holding the text
    c.data.data_dir = ""  # TFDS data dir; "" = $TFDS_DATA_DIR or ~/tensorflow_datasets
    c.data.seq_len = 256
    # independently packed streams the global batch is drawn from (must divide train.batch_size);
    # > 1 lets each host pack only its own rows' streams (multi-host). Changes the data order.
    c.data.streams = 1
    # data selection (MASS, docs/methods/mass.md): keep the top select_ratio of the train split's
    # documents by the scores in select_scores (a .npy, one float per train document, e.g. from
    # icml_jax.analysis.mass.write_scores); "" = keep every document
    c.data.select_scores = ""
    c.data.select_ratio = 1.0
    # preference / reward-model tasks (data.name="preference_jsonl"; icml_jax/data/preference.py)
    c.data.eval_path = ""  # validation pairs (JSONL); "" = the first pairs of data.path
    c.data.max_prompt_len = 0  # > 0: prompts keep their last max_prompt_len tokens
    c.data.add_eos = True  # append eos to every response (TRL's convention)
    c.data.tokenizer = ml_collections.ConfigDict()
    c.data.tokenizer.type = "byte"  # byte | sentencepiece
    c.data.tokenizer.model_path = ""  # a SentencePiece .model file
    c.data.tokenizer.extra_ids = 0  # byte only: N single-token symbols U+E000.. (ids 259..258+N)

    c.train = ml_collections.ConfigDict()
    c.train.steps = 1000
    c.train.batch_size = 16  # global, in packed rows
    c.train.grad_accum = 1
    c.train.lr = 3e-3
    c.train.warmup_steps = 100
    c.train.min_lr_ratio = 0.1
    c.train.weight_decay = 0.1
    c.train.b1 = 0.9
    c.train.b2 = 0.95
    c.train.eps = 1e-8
    c.train.clip_norm = 1.0
    c.train.z_loss = 0.0  # coefficient of mean (log Z)^2 added to the loss (RMT reference: 1e-4)
    c.train.log_every = 10
    c.train.eval_every = 200
    c.train.eval_batches = 8
    c.train.checkpoint_every = 200
    # extra steps to checkpoint besides every checkpoint_every (e.g. log-spaced ones for a
    # training-dynamics study); keep_checkpoints still bounds how many stay on disk
    c.train.checkpoint_steps = ()
    c.train.keep_checkpoints = 3
    c.train.async_checkpoint = True
    # CRC32 of every checkpoint file, written after each save and checked on restore (a step whose
    # files changed is set aside and the previous one is used); costs one read of each checkpoint
    c.train.checkpoint_checksums = True
    # True: move this workdir's previous run (checkpoints, metrics, config) to previous_runs/<time>/
    # and train from step 0; needed to reuse a workdir with another model, data or seed. Acts once:
    # the same command again resumes the new run.
    c.train.start_over = False
    c.train.samples = 3  # generated samples printed at the end (0 = none)
    c.train.sample_len = 120
    c.train.sample_temperature = 0.8
    c.train.sample_prompts = ("ROMEO.", "To be, or not to be", "KING HENRY.")
    c.train.progress = True
    # a training workdir (e.g. the SFT run) whose newest params initialise this run (fresh runs
    # only; a resumed run restores its own checkpoint). Reward models load it into the backbone.
    c.train.init_from = ""

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # -1 = infer from the device count
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    # logical axis -> mesh axes. Params: embed/vocab/mlp/heads/kv_heads/head_dim/layers;
    # activations: batch/length/act_embed/act_heads/act_kv_heads/act_mlp/act_vocab.
    c.mesh.rules = (
        ("batch", ("data", "fsdp")),
        ("embed", "fsdp"),
        ("vocab", "tensor"),
        ("mlp", "tensor"),
        ("heads", "tensor"),
        ("kv_heads", "tensor"),
        ("head_dim", None),
        ("layers", None),
        ("length", None),
        ("act_embed", None),
        ("act_heads", "tensor"),
        ("act_kv_heads", "tensor"),
        ("act_mlp", "tensor"),
        ("act_vocab", "tensor"),
        # Residual Matrix Transformer (residual="rmt"): rank R (= heads), key dim Dk, value dim Dv.
        ("rmt_rank", "tensor"),
        ("rmt_key", "fsdp"),
        ("rmt_value", None),
        ("act_rmt_key", None),
        ("act_rmt_value", None),
    )
    return c


PRESETS = {
    "tiny": dict(
        model=dict(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=64,
                   max_seq_len=128),
        data=dict(seq_len=32),
        train=dict(steps=20, batch_size=8, lr=1e-2, warmup_steps=2, log_every=5, eval_every=10,
                   eval_batches=2, checkpoint_every=10, samples=1, sample_len=16, progress=False,
                   async_checkpoint=False),
    ),
    "small": dict(
        model=dict(d_model=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, ffn_dim=704,
                   max_seq_len=512),
        data=dict(seq_len=256),
        train=dict(steps=400, batch_size=16, lr=3e-3, warmup_steps=40, eval_every=100,
                   checkpoint_every=100),
    ),
    "20m": dict(
        model=dict(d_model=512, num_layers=6, num_heads=8, num_kv_heads=4, head_dim=64, ffn_dim=1408,
                   max_seq_len=1024),
        data=dict(seq_len=256),
        train=dict(steps=2000, batch_size=16, lr=1e-3, warmup_steps=200),
    ),
    "base": dict(
        model=dict(d_model=1024, num_layers=16, num_heads=16, num_kv_heads=8, head_dim=64,
                   ffn_dim=2816, max_seq_len=2048, dtype="bfloat16", remat="dots"),
        data=dict(seq_len=1024),
        train=dict(steps=20000, batch_size=256, lr=6e-4, warmup_steps=1000),
    ),
}


def get_config(preset: str = "small") -> ml_collections.ConfigDict:
    """Returns the config of a named preset (see PRESETS)."""
    return preset_config(PRESETS, preset, default="small", where="configs/lm.py")


def preset_config(presets: dict, preset: str, *, default: str, where: str,
                  base: dict | None = None, sections: dict | None = None) -> ml_collections.ConfigDict:
    """``base_config()`` plus the new top-level ``sections`` (e.g. a task's ``loss``), updated by
    the nested dicts ``base`` then ``presets[preset]``, locked; the shared ``get_config`` of every
    config file (``where`` names the file in the error)."""
    preset = preset or default
    if preset not in presets:
        raise ValueError(f"{where}: unknown preset {preset!r}; choose one of {sorted(presets)}")
    c = base_config()
    for name, fields in (sections or {}).items():
        c[name] = ml_collections.ConfigDict(fields)
    c.update_from_flattened_dict(_flatten(base or {}))
    c.update_from_flattened_dict(_flatten(presets[preset]))
    c.preset = preset
    c.lock()
    return c


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out

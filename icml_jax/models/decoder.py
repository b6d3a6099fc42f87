"""The decoder-only transformer: embeddings -> L blocks -> logits, parts chosen by registries.

``Decoder(cfg)(tokens_BT, positions_BT=None, segment_ids_BT=None) -> logits_BTV`` (float32).
Segment ids mark packed documents (0 = padding); a token attends only within its segment and
only to earlier slots. Positions restart per document in packed rows. With the collection
``hidden`` mutable, an unscanned decoder sows every layer's output (``hidden/h_{i}``, a 1-tuple).
``config.model.blocks`` gives each layer its own block (``models/hetero.py``); named points can be
captured (collection ``hooks``) and edited (``edits``) as ``models/hooks.py`` says.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from icml_jax.models import hetero, hooks
from icml_jax.models.layers import MATMUL_NAME, upcast
from icml_jax.models.residual import RESIDUALS

_CP = jax.checkpoint_policies
_MATMULS = _CP.save_only_these_names(MATMUL_NAME)  # layers.matmul's outputs (a custom VJP hides their dot)
_REMAT_POLICIES = {
    "full": None,  # save nothing, recompute the whole block
    "dots": _CP.save_from_both_policies(_CP.dots_saveable, _MATMULS),
    "dots_no_batch": _CP.save_from_both_policies(_CP.dots_with_no_batch_dims_saveable, _MATMULS),
}


def _block_class(cfg):
    if hetero.is_hetero(cfg):
        hetero.validate(cfg)  # e.g. a scanned stack would repeat one layer's layout
        block = hetero.HeteroBlock
    else:
        block = RESIDUALS.get(cfg.residual).Block
    if cfg.remat == "none":
        return block
    if cfg.remat not in _REMAT_POLICIES:
        raise ValueError(f"unknown config.model.remat {cfg.remat!r}; choose one of "
                         f"{['none'] + sorted(_REMAT_POLICIES)}")
    return nn.remat(block, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)


class Decoder(nn.Module):
    """``decode=True`` adds a KV cache (collection ``cache``) sized by the init input [B, S]; each
    call then appends its tokens (prefill: many, decode: one) and returns their logits."""
    cfg: ml_collections.ConfigDict
    decode: bool = False
    edits: hooks.Edits | None = None  # hook edits (models/hooks.py); None / empty: none

    @nn.compact
    def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None, last_only: bool = False,
                 features: bool = False):
        """Logits [B, T, V] float32; ``last_only`` unembeds only the last slot ([B, 1, V]), which
        is what a prefill needs. ``features`` returns what the unembedding reads instead: the
        final-normed hidden state [B, T, F] (F = D for the standard stream; heads on top of
        the decoder, e.g. a reward model's scalar score, use it)."""
        c = self.cfg
        B, T = tokens_BT.shape
        if T > c.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds config.model.max_seq_len={c.max_seq_len}; "
                             "shorten config.data.seq_len or raise max_seq_len")
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if segment_ids_BT is None:
            segment_ids_BT = jnp.ones((B, T), jnp.int32)
        io = RESIDUALS.get(c.residual).IO(c, name="io")
        h = io(tokens_BT, positions_BT)
        block = _block_class(c)
        if self.edits and (c.scan_layers or c.residual != "standard" or self.edits.max_layer() >= c.num_layers):
            raise ValueError(f"hook edits {self.edits} need an unscanned standard decoder "
                             f"(config.model.scan_layers=False, residual='standard') and layers < "
                             f"num_layers={c.num_layers}")
        if c.scan_layers:
            stack = nn.scan(block, variable_axes={"params": 0, "intermediates": 0, "cache": 0, "sparsity": 0,
                                                  "hooks": 0},
                            split_rngs={"params": True}, in_axes=(nn.broadcast, nn.broadcast),
                            length=c.num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
            h, _ = stack(c, self.decode, name="layers")(h, positions_BT, segment_ids_BT)
        else:
            het = hetero.is_hetero(c)
            extra = lambda i: ({"layer": i} if het else {}) | (  # noqa: E731
                {"edits": self.edits.layer(i)} if self.edits and self.edits.layer(i) else {})
            for i in range(c.num_layers):
                h, _ = block(c, self.decode, name=f"layer_{i}", **extra(i))(h, positions_BT, segment_ids_BT)
                if self.is_mutable_collection("hidden") and not self.is_initializing():
                    self.sow("hidden", f"h_{i}", h)  # distillation / analysis only
        if last_only:
            h = jax.tree.map(lambda x: x[:, -1:], h)
        if features:
            # the residual stream's norm per token before the final norm, float32 [B, T]: a
            # diagnostic that exists only when the caller makes "diagnostics" mutable
            sq = sum(jnp.sum(jnp.square(upcast(x)), axis=tuple(range(2, x.ndim)))
                     for x in jax.tree.leaves(h) if jnp.issubdtype(x.dtype, jnp.floating))
            self.sow("diagnostics", "residual_norm", jnp.sqrt(sq))
        return io.features(h) if features else io.unembed(h)


def build_model(model_cfg: ml_collections.ConfigDict, decode: bool = False,
                edits: hooks.Edits | dict | None = None) -> Decoder:
    """A Decoder over a frozen (hashable) copy of ``config.model``; ``edits``: hook edits
    (``models/hooks.py``; a dict is wrapped in ``hooks.Edits``)."""
    if edits is not None and not isinstance(edits, hooks.Edits):
        edits = hooks.Edits(edits)
    return Decoder(ml_collections.FrozenConfigDict(model_cfg), decode=decode, edits=edits or None)


def unrolled(model_cfg: ml_collections.ConfigDict) -> tuple[ml_collections.ConfigDict, int]:
    """(the config a decode loop builds its model from, L to split the stacked variables into with
    :func:`split_layers`, 0 for none): a ``scan_layers`` model decodes with its layers unrolled
    (``inference.decode``, ``collab``) unless ``config.model.decode_unrolled`` is False (configs
    saved before that key existed count as True); other configs come back as they are, with 0.

    Under ``nn.scan`` every layer's slice of the stacked KV cache is copied out, updated and written
    back on every step (extra cache-sized copies per layer in the compiled loop), so a scanned
    model decoded 1.8x slower than the same weights unrolled at batch 1 and 8 with 192 cache slots,
    and 2.4x slower at batch 1 with 1024 (``benchmarks.decode_speed``, 20m dims); unrolled, each
    cache is updated in place. The price: :func:`split_layers` makes a per-layer copy of the weights
    for the call (the stacked ones stay), and the unrolled step compiles longer;
    ``decode_unrolled=False`` keeps the scanned loop (e.g. when the weights cannot be held twice)."""
    if not (model_cfg.scan_layers and model_cfg.get("decode_unrolled", True)):
        return model_cfg, 0
    cfg = ml_collections.ConfigDict(model_cfg.to_dict())
    cfg.scan_layers = False
    return cfg, int(model_cfg.num_layers)


def split_layers(tree, num_layers: int):
    """A scanned model's variables (params, a sparsity tree) in the unrolled layout: the stacked
    ``layers`` subtree (leading axis L) becomes ``layer_0`` .. ``layer_{L-1}``; other entries are
    kept. Boxed (partitioned) leaves are unboxed first. With ``num_layers`` 0, or a tree without
    ``layers`` (or None), the tree comes back as it is. Jit-friendly: inside a jitted decode loop
    the slices are taken once, before the loop."""
    if not num_layers or tree is None or "layers" not in tree:
        return tree
    tree = nn.meta.unbox(tree)
    out = {k: v for k, v in tree.items() if k != "layers"}
    for i in range(num_layers):
        out[f"layer_{i}"] = jax.tree.map(lambda x, i=i: x[i], tree["layers"])
    return out

"""Named points of the decoder that can be captured and edited, in training, scoring and KV-cache
decoding alike (docs/hooks.md).

Points, per layer ``i`` of the standard (and heterogeneous) decoder, named ``layer_{i}/{point}``:

  resid_pre    [B, T, D]        the residual stream entering the layer
  attn_heads   [B, T, G, R, K]  each query head's attention output before the output projection
                                (query head h = g * R + r; G KV heads, R query heads per KV head)
  attn_out     [B, T, D]        what the attention sub-block adds to the stream
  mlp_hidden   [B, T, F]        the MLP's hidden activations (what the down projection reads)
  mlp_out      [B, T, D]        what the MLP sub-block adds to the stream
  resid_post   [B, T, D]        the residual stream leaving the layer

**Capture.** With the Flax collection ``hooks`` mutable, every point sows its value (after any
edit): ``capture`` returns ``{name: array}``. **Edit.** ``Edits({name: fn})`` maps names to pure
functions ``fn(x) -> x`` of the same shape and dtype, applied where the value is made, so
everything downstream sees the edited value; the mapping is static (part of the jitted
program, hashable), e.g. ``build_model(cfg, edits=Edits({"layer_1/attn_heads": f}))`` or
``generate(..., edits=...)``. During KV-cache decoding a step's T is 1, so an edit of the step's
positions is an edit of the current token. A point with no edit and no capture adds nothing to
the program. Layers that a heterogeneous layout makes linear or no-op have only the residual
points (and ``attn_out`` / ``mlp_out`` for linear sub-blocks).

**Edits with array arguments.** ``Edits({name: fn}, args={name: pytree})`` calls ``fn(x, args[name])``:
the arrays (a steering vector, a strength, an SAE's params, feature indices) are arguments of the
program, not constants in it, so ``generate`` / ``scored_decode`` compile once for every value of
them (sweeping a strength reuses one compiled program; closed-over arrays would be baked into it
and recompiled for each new function). Inside a jitted function of your own, build the ``Edits``
there with traced ``args``. Two ``Edits`` are equal when their functions are the same objects and
their arguments the same arrays (``split`` / ``bind`` separate them for a jitted program).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import jax

POINTS = ("resid_pre", "attn_heads", "attn_out", "mlp_hidden", "mlp_out", "resid_post")
COLLECTION = "hooks"
_NAME = re.compile(r"^layer_(\d+)/(\w+)$")


class _Unbound:
    """Stands for the arguments ``Edits.split`` took out (the program's static half)."""

    def __repr__(self):
        return "<unbound>"


UNBOUND = _Unbound()


class Edits:
    """A static, hashable mapping ``layer_{i}/{point} -> fn`` (functions compare by identity);
    ``args``: {name: pytree of arrays} for the names whose function takes them, ``fn(x, a)``."""

    def __init__(self, mapping: Mapping[str, Callable] | None = None, args: Mapping | None = None):
        mapping, args = dict(mapping or {}), dict(args or {})
        unknown = sorted(set(args) - set(mapping))
        if unknown:
            raise ValueError(f"hook edit args for {unknown} have no edit function (edits: {sorted(mapping)})")
        items = []
        for name, fn in mapping.items():
            m = _NAME.match(name)
            if not m or m.group(2) not in POINTS:
                raise ValueError(f"hook name {name!r}: use 'layer_<i>/<point>' with a point in {POINTS}")
            if not callable(fn):
                raise ValueError(f"hook {name!r}: the edit must be a function x -> x, got {type(fn).__name__}")
            items.append((int(m.group(1)), m.group(2), fn))
        self.items = tuple(sorted(items, key=lambda t: (t[0], POINTS.index(t[1]))))
        self.args = args

    def layer(self, i: int) -> tuple:
        """This layer's ((point, fn), ...), the static field a block carries; functions with
        arguments come bound to them."""
        out = []
        for layer, p, fn in self.items:
            if layer != i:
                continue
            name = f"layer_{layer}/{p}"
            if name in self.args:
                a = self.args[name]
                if a is UNBOUND:
                    raise ValueError(f"hook edit {name!r}: its arguments were split off (Edits.split); "
                                     "bind them inside the jitted program (Edits.bind)")
                fn = _bound(fn, a)
            out.append((p, fn))
        return tuple(out)

    def split(self) -> tuple["Edits", dict | None]:
        """(these edits without their arrays: static, hashable by structure; the arrays, or None)."""
        if not self.args:
            return self, None
        return self._with({n: UNBOUND for n in self.args}), dict(self.args)

    def bind(self, args: Mapping | None) -> "Edits":
        """These edits with ``args`` (e.g. traced ones inside a jitted program) in place of the
        split-off arrays."""
        if args is None:
            return self
        if set(args) != set(self.args):
            raise ValueError(f"hook edit args for {sorted(args)} do not match the edits' {sorted(self.args)}")
        return self._with(dict(args))

    def _with(self, args: dict) -> "Edits":
        e = Edits.__new__(Edits)
        e.items, e.args = self.items, args
        return e

    def max_layer(self) -> int:
        return max((layer for layer, _, _ in self.items), default=-1)

    def _key(self):
        # arrays compare by identity: equal values in two arrays compile twice, but a program
        # never runs with another array's values baked into it
        return self.items, tuple(sorted(
            (n, "-" if a is UNBOUND else tuple(id(x) for x in jax.tree.leaves(a))) for n, a in self.args.items()))

    def __bool__(self):
        return bool(self.items)

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, Edits) and self._key() == other._key()

    def __repr__(self):
        return f"Edits({[f'layer_{i}/{p}' for i, p, _ in self.items]})"


def _bound(fn, a):
    def edit(x):
        return fn(x, a)
    return edit


def split_model(model):
    """(``model`` with its edits' arrays split off, the arrays or None): a jitted decoding
    program's static model and traced argument (``bind_model`` inside the program)."""
    edits = getattr(model, "edits", None)
    if not edits:
        return model, None
    static, args = edits.split()
    return (model if args is None else model.clone(edits=static)), args


def bind_model(model, args):
    """Inside the jitted program: ``model`` with the split-off edit arrays bound again."""
    return model if args is None else model.clone(edits=model.edits.bind(args))


def point(module, name: str, x, edits: tuple = ()):
    """The value of point ``name`` in ``module``: edited by its function in ``edits`` (a block's
    ``Edits.layer(i)``) and sown into ``hooks`` when that collection is mutable."""
    for p, fn in edits:
        if p == name:
            y = fn(x)
            if getattr(y, "shape", None) != x.shape or getattr(y, "dtype", None) != x.dtype:
                raise ValueError(f"the edit of hook point {name!r} must keep shape {x.shape} and dtype "
                                 f"{x.dtype}; it returned {getattr(y, 'shape', None)} {getattr(y, 'dtype', None)}")
            x = y
    if module.is_mutable_collection(COLLECTION) and not module.is_initializing():
        module.sow(COLLECTION, name, x)
    return x


def names_of(tree) -> dict:
    """{``layer_{i}/{point}``: array} from a ``hooks`` collection (sub-module levels such as
    ``attn`` / ``mlp`` dropped; a scanned stack's values keep their leading [L] axis under
    ``layers/{point}``)."""
    out = {}
    for path, v in jax.tree_util.tree_leaves_with_path(tree):
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        keys = [k for k in keys if not k.isdigit()]  # the sow tuple's index
        layer = next((k for k in keys if k.startswith("layer_") or k == "layers"), None)
        pt = next((k for k in reversed(keys) if k in POINTS), None)
        if layer is not None and pt is not None:
            out[f"{layer}/{pt}"] = v
    return out


def capture(model, params, tokens_BT, positions_BT=None, segment_ids_BT=None, points=None) -> dict:
    """{name: value} of the hook points of ``model`` (a ``Decoder``, its edits applied) on one
    forward pass; ``points``: names to keep (None: all)."""
    _, state = model.apply({"params": params}, tokens_BT, positions_BT, segment_ids_BT,
                           mutable=[COLLECTION])
    got = names_of(state.get(COLLECTION, {}))
    if points is None:
        return got
    missing = [p for p in points if p not in got]
    if missing:
        raise ValueError(f"hook points {missing} do not exist in this model (it has e.g. "
                         f"{sorted(got)[:6]})")
    return {p: got[p] for p in points}

"""Method knowledge lives on the registry entries (models/contract.py): the trainer, the optimizer
and the FLOP counter ask the entries and never name a position embedding or a residual stream."""
import ast
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.analysis import flops
from icml_jax.config_utils import REPO_ROOT, load_config
from icml_jax.models import contract
from icml_jax.models.positions import POSITIONS, PositionEmbedding
from icml_jax.models.residual import RESIDUALS, Stream
from icml_jax.train.optimizer import make_optimizer

METHOD_FREE = ("icml_jax/train/trainer.py", "icml_jax/train/optimizer.py", "icml_jax/analysis/flops.py")


def _model(**kw):
    c = load_config("configs/lm.py:tiny")
    c.model.update(kw)
    return c


def test_trainer_optimizer_and_flops_name_no_method():
    names = set(POSITIONS.names()) | set(RESIDUALS.names())
    for rel in METHOD_FREE:
        with open(os.path.join(REPO_ROOT, rel)) as f:
            tree = ast.parse(f.read())
        found = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in names}
        assert not found, f"{rel} names {sorted(found)}: ask the registry entry instead"


@pytest.fixture
def registered():
    """A position embedding and a residual stream that no library file knows about."""
    class Frozen(PositionEmbedding):
        @classmethod
        def validate(cls, m):
            if m.head_dim % 4:
                raise ValueError("config.model.head_dim: not a multiple of 4")

        @classmethod
        def frozen_leaf_names(cls, m):
            return ("kernel",)

        @classmethod
        def layer_param_count(cls, m):
            return 7

    std = RESIDUALS.get("standard")
    POSITIONS.register("test_frozen")(Frozen)
    RESIDUALS.register("test_stream")(std._replace(param_count=lambda m: 123,
                                                   train_flops_per_token=lambda m, n: 4.0 * n))
    yield
    POSITIONS._entries.pop("test_frozen")
    RESIDUALS._entries.pop("test_stream")


def test_a_new_entry_reaches_optimizer_validation_and_counts(registered):
    c = _model(position="test_frozen")
    base = flops.param_count(_model().model)
    assert flops.param_count(c.model) == base + 7 * c.model.num_layers
    c.model.head_dim = 6
    with pytest.raises(ValueError, match="multiple of 4"):
        contract.validate(c.model)
    c.model.head_dim = 8
    contract.validate(c.model)
    params = {"a": {"kernel": jnp.ones((2, 2))}, "b": {"bias": jnp.ones((2,))}}
    assert jax.tree.leaves(contract.optimizer_spec(c.model).frozen_mask(params)) == [True, False]
    c.train.weight_decay, c.train.warmup_steps = 0.5, 0
    tx = make_optimizer(c.train, model_cfg=c.model)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_array_equal(updates["a"]["kernel"], 0.0)  # frozen: no update, no decay
    assert np.all(np.asarray(updates["b"]["bias"]) != 0)
    s = _model(residual="test_stream").model
    assert flops.param_count(s) == 123 and flops.train_flops_per_token(s, 16) == 64.0


def test_rmt_refuses_a_position_it_would_ignore():
    c = _model(residual="rmt", num_kv_heads=4, num_heads=4)
    for ok in ("rope", "alibi"):
        c.model.position = ok
        contract.validate(c.model)
    c.model.position = "fope"
    with pytest.raises(ValueError, match="config.model.position='fope' would be ignored"):
        contract.validate(c.model)
    c.model.position = "alibi"
    c.model.attention_impl = "cudnn"  # the RMT's own attention would not use it
    with pytest.raises(ValueError, match="attention_impl='cudnn' would be ignored"):
        contract.validate(c.model)


def test_rope_refuses_an_odd_head_dim_and_the_rmt_does_not_ask():
    c = _model(head_dim=7)
    with pytest.raises(ValueError, match="head_dim=7 is odd"):
        contract.validate(c.model)
    assert not RESIDUALS.get("rmt").reads_position and isinstance(RESIDUALS.get("rmt"), Stream)

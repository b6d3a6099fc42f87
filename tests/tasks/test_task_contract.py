"""The written task contract (tasks/base.py) is the one every registered task follows and the
trainer relies on."""
import inspect

import pytest

from icml_jax import tasks
from icml_jax.config_utils import load_config
from icml_jax.losses import implicit_prm
from icml_jax.train import trainer

METHODS = ("dummy_batch", "init_params", "loss", "train_iterator", "eval_batches")


@pytest.mark.parametrize("name", tasks.TASKS.names())
def test_every_task_subclasses_the_contract_and_implements_it(name):
    cls = tasks.TASKS.get(name)
    assert issubclass(cls, tasks.Task)
    for m in METHODS:
        assert getattr(cls, m) is not getattr(tasks.Task, m), f"{name} does not implement {m}"
        assert list(inspect.signature(getattr(cls, m)).parameters) == \
            list(inspect.signature(getattr(tasks.Task, m)).parameters), f"{name}.{m}'s signature"
    assert isinstance(cls.loss_unit, str) and isinstance(cls.reports_perplexity, bool)
    assert isinstance(cls.can_sample, bool) and cls.pretrained_key in (None, "backbone")
    # no jax.jit with a static `self` on a method: its cache would key on (and keep) instances
    for v in vars(cls).values():
        assert not (callable(v) and hasattr(v, "lower")), f"{name} has a jitted method {v}"


def test_the_trainer_refuses_a_registered_object_that_is_not_a_task(monkeypatch):
    monkeypatch.setitem(tasks.TASKS._entries, "not_a_task", lambda config, context: object())
    c = load_config("configs/lm.py:tiny")
    c.task = "not_a_task"
    with pytest.raises(TypeError, match=r"does not subclass icml_jax\.tasks\.Task"):
        trainer.build_task(c, (1, 1, 1))


def test_the_implicit_prm_metrics_use_trl_names():
    import jax.numpy as jnp
    _, m = implicit_prm.ce_loss(jnp.array([1.0, -2.0]), jnp.array([1.0, 0.0]))
    assert set(m) == {"accuracy", "rewards/correct", "rewards/incorrect"}
    assert float(m["rewards/correct"]) == 1.0 and float(m["rewards/incorrect"]) == -2.0

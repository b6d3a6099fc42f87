"""Every preset of every config builds: the model initialises abstractly and the counts agree."""
import glob
import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest

from icml_jax.analysis.flops import param_count
from icml_jax.config_utils import REPO_ROOT, load_config
from icml_jax.models import build_model
from icml_jax.train.trainer import validate_config


def _presets():
    out = []
    for path in sorted(glob.glob(os.path.join(REPO_ROOT, "configs", "*.py"))):
        spec = importlib.util.spec_from_file_location("cfg", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out += [(os.path.relpath(path, REPO_ROOT), p) for p in getattr(mod, "PRESETS", {None: 0})]
    return out


@pytest.mark.parametrize("path,preset", _presets())
def test_preset_builds(path, preset):
    c = load_config(f"{path}:{preset}" if preset else path)
    assert c.data.seq_len <= c.model.max_seq_len
    model = build_model(c.model)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    n = sum(x.size for x in jax.tree.leaves(shapes))
    assert n == param_count(c.model)
    validate_config(c, 1)


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown preset 'hueg'"):
        load_config("configs/lm.py:hueg")


def test_an_older_saved_config_is_completed_at_load_and_resumes():
    """Keys added since a run was saved take the base value once, at load time, so resuming or
    sampling that run neither breaks on a missing key nor counts it as a changed setting."""
    import json
    from icml_jax.config_utils import complete_config
    from icml_jax.train import workdir as workdir_lib
    new = json.loads(load_config("configs/fope.py:tiny").to_json_best_effort())
    old = json.loads(json.dumps(new))
    del old["model"]["rope_floor_ratio"], old["model"]["fope"]["pad_sin_value"], old["train"]["z_loss"]
    assert workdir_lib.config_changes(old, new)["fixed"]  # without completion: refused
    done = complete_config(old)
    assert done["model"]["rope_floor_ratio"] == 1.0 and done["model"]["position"] == "fope"
    assert not any(workdir_lib.config_changes(done, new).values())
    assert complete_config(["not", "a", "config"]) == ["not", "a", "config"]


def test_precision_keys_are_free_on_resume():
    """model.dtype and model.rmt.residual_dtype change how the same params are computed, so a run
    may resume with another value (a saved config without the newer key too)."""
    import json
    from icml_jax.train import workdir as workdir_lib
    saved = json.loads(load_config("configs/rmt.py:tiny").to_json_best_effort())
    new = json.loads(json.dumps(saved))
    new["model"]["rmt"]["residual_dtype"], new["model"]["dtype"] = "bfloat16", "bfloat16"
    assert not any(workdir_lib.config_changes(saved, new).values())
    del saved["model"]["rmt"]["residual_dtype"]
    assert not any(workdir_lib.config_changes(saved, new).values())
    new["model"]["rmt"]["key_dim"] = 8  # (a param-shape key is still refused)
    assert workdir_lib.config_changes(saved, new)["fixed"]


def test_decode_only_keys_are_free_on_resume():
    """The KV-cache policy and decode_unrolled never touch training: a run resumes under other
    values (e.g. the SnapKV pooling default that changed from 7 to 5); a training key does not."""
    import json
    from icml_jax.train import workdir as workdir_lib
    saved = json.loads(load_config("configs/lm.py:tiny").to_json_best_effort())
    new = json.loads(json.dumps(saved))
    saved["model"]["kv_policy"]["pool"] = 7
    new["model"]["kv_policy"].update(name="morphkv", slots=64, window=8)
    new["model"]["decode_unrolled"] = not new["model"].get("decode_unrolled", True)
    assert not any(workdir_lib.config_changes(saved, new).values())
    new["model"]["d_model"] = 48
    assert workdir_lib.config_changes(saved, new)["fixed"] == ["model.d_model: 32 -> 48"]

"""Where the reward head reads the backbone (``config.loss.reward_position``), for every tokenizer
path the tasks build (byte, SentencePiece) and with and without an appended eos."""
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.data import ByteTokenizer, train_sentencepiece
from icml_jax.data.preference import encode_responses
from icml_jax.tasks.reward_model import REWARD_POSITIONS, score_index


WORDS = ("o happy dagger this is thy sheath there rust and let me die speak no more romeo "
         "juliet what light through yonder window breaks it is the east").split()


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    rng = np.random.default_rng(0)
    text = "\n".join(" ".join(rng.choice(WORDS, 12)) for _ in range(1500))
    spm = train_sentencepiece([text], str(tmp_path_factory.mktemp("spm") / "tiny"), vocab_size=400)
    return {"byte": ByteTokenizer(), "sentencepiece": spm}


@pytest.mark.parametrize("kind", ["byte", "sentencepiece"])
@pytest.mark.parametrize("add_eos", [True, False])
def test_the_reward_is_read_at_the_documented_token(tokenizers, kind, add_eos):
    tok = tokenizers[kind]
    prompts, responses = ["romeo ", "speak "], ["o happy dagger", "no"]
    arrays, _ = encode_responses(prompts, responses, tok, 48, add_eos=add_eos)
    tokens, lengths = jnp.asarray(arrays["inputs"]), jnp.asarray(arrays["lengths"])
    last = np.asarray(score_index(tokens, lengths, tok.eos_id, "last"))
    resp = np.asarray(score_index(tokens, lengths, tok.eos_id, "last_response_token"))
    np.testing.assert_array_equal(last, np.asarray(lengths) - 1)  # TRL: the last real token
    for i, r in enumerate(responses):
        t = np.asarray(tokens[i])
        assert (t[last[i]] == tok.eos_id) == add_eos
        assert t[resp[i]] == tok.encode(r)[-1] and t[resp[i]] != tok.eos_id
        assert arrays["response_mask"][i][resp[i]] == 1  # a response token, not the prompt's
    assert REWARD_POSITIONS == ("last", "last_response_token")
    if add_eos:  # an empty response is its eos alone: never step back onto the prompt
        e, _ = encode_responses(["romeo "], [""], tok, 48, add_eos=True)
        idx = score_index(jnp.asarray(e["inputs"]), jnp.asarray(e["lengths"]), tok.eos_id,
                          "last_response_token", jnp.asarray(e["response_mask"]))
        assert int(idx[0]) == int(e["lengths"][0]) - 1


def test_the_task_reads_the_configured_position_and_refuses_others(tmp_path):
    from icml_jax.config_utils import load_config
    from icml_jax.data.preference import write_preference_jsonl
    from icml_jax.tasks import TASKS
    from tests.tasks.helpers import synthetic_pairs
    path = str(tmp_path / "pairs.jsonl")
    write_preference_jsonl(path, synthetic_pairs(8, 0))
    c = load_config("configs/reward_model.py:tiny", unlocked=True)
    c.data.path, c.data.eval_path = path, path
    assert c.loss.reward_position == "last"  # TRL's default
    c.loss.reward_position = "last_response_token"
    assert TASKS.get("reward_model")(c).reward_position == "last_response_token"
    c.loss.reward_position = "eos"
    with pytest.raises(ValueError, match=r"unknown config.loss.reward_position 'eos'"):
        TASKS.get("reward_model")(c)


def test_the_residual_norm_is_the_one_before_the_final_norm(tmp_path):
    """residual_norm equals the norm of the last block's output (flax's captured intermediates) at
    the scoring token, and differs from the final-normed hidden_norm."""
    import flax.linen as nn
    import jax
    from icml_jax.config_utils import load_config
    from icml_jax.data.preference import write_preference_jsonl
    from icml_jax.tasks import TASKS
    from icml_jax.tasks.pairs import flat
    from tests.tasks.helpers import synthetic_pairs
    path = str(tmp_path / "pairs.jsonl")
    write_preference_jsonl(path, synthetic_pairs(8, 0))
    c = load_config("configs/reward_model.py:tiny", unlocked=True)
    c.data.path, c.data.eval_path = path, path
    task = TASKS.get("reward_model")(c)
    batch = task.eval_batches()[0]
    params = jax.jit(lambda k, b: nn.meta.unbox(task.init_params(k, b)))(jax.random.key(0), batch)

    assert not c.model.scan_layers
    last = f"layer_{c.model.num_layers - 1}"

    @jax.jit
    def run(p, b):
        args = (flat(b["inputs"]), flat(b["positions"]), flat(b["segment_ids"]), flat(b["lengths"]))
        r, h, res = task.apply(p, *args, with_residual=True)
        _, inter = task.model.apply({"params": p}, *args[:3], jnp.maximum(args[3] - 1, 0),
                                    capture_intermediates=True, mutable=["intermediates"])
        h_last = inter["intermediates"]["backbone"][last]["__call__"][0][0]  # [N, T, D]
        want = jnp.linalg.norm(jnp.take_along_axis(
            h_last, jnp.maximum(args[3] - 1, 0)[:, None, None], axis=1)[:, 0], axis=-1)
        return jnp.linalg.norm(h, axis=-1), res, want, task.loss(p, b)[2]
    f, n, want, msums = run(params, batch)
    np.testing.assert_allclose(n, want, rtol=1e-5)
    assert float(jnp.max(jnp.abs(f - n))) > 1e-2 * float(jnp.max(n))  # not the normed one
    assert {"residual_norm/mean", "residual_norm/std"} <= set(msums)
    # the host-side scorer gives the same residual norms, and the same rewards with or without them
    arrays = {k: np.asarray(flat(batch[k]))
              for k in ("inputs", "positions", "segment_ids", "lengths", "response_mask")}
    r2, h2, res2 = task.score(params, arrays, with_residual=True)
    np.testing.assert_allclose(res2, n, rtol=1e-5)
    r1, h1 = task.score(params, arrays)
    np.testing.assert_allclose(r2, r1, rtol=1e-6)
    np.testing.assert_allclose(h2, h1, rtol=1e-6)

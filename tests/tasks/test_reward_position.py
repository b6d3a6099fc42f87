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
    tokens, lengths = jnp.asarray(arrays["tokens"]), jnp.asarray(arrays["lengths"])
    last = np.asarray(score_index(tokens, lengths, tok.eos_id, "last"))
    resp = np.asarray(score_index(tokens, lengths, tok.eos_id, "last_response_token"))
    np.testing.assert_array_equal(last, np.asarray(lengths) - 1)  # TRL: the last real token
    for i, r in enumerate(responses):
        t = np.asarray(tokens[i])
        assert (t[last[i]] == tok.eos_id) == add_eos
        assert t[resp[i]] == tok.encode(r)[-1] and t[resp[i]] != tok.eos_id
        assert arrays["response_mask"][i][resp[i]] == 1  # a response token, not the prompt's
    assert REWARD_POSITIONS == ("last", "last_response_token")


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

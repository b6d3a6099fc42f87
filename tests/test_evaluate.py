"""``python -m icml_jax.evaluate`` (MedXpertQA), the batched scorer under it
(``analysis/lm_scoring.py``) and the lm-eval adapter (``icml_jax/lm_eval_adapter.py``), on one
random-init tiny decoder (configs/lm.py:tiny, byte tokenizer, max_seq_len 128)."""
import json
import math
import os
import subprocess
import sys
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.analysis import lm_scoring
from icml_jax.analysis import medxpertqa as answerers
from icml_jax.config_utils import REPO_ROOT, load_config
from icml_jax.data import medxpertqa as mx
from icml_jax.data.tokenizers import ByteTokenizer
from icml_jax.losses.logps import token_logprobs
from icml_jax.models.decoder import build_model
from tests.data.medxpertqa_synth import synthetic_rows, write_rows, write_synthetic

pytestmark = pytest.mark.xdist_group("evaluate_tiny_lm")
BATCH = 16


@pytest.fixture(scope="module")
def tiny():
    config = load_config("configs/lm.py:tiny", unlocked=True)
    params = jax.jit(lambda k: nn.meta.unbox(build_model(config.model).init(
        k, jnp.zeros((1, 8), jnp.int32))["params"]))(jax.random.key(0))
    lm = lm_scoring.TextLM(config.model, params, ByteTokenizer(), batch_size=BATCH)
    model = build_model(config.model)

    def ref(p, t):  # one unpadded-equivalent row: right padding never reaches earlier slots
        logits = model.apply({"params": p}, t[:, :-1], jnp.arange(t.shape[1] - 1)[None],
                             jnp.ones_like(t[:, :-1]))
        return token_logprobs(logits, t[:, 1:]), jnp.argmax(logits, -1), jnp.argmin(logits, -1)
    return types.SimpleNamespace(config=config, params=params, lm=lm, ref=jax.jit(ref))


def _reference(tiny, ids, width=65):
    """(per-token log-probs of ids[1:], argmax and argmin of each slot) from a single-row forward
    outside the scorer (no batching, no buckets), the row right-padded to one compiled width."""
    t = np.zeros((1, width), np.int32)
    t[0, :len(ids)] = ids
    lp, best, worst = (np.asarray(x)[0, :len(ids) - 1] for x in tiny.ref(tiny.params, t))
    return lp, best, worst


def test_loglikelihood_matches_unbatched_forward(tiny):
    """Sums over continuation tokens equal an unpadded single-row forward's, whatever the batch
    holds; trailing spaces of the context move to the continuation; an empty context scores after
    BOS; is_greedy is true exactly for the argmax continuation."""
    tok = ByteTokenizer()
    pairs = [("Q: two plus two?\nA:", " four"), ("hello ", "world"), ("", "abc"),
             ("x" * 40, " (C)"), ("y" * 200, " long context cut from the left")]
    alone = [tiny.lm.loglikelihood([p])[0] for p in pairs[:2]]
    cut_before = tiny.lm.truncated
    together = tiny.lm.loglikelihood(pairs * 3)  # 15 rows: two batches, one padded
    ids0 = [tok.bos_id] + tok.encode(pairs[0][0] + pairs[0][1])
    np.testing.assert_allclose(together[0][0], _reference(tiny, ids0)[0][-5:].sum(), rtol=1e-5)
    ids1 = [tok.bos_id] + tok.encode("hello world")
    np.testing.assert_allclose(together[1][0], _reference(tiny, ids1)[0][-6:].sum(), rtol=1e-5)
    ids2 = [tok.bos_id] + tok.encode("abc")
    np.testing.assert_allclose(together[2][0], _reference(tiny, ids2)[0].sum(), rtol=1e-5)
    for a, b in zip(alone, together[:2]):
        np.testing.assert_allclose(a[0], b[0], rtol=1e-5)
    assert [t[0] for t in together[:5]] == [t[0] for t in together[5:10]]
    assert tiny.lm.truncated - cut_before == 3  # the 200-byte context, three times
    ctx = [tok.bos_id] + tok.encode("The cat sat on the")
    _, best, worst = _reference(tiny, ctx + [0])
    greedy, _ = tiny.lm.scorer.score([(ctx, [int(best[-1])]), (ctx, [int(worst[-1])])])
    assert greedy[0][1] and not greedy[1][1]
    assert tiny.lm.scorer.compiled_shapes <= {(BATCH, b) for b in (32, 64, 128)}


def test_rolling_windows_and_loglikelihood_rolling(tiny):
    """Every token predicted exactly once, at most max_len predictions and max_len + 1 tokens per
    window, later windows with a full context; a text that fits scores as loglikelihood("", text)."""
    toks = list(range(10, 310))
    windows = lm_scoring.rolling_windows(toks, 1, 128)
    assert sum((c for _, c in windows), []) == toks
    assert all(len(c) <= 128 and len(x) + len(c) <= 129 for x, c in windows)
    assert all(len(x) + len(c) == 129 for x, c in windows[1:])
    assert windows[0][0] == [1]
    short = "a short document"
    np.testing.assert_allclose(tiny.lm.loglikelihood_rolling([short])[0],
                               tiny.lm.loglikelihood([("", short)])[0][0], rtol=1e-5)
    long = "word " * 60  # 300 bytes: three windows
    lp = tiny.lm.loglikelihood_rolling([long, short])
    assert math.isfinite(lp[0]) and lp[0] < lp[1] < 0


def _flags(**kw):
    base = dict(checkpoint=None, hf=None, baseline=None, text=None, mm=None, mode="letter_loglik",
                out=None, limit=0, batch_size=BATCH, rationale_tokens=8, answer_tokens=4, seed=0)
    return types.SimpleNamespace(**(base | kw))


@pytest.fixture(scope="module")
def workdir(tiny, tmp_path_factory):
    """A trainer-style workdir holding the tiny params (config.json + one orbax step)."""
    from icml_jax.train import checkpoint as ckpt_lib
    from icml_jax.train.optimizer import make_optimizer
    from icml_jax.train.trainer import TrainState, _config_dict
    wd = tmp_path_factory.mktemp("run")
    (wd / "config.json").write_text(json.dumps(_config_dict(tiny.config), indent=2))
    tx = make_optimizer(tiny.config.train)
    ckpt = ckpt_lib.Checkpointer(str(wd / "checkpoints"), async_save=False)
    ckpt.save(1, TrainState(jnp.asarray(1, jnp.int32), tiny.params, tx.init(tiny.params)), None,
              _config_dict(tiny.config))
    ckpt.close()
    return wd


def test_evaluate_letter_loglik_near_chance(workdir, tmp_path):
    """The harness check with a tiny LM: --checkpoint restores the params, every question gets a
    letter, accuracy sits within 3 binomial standard errors of chance (10% / 20%), per-type counts
    add up, and the JSON and Markdown reports are written."""
    from icml_jax import evaluate
    text = write_synthetic(tmp_path / "text.jsonl", 30, "text", seed=3)
    mm = write_synthetic(tmp_path / "mm.jsonl", 20, "mm", seed=4)
    out = tmp_path / "report"
    rep = evaluate.run(_flags(checkpoint=str(workdir), text=text, mm=mm, out=str(out)))
    saved = json.loads((out / "medxpertqa.json").read_text())
    assert saved["subsets"] == json.loads(json.dumps(rep["subsets"]))
    assert "step 1" in saved["model"] and saved["mode"] == "letter_loglik"
    for subset, n in (("text", 30), ("mm", 20)):
        s = saved["subsets"][subset]
        lo, hi = lm_scoring.chance_band(n, mx.chance(subset))
        assert s["n"] == n and s["no_answer"] == 0 and lo <= s["accuracy"] <= hi, s
        for key in mx.BREAKDOWNS:
            cells = s[f"by_{key}"].values()
            assert sum(c["n"] for c in cells) == n and sum(c["correct"] for c in cells) == s["correct"]
        preds = saved["predictions"][subset]
        assert len(preds) == n and sum(p["correct"] for p in preds) == s["correct"]
        assert all(len(p["letter_logps"]) == (10 if subset == "text" else 5) for p in preds)
    md = (out / "medxpertqa.md").read_text()
    assert "| MM (images ignored) | 20 |" in md and "## By question type" in md


def test_cot_protocol_with_a_scripted_model():
    """cot_extract: turn 1 is the system line + "Q: ...\\nA: Let's think step by step.", turn 2
    appends the rationale and the trigger; the letter comes from the turn-2 output."""
    qs = [mx.parse_row(r) for r in synthetic_rows(3, "text")] + \
         [mx.parse_row(r) for r in synthetic_rows(1, "mm")]
    seen = []

    class Scripted:
        def generate(self, contexts, max_new_tokens, progress=None, **_):
            seen.append((list(contexts), max_new_tokens))
            if len(seen) == 1:
                return [f"reasoning {i} about A" for i in range(len(contexts))]
            return ["(B) because", "I understand. Option J.", "no idea", "F, then D"]

    preds, records = answerers.cot_answers(Scripted(), qs, rationale_tokens=7, answer_tokens=3)
    assert preds == ["B", "J", None, "D"]  # F is outside A-E for the MM row
    (first, n1), (second, n2) = seen
    assert (n1, n2) == (7, 3)
    sys_, t1, t2 = mx.cot_turns(qs[0])
    assert first[0] == f"{sys_}\n\n{t1}"
    assert second[0] == f"{sys_}\n\n{t1} reasoning 0 about A\n\n{t2}"
    assert second[3].endswith("Therefore, among A through E, the answer is")
    assert records[1] == {"rationale": "reasoning 1 about A", "answer_text": "I understand. Option J."}


_REPORT_JAX = ("import atexit, runpy, sys; atexit.register(lambda: print('jax imported:', 'jax' in "
               "sys.modules, file=sys.stderr)); runpy.run_module('icml_jax.evaluate', "
               "run_name='__main__', alter_sys=True)")


def _cli(*args):
    return subprocess.run([sys.executable, "-c", _REPORT_JAX, *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_baseline_and_input_errors(tmp_path):
    """The oracle baseline scores 100% through the CLI without importing JAX; bad inputs are one
    line on stderr (file:line:field for a malformed row) and exit 1 before JAX is imported."""
    text = write_synthetic(tmp_path / "t.jsonl", 25, "text")
    r = _cli("--baseline=oracle", f"--text={text}", f"--out={tmp_path / 'o'}")
    assert r.returncode == 0 and "jax imported: False" in r.stderr, r.stderr
    rep = json.loads((tmp_path / "o" / "medxpertqa.json").read_text())
    assert rep["subsets"]["text"]["accuracy"] == 1.0 and "100.0%" in r.stdout
    rows = synthetic_rows(4, "mm")
    rows[2]["label"] = ["H"]
    bad = write_rows(tmp_path / "bad.jsonl", rows)
    for args, want in [
        ([f"--mm={bad}", f"--out={tmp_path}", "--baseline=random"], f"{bad}:3: field 'label'"),
        ([f"--text={text}", f"--out={tmp_path}"], "exactly one of --checkpoint"),
        ([f"--text={text}", f"--out={tmp_path}", f"--checkpoint={tmp_path}"], "no config.json"),
    ]:
        r = _cli(*args)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert want in r.stderr and "jax imported: False" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 2  # the error and the probe's line
    from icml_jax import evaluate
    for kw, want in [(dict(mode="cot"), "--mode=cot"), (dict(mm=str(tmp_path / "no.jsonl")), "no such file"),
                     (dict(batch_size=0), "--batch_size=0"), (dict(text=None), "--text=FILE")]:
        with pytest.raises(evaluate.EvaluateError, match=want):
            evaluate.run(_flags(**(dict(baseline="oracle", text=text, out=str(tmp_path / "x")) | kw)))


# ----------------------------------------------------------------------------- lm-eval adapter

def _instances(kind, args_list):
    from lm_eval.api.instance import Instance
    return [Instance(request_type=kind, doc={}, arguments=a, idx=0, metadata=("t", i, 1))
            for i, a in enumerate(args_list)]


def test_lm_eval_adapter_requests(tiny):
    """IcmlJaxLM answers lm-eval's three request kinds with the scorer's numbers; generate_until
    groups requests by their settings, stops at `until` and respects max_gen_toks; greedy
    generation is repeatable."""
    from lm_eval.api.model import LM
    from lm_eval.api.registry import get_model

    from icml_jax.lm_eval_adapter import IcmlJaxLM
    assert get_model("icml_jax") is IcmlJaxLM and issubclass(IcmlJaxLM, LM)
    from lm_eval.api.registry import model_registry
    assert {"hf", "vllm", "dummy"} <= set(model_registry.keys())  # the built-ins stay registered
    lm = IcmlJaxLM(model=(tiny.config.model, tiny.params, ByteTokenizer()), batch_size=BATCH)
    pairs = [("Question: 1+1?\nAnswer:", " 2"), ("Question: 1+1?\nAnswer:", " 3"), ("", "hi")]
    got = lm.loglikelihood(_instances("loglikelihood", pairs), disable_tqdm=True)
    assert got == tiny.lm.loglikelihood(pairs)
    roll = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [("some text",)]),
                                    disable_tqdm=True)
    assert roll == tiny.lm.loglikelihood_rolling(["some text"])
    ctx = "ROMEO: what light through yonder window"
    reqs = [(ctx, {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}),
            (ctx + "!", {"until": ["\n"], "max_gen_toks": 12}),
            (ctx, {"until": [], "max_gen_toks": 12, "temperature": 0.0})]
    a = lm.generate_until(_instances("generate_until", reqs), disable_tqdm=True)
    b = lm.generate_until(_instances("generate_until", reqs), disable_tqdm=True)
    assert a == b and all(len(t.encode()) <= 12 for t in a)
    assert "\n" not in a[0] and a[2].startswith(a[0])  # the same greedy row, cut at the stop
    assert a[2] == tiny.lm.generate([ctx], 12)[0]


def test_lm_eval_builds_the_adapter_from_a_workdir(workdir):
    """What `--model icml_jax --model_args checkpoint=... --batch_size 16` does: the harness's own
    constructor path, with the batch size it adds itself (a second batch_size in model_args would
    be a harness error, not ours)."""
    from lm_eval.api.registry import get_model

    import icml_jax.lm_eval_adapter  # noqa: F401 (registers icml_jax)
    lm = get_model("icml_jax").create_from_arg_string(
        f"checkpoint={workdir},max_gen_toks=7", {"batch_size": 16, "max_batch_size": None, "device": "cpu"})
    assert lm.where == f"{workdir} step 1" and lm.max_gen_toks == 7 and lm.lm.scorer.batch_size == 16
    with pytest.raises(ValueError, match=r"unknown \['checkpont'\]; expected checkpoint="):
        get_model("icml_jax").create_from_arg_string(f"checkpont={workdir}")


def test_lm_eval_runs_a_local_task_file_end_to_end(tiny, monkeypatch):
    """lm-eval's own ``simple_evaluate`` on the local multiple-choice task of docs/lm_eval_example
    (a JSONL file, no download) with our adapter: its accuracy equals the share of rows where our
    log-likelihood of the right choice is the highest."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from icml_jax.lm_eval_adapter import IcmlJaxLM
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lm = IcmlJaxLM(model=(tiny.config.model, tiny.params, ByteTokenizer()), batch_size=BATCH)
    # include_defaults=False: the local task alone, without indexing lm-eval's thousands of built-in ones
    res = lm_eval.simple_evaluate(model=lm, tasks=["letters_mc"], task_manager=TaskManager(
        include_path="docs/lm_eval_example", include_defaults=False), log_samples=False,
        verbosity="ERROR")
    rows = [json.loads(line) for line in open("docs/lm_eval_example/letters.jsonl")]
    want = np.mean([int(np.argmax([ll for ll, _ in tiny.lm.loglikelihood(
        [(f"Q: {r['question']}\nA:", " " + c) for c in r["choices"]])])) == r["answer"] for r in rows])
    assert res["results"]["letters_mc"]["acc,none"] == pytest.approx(want)

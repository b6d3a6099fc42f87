"""The ``vocagnolm`` task: its batch arrays against a direct computation, its loss against
``losses.vocagnolm.guided_loss``, the arms, the flag checks and a short run through the trainer."""
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.config_utils import load_config
from icml_jax.data.tokenizers import ByteTokenizer, train_sentencepiece
from icml_jax.losses.logps import token_logprobs
from icml_jax.losses.vocagnolm import guided_loss
from icml_jax.models import build_model
from icml_jax.tasks import TaskContext
from icml_jax.tasks.vocagnolm import VocAgnoLMTask
from icml_jax.train.checkpoint import restore_model_params
from icml_jax.train.trainer import train_and_evaluate

pytestmark = pytest.mark.xdist_group("vocagnolm_task")

T = 48  # configs/vocagnolm.py:tiny's data.seq_len


def _texts(n, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a, b = rng.integers(10, 99, 2)
        junk = "".join(rng.choice(list("xyzé×"), 3))  # multi-byte characters too
        out.append(f"Q: {a}+{b}? A: {a}+{b}={a + b} {junk}" if rng.random() < 0.8 else
                   f"Q: {a} plus {b} is {a + b}. Done, with a longer tail that gets cut.")
    return out


def _write(path, texts):
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A SentencePiece teacher trained for a few steps, and the student's documents."""
    root = tmp_path_factory.mktemp("voc")
    texts = _texts(64, 0)
    path = str(root / "docs.jsonl")
    _write(path, texts)
    spm = train_sentencepiece(texts, str(root / "spm" / "spm"), vocab_size=400)
    c = load_config("configs/lm.py:tiny", unlocked=True)
    c.data.name, c.data.path, c.model.vocab_size = "jsonl", path, 512
    c.data.data_dir = str(root / "tfds")  # the JSONL corpus build stays in the test folder
    c.data.tokenizer.type, c.data.tokenizer.model_path = "sentencepiece", spm.model_path
    c.train.update(steps=4, samples=0, eval_every=4, checkpoint_every=4, eval_batches=1, log_every=2)
    teacher = str(root / "teacher")
    train_and_evaluate(c, teacher)
    return dict(root=root, path=path, texts=texts, spm=spm, teacher=teacher, teacher_cfg=c)


@pytest.fixture(scope="module")
def byte_teacher(tmp_path_factory):
    """(workdir holding a config.json, params): a randomly initialised byte-level teacher."""
    wd = tmp_path_factory.mktemp("byte_teacher")
    cfg = load_config("configs/lm.py:tiny")
    with open(wd / "config.json", "w") as f:
        f.write(cfg.to_json_best_effort())
    params = jax.jit(build_model(cfg.model).init)(jax.random.key(3), jnp.zeros((1, T), jnp.int32))["params"]
    return str(wd), cfg, params


def _restore(workdir, model_cfg):
    return restore_model_params(workdir, model_cfg)[0]


def _config(s, **loss):
    c = load_config("configs/vocagnolm.py:tiny", unlocked=True)
    c.data.path = s["path"]
    c.loss.voc_teacher = s["teacher"]
    c.loss.update(loss)
    return c


def _task(c, restore=_restore):
    return VocAgnoLMTask(c, TaskContext(restore_params=restore))


def _batch(task):
    return jax.tree.map(jnp.asarray, next(task.train_iterator(seed=0)))


def _scorer(model_cfg):
    model = build_model(model_cfg)
    return jax.jit(lambda p, x, y: -token_logprobs(model.apply({"params": p}, x), y))


def test_batch_arrays_match_a_direct_computation(setup):
    """Teacher losses: the teacher run on each document alone (another shape); windows: exactly
    the teacher tokens whose character spans overlap the student token (brute force)."""
    task = _task(_config(setup))
    a = task.train_arrays
    tcfg = setup["teacher_cfg"].model
    tparams = _restore(setup["teacher"], tcfg)
    score, spm, byte = _scorer(tcfg), setup["spm"], ByteTokenizer()
    W = 64  # each document alone, padded at the end (causal: no effect on its positions)
    checked = windows_checked = 0
    for r, text in enumerate(setup["texts"][:12]):
        tids, tsp = spm.encode_with_spans(text)
        toks = np.concatenate([[spm.bos_id], tids, [spm.eos_id]])
        m = min(len(toks) - 1, T)
        x = np.zeros((1, W), np.int32)
        y = np.zeros((1, W), np.int32)
        x[0, :len(toks) - 1], y[0, :len(toks) - 1] = toks[:-1], toks[1:]
        direct = np.asarray(score(tparams, x, y))[0, :m]
        np.testing.assert_allclose(a["teacher_loss"][r, :m], direct, rtol=1e-4, atol=1e-4)
        assert not a["teacher_loss"][r, m:].any()
        sids, ssp = byte.encode_with_spans(text)
        n = min(len(sids) + 1, T)
        np.testing.assert_array_equal(a["targets"][r, :n], np.append(sids, byte.eos_id)[:n])
        kept = tsp[:m]  # the teacher's targets within its row (its EOS overlaps nothing)
        for i in range(n):
            lo, hi = (ssp[i] if i < len(sids) else (len(text), len(text)))
            over = [j for j in range(len(kept)) if kept[j, 0] < hi and kept[j, 1] > lo]
            got = a["voc_index"][r, i][a["voc_window"][r, i]].tolist()
            P = task.config.loss.voc_span_pad
            assert got == over[:P], (r, i)
            assert a["voc_mapped"][r, i] == bool(over) and a["voc_truncated"][r, i] == (len(over) > P)
            if over:
                windows_checked += 1
                agg = jnp.max(direct[np.asarray(over[:P])])
                assert abs(float(agg) - direct[got].max()) < 1e-6
        assert not a["voc_mapped"][r, n:].any()
        checked += 1
    assert checked == 12 and windows_checked > 200
    assert 0 < a["voc_mapped"].mean() and (~a["voc_mapped"] & (a["segment_ids"] > 0)).any()  # EOS


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("loss", [{}, dict(voc_agg="mean", voc_include_unmapped=False, voc_k_ratio=0.3,
                                            voc_select_scope="sequence")])
def test_loss_is_guided_loss_on_the_same_inputs(setup, byte_teacher, loss, swap):
    """Byte student, SentencePiece teacher; and swapped (SentencePiece student, byte teacher),
    where one student token spans several teacher tokens, so the aggregation matters."""
    c = _config(setup, **loss)
    if swap:
        c.data.tokenizer.update(type="sentencepiece", model_path=setup["spm"].model_path)
        c.model.vocab_size, c.loss.voc_teacher = 512, byte_teacher[0]
    task = _task(c, restore=(lambda wd, mc: byte_teacher[2]) if swap else _restore)
    b = _batch(task)
    if swap:
        assert (b["voc_window"].sum(-1) > 1).mean() > 0.03
    model, L = build_model(c.model), c.loss

    @jax.jit  # the task's loss and the reference computation, one compiled program
    def losses(b):
        params = task.init_params(jax.random.key(1), b)
        nll = -token_logprobs(model.apply({"params": params}, b["inputs"], b["positions"], b["segment_ids"]),
                              b["targets"])
        want = guided_loss(nll, b["teacher_loss"], b["voc_index"], b["voc_window"], b["voc_mapped"],
                           b["segment_ids"] > 0, k_ratio=L.voc_k_ratio, agg=L.voc_agg,
                           include_unmapped=L.voc_include_unmapped, scope=L.voc_select_scope)
        return task.loss(params, b), nll, want

    (lsum, n, m), nll, (want, wm) = losses(b)
    valid = b["segment_ids"] > 0
    np.testing.assert_allclose(float(lsum / n), float(want), rtol=1e-5)
    np.testing.assert_allclose(float(m["selected_share"] / n), float(wm["selected_share"]), rtol=1e-6)
    mapped = np.asarray(b["voc_mapped"] & valid)
    trunc = np.asarray(b["voc_truncated"])[mapped].mean()
    np.testing.assert_allclose(float(m["truncated_share"] / n), trunc, rtol=1e-5)
    np.testing.assert_allclose(float(m["ce_all"] / n), float(nll[valid].mean()), rtol=1e-5)
    assert float(lsum / n) != pytest.approx(float(nll[valid].mean()), rel=1e-4)  # it selects


def test_arms_without_a_teacher(setup):
    """ce = the mean CE over the valid tokens; random and student_topk train on ceil(k n) of
    them, the latter on the highest-loss ones, the former on a new draw for another batch and
    the same draw for the same batch."""
    tasks = {m: _task(_config(setup, voc_mode=m, voc_teacher="")) for m in ("ce", "random", "student_topk")}
    assert tasks["ce"].reports_perplexity and not tasks["random"].reports_perplexity
    assert "teacher_loss" not in tasks["ce"].train_arrays
    it = tasks["ce"].train_iterator(seed=0)
    b1 = jax.tree.map(jnp.asarray, next(it))
    model = build_model(tasks["ce"].config.model)

    @jax.jit  # one compiled program
    def nll_and_ce_loss(b):
        params = tasks["ce"].init_params(jax.random.key(2), b)
        nll = -token_logprobs(model.apply({"params": params}, b["inputs"], b["positions"], b["segment_ids"]),
                              b["targets"])
        return nll, tasks["ce"].loss(params, b)

    nll, (lsum, n, _) = nll_and_ce_loss(b1)
    valid = np.asarray(b1["segment_ids"] > 0)
    assert n == valid.sum()
    np.testing.assert_allclose(float(lsum / n), float(nll[valid].mean()), rtol=1e-5)
    k = math.ceil(0.4 * valid.sum())
    w_top = np.asarray(jax.jit(lambda b: tasks["student_topk"].weights(nll, b)[0])(b1))
    assert w_top.sum() == k and nll[w_top > 0].min() >= nll[valid & (w_top == 0)].max()
    draw = jax.jit(lambda b: tasks["random"].weights(nll, b)[0])
    other = dict(b1, targets=b1["targets"] + 1)  # other tokens, the same valid positions
    w1, w1b, w2 = np.asarray(draw(b1)), np.asarray(draw(b1)), np.asarray(draw(other))
    assert w1.sum() == k == w2.sum() and not (w1 * ~valid).any() and (w1 == w1b).all()
    assert (w1 != w2).any() and (w1 != w_top).any()


def test_rho1_is_the_identity_alignment(setup, byte_teacher):
    """A teacher with the student's byte tokenizer: every valid target maps to the teacher's same
    position, so the loss is Rho-1's excess-loss selection with the teacher as the reference."""
    wd, cfg, tparams = byte_teacher
    tmodel = build_model(cfg.model)
    c = _config(setup, voc_mode="rho1", voc_teacher=wd)
    task = _task(c, restore=lambda wd, mc: tparams)
    a = task.train_arrays
    valid = a["segment_ids"] > 0
    assert (a["voc_mapped"] == valid).all() and (a["voc_window"].sum(-1) == valid).all()
    assert (a["voc_index"][..., 0] == np.arange(T)).all()
    ref = jax.jit(lambda x, y: -token_logprobs(tmodel.apply({"params": tparams}, x), y))(
        a["inputs"][:8], a["targets"][:8]) * valid[:8]
    np.testing.assert_allclose(a["teacher_loss"][:8], np.asarray(ref), rtol=1e-4, atol=1e-4)
    b = _batch(task)

    @jax.jit  # the student's NLL and the task's weights, one compiled program
    def nll_and_weights(b):
        params = task.init_params(jax.random.key(1), b)
        nll = -token_logprobs(task.model.apply({"params": params}, b["inputs"]), b["targets"])
        return nll, task.weights(nll, b)[0]

    nll, w = map(np.asarray, nll_and_weights(b))
    excess = np.asarray(nll - b["teacher_loss"])
    vb = np.asarray(b["segment_ids"] > 0)
    assert w.sum() == math.ceil(0.4 * vb.sum()) and excess[w > 0].min() >= excess[vb & (w == 0)].max()
    with pytest.raises(ValueError, match="voc_mode='rho1' needs a teacher with the student's tokenizer"):
        _task(_config(setup, voc_mode="rho1"))  # the SentencePiece teacher


def _never(*_):
    raise AssertionError("the teacher was read before the config was checked")


@pytest.mark.parametrize("key,value", [("voc_agg", "median"), ("voc_k_ratio", 0.0), ("voc_k_ratio", 1.5),
                                       ("voc_mode", "rho2"), ("voc_select_scope", "row"), ("voc_span_pad", 0),
                                       ("voc_teacher", ""), ("voc_teacher_seq_len", -1)])
def test_a_bad_flag_is_a_one_line_error_before_any_work(tmp_path, key, value):
    c = load_config("configs/vocagnolm.py:tiny", unlocked=True)
    c.data.path = str(tmp_path / "absent.jsonl")  # read after the checks: FileNotFoundError otherwise
    c.loss.voc_teacher = str(tmp_path / "absent_teacher")
    c.loss[key] = value
    with pytest.raises(ValueError, match=f"config.loss.{key}") as e:
        _task(c, restore=_never)
    assert "\n" not in str(e.value)


def test_iterator_resumes_exactly(setup):
    task = _task(_config(setup))
    it = task.train_iterator(seed=3)
    for _ in range(5):
        next(it)
    state = it.get_state()
    want = [next(it) for _ in range(3)]
    it2 = task.train_iterator(seed=3)
    it2.set_state(state)
    for w in want:
        got = next(it2)
        assert set(got) == set(w) and all((got[k] == w[k]).all() for k in w)


def test_a_short_run_through_the_trainer(setup, tmp_path):
    c = _config(setup)
    summary = train_and_evaluate(c, str(tmp_path / "student"))
    rows = [json.loads(line) for line in open(tmp_path / "student" / "metrics.jsonl")]
    train = [r for r in rows if "loss" in r]
    assert train and all(math.isfinite(r["loss"]) for r in train)
    assert all(0 < r["selected_share"] < 1 and 0 <= r["truncated_share"] < 1 for r in train)
    assert math.isfinite(summary["eval_loss"]) and "eval_selected_share" in json.dumps(rows)
    cache = os.listdir(os.path.join(setup["teacher"], "teacher_losses"))
    assert len(cache) == 1  # one set of rows, one teacher: computed once, read by every later task

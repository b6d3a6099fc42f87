"""The ``sae`` task (Feature Flow's SAE stage): TopK keeps k latents, unit decoder rows, an exact
reconstruction, JumpReLU's pseudo-derivative in the threshold, the losses against numpy, a short
trainer run that learns and resumes exactly, and the config checks."""
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.config_utils import load_config
from icml_jax.losses.sae import fraction_of_variance_unexplained, sae_loss
from icml_jax.models.sae import SAE, unit_decoder
from icml_jax.tasks import TaskContext
from icml_jax.tasks.sae import SAETask
from icml_jax.train import trainer
from tests import jax_env
from tests.tasks.helpers import restore_params, tiny_lm_run
from tests.train.helpers import train_in_process, train_losses

pytestmark = pytest.mark.xdist_group("sae_task")


@pytest.fixture(scope="module")
def source(tmp_path_factory, session_tfds_dir):
    """A configs/lm.py:tiny run of 4 steps (the LM every SAE here reads)."""
    return tiny_lm_run(str(tmp_path_factory.mktemp("sae") / "lm"), session_tfds_dir)


def _config(source, tfds_dir, **sae):
    c = load_config("configs/sae.py:tiny", unlocked=True)
    c.sae.source = source
    c.sae.update(sae)
    c.data.data_dir = tfds_dir
    return c


# ------------------------------------------------------------------ the module alone


def test_topk_keeps_exactly_k_latents_and_decoder_rows_have_unit_norm():
    sae = SAE(d_model=8, latents=32, k=5)
    x = jax.random.normal(jax.random.key(0), (3, 7, 8))

    @jax.jit  # every array checked below, from one compiled program
    def run(x):
        params = sae.init(jax.random.key(1), x)["params"]
        params = {**params, "b_enc": params["b_enc"] + 10.0}  # every pre-activation positive
        x_hat, z = sae.apply({"params": params}, x)
        _, _, d = sae.apply({"params": params}, x, details=True)
        scaled = {**params, "W_dec": params["W_dec"] * jnp.arange(1.0, 33.0)[:, None]}
        g = jax.grad(lambda p: ((sae.apply({"params": p}, x)[0] - x) ** 2).sum())(params)
        moved = jax.tree.map(lambda p, gp: p - 0.5 * gp, params, g)
        return (x_hat, z, d["pre"], unit_decoder(scaled), sae.apply({"params": scaled}, x)[0],
                unit_decoder(moved))

    x_hat, z, pre, scaled_rows, scaled_x_hat, moved_rows = map(np.asarray, run(x))
    assert x_hat.shape == x.shape and z.shape == (3, 7, 32)
    np.testing.assert_array_equal((z != 0).sum(-1), 5)
    # the kept ones are the 5 largest pre-activations
    np.testing.assert_array_equal(np.sort(np.where(z != 0, pre, -np.inf), -1)[..., -5:],
                                  np.sort(pre, -1)[..., -5:])
    # unit rows however the stored W_dec is scaled, and the SAE's function does not see the scale
    np.testing.assert_allclose(np.linalg.norm(scaled_rows, axis=-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(scaled_x_hat, x_hat, rtol=1e-5, atol=1e-6)
    # ... also after an update of the stored rows
    np.testing.assert_allclose(np.linalg.norm(moved_rows, axis=-1), 1.0, rtol=1e-6)


def test_a_signed_identity_basis_with_k_equal_d_reconstructs_exactly():
    """W_dec = [I; -I] (rows scaled arbitrarily), W_enc = [I, -I]: ReLU keeps x+ and x-, at most D
    of them non-zero, so TopK with k = D gives back x."""
    D = 6
    eye = np.eye(D, dtype=np.float32)
    params = {"W_enc": jnp.asarray(np.concatenate([eye, -eye], 1)),
              "W_dec": jnp.asarray(np.concatenate([eye, -eye], 0) * np.arange(1, 2 * D + 1)[:, None]),
              "b_enc": jnp.zeros(2 * D), "b_dec": jnp.zeros(D)}
    x = jax.random.normal(jax.random.key(2), (4, 5, D))
    for pre_bias in (False, True):
        x_hat, z = SAE(d_model=D, latents=2 * D, k=D, pre_bias=pre_bias).apply({"params": params}, x)
        np.testing.assert_allclose(x_hat, x, rtol=1e-6, atol=1e-6)
        assert ((np.asarray(z) != 0).sum(-1) <= D).all()


@pytest.mark.parametrize("pre_bias", [False, True])
def test_forward_is_the_topk_sae_formula_with_and_without_pre_bias(pre_bias):
    """With random weights and a non-zero b_dec: z = relu(topk((x - b_dec·pre_bias) W_enc + b_enc))
    and x̂ = z Ŵ_dec + b_dec (Ŵ_dec row-normalised), as OpenAI's / SAELens' TopK SAE computes it."""
    rng = np.random.default_rng(0)
    D, M, k = 6, 16, 3
    params = {"W_enc": jnp.asarray(rng.normal(size=(D, M)), jnp.float32),
              "W_dec": jnp.asarray(rng.normal(size=(M, D)), jnp.float32),
              "b_enc": jnp.asarray(rng.normal(size=M) * 0.1, jnp.float32),
              "b_dec": jnp.asarray(rng.normal(size=D), jnp.float32)}
    x = rng.normal(size=(5, D)).astype(np.float32)
    x_hat, z = SAE(d_model=D, latents=M, k=k, pre_bias=pre_bias).apply({"params": params}, jnp.asarray(x))
    p = {n: np.asarray(v, np.float64) for n, v in params.items()}
    pre = ((x - p["b_dec"]) if pre_bias else x) @ p["W_enc"] + p["b_enc"]
    keep = np.argsort(-pre, axis=-1)[:, :k]
    want_z = np.zeros_like(pre)
    np.put_along_axis(want_z, keep, np.maximum(np.take_along_axis(pre, keep, -1), 0), -1)
    dec = p["W_dec"] / np.linalg.norm(p["W_dec"], axis=-1, keepdims=True)
    np.testing.assert_allclose(z, want_z, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x_hat, want_z @ dec + p["b_dec"], rtol=1e-5, atol=1e-5)


def test_jumprelu_threshold_gets_the_rectangle_kernel_gradient():
    D, theta, eps = 4, 0.5, 0.1
    sae = SAE(d_model=D, latents=D, activation="jumprelu", bandwidth=eps, init_threshold=theta)
    x = jnp.array([[0.52, 0.9, 0.1, 0.47]])  # latents 0 and 3 lie within ε/2 of θ
    params = {**sae.init(jax.random.key(0), x)["params"], "W_enc": jnp.eye(D), "W_dec": jnp.eye(D)}
    x_hat, z = sae.apply({"params": params}, x)
    np.testing.assert_allclose(z, [[0.52, 0.9, 0.0, 0.0]])
    np.testing.assert_allclose(x_hat, z)
    near = np.array([1.0, 0.0, 0.0, 1.0])
    # L0 = Σ 1[pre > θ]: ∂/∂θ = -(1/ε) K, so ∂/∂log θ = -(θ/ε) K
    g_l0 = jax.grad(lambda p: sae.apply({"params": p}, x, details=True)[2]["l0"].sum())(params)
    np.testing.assert_allclose(g_l0["log_threshold"], -(theta / eps) * near, rtol=1e-5)
    # Σ z: ∂z/∂θ = -(θ/ε) K, so ∂/∂log θ = -(θ²/ε) K; ∂z/∂pre = 1[pre > θ] reaches W_enc
    g_z = jax.grad(lambda p: sae.apply({"params": p}, x)[1].sum())(params)
    np.testing.assert_allclose(g_z["log_threshold"], -(theta ** 2 / eps) * near, rtol=1e-5)
    np.testing.assert_allclose(g_z["b_enc"], [1.0, 1.0, 0.0, 0.0])
    assert np.abs(np.asarray(g_z["log_threshold"])).sum() > 0


def test_the_losses_equal_a_direct_numpy_computation():
    rng = np.random.default_rng(0)
    x, x_hat, aux = rng.normal(size=(3, 2, 5, 4)).astype(np.float32)
    z = np.zeros((2, 5, 6), np.float32)
    z[..., 0] = 1.0
    z[0, 0, 2] = 3.0  # latent 2 active on one token; 1, 3, 4, 5 never
    w = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], np.float32)
    z[0, 3, 1] = 5.0  # active on padding only: still dead
    total, n, m = sae_loss(x, x_hat, z, w, l0_coef=0.5, aux_hat=aux, aux_coef=0.25)
    v = w > 0
    mse = ((x - x_hat) ** 2).sum(-1)[v].sum()
    var = ((x[v] - x[v].mean(0)) ** 2).sum()
    l0 = (z != 0).sum(-1)[v].sum()
    auxk = ((x - x_hat - aux) ** 2).sum(-1)[v].sum()
    assert float(n) == 7
    np.testing.assert_allclose([m["mse"], m["l0"], m["fvu"] / 7, m["dead"] / 7, m["auxk"]],
                               [mse, l0, mse / var, 4 / 6, auxk], rtol=1e-5)
    np.testing.assert_allclose(total, mse + 0.5 * l0 + 0.25 * auxk, rtol=1e-5)
    np.testing.assert_allclose(fraction_of_variance_unexplained(x, x, w), 0.0, atol=1e-7)


def test_auxk_reconstructs_the_residual_from_the_dead_latents_only():
    """sae_objective's AuxK term: the top-aux_k pre-activations among the latents dead in the batch
    (never a live one, however large its pre-activation), decoded by the unit decoder, against the
    main reconstruction's residual — computed here by hand in numpy."""
    from icml_jax.tasks.sae import sae_objective
    sae = SAE(d_model=4, latents=6, k=1)
    rng = np.random.default_rng(1)
    params = {"W_dec": rng.normal(size=(6, 4)).astype(np.float32), "W_enc": rng.normal(size=(4, 6)).astype(np.float32),
              "b_enc": np.array([5.0, 0, 0, 0, 0, 0], np.float32), "b_dec": np.zeros(4, np.float32)}
    x = rng.normal(size=(1, 3, 4)).astype(np.float32)
    w = np.ones((1, 3), np.float32)
    _, _, m = jax.jit(lambda p: sae_objective(sae, p, x, w, aux_k=2, aux_coef=0.5))(params)
    pre = x @ params["W_enc"] + params["b_enc"]
    dec = params["W_dec"] / np.linalg.norm(params["W_dec"], axis=1, keepdims=True)
    live = np.argmax(pre, -1)  # k = 1: the bias makes latent 0 win on every token
    z = np.zeros_like(pre)
    np.put_along_axis(z, live[..., None], np.maximum(np.take_along_axis(pre, live[..., None], -1), 0), -1)
    dead = ~(z != 0).reshape(-1, 6).any(0)
    assert dead.sum() == 5 and not dead[0]
    pre_dead = np.where(dead, pre, -np.inf)
    top = np.argsort(-pre_dead, -1)[..., :2]
    z_aux = np.zeros_like(pre)
    np.put_along_axis(z_aux, top, np.maximum(np.take_along_axis(pre_dead, top, -1), 0), -1)
    want = ((x - z @ dec - z_aux @ dec) ** 2).sum()
    np.testing.assert_allclose(m["auxk"], want, rtol=1e-5)


# ------------------------------------------------------------------ the task through the trainer


def test_training_lowers_the_loss_and_a_resumed_run_repeats_it(source, session_tfds_dir, tmp_path):
    task = SAETask(_config(source, session_tfds_dir), TaskContext(restore_params=restore_params))
    it = task.train_iterator(seed=0)
    state = it.get_state()
    batch = next(it)
    assert batch["activations"].shape == (8, 32, 32)
    it.set_state(state)
    np.testing.assert_array_equal(np.asarray(next(it)["activations"]), np.asarray(batch["activations"]))
    args = ("--config.sae.source=" + source, "--config.train.log_every=1",
            "--config.train.checkpoint_every=4", "--config.sae.aux_k=8")
    full = str(tmp_path / "full")
    with jax_env.caching_every_compilation():  # the resumed run below reads the same programs
        summary = train_in_process(full, *args, config="configs/sae.py:tiny",
                                   data_dir=session_tfds_dir)
    assert summary["step"] == 8 and "eval_perplexity" not in summary
    assert {"eval_mse", "eval_fvu", "eval_l0", "eval_dead", "eval_auxk"} <= set(summary)
    assert summary["eval_l0"] <= 4.0 + 1e-6
    want = train_losses(full)
    assert sorted(want) == list(range(1, 9))
    assert want[8] < 0.7 * want[1], want  # step 1 logs the loss of the initial params
    # stop after step 4 (its checkpoint is the newest), restart: the same losses
    resumed = str(tmp_path / "resumed")
    shutil.copytree(full, resumed)
    shutil.rmtree(os.path.join(resumed, "checkpoints", "8"))
    with jax_env.caching_every_compilation():
        again = train_in_process(resumed, *args, config="configs/sae.py:tiny", data_dir=session_tfds_dir)
    assert again["start_step"] == 4
    assert train_losses(resumed) == want


def test_jumprelu_trains_through_the_trainer(source, session_tfds_dir, tmp_path):
    summary = train_in_process(str(tmp_path / "jr"), "--config.sae.source=" + source,
                               "--config.sae.activation=jumprelu", "--config.train.steps=4",
                               "--config.train.eval_every=4", "--config.train.checkpoint_every=4",
                               config="configs/sae.py:tiny", data_dir=session_tfds_dir)
    assert np.isfinite(summary["eval_loss"]) and summary["eval_l0"] > 0


def test_a_bad_source_or_point_fails_naming_the_key_before_training(source, session_tfds_dir, tmp_path):
    cases = [({"source": ""}, r"^config\.sae\.source is empty"),
             ({"source": str(tmp_path / "nowhere")}, r"^config\.sae\.source="),
             ({"point": "layer_1/bogus"}, r"^config\.sae\.point="),
             ({"point": "layer_2/resid_post"}, r"^config\.sae\.point=.*2 layers"),
             ({"point": "layer_0/attn_heads"}, r"^config\.sae\.point=.*attn_heads"),
             ({"activation": "relu"}, r"^config\.sae\.activation="),
             ({"k": 65}, r"^config\.sae\.k=")]
    for change, match in cases:
        c = _config(source, session_tfds_dir)
        c.sae.update(change)
        wd = tmp_path / "run"
        with pytest.raises(ValueError, match=match) as e:
            trainer.train(c, str(wd))
        assert "\n" not in str(e.value)
        assert not wd.exists()  # refused before the workdir was even made
    empty = tmp_path / "empty"  # a config.json but no checkpoint
    os.makedirs(empty)
    shutil.copy(os.path.join(source, "config.json"), empty / "config.json")
    with pytest.raises(ValueError, match=r"^config\.sae\.source=.*no checkpoints") as e:
        trainer.build_task(_config(str(empty), session_tfds_dir), (1, 1, 1))
    assert "\n" not in str(e.value)

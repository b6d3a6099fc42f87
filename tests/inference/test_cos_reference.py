"""CoS combiners and acceptance rule against the authors' own code, executed (fixture ``data/cos_reference.npz``).

How the fixture was made (once, by hand): ``/tmp/cosref/make_fixture.py``, a generator kept OUTSIDE
this repository because the project does not copy reference code. It runs Kamichanw/CoS at commit
b7c5553 (b7c555324539bb476d39a4002922973e296d1e18; files extracted unchanged) with torch 2.13 CPU and
omegaconf 2.3.0:

- ``src/myutils/__init__.py`` is imported, registering the reference's ``eval`` OmegaConf resolver;
  ``configs/method/we.yaml`` / ``cd.yaml`` are loaded, ``lambda`` / ``alpha`` set as a hydra override
  would, and ``llm.ensemble_fn`` / ``llm.ensemble_target`` read: the yaml strings
  ``lambda probs,logprobs: ((1 - lambda) * probs[0] + lambda * probs[1], logprobs[0])`` (target
  ``probs``) and ``lambda logits: logits[0] - alpha * logits[1]`` (target ``raw-logits``) become
  callables by the reference's own path.
- ``ChefSampler(ensemble_fn=..., ensemble_target=...)`` (vllm/vllm/chef/chef_sampler.py) is built and
  its ``EnsembleSampler.forward`` (vllm/vllm/ensemble_decode/ensemble_sampler.py) called on
  ``[logits of model, logits of extra_model]`` (the reference's order: model_configs[0] is the base
  model, the extra models follow), float32, V = 12, 6 rows, T in {0.6, 1.0, 1.7}, lambda in {0.3, 0.5},
  alpha in {0.1, 0.5}. The temperature path is the reference's: SamplingTensors.from_sampling_metadata
  / from_lists (sampling_metadata.py) and Sampler, _apply_min_tokens_penalty, _apply_penalties,
  _apply_top_k_top_p, _apply_min_p (sampler.py) executed verbatim from the extracted files.
- For acceptance, the same ChefSampler's inherited RejectionSampler methods
  (vllm/vllm/model_executor/layers/rejection_sampler.py): ``_create_uniform_samples`` with seeded torch
  generators (the uniforms are recorded, then ``_get_accepted`` draws the same ones from fresh
  generators of the same seeds), ``_get_accepted`` and ``_get_recovered_probs``, batch 156, k = 1.
  Targets r are the reference's combined distributions above; drafts q = softmax(l / T) (float32) of
  the extra model's logits (kind 0), of unrelated logits (kind 1), or q = r exactly (kind 2); the draft
  token is drawn from q. 77 accepted, 79 rejected; every uniform lies >= 6e-3 from its
  min(1, r(x) / q(x)), so float32 vs float64 cannot flip a decision.
Stubs (none in the math): vllm.envs (no flashinfer: the pytorch path), vllm.logger, SamplingMetadata
(one sequence group: temperature T, no penalties, top-p 1, top-k -1, min-p 0, min_tokens 0),
is_pin_memory_available, _sample (the draw; the fixture records the probabilities it is given),
_build_sampler_output (packs on_device_tensors as the reference does), get_logprobs (not reached).

Model order. The reference names models by role: ``model`` (logits[0]) and ``extra_model``
(logits[1]); we.yaml puts lambda on the extra model, cd.yaml subtracts alpha times the extra
(amateur) model's logits. Our ``Combiner`` names them by list position, a first:
  we: r = lambda * p_extra + (1 - lambda) * p_model  ==  Combiner("we", weight_a=lambda)(l_extra, l_model)
      i.e. our models = [extra_model, model] with weight_a = lambda;
  cd: r = softmax((l_model - alpha * l_extra) / T)  ==  Combiner("cd", alpha=alpha)(l_extra, l_model)
      i.e. our models = [amateur, expert] = [extra_model, model].

Tolerance. The reference computes in float32 (``logits.to(torch.float)``, softmax with
dtype=torch.float), ours in float64 on the same float32 inputs. A float32 softmax of z / T carries a
relative error of about u * (|z / T| + |z / T - max|) + a few u (u = 2^-24 = 6e-8; exp, sum of 12
terms, division), with |z / T| < 7 here (so |z / T - max| < 14): <= ~1.5e-6. Observed: 4.8e-7 (we), 6.2e-7 (cd), 2.1e-7 for
the recovered distributions (whose float32 subtraction of float32 inputs is nearly exact). RTOL = 2e-6
sits above the bound and far below any formula error (>= 1e-2 for each mutation tried).

Known difference, not tested as parity: for r == q (kind 2) the reference's recovered distribution is
uniform (it clamps r - q at float32's smallest normal, then normalises), ours returns r; a draft
there is accepted with probability 1 (u < 1 = r(x) / q(x)), so neither is ever sampled.
"""
import os

import numpy as np
import pytest

from icml_jax.inference import collab

REF = os.path.join(os.path.dirname(__file__), "data", "cos_reference.npz")
RTOL = 2e-6


@pytest.fixture(scope="module")
def ref():
    with np.load(REF) as d:
        return {k: d[k] for k in d.files}


def test_fixture_is_the_documented_one(ref):
    assert str(ref["commit"]).startswith("b7c5553")
    assert ref["l_model"].shape == ref["l_extra"].shape == (6, 12)
    assert sorted(set(ref["we_T"])) == sorted(set(ref["cd_T"])) == [0.6, 1.0, 1.7]
    assert sorted(set(ref["we_lambda"])) == [0.3, 0.5] and sorted(set(ref["cd_alpha"])) == [0.1, 0.5]
    assert ref["we_probs"].shape == ref["cd_probs"].shape == (6, 6, 12)
    acc = ref["acc_accepted"]
    assert acc.any() and not acc.all()


def test_weighted_ensemble_matches_reference(ref):
    l_a, l_b = ref["l_extra"], ref["l_model"]  # ours: a = extra_model, b = model (docstring)
    for T, lam, probs in zip(ref["we_T"], ref["we_lambda"], ref["we_probs"]):
        comb = collab.Combiner("we", weight_a=float(lam))
        for i in range(len(l_a)):
            r = comb(l_a[i], l_b[i], temperature=float(T))
            np.testing.assert_allclose(r, probs[i], rtol=RTOL, atol=0, err_msg=f"we T={T} lambda={lam} row {i}")


def test_contrastive_decoding_matches_reference(ref):
    l_a, l_b = ref["l_extra"], ref["l_model"]  # ours: a = amateur = extra_model, b = expert = model
    for T, alpha, probs in zip(ref["cd_T"], ref["cd_alpha"], ref["cd_probs"]):
        comb = collab.Combiner("cd", alpha=float(alpha))
        for i in range(len(l_a)):
            r = comb(l_a[i], l_b[i], temperature=float(T))
            np.testing.assert_allclose(r, probs[i], rtol=RTOL, atol=0, err_msg=f"cd T={T} alpha={alpha} row {i}")


class _Uniforms:
    """A stand-in for numpy's Generator: ``uniform()`` returns the reference's stored draws in order."""

    def __init__(self, values):
        self.values = list(values)

    def uniform(self):
        return self.values.pop(0)


def test_accept_decisions_match_reference(ref):
    r, q, x = ref["acc_target"].astype(np.float64), ref["acc_draft"].astype(np.float64), ref["acc_token"]
    rng = _Uniforms(ref["acc_uniform"].astype(np.float64))
    ours = np.array([collab._accept(rng, r[k], q[k], int(x[k]), greedy=False) for k in range(len(r))])
    assert not rng.values, "our _accept should draw exactly one uniform per draft"
    np.testing.assert_array_equal(ours, ref["acc_accepted"])
    assert ours[ref["acc_kind"] == 2].all()  # r == q: always accepted, by both


def test_residual_matches_reference(ref):
    keep = ref["acc_kind"] != 2  # r == q: see the docstring's known difference
    for r, q, rec in zip(ref["acc_target"][keep], ref["acc_draft"][keep], ref["acc_recovered"][keep]):
        ours = collab._residual(r, q)
        # the reference clamps at float32's smallest normal (1.2e-38) where we clamp at 0
        np.testing.assert_allclose(ours, rec, rtol=RTOL, atol=1e-30)

"""How ``cett_reference.npz`` was made (run once, by hand; not part of the test suite).

Threshold search: the authors' ``SparseMiniCPMForCausalLM.calc_thresholds_given_cett`` and
``set_thresholds`` in ``src/model_utils.py`` of thunlp/SparsingLaw at commit a6d9b4c (their code
is NOT in this repository). Fits: ``A_relu`` / ``A_silu``, ``CURVE_PARAM`` and ``load_data`` of
``calc.py`` in Raincleared-Song/SparsingLawData at commit 1cab443.

    git --git-dir=<mirror of thunlp/SparsingLaw> archive HEAD src | tar -x -C /tmp/sl_ref
    git --git-dir=<mirror of SparsingLawData> archive HEAD | tar -x -C /tmp/sld_ref
    .venv/bin/python tests/analysis/data/make_cett_reference.py /tmp/sl_ref/src /tmp/sld_ref

``model_utils`` imports their MiniCPM package (``model``); a stub module with empty classes stands
in for it, since the threshold routine only reads ``self.intermedia``, ``self.state_dict()``,
``self.config.num_hidden_layers`` and (for ``set_thresholds``) ``self.named_modules()``. The object
is made with ``__new__`` (no model), ``Tensor.cuda`` is the identity (CPU run). torch 2.13.0+cpu.

Cases: 256 tokens x 64 neurons, d_model 32, two "layers" given to one call:
  relu  a = relu(g - 0.5) * u, g, u ~ N(0, 1)   (ReLU-GLU with a shifted ReLU: many exact zeros)
  silu  a = silu(g) * u
  W_down [32, 64] ~ N(0, 0.1) with column norms varied by exp(N(0, 0.3)).
For c in C_VALUES the npz holds the thresholds ``thresholds_c{c}`` [2] and the reference's
activation ratio ``ratio_c{c}`` [2] (1 - mean of ``|x| < t / ||W_down[:, j]||``), plus
``acts`` [2, 256, 64] and ``w_down`` [2, 64, 32] (our [F, D] layout: the transpose of theirs).
The wrap case (c = 0, every grid point exceeds) is ``thresholds_c0``.

Fits: ``fit_{model}_data`` = (D in billions, activation ratio) of ``data/{model}.txt``,
``fit_{model}_params`` = their CURVE_PARAM (alpha, b, c, A0; b = nan for SiLU) and
``fit_{model}_mae`` = MAE of that curve on the data (what ``calc.py`` prints as "MAE of power-law").
"""
import os
import sys
import types

import numpy as np

C_VALUES = (0.0, 0.05, 0.2, 0.5)
FIT_MODELS = ("0.1b_relu", "0.4b_relu", "0.1b_silu", "0.4b_silu")


def _stub_model_package():
    model = types.ModuleType("model")
    modeling = types.ModuleType("model.modeling_minicpm")

    class MiniCPMForCausalLM:  # noqa: D401 - stand-in base class
        pass

    class VanillaMLP:
        pass

    model.MiniCPMForCausalLM, model.MiniCPMConfig = MiniCPMForCausalLM, object
    modeling.VanillaMLP = VanillaMLP
    sys.modules["model"], sys.modules["model.modeling_minicpm"] = model, modeling
    return VanillaMLP


def make_inputs(rng):
    N, F, D = 256, 64, 32
    g, u = rng.randn(2, N, F).astype(np.float32), rng.randn(2, N, F).astype(np.float32)
    relu = np.maximum(g[0] - 0.5, 0) * u[0]
    silu = g[1] / (1 + np.exp(-g[1])) * u[1]
    acts = np.stack([relu, silu]).astype(np.float32)
    w_DF = rng.randn(2, D, F).astype(np.float32) * 0.1 * np.exp(0.3 * rng.randn(2, 1, F)).astype(np.float32)
    return acts, w_DF


def threshold_cases(src_dir):
    VanillaMLP = _stub_model_package()
    sys.path.insert(0, src_dir)
    import torch
    torch.Tensor.cuda = lambda self, *a, **k: self
    from model_utils import SparseMiniCPMForCausalLM

    acts, w_DF = make_inputs(np.random.RandomState(0))
    L = acts.shape[0]
    ref = SparseMiniCPMForCausalLM.__new__(SparseMiniCPMForCausalLM)
    ref.config = types.SimpleNamespace(num_hidden_layers=L)
    ref.intermedia = {i: torch.from_numpy(acts[i])[None] for i in range(L)}
    ref.neuron_thresholds_by_layer = {}
    sd = {f"model.layers.{i}.mlp.down_proj.weight": torch.from_numpy(w_DF[i]) for i in range(L)}
    ref.state_dict = lambda: sd
    mlps = []
    for i in range(L):
        m = VanillaMLP()
        m.down_proj = types.SimpleNamespace(weight=torch.from_numpy(w_DF[i]))
        mlps.append((f"model.layers.{i}.mlp", m))
    ref.named_modules = lambda: iter(mlps)
    mask = torch.ones(1, acts.shape[1], dtype=torch.long)

    out = {"acts": acts, "w_down": np.ascontiguousarray(w_DF.transpose(0, 2, 1))}
    for c in C_VALUES:
        th = ref.calc_thresholds_given_cett(c, mask)
        ref.set_thresholds(th)
        ratios = [1 - float((ref.intermedia[i].abs() < ref.neuron_thresholds_by_layer[i]).float().mean())
                  for i in range(L)]
        out[f"thresholds_c{c}"] = np.array(th, np.float64)
        out[f"ratio_c{c}"] = np.array(ratios, np.float64)
        print(f"c={c}: thresholds {th}, ratios {ratios}")
    return out


def fit_cases(data_dir):
    sys.path.insert(0, data_dir)
    cwd = os.getcwd()
    os.chdir(data_dir)  # load_data reads data/<model>.txt relative to the working directory
    try:
        import calc
        out = {}
        for name in FIT_MODELS:
            x, y = calc.load_data(name)
            alpha, b, c, A0 = calc.CURVE_PARAM[name]
            f = calc.A_relu if "relu" in name else calc.A_silu
            pred = f(x, *calc.CURVE_PARAM[name])
            out[f"fit_{name}_data"] = np.stack([x, y])
            out[f"fit_{name}_params"] = np.array([alpha, np.nan if b is None else b, c, A0])
            out[f"fit_{name}_mae"] = np.array(np.mean(np.abs(y - pred)))
            print(name, calc.CURVE_PARAM[name], "MAE", out[f"fit_{name}_mae"])
        return out
    finally:
        os.chdir(cwd)


def main():
    src_dir, data_dir = sys.argv[1], sys.argv[2]
    out = {**threshold_cases(src_dir), **fit_cases(data_dir)}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cett_reference.npz")
    np.savez_compressed(path, **out)
    print("wrote", path, os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()

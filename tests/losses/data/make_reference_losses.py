"""Runs the papers' own loss code once (in torch, fp64) and stores inputs + outputs for
tests/losses/test_reference_parity.py. Not part of the test suite: it needs the reference
repositories (the commits of the specs) and torch; run it from the repo root with

  python tests/losses/data/make_reference_losses.py TGDPO_REPO RM_ROBUSTNESS_REPO

where each argument is a checkout (or a folder holding the two files below):
  dvlab-research/TGDPO @ dd88982  src/llamafactory/train/tgdpo/trainer.py  (CustomDPOTrainer.dpo_loss)
                                   src/llamafactory/train/trainer_utils.py  (get_batch_logps, the
                                                                             per-token version)
  LinkedIn-XFACT/RM-Robustness @ 3bafaab  modules/trainers/reward_trainer.py (RewardTrainer.compute_loss)

Only the named functions are taken out of the files (with ``ast``) and executed against small
stand-ins for ``self`` (hyper-parameters, a model that returns given rewards); none of their code
is stored in this repository. Writes tests/losses/data/reference_losses.npz.
"""
import ast
import enum
import os
import sys
import types

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def _function(path, name, index=-1):
    tree = ast.parse(open(path).read())
    defs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    fn = defs[index]
    fn.decorator_list = []
    fn.returns = None
    for a in fn.args.args + fn.args.kwonlyargs:
        a.annotation = None
    mod = ast.Module(body=[fn], type_ignores=[])

    class FDivergenceType(enum.Enum):
        REVERSE_KL = "reverse_kl"
        JS_DIVERGENCE = "js_divergence"
        ALPHA_DIVERGENCE = "alpha_divergence"

    ns = {"torch": torch, "F": F, "nn": nn, "FDivergenceType": FDivergenceType,
          "FDivergenceConstants": types.SimpleNamespace(), "IGNORE_INDEX": -100}
    exec(compile(mod, path, "exec"), ns)  # noqa: S102 - the reference function, run once
    return ns[name]


def _find(root, rel):
    p = os.path.join(root, rel)
    return p if os.path.exists(p) else os.path.join(root, os.path.basename(rel))


def main(tgdpo_root, rm_root):
    torch.manual_seed(0)
    out = {}
    dtype = torch.float64
    # --- TGDPO: per-token log-probs from logits + labels, then dpo_loss (sigmoid = TGDPO)
    get_batch_logps = _function(_find(tgdpo_root, "src/llamafactory/train/trainer_utils.py"),
                                "get_batch_logps", index=-1)
    dpo_loss = _function(_find(tgdpo_root, "src/llamafactory/train/tgdpo/trainer.py"), "dpo_loss")
    B, T, V = 4, 9, 11
    labels = torch.randint(0, V, (2 * B, T))
    prompt = torch.randint(1, 4, (2 * B,))
    length = torch.randint(6, T + 1, (2 * B,))
    for i in range(2 * B):
        labels[i, : prompt[i] + 1] = -100  # bos + prompt are not labels
        labels[i, length[i]:] = -100      # padding
    tokens = labels.clamp(min=0)
    logits = {m: torch.randn(2 * B, T, V, dtype=dtype) for m in ("policy", "ref", "guide")}
    out["tg_tokens"] = tokens.numpy()
    out["tg_mask"] = (labels != -100).numpy().astype(np.int32)
    for m, lg in logits.items():
        out[f"tg_logits_{m}"] = lg.numpy()
    lp = {m: get_batch_logps(lg, labels)[0] for m, lg in logits.items()}
    for alpha in (0.0, 0.5, 2.0):
        self = types.SimpleNamespace(beta=0.1, tgdpo_alpha=alpha, loss_type="sigmoid",
                                     reference_free=False, f_divergence_type="reverse_kl",
                                     label_smoothing=0.0,
                                     accelerator=types.SimpleNamespace(device="cpu"))
        losses, cr, rr = dpo_loss(self, lp["policy"][:B], lp["policy"][B:], lp["ref"][:B],
                                  lp["ref"][B:], None, None, lp["guide"][:B], lp["guide"][B:])
        out[f"tg_losses_alpha{alpha}"] = losses.numpy()
        out[f"tg_rewards_chosen_alpha{alpha}"] = cr.sum(-1).numpy()
        out[f"tg_rewards_rejected_alpha{alpha}"] = rr.sum(-1).numpy()
    # --- RM-Robustness: compute_loss with a stand-in model returning fixed rewards
    compute_loss = _function(_find(rm_root, "modules/trainers/reward_trainer.py"), "compute_loss")
    Bp = 6
    rw, rl = torch.randn(Bp, 1, dtype=dtype) + 0.7, torch.randn(Bp, 1, dtype=dtype) + 0.7
    out["rm_chosen"], out["rm_rejected"] = rw.numpy()[:, 0], rl.numpy()[:, 0]

    class Model:
        def __call__(self, input_ids, attention_mask, return_dict):
            return {"logits": rw if input_ids == "c" else rl}

    inputs = {"input_ids_chosen": "c", "attention_mask_chosen": None, "input_ids_rejected": "r",
              "attention_mask_rejected": None}
    flags = dict(use_margin=False, use_hinge=False, use_normalization=False, use_eurus=False,
                 use_batch_sum=False, center_rewards_coefficient=None, log_every_reward=False,
                 margin=0.0, bsr_lambda=1e-3 * Bp)  # the trainer scales lambda by the batch once
    cases = {"bt": {}, "margin": dict(use_margin=True, margin=0.5),
             "hinge": dict(use_hinge=True, margin=0.5), "normalized": dict(use_normalization=True),
             "eurus": dict(use_eurus=True), "bsr": dict(use_batch_sum=True),
             "margin_bsr": dict(use_margin=True, margin=0.5, use_batch_sum=True)}
    for name, f in cases.items():
        self = types.SimpleNamespace(
            args=types.SimpleNamespace(**{**flags, **f}), log=lambda m: None,
            accelerator=types.SimpleNamespace(gather=lambda x: x))
        out[f"rm_loss_{name}"] = np.asarray(compute_loss(self, Model(), inputs).item())
    # their centring line cannot run (a power without an exponent)
    self = types.SimpleNamespace(args=types.SimpleNamespace(**{**flags, "center_rewards_coefficient": 0.01}),
                                 log=lambda m: None, accelerator=types.SimpleNamespace(gather=lambda x: x))
    try:
        compute_loss(self, Model(), inputs)
        out["rm_center_raises"] = np.asarray(False)
    except TypeError:
        out["rm_center_raises"] = np.asarray(True)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference_losses.npz")
    np.savez(path, **out)
    print(f"wrote {path}: {sorted(out)}")


if __name__ == "__main__":
    main(*sys.argv[1:3])

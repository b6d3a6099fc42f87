"""How ``fope_reference.npz`` was made (run once, by hand; not part of the test suite).

It runs the authors' FoPE module, ``FourierEmbedding`` in ``olmo/model.py`` of
TsinghuaC3I/Fourier-Position-Embedding at commit bd94b20 (their code is NOT in this repository):

    git -C <mirror of that repo> archive HEAD olmo | tar -x -C /tmp/fope_ref
    pip install --target /tmp/refdeps omegaconf
    PYTHONPATH=<dir with this file's STUB finder>:/tmp/fope_ref:/tmp/refdeps python make_fope_reference.py

Their package imports many unrelated dependencies (boto3, rich, olmo_data, ...); a meta-path finder
that turns those top-level names into ``MagicMock`` modules (``stub.py`` below) lets ``olmo.model``
import; none of them is used by ``FourierEmbedding``. torch 2.13.0+cpu, fp32.

Cases (``eye_xavier_norm``, separate basis and head, ignore zero, floor clamp to zero, theta 1e4):
  c32h2L256    d_model 32, 2 heads (head dim 16), L = 256, 5 positions 0..4 (the spec's parity test)
  c32h2L256off same, the 5 queries at positions 7..11 (``all_len=12``, a KV-cache offset)
  c256h4L128   d_model 256, 4 heads (head dim 64), L = 128, 6 positions 3..8
Each has x [1, H, T, K], the coefficient tensors overwritten with N(0, 1) arrays, y = module(x),
and the reference's kept frequencies ``omega``. ``shape_{K}_{L}`` = (input_dim, output_dim) and
``std_{K}_{L}`` = std of (sin_coef - step eye) at init (8 heads, gain 0.3, torch.manual_seed(0)).
"""
import sys, importlib.abc, importlib.machinery  # noqa: E401
from unittest import mock

import numpy as np

STUB = {"boto3", "botocore", "google", "rich", "cached_path", "datasets", "wandb", "requests",
        "torchmetrics", "tokenizers", "pydantic", "olmo_core", "smart_open", "transformers",
        "necessary", "olmo_data", "s3fs", "gcsfs"}


class _Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUB:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        m = mock.MagicMock()
        m.__path__, m.__spec__, m.__name__ = [], spec, spec.name
        return m

    def exec_module(self, m):
        pass


def main():
    sys.meta_path.insert(0, _Stub())
    import torch
    import olmo.model as M
    from olmo.config import ModelConfig

    def make(d_model, n_heads, L, gain=0.3):
        cfg = ModelConfig(d_model=d_model, n_heads=n_heads, max_sequence_length=L, rope=True,
                          rope_clamp_floor_freq=True, rope_clamp_floor_to_zero=True, fourier=True,
                          fourier_init="eye_xavier_norm", fourier_init_norm_gain=gain,
                          fourier_separate_basis=True, fourier_separate_head=True,
                          fourier_ignore_zero=True, init_device="cpu")
        return M.FourierEmbedding(cfg, M.BufferCache())

    out, rng = {}, np.random.RandomState(0)
    for name, d, h, L, T, all_len in [("c32h2L256", 32, 2, 256, 5, 5),
                                      ("c32h2L256off", 32, 2, 256, 5, 12),
                                      ("c256h4L128", 256, 4, 128, 6, 9)]:
        fe = make(d, h, L)
        sin = rng.randn(*fe.sin_coef.shape).astype(np.float32)
        cos = rng.randn(*fe.cos_coef.shape).astype(np.float32)
        with torch.no_grad():
            fe.sin_coef.copy_(torch.from_numpy(sin))
            fe.cos_coef.copy_(torch.from_numpy(cos))
        x = rng.randn(1, h, T, d // h).astype(np.float32)
        out[f"{name}/x"], out[f"{name}/y"] = x, fe(torch.from_numpy(x), all_len).detach().numpy()
        out[f"{name}/sin_coef"], out[f"{name}/cos_coef"] = sin, cos
        out[f"{name}/meta"] = np.array([d, h, L, T, all_len])
        out[f"{name}/omega"] = fe.inv_freq.numpy().reshape(-1)
    for hd, L in [(64, 512), (128, 512), (64, 1024), (128, 1024), (64, 128)]:
        torch.manual_seed(0)
        fe = make(hd * 8, 8, L)
        sc = fe.sin_coef.detach().numpy()
        step = -(-fe.input_dim // fe.output_dim)
        E = np.zeros(sc.shape[1:], np.float32)
        for i in range(fe.output_dim):
            if i * step < fe.input_dim:
                E[i * step, i] = 1
        out[f"shape_{hd}_{L}"] = np.array([fe.input_dim, fe.output_dim])
        out[f"std_{hd}_{L}"] = np.array([(sc - E).std()])
    np.savez_compressed("fope_reference.npz", **out)


if __name__ == "__main__":
    main()

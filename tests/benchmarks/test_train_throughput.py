"""benchmarks/train_throughput's pieces that need no child process: the split batched matmul and
the report's table of batched-matmul variants (the benchmark itself runs in ``make bench``)."""
import numpy as np

from benchmarks import train_throughput as tt


def test_split_matmul_equals_the_batched_matmul():
    import jax.numpy as jnp
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((4, 3, 5), np.float32), rng.standard_normal((4, 5, 2), np.float32)
    for parts in (1, 2, 4):
        np.testing.assert_allclose(tt.split_matmul(jnp.asarray(a), jnp.asarray(b), parts), a @ b,
                                   rtol=1e-5, atol=1e-6)


def test_report_lists_each_batched_matmul_variant_and_its_errors():
    shapes = [f"{n}x({m}x{k}x{q})" for n, m, k, q in tt.BMM_SHAPES]
    res = {"date": "d", "argv": [], "xla_flags": "", "versions": {}, "loadavg_start": (0, 0, 0),
           "loadavg_end": (0, 0, 0), "runtime_s": 1.0, "presets": {},
           "machine": {"cpu": "cpu", "cores": 2, "ram_gib": 1},
           "matmul": {"jax": {"gflops": {"8x8x8": 100.0}, "bmm_gflops": {s: 50.0 for s in shapes}},
                      "bmm_variants": {"oneDNN": {"bmm_gflops": {s: 60.0 + i for i, s in enumerate(shapes)}},
                                       "split into 2 dots": {"error": "boom"}}}}
    md = tt.markdown(tt.summarize(res))
    assert "| oneDNN | 60 | 61 |" in md
    assert "| split into 2 dots | error | error |" in md
    assert "| variant | " + " | ".join(shapes) + " |" in md

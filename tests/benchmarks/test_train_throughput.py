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


def _row(tok_s, **extra):
    return {"tokens_per_s": tok_s, "step_s_min": 1.0, "step_s_median": 1.0, "model_tflops_per_s": 0.1,
            "params": 1e6, **extra}


def test_headline_ratio_is_the_median_of_interleaved_rounds():
    rounds = [{"ours": 90.0, "torch_sdpa": 100.0}, {"ours": 100.0, "torch_sdpa": 100.0},
              {"ours": 120.0, "torch_sdpa": 100.0}]
    res = {"date": "d", "argv": [], "xla_flags": "", "versions": {}, "loadavg_start": (0, 0, 0),
           "loadavg_end": (0, 0, 0), "runtime_s": 1.0, "machine": {"cpu": "cpu", "cores": 2, "ram_gib": 1},
           "matmul": {"jax": {"gflops": {"8x8x8": 100.0}}},
           "presets": {"small": {"batch": 2, "seq_len": 8, "rounds": rounds,
                                 "ours": _row(90.0, glibc_tunables="glibc.malloc.hugetlb=1",
                                              page_faults_per_step=700.0),
                                 "torch_sdpa": _row(100.0, glibc_tunables="", page_faults_per_step=12000.0)}}}
    tt.summarize(res)
    row = res["presets"]["small"]
    assert row["round_ratios"] == [0.9, 1.0, 1.2] and row["ratio_median_of_rounds"] == 1.0
    md = tt.markdown(res)
    assert "| small | 90 / 100, 100 / 100, 120 / 100 | 0.90×, 1.00×, 1.20× | **1.00×** | 0.90–1.20× |" in md
    # the headline table: round 1's tokens/s, the rounds' median ratio (round 1 alone: 0.90×)
    assert "| small | 1.00M | 2×8 | 90 | 100 | 1.00× |" in md
    assert "| small | ours | 90 | " in md and "| 700 | yes |" in md  # faults and huge pages per row
    assert "| 12,000 | no |" in md


def test_rounds_below_one_are_refused(capsys):
    import pytest
    with pytest.raises(SystemExit):
        tt.parse_args(["--rounds=0"])
    assert "--rounds=0: give at least 1" in capsys.readouterr().err
    assert tt.parse_args(["--rounds=1"]).rounds == 1


def test_child_environ_sets_or_removes_malloc_huge_pages(monkeypatch):
    monkeypatch.setattr(tt.xla_env, "thp_mode", lambda *a: "madvise")
    monkeypatch.setattr(tt.xla_env, "glibc_version", lambda: (2, 36))
    base = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "XLA_FLAGS": "--a"}
    off = tt.child_environ(base, "--b", hugepages=False)
    assert off["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2" and off["XLA_FLAGS"] == "--b"
    on = tt.child_environ({"PATH": "/bin"}, None, hugepages=True)
    assert on["GLIBC_TUNABLES"] == tt.xla_env.HUGEPAGE_TUNABLE and "XLA_FLAGS" not in on
    assert "GLIBC_TUNABLES" not in tt.child_environ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
                                                   hugepages=False)
    assert tt.child_environ(base) == base  # None: inherited as it is
    mine = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}  # the user's own value is kept, as the CLI keeps it
    assert tt.child_environ(mine, hugepages=True) == mine
    # the user's opt-out also holds for the benchmark's "ours"
    assert "GLIBC_TUNABLES" not in tt.child_environ({tt.xla_env.HUGEPAGES_ENV: "0"}, hugepages=True)

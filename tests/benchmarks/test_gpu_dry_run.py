"""benchmarks/gpu.py --dry-run: the GPU benchmark's code runs end to end at tiny sizes on the CPU
(so it does not rot between the sessions that are lent a GPU), and its report is well formed."""
import json

from benchmarks import gpu


def test_gpu_benchmark_dry_run_writes_its_report(tmp_path):
    res = gpu.main(["--dry-run", "--models=transformer,rmt", f"--out_dir={tmp_path}"])
    assert set(res["train"]) == {"transformer", "rmt"} and set(res["decode"]) == {"transformer", "rmt"}
    for name, r in res["train"].items():
        assert "error" not in r, (name, r)
        assert r["tokens_per_s"] > 0 and r["compile_s"] > 0 and r["loss"] > 0
        assert abs(r["model_tflops_per_s"] * 1e12 / (r["tokens_per_s"] * r["flops_per_token"]) - 1) < 1e-9
    assert res["train"]["rmt"]["params"] != res["train"]["transformer"]["params"]  # two models
    for name, rows in res["decode"].items():
        assert isinstance(rows, list) and [r["batch"] for r in rows] == list(gpu.SIZES["dry"]["decode_batches"])
        for r in rows:
            assert r["param_bytes"] > 0 and r["kv_bytes_mean"] > 0
            assert r["hbm_bytes_per_s"] == (r["param_bytes"] + r["kv_bytes_mean"]) / r["step_s"]
    saved = json.loads((tmp_path / "gpu_dryrun.json").read_text())
    assert saved["dry_run"] and saved["train"].keys() == res["train"].keys()
    md = (tmp_path / "gpu_dryrun.md").read_text()
    assert "| transformer |" in md and "| rmt |" in md and "dry run" in md

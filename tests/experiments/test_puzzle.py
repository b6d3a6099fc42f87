"""experiments/puzzle at its tiny preset: the parent, library, children, GKD runs and outputs; the
searched children meet their budgets and every child's row matches its layout's costs."""
import csv
import os

from experiments.puzzle.__main__ import HEADLINE, PRESETS, main


def test_puzzle_tiny_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    wd = str(tmp_path / "exp")
    main([f"--workdir={wd}", "--preset=tiny"])
    exp = PRESETS["tiny"]
    for name in ("results.csv", "library.csv", "bld.csv", "results.md", "pareto.png", "config.json"):
        assert os.path.getsize(os.path.join(wd, name)) > 0, name
    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    before = [r for r in rows if r["stage"] == "BLD blocks"]
    names = [r["child"] for r in before]
    # baselines, then a Puzzle child per budget (the headline and each uniform baseline's)
    assert len(names) == len(exp.uniform) + len(exp.drop) + 1 + len(exp.uniform) + int(exp.latency_child)
    head = next(r for r in before if r["child"] == HEADLINE)
    assert float(head["params_share"]) <= exp.budget[0] + 1e-9 and float(head["kv_share"]) <= exp.budget[1] + 1e-9
    for u in exp.uniform:
        base = next(r for r in before if r["child"] == f"uniform KV {u[0]}, FFN {u[1]}")
        pz = next(r for r in before if r["child"] == f"Puzzle @ {base['child']}")
        assert int(pz["params"]) <= int(base["params"]) and int(pz["kv_bytes"]) <= int(base["kv_bytes"])
    after = [r for r in rows if r["stage"].startswith("after GKD")]
    assert len(after) == (len(exp.gkd_arms) + 1) * len(exp.gkd_seeds)
    assert all(float(r["kl_to_parent"]) >= 0 for r in rows)
    lib = list(csv.DictReader(open(os.path.join(wd, "library.csv"))))
    pairs = (1 + len(exp.attention)) * (1 + len(exp.ffn))
    assert len(lib) == exp.run.model.num_layers * pairs
    own = [r for r in lib if r["pair"] == "kv2+ffn64"]
    assert all(abs(float(r["kl_div"])) < 1e-6 for r in own)  # the parent's own blocks cost nothing
    lat = {(int(r["layer"]), r["pair"]): float(r["latency_ms"]) for r in lib}

    def summed(row):
        name = lambda k, part: (f"kv{k}" if part == "a" else f"ffn{k}") if k.isdigit() else (  # noqa: E731
            f"{'attn' if part == 'a' else 'ffn'}_{k}")
        pairs = zip(row["layout_attention"].split(","), row["layout_ffn"].split(","))
        return sum(lat[(i, f"{name(a, 'a')}+{name(f, 'f')}")] for i, (a, f) in enumerate(pairs))
    u = exp.uniform[0]
    fast = next(r for r in before if r["child"].endswith("+ latency"))
    assert summed(fast) <= summed(next(r for r in before if r["child"] == f"uniform KV {u[0]}, FFN {u[1]}")) * (1 + 1e-6)
    assert "Gates:" in open(os.path.join(wd, "results.md")).read()

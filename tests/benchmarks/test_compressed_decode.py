"""benchmarks/compressed_decode.py on the tiny preset: TLR variants and Puzzle children decode end
to end and the report holds their params, KV bytes per token and ratios to the parent."""
import json

from benchmarks import compressed_decode
from icml_jax.config_utils import load_config


def test_compressed_decode_tiny_reports_tlr_and_puzzle_children(tmp_path):
    res = compressed_decode.main(["--preset=tiny", "--batches=1,2", "--repeats=1", "--new_tokens=3",
                                  "--prompt=5", f"--out={tmp_path}"])
    rows = res["rows"]
    m = load_config("configs/lm.py:tiny").model  # 2 layers, 2 KV heads, head_dim 8, F 64, float32
    layouts = compressed_decode.puzzle_layouts(m)
    assert {r["variant"] for r in rows} == {"dense parent", "magnitude 50%, prune only",
                                            "magnitude 50% + rank-16 factors", *layouts}
    assert len(rows) == 2 * (3 + len(layouts))
    parent = next(r for r in rows if r["variant"] == "dense parent")
    assert parent["kv_bytes_per_token"] == 2 * 2 * 2 * 8 * 4  # layers * (k, v) * G * K * float32
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["speed_vs_parent"] > 0
        if r["variant"] in layouts:
            assert r["blocks"] == dict(zip(("attention", "ffn"), layouts[r["variant"]]))
            assert r["params"] < parent["params"] and r["kv_vs_parent"] == 0.5
        if r["variant"] == "dense parent":
            assert r["speed_vs_parent"] == r["params_vs_parent"] == r["kv_vs_parent"] == 1.0
    assert json.loads((tmp_path / "compressed_decode.json").read_text())["rows"] == rows
    md = (tmp_path / "compressed_decode.md").read_text()
    assert "## Puzzle children" in md and "| puzzle: last 1 of 2 layers no-op |" in md

"""benchmarks/cos_speed.py --tiny: the CoS benchmark runs end to end on tiny random models and its
report is well formed (the T = 0 drivers agree; the speculative ones call b less than standard)."""
import json

from benchmarks import cos_speed


def test_cos_benchmark_tiny_writes_its_report(tmp_path):
    res = cos_speed.main(["--tiny", "--new_tokens=10", "--prompts=1", f"--out={tmp_path}"])
    rows = res["rows"]
    assert {(r["combiner"], r["temperature"], r["method"]) for r in rows} == {
        (c, t, m) for c in ("we", "cd") for t in (0.0, 1.0) for m in cos_speed.METHODS}
    for r in rows:
        assert r["tokens"] == 10 and r["tokens_per_s"] > 0
        if r["temperature"] == 0:
            assert r["same_as_standard"] is True
        if r["method"] == "standard":
            assert r["speedup_vs_standard"] == 1.0 and r["acceptance"] is None
    # we at T = 1: the drafts' acceptance is at least the proposer's weight in expectation
    we = [r for r in rows if r["combiner"] == "we" and r["method"] != "standard"]
    assert all(r["b_calls_per_token"] < 0.9 for r in we)
    saved = json.loads((tmp_path / "cos_speed.json").read_text())
    assert saved["rows"] == rows
    assert "| we | 0 | cos |" in (tmp_path / "cos_speed.md").read_text()

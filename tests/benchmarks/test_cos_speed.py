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


def test_merge_passes_takes_medians_and_the_range():
    def row(method, tps, sp):
        return dict(combiner="cd", temperature=1.0, method=method, tokens=64, tokens_per_s=tps,
                    speedup_vs_standard=sp, acceptance=0.8, same_as_standard=None)
    passes = [[row("standard", 100.0, 1.0), row("cos", 150.0, 1.5)],
              [row("standard", 80.0, 1.0), row("cos", 100.0, 1.25)],
              [row("standard", 120.0, 1.0), row("cos", 200.0, 5 / 3)]]
    std, cos = cos_speed.merge_passes(passes)
    assert (std["tokens_per_s"], std["speedup_vs_standard"], std["speedup_range"]) == (100.0, 1.0, [1.0, 1.0])
    assert (cos["tokens_per_s"], cos["speedup_vs_standard"], cos["speedup_range"]) == (150.0, 1.5, [1.25, 5 / 3])
    assert cos["passes"] == 3 and cos["acceptance"] == 0.8 and cos["method"] == "cos"
    t0 = [[dict(passes[0][1], temperature=0.0, same_as_standard=ok)] for ok in (True, False, True)]
    assert cos_speed.merge_passes(t0)[0]["same_as_standard"] is False  # one pass disagreeing is enough

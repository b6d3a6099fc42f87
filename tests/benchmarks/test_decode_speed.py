"""benchmarks/decode_speed.py's report code on a synthetic result (the benchmark itself runs torch
and transformers beside us, minutes on this CPU, so it is not run here): the rounds' medians and
the table row with its per-round speedups."""
from benchmarks import decode_speed


def test_median_run_and_report_row():
    runs = [dict(generate_s=g, prefill_s=p, compile_s=c, matmul_floor_s=c / 1e3, tokens=[[1, 2]], loadavg=l)
            for g, p, c, l in ((1.0, 0.1, 2.0, 0.5), (3.0, 0.3, 4.0, 0.6), (2.0, 0.2, 3.0, 0.7))]
    m = decode_speed._median_run(runs)
    assert (m["generate_s"], m["prefill_s"], m["compile_s"], m["matmul_floor_s"]) == (2.0, 0.2, 3.0, 3e-3)
    assert m["tokens"] == [[1, 2]] and m["loadavg"] == 0.5  # the first round's
    o = decode_speed._summary(m, 8)
    h = decode_speed._summary(dict(generate_s=4.0, prefill_s=0.2, matmul_floor_s=5e-3), 8)
    assert o["matmul_floor_ms"] == 3.0 and h["matmul_floor_ms"] == 5.0
    assert o["tokens_per_s"] == 8 * decode_speed.NEW_TOKENS / 2.0
    assert abs(o["per_token_ms"] - 1e3 * 1.8 / (decode_speed.NEW_TOKENS - 1)) < 1e-9
    for side in (o, h):
        side["gb_per_s"] = 1.0
    report = dict(env=dict(date="d", cpus=2, machine="x86_64", jax="j", torch="t", torch_threads=2,
                           transformers="tr", loadavg=(1.0, 1.0, 1.0), xla_flags="", prompt_len=64,
                           new_tokens=128, repeats=5, rounds=3, memory_gb_per_s=dict(read=30.0, copy=25.0)),
                  results=[dict(preset="20m", params=17.9e6, batch=8, ours=o, transformers=h, speedup=2.0,
                                speedup_per_round=[2.1, 2.0, 1.9], greedy_tokens_agree=1.0)])
    md = decode_speed._markdown(report)
    assert "| 20m | 17.90M | 8 | 512 | 256 | 2.0x | 2.1x, 2.0x, 1.9x |" in md
    assert "3 rounds per case" in md
    header, sep = [l for l in md.splitlines() if l.startswith("| model") or l.startswith("|---")]
    assert header.count("|") == sep.count("|")
    # the floor bullet: 2x needs half of transformers' per-token latency
    bullet = next(l for l in md.splitlines() if l.startswith("* 20m, batch 8"))
    assert f"2x needs <= {h['per_token_ms'] / 2:.2f} ms/token" in bullet
    assert "our matmuls alone take 3.00 ms, transformers' 5.00 ms" in bullet
    assert "median of 15 passes" in md
    assert "Scanned layers" not in md  # no scan table without scan results
    report["scan"], report["scan_preset"] = [dict(batch=1, slots=1024, ms_per_token=dict(unrolled=5.0, scanned=18.0),
                                                  ratio=3.6, tokens_agree=True)], "20m"
    md = decode_speed._markdown(report)
    assert "| 1 | 1024 | 5.00 | 18.00 | 3.60x | True |" in md and "copy of `20m`" in md


def test_matmul_shapes_do_the_same_work_on_both_sides():
    """Ours fuses q/k/v and gate/up, transformers does not: the same multiply-adds either way, and
    they are the model's weight matmuls (every layer's projections and MLP, plus the head)."""
    from icml_jax.config_utils import load_config
    m = load_config("configs/lm.py:20m", unlocked=True).model
    ours, hf = (decode_speed.matmul_shapes(m, side) for side in ("ours", "hf"))
    assert len(ours) == 4 * m.num_layers + 1 and len(hf) == 7 * m.num_layers + 1
    macs = lambda shapes: sum(i * o for i, o in shapes)  # noqa: E731
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    layer = m.d_model * (q + 2 * kv) + q * m.d_model + 3 * m.d_model * m.ffn_dim
    assert macs(ours) == macs(hf) == m.num_layers * layer + m.d_model * m.vocab_size


def test_matmul_floor_runs_ours():
    from icml_jax.config_utils import load_config
    m = load_config("configs/lm.py:tiny", unlocked=True).model
    t = decode_speed.matmul_floor(m, "ours", 2, 2)
    assert 0 < t < 10


def test_scan_cost_runs_both_loops_and_they_agree():
    """The scanned-model comparison on the tiny preset: both decode loops run (one compile each)
    and give the same greedy tokens."""
    from icml_jax.config_utils import load_config
    m = load_config("configs/lm.py:tiny", unlocked=True).model
    r = decode_speed.scan_cost(m, 2, 8, 1)
    assert r["tokens_agree"] and r["slots"] == decode_speed.PROMPT_LEN + 8
    assert set(r["ms_per_token"]) == {"unrolled", "scanned"} and r["ratio"] > 0

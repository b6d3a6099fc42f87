"""benchmarks/decode_speed.py's report code on a synthetic result (the benchmark itself runs torch
and transformers beside us, minutes on this CPU, so it is not run here): the rounds' medians and
the table row with its per-round speedups."""
from benchmarks import decode_speed


def test_median_run_and_report_row():
    runs = [dict(generate_s=g, prefill_s=p, compile_s=c, tokens=[[1, 2]], loadavg=l)
            for g, p, c, l in ((1.0, 0.1, 2.0, 0.5), (3.0, 0.3, 4.0, 0.6), (2.0, 0.2, 3.0, 0.7))]
    m = decode_speed._median_run(runs)
    assert (m["generate_s"], m["prefill_s"], m["compile_s"]) == (2.0, 0.2, 3.0)
    assert m["tokens"] == [[1, 2]] and m["loadavg"] == 0.5  # the first round's
    o, h = decode_speed._summary(m, 8), decode_speed._summary(dict(generate_s=4.0, prefill_s=0.2), 8)
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

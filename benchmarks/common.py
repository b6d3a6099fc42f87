"""Helpers shared by the benchmarks: timing and atomic result files."""
import os
import statistics
import time

from icml_jax.atomic import write_atomic  # a killed benchmark never leaves half a report

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def time_calls(fn, n: int) -> list:
    """Wall-clock seconds of ``n`` calls of ``fn`` (which must block until its work is done)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def median_time(fn, n: int) -> float:
    return statistics.median(time_calls(fn, n))



def write_report(out_dir: str, name: str, result: dict, markdown: str) -> None:
    """``out_dir/name.json`` (the raw result) and ``out_dir/name.md`` (the report), each atomic.
    The JSON also records this process's ``GLIBC_TUNABLES`` (malloc's huge pages, set by the
    entry points' restart: ``icml_jax.xla_env.restart_with_hugepages``) unless the result has it."""
    import json
    result = {**result, "glibc_tunables": result.get("glibc_tunables", os.environ.get("GLIBC_TUNABLES", ""))}
    write_atomic(os.path.join(out_dir, f"{name}.json"), json.dumps(result, indent=2) + "\n")
    write_atomic(os.path.join(out_dir, f"{name}.md"), markdown)

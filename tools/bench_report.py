#!/usr/bin/env python3
"""Summarise a bench_memory Google Benchmark JSON file as a markdown table.

Usage:
    ./build/release/bench/bench_memory --benchmark_format=json --benchmark_out=bench.json
    python3 tools/bench_report.py bench.json
    python3 tools/bench_report.py --cpu-time bench.json

--cpu-time recomputes every rate from the benchmark's CPU time (the main thread's CPU time in
Google Benchmark 1.7) instead of its wall-clock time. Use it only for a single-threaded run
(OMP_NUM_THREADS=1): on a shared, oversubscribed machine the thread's CPU time leaves out the
time it waited for a core, so single-core rates and ratios stay stable under load. With more
than one thread it would ignore the other threads' work.

Prints one row per benchmark: name, tokens/s, GFLOPS (from the FLOP model in
bench/bench_memory.cpp), that GFLOPS as a fraction of BM_Gemm's GFLOPS *from the same file*,
and, for every BM_MemoryChunked row whose (L, d_h, B, retrieval) matches a BM_MemoryPerToken
row, the chunked / per-token speedup in tokens/s. Ratios are only meaningful between results
of one run (same machine load), which is why they are computed here and not across files.

Python 3 standard library only; optional, never needed by the tests.
"""

import json
import sys


TIME_UNIT = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_args(name):
    """'BM_X/b:64/L:2/.../real_time' -> ('BM_X', {'b': 64, 'L': 2, ...})."""
    parts = name.split("/")
    args = {}
    for p in parts[1:]:
        if ":" in p:
            k, v = p.split(":", 1)
            try:
                args[k] = int(v)
            except ValueError:
                args[k] = v
    return parts[0], args


def fmt(x, digits=1):
    if x is None:
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def main(argv):
    args = argv[1:]
    cpu_time = "--cpu-time" in args
    args = [a for a in args if a != "--cpu-time"]
    if len(args) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8") as f:
        data = json.load(f)

    rows = []
    has_aggregates = any(b.get("run_type") == "aggregate" for b in data.get("benchmarks", []))
    for b in data.get("benchmarks", []):
        # With --benchmark_repetitions, keep the median aggregate only (robust to a noisy,
        # shared machine); without, the single run.
        if has_aggregates and b.get("run_type") != "aggregate":
            continue
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        if b.get("error_occurred"):
            rows.append((b["name"], None, None, b.get("error_message", "error")))
            continue
        name = b.get("run_name", b["name"]) if b.get("run_type") == "aggregate" else b["name"]
        tps, gf = b.get("tokens_per_second"), b.get("GFLOPS")
        if cpu_time:
            secs = b["cpu_time"] * TIME_UNIT[b.get("time_unit", "ns")]
            base, a = parse_args(name)
            if base.startswith("BM_Gemm"):
                n = int(name.split("/")[1])
                gf = 2.0 * n ** 3 / secs / 1e9
            elif "N" in a and "B" in a:
                tokens = a["N"] * a["B"]
                tps = tokens / secs
                gf = b.get("flops_per_token", 0.0) * tokens / secs / 1e9
        rows.append((name, tps, gf, None))

    gemm = [g for (n, _, g, e) in rows if n.startswith("BM_Gemm") and g is not None]
    gemm_rate = gemm[0] if gemm else None

    per_token = {}
    for name, tps, _, err in rows:
        base, a = parse_args(name)
        if base == "BM_MemoryPerToken" and tps is not None:
            per_token[(a.get("L"), a.get("dh"), a.get("B"), a.get("inchunk"))] = tps

    ctx = data.get("context", {})
    print(f"Host: {ctx.get('host_name', '?')}, {ctx.get('num_cpus', '?')} CPUs @ "
          f"{ctx.get('mhz_per_cpu', '?')} MHz, eigen_threads={ctx.get('eigen_threads', '?')}, "
          f"load_avg={ctx.get('load_avg', '?')}, date={ctx.get('date', '?')}")
    print("Rates from " + ("CPU time (single-threaded run)" if cpu_time else "wall-clock time"))
    if cpu_time and str(ctx.get("eigen_threads", "1")) != "1":
        print("WARNING: --cpu-time on a run with eigen_threads != 1: rates ignore other threads")
    if gemm_rate:
        print(f"BM_Gemm reference: {gemm_rate:.1f} GFLOPS")
    print()
    print("| benchmark | tokens/s | GFLOPS | of GEMM | chunked / per-token |")
    print("|---|---:|---:|---:|---:|")
    for name, tps, gf, err in rows:
        short = name.replace("/real_time", "")
        if err is not None:
            print(f"| {short} | {err} | | | |")
            continue
        frac = f"{100.0 * gf / gemm_rate:.0f}%" if (gf is not None and gemm_rate) else "-"
        speedup = "-"
        base, a = parse_args(name)
        if base == "BM_MemoryChunked":
            ref = per_token.get((a.get("L"), a.get("dh"), a.get("B"), a.get("inchunk")))
            if ref and tps:
                speedup = f"{tps / ref:.1f}x"
        print(f"| {short} | {fmt(tps)} | {fmt(gf)} | {frac} | {speedup} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

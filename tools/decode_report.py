#!/usr/bin/env python3
"""Summarise bench/decode_contention.sh's runs (bench_decode JSON files) as markdown tables.

Usage:
    python3 tools/decode_report.py DIR          # DIR/busy{0,1,2}_{default,1}.json
    python3 tools/decode_report.py FILE.json    # one run

For each run: tokens/s, p50/p99 step latency, GB/s of weights read, and the ratios the serving
targets are stated in, all within that run: decode B=1 / chunked, decode B=64 / chunked B=1
(memory; model per kind), MAC / MAG chunked, memory GB/s / BM_StreamRead GB/s. Across runs:
each benchmark's time with the default threads / its time with OMP_NUM_THREADS=1 under the
same load (target <= 1.2). Python 3 standard library only; never needed by the tests.
"""

import json
import os
import sys


def load(path):
    with open(path) as f:
        data = json.load(f)
    rows = {}
    for b in data["benchmarks"]:
        if b.get("run_type", "iteration") != "iteration":
            continue
        name = b["run_name"] if "run_name" in b else b["name"]
        name = name.split("/iterations:")[0].replace("/real_time", "")
        rows[name] = b
    return rows


def rate(rows, name):
    b = rows.get(name)
    return b.get("tokens_per_second") if b else None


def ratio(a, b):
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def table(rows, title):
    print(f"\n### {title}\n")
    print("| benchmark | tokens/s | p50 us | p99 us | GB/s |")
    print("|---|---:|---:|---:|---:|")
    for name, b in rows.items():
        tps = b.get("tokens_per_second")
        if tps is None:
            extra = f"GFLOPS {b['GFLOPS']:.1f}" if "GFLOPS" in b else ""
            extra = extra or (f"GB/s {b['GBps']:.1f}" if "GBps" in b else "")
            print(f"| {name} | {extra} | | | |")
            continue
        gbps = b.get("GBps")
        print(f"| {name} | {tps:,.0f} | {b['p50_us']:,.0f} | {b['p99_us']:,.0f} | "
              f"{'' if gbps is None else f'{gbps:.1f}'} |")
    chunked = rate(rows, "BM_MemoryChunked")
    print()
    print(f"- memory decode B=1 / chunked: {ratio(rate(rows, 'BM_MemoryDecode/1'), chunked)}"
          " (target >= 0.70)")
    print(f"- memory decode B=64 / chunked B=1: {ratio(rate(rows, 'BM_MemoryDecode/64'), chunked)}"
          " (target >= 1.0)")
    for kind, k in (("MAG", 0), ("MAC", 1)):
        c = rate(rows, f"BM_ModelChunked/mac:{k}")
        print(f"- model {kind} decode B=1 / chunked: "
              f"{ratio(rate(rows, f'BM_ModelDecode/mac:{k}/B:1'), c)}, "
              f"B=64 / chunked: {ratio(rate(rows, f'BM_ModelDecode/mac:{k}/B:64'), c)}")
    print(f"- model MAC / MAG chunked: "
          f"{ratio(rate(rows, 'BM_ModelChunked/mac:1'), rate(rows, 'BM_ModelChunked/mac:0'))}")


def main(argv):
    if len(argv) != 2:
        print(__doc__)
        return 2
    path = argv[1]
    if not os.path.isdir(path):
        table(load(path), path)
        return 0
    runs = {}
    for busy in (0, 1, 2):
        for threads in ("default", "1"):
            f = os.path.join(path, f"busy{busy}_{threads}.json")
            if os.path.exists(f):
                runs[(busy, threads)] = load(f)
                table(runs[(busy, threads)], f"{busy} busy loop(s), threads: {threads}")
    print("\n### default threads time / OMP_NUM_THREADS=1 time, same load (target <= 1.2)\n")
    names = [n for n in next(iter(runs.values())) if "tokens_per_second" in runs[next(iter(runs))][n]]
    print("| benchmark | " + " | ".join(f"{b} busy" for b in (0, 1, 2)) + " |")
    print("|---|" + "---:|" * 3)
    for n in names:
        cells = []
        for busy in (0, 1, 2):
            d, s = runs.get((busy, "default")), runs.get((busy, "1"))
            cells.append(ratio(rate(s, n) if s else None, rate(d, n) if d else None))
        print(f"| {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

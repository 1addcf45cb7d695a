#!/usr/bin/env python3
"""Write a safetensors file that titans::io::load_parameters can load (docs/formats.md).

Usage:
    python3 tools/write_safetensors.py --out /tmp/mem.safetensors --d-model 32 --heads 2 \\
        --depth 2 --dtype f32
    python3 tools/write_safetensors.py --out /tmp/mem.safetensors --d-model 32 --heads 2 \\
        --depth 2 --dtype bf16 --no-conv --constant-gates
    python3 tools/write_safetensors.py --out /tmp/mem.safetensors --from-torch   # needs torch

The file holds the outer parameters of one NeuralMemory (MemoryParams), loaded in C++ with
the matching MemoryConfig:

    titans::MemoryConfig cfg{.d_model = 32, .n_heads = 2, .depth = 2};
    auto p = titans::io::load_parameters<titans::MemoryParams<float>>("/tmp/mem.safetensors", cfg);
    titans::NeuralMemory<float> mem(cfg, std::move(p));

It is also a small reference for writing titans files from other code:

  * write_safetensors() implements the format itself (no `safetensors` pip package): an 8-byte
    little-endian header length, the JSON header padded with spaces to a multiple of 8, then
    every tensor's bytes, little-endian and row-major, at its data_offsets.
  * memory_params() returns the exact tensor names and shapes titans expects. Weights are
    applied to ROW vectors from the right (y = x W, W is in x out): a PyTorch nn.Linear weight
    (out x in) must be transposed; see memory_params_from_torch().
  * Dtypes: f32, f64, f16 and bf16 (bf16 rounded to nearest even from float32 in NumPy);
    titans converts any of them to the float or double it loads into.

NumPy only; torch is used by --from-torch when it is installed. Nothing else is needed.
"""

import argparse
import json
import os
import struct
import sys

import numpy as np

DTYPES = ("f32", "f64", "f16", "bf16")


# --------------------------------------------------------------------------------------------
# The format.

def float32_to_bfloat16_bits(a):
    """float32 array -> uint16 bfloat16 bits, rounded to nearest even (NaN stays NaN)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(np.asarray(a, dtype=np.float32))
    out[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)  # quiet NaN, sign kept
    return out


def encode(array, dtype):
    """(safetensors dtype name, shape, little-endian row-major bytes) of `array` as `dtype`."""
    a = np.asarray(array)
    if dtype == "f32":
        name, data = "F32", np.ascontiguousarray(a, dtype="<f4")
    elif dtype == "f64":
        name, data = "F64", np.ascontiguousarray(a, dtype="<f8")
    elif dtype == "f16":
        name, data = "F16", np.ascontiguousarray(a, dtype="<f2")
    elif dtype == "bf16":
        name, data = "BF16", float32_to_bfloat16_bits(a.astype(np.float32)).astype("<u2")
    else:
        raise ValueError(f"dtype {dtype!r}: expected one of {DTYPES}")
    return name, list(a.shape), data.tobytes(order="C")


def decode(dtype_name, data):
    """The float values of little-endian bytes of a float dtype (F64, F32, F16, BF16)."""
    if dtype_name == "BF16":
        return (np.frombuffer(data, "<u2").astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(data, {"F64": "<f8", "F32": "<f4", "F16": "<f2"}[dtype_name])


def write_safetensors(path, tensors, metadata=None, dtype="f32"):
    """Writes `tensors` (name -> array, in order) as a safetensors file; returns the header.

    Every array is stored as `dtype`; a value that is NaN or infinite, or becomes infinite in
    `dtype` (f16 beyond 65504), raises ValueError, as titans would reject the file. `metadata`
    (str -> str) goes into "__metadata__". The file is written to "<path>.tmp" and renamed, so `path` is never left half-written.
    """
    header, chunks, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, array in tensors.items():
        with np.errstate(over="ignore"):
            dt, shape, data = encode(array, dtype)
        if not np.all(np.isfinite(decode(dt, data))):  # NaN/Inf given, or out of range
            raise ValueError(f"tensor {name!r} has a NaN or infinite value as {dtype} "
                             "(titans rejects it)")
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("utf-8")
    text += b" " * (-len(text) % 8)  # pad: the data section starts 8-byte aligned
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in chunks:
            f.write(data)
    os.replace(tmp, path)
    return header


# --------------------------------------------------------------------------------------------
# The names and shapes of MemoryParams (include/titans/memory/params.hpp).

def memory_params(d_model, n_heads, depth, expansion=4, conv_kernel=4, use_conv=True,
                  data_dependent_gates=True, d_head=None, rng=None):
    """name -> float64 array for every tensor a NeuralMemory with these settings loads.

    d_head=None means d_model // n_heads (MemoryConfig::d_head = 0). data_dependent_gates
    is True for GateMode::DataDependent and PerChunk, False for GateMode::Constant (then the
    gate tensors are absent: titans rejects a file that has tensors it does not use). The
    values follow MemoryParams::random's distributions (not its exact numbers).
    """
    rng = np.random.default_rng(0) if rng is None else rng
    d, H = d_model, n_heads
    dh = d_head if d_head else d_model // n_heads
    if not d_head and d_model % n_heads:
        raise ValueError("d_model must be a multiple of n_heads when d_head is not given")
    D, K, L = H * dh, conv_kernel, depth
    hidden = expansion * dh if L >= 2 else dh

    def gauss(rows, cols, sd):
        return rng.standard_normal((rows, cols)) * sd

    def layer_in(l):   # 1-based, as MemoryConfig::layer_in
        return dh if l == 1 else hidden

    def layer_out(l):
        return dh if l == L else hidden

    t = {}
    for n in ("w_q", "w_k", "w_v"):
        t[n] = gauss(d, D, d ** -0.5)                     # d x D
    if use_conv:
        for n in ("conv_q", "conv_k", "conv_v"):
            c = gauss(K, D, 0.1)                          # K x D, row K-1: current token
            c[K - 1] += 1.0
            t[n] = c
    if data_dependent_gates:
        for n in ("w_theta", "w_eta", "w_alpha"):
            t[n] = gauss(d, H, d ** -0.5)                 # d x H
        t["b_theta"] = np.zeros(H)                        # rank 1 [H] (or [1, H])
        t["b_eta"] = np.full(H, 2.0)
        t["b_alpha"] = np.full(H, -8.0)
    for h in range(H):
        for l in range(1, L + 1):                         # named with the 0-based index l-1
            t[f"memory_init.{h}.{l - 1}"] = gauss(layer_in(l), layer_out(l), layer_in(l) ** -0.5)
    t["w_o"] = gauss(D, d, D ** -0.5)                     # D x d
    return t


def titans_metadata(obj="memory"):
    """The metadata titans itself writes that a loader checks: "format" and "format_version".
    Optional for a parameter file (a file with no "format" loads too); if "format" is given
    it must be "titans.params" with format_version "1"."""
    return {"format": "titans.params", "format_version": "1", "object": obj,
            "producer": "tools/write_safetensors.py"}


# --------------------------------------------------------------------------------------------
# From PyTorch: a module that keeps its weights the PyTorch way.

def memory_params_from_torch(d_model=32, n_heads=2, depth=2, expansion=4, conv_kernel=4,
                             seed=0):
    """Exports a (randomly initialised) PyTorch memory to titans names. Needs torch.

    The rules, for any PyTorch model:
      * nn.Linear(in, out).weight is out x in (y = x W^T + b): titans wants in x out -> .T
      * nn.Linear bias (out,) -> rank 1 [out]: no change
      * a depthwise causal nn.Conv1d(D, D, K, groups=D, padding=K-1) (output cut to the
        first T steps) has weight D x 1 x K with tap K-1 on the current token, as titans:
        conv[j, c] = weight[c, 0, j] -> weight[:, 0, :].T
      * an nn.Parameter used as x @ W (in x out) is already in titans' layout: no change
      * nn.Embedding(vocab, d).weight is vocab x d, the layout of titans' "embedding": no change
    """
    import torch
    from torch import nn

    torch.manual_seed(seed)
    d, H = d_model, n_heads
    dh = d // H
    D = H * dh
    hidden = expansion * dh if depth >= 2 else dh

    class TorchMemory(nn.Module):
        def __init__(self):
            super().__init__()
            self.to_q = nn.Linear(d, D, bias=False)
            self.to_k = nn.Linear(d, D, bias=False)
            self.to_v = nn.Linear(d, D, bias=False)
            self.conv = nn.ModuleDict({n: nn.Conv1d(D, D, conv_kernel, groups=D, bias=False,
                                                    padding=conv_kernel - 1)
                                       for n in ("q", "k", "v")})
            self.gates = nn.ModuleDict({n: nn.Linear(d, H) for n in ("theta", "eta", "alpha")})
            # Initial memory MLP weights per head, used as h @ W (already in x out).
            widths = [dh] + [hidden] * (depth - 1) + [dh]
            self.memory_init = nn.ParameterList(
                nn.Parameter(torch.randn(widths[l], widths[l + 1]) * widths[l] ** -0.5)
                for _ in range(H) for l in range(depth))
            self.to_out = nn.Linear(D, d, bias=False)

    m = TorchMemory()

    def np_(x):
        return x.detach().to(torch.float64).cpu().numpy()

    t = {
        "w_q": np_(m.to_q.weight).T,                    # (D x d).T -> d x D
        "w_k": np_(m.to_k.weight).T,
        "w_v": np_(m.to_v.weight).T,
        "conv_q": np_(m.conv["q"].weight)[:, 0, :].T,   # (D x 1 x K) -> K x D
        "conv_k": np_(m.conv["k"].weight)[:, 0, :].T,
        "conv_v": np_(m.conv["v"].weight)[:, 0, :].T,
        "w_theta": np_(m.gates["theta"].weight).T,      # (H x d).T -> d x H
        "w_eta": np_(m.gates["eta"].weight).T,
        "w_alpha": np_(m.gates["alpha"].weight).T,
        "b_theta": np_(m.gates["theta"].bias),          # [H]
        "b_eta": np_(m.gates["eta"].bias),
        "b_alpha": np_(m.gates["alpha"].bias),
    }
    for h in range(H):
        for l in range(depth):
            t[f"memory_init.{h}.{l}"] = np_(m.memory_init[h * depth + l])  # no transpose
    t["w_o"] = np_(m.to_out.weight).T                   # (d x D).T -> D x d
    return t


# --------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the .safetensors file to write")
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--d-head", type=int, default=0, help="0: d_model / heads")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--expansion", type=int, default=4)
    ap.add_argument("--conv-kernel", type=int, default=4)
    ap.add_argument("--no-conv", action="store_true", help="MemoryConfig::use_conv = false")
    ap.add_argument("--constant-gates", action="store_true",
                    help="GateMode::Constant: no gate tensors")
    ap.add_argument("--dtype", choices=DTYPES, default="f32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-metadata", action="store_true",
                    help="write no __metadata__ (titans loads such files too)")
    ap.add_argument("--from-torch", action="store_true",
                    help="export a PyTorch module instead (needs torch; ignores --no-conv, "
                         "--constant-gates and --d-head)")
    args = ap.parse_args(argv)

    if args.from_torch:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("--from-torch needs PyTorch (pip install torch); not installed", file=sys.stderr)
            return 2
        tensors = memory_params_from_torch(args.d_model, args.heads, args.depth, args.expansion,
                                           args.conv_kernel, args.seed)
    else:
        tensors = memory_params(args.d_model, args.heads, args.depth, args.expansion,
                                args.conv_kernel, use_conv=not args.no_conv,
                                data_dependent_gates=not args.constant_gates,
                                d_head=args.d_head or None,
                                rng=np.random.default_rng(args.seed))
    meta = None if args.no_metadata else titans_metadata("memory")
    header = write_safetensors(args.out, tensors, meta, args.dtype)

    print(f"wrote {args.out}: {len(tensors)} tensors, {args.dtype}, "
          f"{os.path.getsize(args.out)} bytes")
    for name, info in header.items():
        if name != "__metadata__":
            print(f"  {name:20s} {info['dtype']:5s} {str(info['shape']):12s} "
                  f"bytes [{info['data_offsets'][0]}, {info['data_offsets'][1]})")
    gates = "Constant" if args.constant_gates and not args.from_torch else "DataDependent"
    d_head = f".d_head = {args.d_head}, " if args.d_head and not args.from_torch else ""
    conv = "false" if args.no_conv and not args.from_torch else "true"
    print("load with: titans::MemoryConfig cfg{"
          f".d_model = {args.d_model}, .n_heads = {args.heads}, {d_head}.depth = {args.depth}, "
          f".expansion = {args.expansion}, .use_conv = {conv}, "
          f".conv_kernel = {args.conv_kernel}, .gates = titans::GateMode::{gates}}};")
    return 0


if __name__ == "__main__":
    sys.exit(main())

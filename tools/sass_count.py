#!/usr/bin/env python3
"""Counts a cubin's SASS instructions per kernel, by opcode family.

Static counts (each instruction once, wherever it sits in loops): what the counted floors in
docs/performance.md compare before and after a change, with no GPU needed.

    nvcc -std=c++20 --extended-lambda -arch=sm_90 -I include -isystem /usr/include/eigen3 \\
         -O2 -cubin kernels.cu -o kernels.cubin
    python3 tools/sass_count.py kernels.cubin warp_tiled_attention_kernel

where kernels.cu includes <titans/titans.hpp> and <titans/backend/cuda/cuda.cuh> and calls the
launchers whose kernels are wanted. The trailing arguments keep the kernels whose demangled
names contain all of them. cuobjdump is taken from $CUOBJDUMP, the CUDA toolkit's bin, or PATH;
a toolkit without it can take the one in PyPI's `nvidia-cuda-cuobjdump` wheel
(`pip download --no-deps nvidia-cuda-cuobjdump`, unzip, nvidia/cu13/bin/cuobjdump).
"""
import collections
import os
import re
import shutil
import subprocess
import sys

FAMILIES = ["HMMA", "LDS", "STS", "LDG", "STG", "MUFU", "SHFL", "BAR", "FFMA", "FADD", "FMUL",
            "FSETP", "FSEL", "FMNMX", "DFMA", "IMAD", "ISETP", "BRA"]


def cuobjdump():
    for path in (os.environ.get("CUOBJDUMP"), "/usr/local/cuda/bin/cuobjdump",
                 shutil.which("cuobjdump")):
        if path and os.access(path, os.X_OK):
            return path
    sys.exit("sass_count.py: no cuobjdump (set CUOBJDUMP; see the docstring)")


def demangle(name):
    out = subprocess.run(["c++filt", name], capture_output=True, text=True).stdout.strip()
    return out or name


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    text = subprocess.run([cuobjdump(), "-sass", sys.argv[1]], capture_output=True, text=True,
                          check=True).stdout
    wanted = sys.argv[2:]
    line_re = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
    for part in re.split(r"\n\s+Function : ", text)[1:]:
        name = demangle(part.split("\n", 1)[0].strip())
        if not all(w in name for w in wanted):
            continue
        counts = collections.Counter()
        for line in part.split("\n"):
            m = line_re.match(line)
            if m:
                counts[m.group(1)] += 1
        total = sum(counts.values())
        print(name[:110])
        print("  total", total, " ".join(f"{k}={counts[k]}" for k in FAMILIES))


if __name__ == "__main__":
    main()

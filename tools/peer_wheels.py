#!/usr/bin/env python3
"""Wheels of a Python package and of the requirements a GPU machine's image lacks, for a machine
that cannot reach PyPI (the lent GPU machines: docs/performance.md, "CUDA backend").

    python3 tools/peer_wheels.py titans-pytorch --dest .whl     # here, where pip reaches PyPI
    # there: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    #        PYTHONPATH=/tmp/site python3 tools/compare_pytorch_gpu.py ...

Walks the Requires-Dist lines of each downloaded wheel (extras and non-Linux markers left
out) and downloads, for CPython 3.12 on manylinux x86-64, every requirement not already in the
image (--have, default: the packages the device image lists, torch, numpy and the like).
"""

import argparse
import pathlib
import re
import subprocess
import sys
import zipfile

try:
    from packaging.markers import Marker
except ImportError:  # pip carries its own copy
    from pip._vendor.packaging.markers import Marker

# What the GPU machines' image holds (the device tool's KINDS.md, 2026-11-17), in part.
IMAGE = {
    "torch", "numpy", "einops", "ninja", "tqdm", "packaging", "typing-extensions", "filelock",
    "sympy", "networkx", "jinja2", "fsspec", "setuptools", "pyyaml", "cloudpickle",
    "importlib-metadata", "zipp", "triton", "pillow", "markupsafe", "mpmath", "psutil",
    "requests", "urllib3", "idna", "certifi", "charset-normalizer", "six", "wrapt",
    "nvidia-cublas", "nvidia-cuda-runtime", "nvidia-cudnn-cu13", "nvidia-nccl-cu13",
}
# The GPU machines' Python: markers are evaluated for it (an extra never matches).
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython",
          "extra": ""}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(wheel):
    """The names a wheel requires (no extras, no markers that exclude Linux)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode("utf-8", "replace").splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        spec, _, marker = line[len("Requires-Dist:"):].partition(";")
        if marker.strip() and not Marker(marker.strip()).evaluate(TARGET):
            continue  # an extra, another platform or an older Python
        out.append(norm(re.split(r"[ <>=!~\[(]", spec.strip(), maxsplit=1)[0]))
    return out


def download(name, dest):
    before = set(dest.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(dest), name]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    new = set(dest.glob("*.whl")) - before
    return sorted(new) or sorted(dest.glob(norm(name).replace("-", "_") + "-*.whl"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("package")
    ap.add_argument("--dest", default=".whl")
    ap.add_argument("--have", default="", help="more packages the image has (comma-separated)")
    args = ap.parse_args()
    dest = pathlib.Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    have = IMAGE | {norm(h) for h in args.have.split(",") if h}
    todo, seen = [norm(args.package)], set()
    while todo:
        name = todo.pop()
        if name in seen or name in have:
            continue
        seen.add(name)
        for wheel in download(name, dest):
            todo.extend(requirements(wheel))
    print(f"{len(seen)} packages into {dest}: {', '.join(sorted(seen))}")


if __name__ == "__main__":
    main()

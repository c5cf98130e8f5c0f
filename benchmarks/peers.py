"""Find or build the peer engines the GGUF benchmarks compare against.

llama.cpp comes from PyPI: the `llama-cpp-python` sdist vendors the whole llama.cpp tree, so
`pip download --no-binary` gives the same sources on any machine that reaches PyPI, and CMake
builds `llama-bench` and `llama-server` natively (GGML_NATIVE: the build machine's ISA). The build
lands in a cache folder and is reused. ik_llama.cpp is not on PyPI: users clone
https://github.com/ikawrakow/ik_llama.cpp, build it (`cmake -B build && cmake --build build
--target llama-bench`) and pass the binary with `--ik-llama-bench`.

    python -m benchmarks.peers            # prints the paths, building once (about 10 min on 2 cores)
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tarfile

LLAMA_CPP_PYTHON = "0.3.36"  # the version issue 59's figures were taken with
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "pagedllm", "peers")
TARGETS = ("llama-bench", "llama-server")


def llama_cpp_binaries(version: str = LLAMA_CPP_PYTHON, cache: str = CACHE, jobs: int | None = None) -> dict[str, str]:
    """Paths of llama.cpp's `llama-bench` and `llama-server`, building them from the sdist once."""
    root = os.path.join(cache, f"llama-cpp-python-{version}")
    build = os.path.join(root, "build")
    found = {t: os.path.join(build, "bin", t) for t in TARGETS}
    if all(os.path.exists(p) for p in found.values()):
        return found
    os.makedirs(root, exist_ok=True)
    tarballs = glob.glob(os.path.join(root, "llama_cpp_python-*.tar.gz"))
    if not tarballs:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", root], check=True)
        tarballs = glob.glob(os.path.join(root, "llama_cpp_python-*.tar.gz"))
    src = os.path.join(root, "src")
    if not os.path.isdir(src):
        with tarfile.open(tarballs[0]) as tar:
            tar.extractall(src, filter="data")
    vendor = glob.glob(os.path.join(src, "*", "vendor", "llama.cpp"))[0]
    return cmake_build(vendor, build, TARGETS, jobs)


def ik_llama_bench(source: str, jobs: int | None = None) -> str:
    """ik_llama.cpp's `llama-bench` built from a source checkout the user brings (not on PyPI)."""
    build = os.path.join(CACHE, "ik_llama.cpp-build")
    binary = os.path.join(build, "bin", "llama-bench")
    if os.path.exists(binary):
        return binary
    return cmake_build(source, build, ("llama-bench",), jobs, examples=True)["llama-bench"]  # its bench is an example


def cmake_build(source: str, build: str, targets: tuple[str, ...], jobs: int | None,
                examples: bool = False) -> dict[str, str]:
    """A native Release build of llama.cpp-style sources (static, no curl, no tests)."""
    shutil.rmtree(build, ignore_errors=True)
    subprocess.run(["cmake", "-S", source, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", f"-DLLAMA_BUILD_EXAMPLES={'ON' if examples else 'OFF'}",
                    "-DBUILD_SHARED_LIBS=OFF"], check=True)
    subprocess.run(["cmake", "--build", build, "--config", "Release", "-j", str(jobs or os.cpu_count() or 2),
                    "--target", *targets], check=True)
    found = {t: os.path.join(build, "bin", t) for t in targets}
    missing = [p for p in found.values() if not os.path.exists(p)]
    if missing:
        raise RuntimeError(f"build of {source} finished without {missing}")
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", default=LLAMA_CPP_PYTHON)
    p.add_argument("--ik-source", default=None, help="an ik_llama.cpp checkout to build llama-bench from")
    args = p.parse_args()
    for name, path in llama_cpp_binaries(args.version).items():
        print(f"{name}: {path}")
    if args.ik_source:
        print(f"ik_llama.cpp llama-bench: {ik_llama_bench(args.ik_source)}")


if __name__ == "__main__":
    main()

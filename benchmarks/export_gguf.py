"""GGUF export time and peak memory: gemmaforge's writer against llama.cpp's convert_hf_to_gguf.py.

    python benchmarks/export_gguf.py [--model runs/quickstart/merged] [--converter DIR] [--quants f16,q8_0]
    python benchmarks/export_gguf.py --model MULTIMODAL_FOLDER --mmproj    (the towers' projector file, f16)

Both convert the same merged Hugging Face folder, each run in its own process (peak RSS is that process's,
from getrusage). --converter is a llama.cpp folder holding convert_hf_to_gguf.py, conversion/ and gguf-py/
(default: taken from the sdist of the installed llama-cpp-python, fetched through pip).
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = "from pathlib import Path; import sys; from gemmaforge.export.gguf import write_gguf; " \
       "write_gguf(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])"
OURS_MMPROJ = "from pathlib import Path; import sys; from gemmaforge.export.gguf_mmproj import write_mmproj; " \
              "write_mmproj(Path(sys.argv[1]), Path(sys.argv[2]))"


def fetch_converter(work: Path) -> Path:
    version = metadata.version("llama-cpp-python")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={version}", "-d", str(work)], check=True)
    root = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tarfile.open(next(work.glob("*.tar.gz"))) as tar:
        tar.extractall(work, members=[m for m in tar.getmembers() if m.name.startswith(
            (root + "convert_hf_to_gguf.py", root + "conversion/", root + "gguf-py/"))], filter="data")
    return work / root


def measured(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[float, int]:
    """Wall seconds and the child's peak RSS in bytes (run alone: getrusage reports the largest child)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    subprocess.run(command, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak <= before:
        raise RuntimeError("a previous child had a larger peak: run each measurement in a fresh parent")
    return seconds, peak * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "runs" / "quickstart" / "merged")
    parser.add_argument("--converter", type=Path)
    parser.add_argument("--quants", default="f16,q8_0")
    parser.add_argument("--mmproj", action="store_true", help="the projector file of a multimodal folder (f16)")
    parser.add_argument("--only", choices=["gemmaforge", "llama.cpp"], help=argparse.SUPPRESS)
    parser.add_argument("--quant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    model = args.model.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        converter = args.converter.resolve() if args.converter else fetch_converter(work / "sdist")
        if args.only:  # one measurement in this (fresh) parent, so getrusage sees only its child
            out = work / f"{args.only}-{args.quant}.gguf"
            if args.only == "gemmaforge":
                seconds, peak = measured([sys.executable, "-c", OURS_MMPROJ if args.mmproj else OURS, str(model),
                                          str(out), args.quant], ROOT)
            else:
                seconds, peak = measured([sys.executable, "convert_hf_to_gguf.py", str(model), "--outtype", args.quant,
                                          "--outfile", str(out), *(["--mmproj"] if args.mmproj else [])], converter,
                                         env={"PYTHONPATH": str(converter / "gguf-py"), "PATH": "/usr/bin:/bin"})
            print(f"| {args.only} | {'mmproj ' if args.mmproj else ''}{args.quant} | {seconds:.1f} | "
                  f"{peak / 2**20:,.0f} | {out.stat().st_size / 2**20:,.0f} |")
            return
        print(f"model: {model}")
        print("| converter | quant | seconds | peak RSS MiB | file MiB |")
        print("|---|---|---|---|---|")
        for quant in ["f16"] if args.mmproj else args.quants.split(","):
            for who in ("gemmaforge", "llama.cpp"):
                result = subprocess.run([sys.executable, __file__, "--model", str(model), "--converter", str(converter),
                                         "--only", who, "--quant", quant, *(["--mmproj"] if args.mmproj else [])],
                                        capture_output=True, text=True, check=True)
                print(result.stdout.strip(), flush=True)


if __name__ == "__main__":
    main()

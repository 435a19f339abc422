"""Throughput and peak memory of `gemmaforge data prepare` on a large synthetic JSONL dataset.

    python benchmarks/data_prepare.py --records 1000000 [--dedup exact|near] [--keep DIR]

Writes N alpaca records (Chinese and English, some HTML, ~3% exact duplicates), runs the real CLI in a
subprocess and reports records/s and the child's peak RSS. Memory should stay flat as N grows: run
it with 100k and 1M records and compare.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOPICS = ["咖啡", "退货", "运费", "发票", "保修", "coffee", "refund", "shipping", "invoice", "warranty"]
ZH = ("的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动"
      "同工也能下过子说产种面而方后多定行学法所")
EN = ["the", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on", "are", "as", "with",
      "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by", "word"]


def sentence(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return "".join(rng.choice(ZH) for _ in range(rng.randint(20, 80))) + "。"
    return " ".join(rng.choice(EN) for _ in range(rng.randint(8, 30))).capitalize() + "."


def write_dataset(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    previous: list[str] = []
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            if previous and rng.random() < 0.03:
                f.write(rng.choice(previous))  # an exact duplicate
                continue
            answer = " ".join(sentence(rng) for _ in range(rng.randint(1, 4)))
            if rng.random() < 0.05:
                answer = f"<p>{answer}</p>&nbsp;<br>"
            record = {"instruction": f"{rng.choice(TOPICS)} #{i}: {sentence(rng)}", "input": "", "output": answer}
            line = json.dumps(record, ensure_ascii=False) + "\n"
            f.write(line)
            if len(previous) < 1000:
                previous.append(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--dedup", choices=["none", "exact", "near"], default="exact")
    parser.add_argument("--keep", type=Path, help="folder for the dataset and outputs (default: a temp dir)")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="gf-data-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    source = work / f"synthetic-{args.records}.jsonl"
    if not source.exists():
        start = time.perf_counter()
        write_dataset(source, args.records)
        print(f"wrote {source} ({source.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - start:.0f} s")
    out = work / f"prepared-{args.records}-{args.dedup}"
    command = [sys.executable, "-m", "gemmaforge", "data", "prepare", str(source), "-o", str(out),
               f"clean.dedup={args.dedup}"]
    start = time.perf_counter()
    subprocess.run(command, check=True)
    seconds = time.perf_counter() - start
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    stats = json.loads((out / "stats.json").read_text())
    print(json.dumps({
        "records": stats["records"], "kept": stats["kept"], "dropped": stats["dropped"], "changed": stats["changed"],
        "dedup": args.dedup, "wall_s": round(seconds, 1), "records_per_s": round(stats["records"] / seconds),
        "stage_s": stats["seconds"], "peak_rss_mib": round(peak_mib), "tokens": stats["tokens"],
    }, indent=2))


if __name__ == "__main__":
    main()

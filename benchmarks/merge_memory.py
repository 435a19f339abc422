"""Peak memory of the merge (base + adapter -> merged/) and of the GGUF export, against the model's size.

    python benchmarks/merge_memory.py [--size 1b|4b] [--no-fp32] [--work DIR]

Builds a checkpoint with the real text sizes of Gemma 3 1B (hidden 1152, intermediate 6912, 26 layers, 4 heads /
1 KV head of 256, vocab 262144: 1.0 B parameters) or 4B's text model (2560, 10240, 34 layers, 8 / 4 heads of
256: 3.9 B), random weights stored in bf16 as the Hub checkpoints are, and a random LoRA r 16 adapter on the
default targets with the chat-marker rows. Each step runs in its own process (and so does the build); its peak
resident memory is getrusage's ru_maxrss (mapped checkpoint pages included) and its peak anonymous memory is
RssAnon sampled every 20 ms (what it allocated):
  * whole fp32: the merge as gemmaforge did it before (the base loaded in fp32, merged, cast back);
  * merge in place: gemmaforge's merge (the base's files copied, each adapted module's weights read, merged in
    fp32 and written back in place, one module at a time);
  * gguf f16: gemmaforge's streaming GGUF writer on the merged folder;
  * then both merges again in a memory cgroup holding RAM (anonymous memory and page cache) to half the model's
    bf16 size: a model larger than the machine's RAM (needs root; skipped otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {
    "1b": dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
               num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256),
    "4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
               num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256),
}
# RssAnon sampled every 20 ms: the memory the process allocated, without the checkpoint pages it maps (which
# ru_maxrss counts, and which the kernel can drop and read again)
SAMPLER = """
import threading, time
peak_anon = [0]
def _sample():
    while True:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                peak_anon[0] = max(peak_anon[0], int(line.split()[1]) * 1024)
        time.sleep(0.02)
threading.Thread(target=_sample, daemon=True).start()
"""
REPORT = ("import resource, json; print(json.dumps({'peak_rss': "
          "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 'peak_anon': peak_anon[0]}))")
WHOLE_FP32 = """
import sys, torch
from pathlib import Path
from peft import PeftModel
from transformers import AutoModelForCausalLM
base, adapter, out = map(Path, sys.argv[1:4])
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
model.merge_and_unload().to(torch.bfloat16).save_pretrained(out, max_shard_size="5GB")
"""
MERGE = """
import shutil, sys, torch
from pathlib import Path
from transformers import Gemma3ForCausalLM
from gemmaforge.export.merge_in_place import merge_into_copy
base, adapter, out = map(Path, sys.argv[1:4])
out.mkdir()
merge_into_copy(base, adapter, Gemma3ForCausalLM, torch.bfloat16, out)
shutil.copyfile(base / "config.json", out / "config.json")
"""
GGUF = """
import sys
from pathlib import Path
from gemmaforge.export.gguf import write_gguf
write_gguf(Path(sys.argv[1]), Path(sys.argv[2]), "f16")
"""


def build(size: str, work: Path) -> int:
    """Base and adapter into work/base and work/adapter; the parameter count. Run in a child process: Linux keeps
    a process's peak RSS across fork and exec, so the measuring parent must never hold the model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from gemmaforge.models import EMBEDDED_NAME, default_home, resolve_model

    config = Gemma3TextConfig(vocab_size=262144, sliding_window=512, max_position_embeddings=32768,
                              rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, **SIZES[size])
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).to(torch.bfloat16)
    parameters = sum(p.numel() for p in model.parameters())
    model.save_pretrained(work / "base", max_shard_size="5GB")
    tokenizer = resolve_model(EMBEDDED_NAME, default_home()).path
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / file, work / "base" / file)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets, init_lora_weights=False,
                                            trainable_token_indices=[105, 106]))
    peft.save_pretrained(work / "adapter")
    return parameters


def measure(script: str, *args: Path, cgroup: Path | None = None) -> tuple[float, int, int]:
    """Seconds, peak RSS and peak anonymous memory of `script` in a child process, inside the memory `cgroup` when
    one is given."""
    def enter() -> None:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", SAMPLER + script + "\n" + REPORT, *map(str, args)], cwd=ROOT,
                         check=True, capture_output=True, text=True, preexec_fn=enter if cgroup else None).stdout
    peaks = json.loads(out.strip().splitlines()[-1])
    return time.perf_counter() - start, peaks["peak_rss"], peaks["peak_anon"]


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path | None]:
    """A memory cgroup holding its processes' RAM (anonymous memory and page cache together) to `limit` bytes, as a
    machine with that much RAM would; None where none can be made (cgroup v1 or v2, as root)."""
    for root, limit_file in ((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
                             (Path("/sys/fs/cgroup"), "memory.max")):
        group = root / f"gemmaforge-merge-memory-{os.getpid()}"
        try:
            group.mkdir()
        except OSError:
            continue
        try:
            if (group / limit_file).exists():
                (group / limit_file).write_text(str(limit))
                yield group
                return
        finally:
            group.rmdir()
    yield None


def merges_within_half_the_model(base: Path, adapter: Path, work: Path, parameters: int) -> str:
    """Both merges again on a machine with half the model's bf16 size in RAM (a memory cgroup, no swap), and
    whether the merge in place writes the very files it wrote with all the RAM."""
    cap = parameters  # bytes: half of 2 bytes per parameter
    with memory_cgroup(cap) as cgroup:
        if cgroup is None:
            return "RAM capped at half the model: skipped (no memory cgroup can be made here; needs root)"
        outcomes, done = [], False
        for name, script, out in (("whole fp32 merge", WHOLE_FP32, "fp32-capped"), ("merge in place", MERGE, "capped")):
            try:
                seconds, _, anon = measure(script, base, adapter, work / out, cgroup=cgroup)
                outcomes.append(f"{name} done in {seconds:.1f} s, peak anonymous {anon / 2**30:.2f} GiB")
                done = out == "capped"
            except subprocess.CalledProcessError as error:
                reason = f"exit {error.returncode}" + (" (killed: out of memory)" if error.returncode < 0 else "")
                outcomes.append(f"{name} fails, {reason}")
    if done:
        same = all(filecmp.cmp(f, work / "capped" / f.name, shallow=False)
                   for f in (work / "merged").glob("*.safetensors"))
        outcomes.append(f"files identical to the merge with all the RAM: {same}")
    return f"RAM capped at {cap / 2**30:.2f} GiB (a memory cgroup, half the bf16 model): " + "; ".join(outcomes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="1b")
    parser.add_argument("--work", type=Path)
    parser.add_argument("--no-fp32", action="store_true", help="skip the whole-fp32 merge (4b needs ~22 GB for it)")
    parser.add_argument("--build", type=Path, help=argparse.SUPPRESS)  # the child process that builds
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.build:
        print(build(args.size, args.build))
        return
    with tempfile.TemporaryDirectory(dir=args.work) as folder:
        work = Path(folder)
        parameters = int(subprocess.run([sys.executable, __file__, "--size", args.size, "--build", str(work)],
                                        check=True, capture_output=True, text=True).stdout.split()[-1])
        base, adapter = work / "base", work / "adapter"
        rows = [] if args.no_fp32 else [("whole fp32 (before)", *measure(WHOLE_FP32, base, adapter, work / "fp32"))]
        rows.append(("merge in place", *measure(MERGE, base, adapter, work / "merged")))
        for file in ("tokenizer.json", "tokenizer_config.json"):  # as the merge stage saves them
            shutil.copy(base / file, work / "merged" / file)
        rows.append(("gguf f16 (streaming)", *measure(GGUF, work / "merged", work / "model-f16.gguf")))
        capped = merges_within_half_the_model(base, adapter, work, parameters)
        print(f"{parameters / 1e9:.2f} B parameters, {2 * parameters / 2**30:.2f} GiB in bf16\n")
        print("| step | seconds | peak RSS | peak anonymous (RssAnon) | anonymous bytes per parameter |")
        print("|---|---|---|---|---|")
        for name, seconds, peak, anon in rows:
            print(f"| {name} | {seconds:.1f} | {peak / 2**30:.2f} GiB | {anon / 2**30:.2f} GiB | "
                  f"{anon / parameters:.2f} |")
        print(f"\n{capped}")


if __name__ == "__main__":
    main()

"""Every GPU path of gemmaforge in one short run, for the moment a GPU is at hand.

    python benchmarks/gpu_check.py --out DIR [--model gemma3-270m | --random-weights FOLDER] [--budget-s 470]
    python benchmarks/gpu_check.py --out DIR --dry-run      # the plumbing, on any machine (tested in the suite)
    python benchmarks/gpu_check.py --out DIR --cpu --random-weights FOLDER   # every step's body on the CPU

It installs nothing. What it needs: torch with a GPU and gemmaforge's own dependencies (`pip install -e .`);
bitsandbytes for QLoRA, llama-cpp-python for `export verify`, fastapi + uvicorn + httpx for serving, vLLM for
the vLLM step: a step whose package is missing is reported as skipped, with the package named. Each step runs in
its own process under its own time limit, within --budget-s for the whole check, and a step that fails or runs
out of time does not stop the next. Steps:

- environment: versions, the GPU, which optional packages are there;
- doctor: `gemmaforge doctor --json`, saved as doctor.json;
- matmul: the bf16 matrix-product rate this GPU reaches (8192^3, mean of 10 after 3 warm-ups): MFU's denominator;
- train_bf16: a short bf16 LoRA run (the quickstart's data and LoRA, packed rows of 512 tokens, batch 8) with the
  monitor on: samples/s, tokens/s, MFU, peak memory against the memory plan the training made for itself (as
  `gemmaforge plan` prints it; the +-20% rule), and whether every monitor field was read;
- qlora: the same run on 4-bit weights (bitsandbytes);
- merge_export_verify: merge the bf16 run (in place, from the full-precision base), write its f16 GGUF, and
  `export verify` it in llama.cpp (top-1 agreement with the merged model);
- serve: `gemmaforge serve` with the transformers engine on the GPU: 1 client (streamed) and 8 clients at once;
- generate_static: transformers' own `generate` with a static cache on the merged model, the same questions and
  answer length, one at a time: the single-client speed the serve step is held against (issue: >= 0.8x);
- serve_profile: where the transformers engine's time goes with 1 and 8 requests at once, in ms per generated token:
  the forwards (prefill and decode, the GPU synchronised), choosing each row's token, handing it to its answer
  (text, stop checks, the event), and the rest (scheduling, the waiting client): what to make faster, measured
  where it runs;
- serve_fleet: 8 requests on 8 adapters of the model at once, decoded in shared steps and taking turns, against 8
  on one adapter and on the base model (benchmarks/serve_fleet.py);
- vllm: `export vllm` and vLLM on the merged folder and with the adapter, when vLLM is installed.

Results: DIR/gpu_check.json (every step's figures and status) and DIR/summary.md; DIR/doctor.json; DIR/log.txt
(every step's output). --random-weights FOLDER takes a checkpoint's config and tokenizer files without its
weights (where the real weights cannot travel) and draws random weights of that exact architecture: speed and
memory are those of the real model, losses and answers are not.

--cpu runs every step's body on the CPU, on a short run (4 steps of batch 2, rows of 128 tokens, fp32): the check's
own test (tests/unit/test_gpu_check.py, on a tiny model), so that a GPU session's few minutes are not spent finding
a broken step. Its figures say nothing about any GPU; QLoRA is reported skipped there (bitsandbytes' 4-bit
weights need a GPU, and `train` refuses them on a CPU).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STEPS = {  # name -> time limit (s); the whole check is also held to --budget-s
    "environment": 60, "doctor": 90, "matmul": 60, "model": 120, "train_bf16": 180, "qlora": 150,
    "merge_export_verify": 150, "serve": 150, "generate_static": 150, "serve_profile": 120,
    "serve_fleet": 120, "vllm": 240,
}
GPU_STEPS = {"matmul", "train_bf16", "qlora", "merge_export_verify", "serve", "generate_static", "serve_profile",
             "serve_fleet", "vllm"}
OPTIONAL = {"bitsandbytes": "qlora", "llama_cpp": "merge_export_verify (verify)", "vllm": "vllm",
            "fastapi": "serve", "uvicorn": "serve", "httpx": "serve"}
TRAIN = {"max_steps": 40, "per_device_train_batch_size": 8, "cutoff_len": 512, "packing": True,
         "learning_rate": 1e-3, "logging_steps": 5, "save_steps": 1000, "precision": "bf16", "seed": 42}
CPU_TRAIN = {**TRAIN, "max_steps": 4, "per_device_train_batch_size": 2, "cutoff_len": 128, "logging_steps": 2,
             "precision": "fp32"}
LORA = {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"]}


class Skipped(Exception):
    """The step cannot run here; the message says why."""


def gemmaforge(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """`python -m gemmaforge ARGS` from this checkout, its output echoed into the log."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "gemmaforge", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    print(f"$ gemmaforge {' '.join(args)}  (exit {proc.returncode})\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    if proc.returncode != 0:
        raise RuntimeError(f"gemmaforge {args[0]} exited {proc.returncode}: {proc.stderr.strip()[-600:]}")
    return proc


def need_gpu(args: argparse.Namespace) -> None:
    import torch

    if not args.cpu and not torch.cuda.is_available():
        raise Skipped("no GPU: torch.cuda.is_available() is false")


def need(module: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise Skipped(f"{module} is not installed")


def earlier(work: Path, step: str) -> dict[str, Any]:
    path = work / "steps" / f"{step}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


# ---------------------------------------------------------------------------- steps (each in its own process)


def step_environment(args: argparse.Namespace) -> dict[str, Any]:
    import importlib.metadata
    import importlib.util

    import torch

    versions = {}
    for name in ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "llama_cpp_python", "vllm",
                 "fastapi", "uvicorn", "gguf"):
        try:
            versions[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    gpu = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {"name": props.name, "memory_bytes": props.total_memory, "count": torch.cuda.device_count(),
               "cuda": torch.version.cuda, "hip": torch.version.hip}
    missing = {m: use for m, use in OPTIONAL.items() if importlib.util.find_spec(m) is None}
    return {"python": sys.version.split()[0], "gpu": gpu, "versions": versions, "missing_for": missing}


def step_doctor(args: argparse.Namespace) -> dict[str, Any]:
    report = json.loads(gemmaforge("doctor", "--json", timeout=STEPS["doctor"]).stdout)
    (args.out / "doctor.json").write_text(json.dumps(report, indent=2) + "\n")
    return {"status_of_doctor": report.get("status"), "summary": report.get("summary")}


def bf16_matmul_tflops(n: int = 8192, device: str = "cuda") -> float:
    """The bf16 matrix-product rate of this GPU: n^3 products, the mean of 10 after 3 warm-ups (MFU's denominator)."""
    import torch

    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    synchronize()
    begin = time.perf_counter()
    for _ in range(10):
        a @ b
    synchronize()
    seconds = (time.perf_counter() - begin) / 10
    return float(f"{2 * n**3 / seconds / 1e12:.3g}")  # three figures: a CPU rate is a fraction of one


def step_matmul(args: argparse.Namespace) -> dict[str, Any]:
    need_gpu(args)
    n, device = (512, "cpu") if args.cpu else (8192, "cuda")
    return {"bf16_tflops": bf16_matmul_tflops(n, device), "shape": [n, n, n], "device": device}


def step_model(args: argparse.Namespace) -> dict[str, Any]:
    """The checkpoint the runs train: --model as given, or random weights of --random-weights' architecture."""
    if args.random_weights is None:
        return {"model": args.model, "random_weights": False}
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    target = args.work / "model"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for file in args.random_weights.iterdir():
        if file.name.endswith(".gz"):  # a tokenizer.json compressed to travel
            (target / file.name.removesuffix(".gz")).write_bytes(gzip.decompress(file.read_bytes()))
        elif file.is_file():
            shutil.copyfile(file, target / file.name)
    config = AutoConfig.from_pretrained(target)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # a trained model's final-norm scale: random logits are otherwise near-uniform, and
        model.get_decoder().norm.weight.fill_(30.0)  # top-1 agreement between two exports would mean nothing
    model.save_pretrained(target)
    params = sum(p.numel() for p in model.parameters())
    return {"model": str(target), "random_weights": True, "architecture": type(model).__name__, "parameters": params}


def train_run(args: argparse.Namespace, name: str, **model: Any) -> dict[str, Any]:
    """A short LoRA run with the monitor on, and the plan's prediction for it."""
    need_gpu(args)
    run = args.work / name
    shutil.rmtree(run, ignore_errors=True)
    config = args.work / f"{name}.yaml"
    config.write_text(json.dumps({
        "output_dir": str(run), "model": {"name_or_path": earlier(args.work, "model")["model"], **model},
        "data": {"path": str(ROOT / "examples" / "data" / "coffee_qa.json"), "val_size": 0.1},
        # check_memory off: measured even where the plan says it does not fit
        "lora": LORA, "train": {**(CPU_TRAIN if args.cpu else TRAIN), "check_memory": False}}))
    gemmaforge("train", str(config), timeout=STEPS[name])  # its record holds the plan it made for itself
    train = json.loads((run / "manifest.json").read_text())["stages"]["train"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r]
    monitor_keys = ("gpu_utilization_pct", "gpu_memory_used_bytes", "gpu_temperature_c", "gpu_power_w")
    unread = sorted({k for r in logged for k in monitor_keys if r.get(k) is None})
    stats = json.loads((run / "data" / "stats.json").read_text())
    tokens_per_sample = stats["tokens"]["mean"]
    flops = training_flops(earlier(args.work, "model"), tokens_per_sample, train["samples_per_second"],
                           train["supervised_tokens_per_second"])
    rate = earlier(args.work, "matmul").get("bf16_tflops")
    peak, planned = train["peak_memory_bytes"], train["planned_peak_bytes"]
    used = max((r.get("gpu_memory_used_bytes") or 0) for r in logged) if logged else 0
    return {
        "steps": train["steps"], "samples_per_second": train["samples_per_second"],
        "tokens_per_second": round(tokens_per_sample * train["samples_per_second"]),
        "supervised_tokens_per_second": train["supervised_tokens_per_second"],
        "model_tflops": round(flops / 1e12, 2), "mfu": round(flops / (rate * 1e12), 4) if rate else None,
        "peak_allocated_bytes": peak, "gpu_memory_used_max_bytes": used, "planned_peak_bytes": planned,
        "plan_error": round(peak / planned - 1, 3) if planned else None,
        "plan_within_20pct": bool(planned and abs(peak / planned - 1) <= 0.2),
        "train_loss": train["train_loss"], "monitor_fields_unread": unread, "plan_parts": train["planned_parts"],
    }


def training_flops(model: dict[str, Any], tokens_per_sample: float, samples_per_s: float,
                   supervised_per_s: float) -> float:
    """Model FLOP/s of LoRA training on frozen weights: the forward (2 per weight and token) and the backward
    through the frozen weights to the inputs (2 more; their own gradients are never formed), over the decoder's
    weights for every token and the output layer for the supervised tokens only (the loss skips the rest)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model["model"]).get_text_config()
    embedding = config.vocab_size * config.hidden_size
    decoder = (model.get("parameters") or 0) - embedding
    return 4 * decoder * tokens_per_sample * samples_per_s + 4 * embedding * supervised_per_s


def step_train_bf16(args: argparse.Namespace) -> dict[str, Any]:
    return train_run(args, "train_bf16")


def step_qlora(args: argparse.Namespace) -> dict[str, Any]:
    if args.cpu:
        raise Skipped("--cpu: bitsandbytes' 4-bit weights need a GPU (train refuses model.load_in_4bit on a CPU)")
    need_gpu(args)
    need("bitsandbytes")
    return train_run(args, "qlora", load_in_4bit=True)


def step_merge_export_verify(args: argparse.Namespace) -> dict[str, Any]:
    need_gpu(args)
    run = args.work / "train_bf16"
    if not (run / "adapter" / "adapter_config.json").is_file():
        raise Skipped("train_bf16 left no adapter")
    out: dict[str, Any] = {}
    for label, command in (("merge", ("merge", str(run))),
                           ("export_gguf", ("export", "gguf", str(run), "--quant", "f16"))):
        begin = time.perf_counter()
        gemmaforge(*command, timeout=STEPS["merge_export_verify"])
        out[f"{label}_s"] = round(time.perf_counter() - begin, 1)
    try:
        need("llama_cpp")
    except Skipped as e:  # merge and export still measured
        return {**out, "verify": f"skipped: {e}"}
    try:
        gemmaforge("export", "verify", str(run), timeout=STEPS["merge_export_verify"])
    except RuntimeError as e:  # below the f16 threshold: the figures still tell how far
        out["verify_failed"] = str(e)[-300:]
    report = json.loads((run / "gguf" / "verify.json").read_text())
    f16 = report["files"]["f16"]
    return {**out, "top1_agreement": f16["top1_agreement"], "mean_kl": f16["mean_kl"],
            "positions": report["positions"]}


def coffee_questions() -> list[str]:
    import yaml

    suite = yaml.safe_load((ROOT / "examples" / "suites" / "coffee.yaml").read_text(encoding="utf-8"))
    return [c["prompt"] for c in suite["cases"]]


def answer_lengths(args: argparse.Namespace) -> tuple[int, int]:
    """(max_tokens, requests per client): --cpu proves the plumbing, not the speed: fewer and shorter answers."""
    return (16, 1) if args.cpu else (64, 4)


def step_serve(args: argparse.Namespace) -> dict[str, Any]:
    need_gpu(args)
    for module in ("fastapi", "uvicorn", "httpx"):
        need(module)
    sys.path.insert(0, str(Path(__file__).parent))
    from serve_throughput import free_port, measure, start

    run = args.work / "train_bf16"
    if not (run / "adapter" / "adapter_config.json").is_file():
        raise Skipped("train_bf16 left no adapter")
    questions = coffee_questions()
    port = free_port()
    env_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    os.environ["PYTHONPATH"] = env_path
    command = [sys.executable, "-m", "gemmaforge", "serve", str(run), "--max-batch", "8", "--port", str(port)]
    process = start(command + (["--dtype", "fp32"] if args.cpu else []), port)
    try:
        from gemmaforge.runs import RunDir

        name = RunDir.open(run).config().export.ollama.name or run.name  # the name serve gives the run
        max_tokens, requests = answer_lengths(args)
        figures = measure("transformers", f"http://127.0.0.1:{port}", name, questions,
                          argparse.Namespace(max_tokens=max_tokens, requests=requests, clients=8))
    finally:
        process.terminate()
        process.wait(timeout=30)
    return {"max_tokens": max_tokens, "clients": 8,
            **{k: round(v, 1) for k, v in figures.items() if k != "engine"}}


def step_generate_static(args: argparse.Namespace) -> dict[str, Any]:
    need_gpu(args)
    sys.path.insert(0, str(Path(__file__).parent))
    from serve_throughput import generate_static

    merged = args.work / "train_bf16" / "merged"
    if not (merged / "config.json").is_file():
        raise Skipped("merge_export_verify left no merged folder")
    max_tokens, requests = answer_lengths(args)
    figures = generate_static(merged, coffee_questions(), argparse.Namespace(max_tokens=max_tokens,
                                                                              requests=requests))
    return {"max_tokens": max_tokens, **{k: v if k == "engine" else round(v, 1) for k, v in figures.items()
                                          if k != "aggregate_tok_s"}}


def step_serve_profile(args: argparse.Namespace) -> dict[str, Any]:
    need_gpu(args)
    import asyncio

    import torch

    from gemmaforge.inference.jobs import Delta, Job, Params
    from gemmaforge.models import default_home
    from gemmaforge.serve.server import ServeOptions, load_registry

    run = args.work / "train_bf16"
    if not (run / "adapter" / "adapter_config.json").is_file():
        raise Skipped("train_bf16 left no adapter")
    registry = load_registry([str(run)], ServeOptions(max_batch=8, dtype="fp32" if args.cpu else "auto"),
                             default_home())
    served = next(iter(registry.models.values()))
    engine = served.engine
    spent: dict[str, float] = {}

    def timed(name: str, method: Any, sync: bool = False) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            begin = time.perf_counter()
            out = method(*a, **k)
            if sync and torch.cuda.is_available():
                torch.cuda.synchronize()
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - begin
            return out
        return wrapper

    sections = ("_forward", "_choose", "_accept")
    for name in sections:  # the instance's own attribute, over the class's method
        setattr(engine, name, timed(name, getattr(engine, name), sync=name == "_forward"))
    max_tokens, _ = answer_lengths(args)
    prompts = [engine.encode(served.family.chat.render([{"role": "user", "content": q}],
                                                       add_generation_prompt=True).text) for q in coffee_questions()]

    async def answer(prompt: list[int]) -> int:
        job = Job(prompt, Params(max_tokens=max_tokens, temperature=0), served.adapter, asyncio.get_running_loop())
        engine.submit(job)
        while isinstance(event := await job.events.get(), Delta):
            pass
        return event.completion_tokens  # type: ignore[union-attr]  # the Finished that ended the loop

    async def together(n: int) -> int:
        return sum(await asyncio.gather(*(answer(prompts[i % len(prompts)]) for i in range(n))))

    asyncio.run(together(1))  # warm-up
    out: dict[str, Any] = {"max_tokens": max_tokens}
    try:
        for clients in (1, 8):
            spent.clear()
            begin = time.perf_counter()
            tokens = asyncio.run(together(clients))
            wall = time.perf_counter() - begin
            per_token = {f"{name.strip('_')}_ms": round(1000 * spent.get(name, 0.0) / tokens, 3) for name in sections}
            out[f"clients_{clients}"] = {"tokens": tokens, "tok_s": round(tokens / wall, 1), **per_token,
                                         "rest_ms": round(1000 * wall / tokens - sum(per_token.values()), 3)}
    finally:
        registry.close()
    return out


def step_serve_fleet(args: argparse.Namespace) -> dict[str, Any]:
    need_gpu(args)
    sys.path.insert(0, str(Path(__file__).parent))
    from serve_fleet import fleet

    max_tokens, _ = answer_lengths(args)
    figures = fleet(earlier(args.work, "model")["model"], 2 if args.cpu else 8, max_tokens, 1 if args.cpu else 2)
    return {"max_tokens": max_tokens, "most_adapters_in_a_forward": figures["most_adapters_in_a_forward"],
            **{f"{case} tok_s": rate for case, rate in figures["tok_s"].items()}}


def step_vllm(args: argparse.Namespace) -> dict[str, Any]:
    need_gpu(args)
    need("vllm")
    run = args.work / "train_bf16"
    if not (run / "merged" / "config.json").is_file():
        raise Skipped("merge_export_verify left no merged folder")
    gemmaforge("export", "vllm", str(run), timeout=STEPS["vllm"])
    from vllm import LLM, SamplingParams

    begin = time.perf_counter()
    llm = LLM(model=str(run / "merged"), dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=1024)
    outputs = llm.generate(["Hello"] * 32, SamplingParams(max_tokens=64, temperature=0))
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"load_and_generate_s": round(time.perf_counter() - begin, 1), "generated_tokens": tokens}


# ---------------------------------------------------------------------------- the check


def run_step(name: str, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """The step in its own process, under the smaller of its limit and what is left of the budget."""
    if args.dry_run and name in GPU_STEPS:
        return {"status": "skipped", "reason": "no GPU: --dry-run"}
    limit = min(STEPS[name], deadline - time.monotonic())
    if limit < 5:
        return {"status": "skipped", "reason": f"no time left in the {args.budget_s} s budget"}
    result_path = args.work / "steps" / f"{name}.json"
    result_path.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--step", name, "--out", str(args.out), "--work", str(args.work),
               "--model", args.model, *(["--random-weights", str(args.random_weights)] if args.random_weights else []),
               *(["--cpu"] if args.cpu else [])]
    begin = time.perf_counter()
    with (args.out / "log.txt").open("a") as log:
        log.write(f"\n===== {name} (limit {limit:.0f} s)\n")
        log.flush()
        try:
            proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=limit, cwd=ROOT)
            status = json.loads(result_path.read_text()) if result_path.is_file() else \
                {"status": "failed", "reason": f"exit {proc.returncode} with no result (see log.txt)"}
        except subprocess.TimeoutExpired:
            status = {"status": "failed", "reason": f"ran past its {limit:.0f} s limit"}
    return {**status, "seconds": round(time.perf_counter() - begin, 1)}


def one_step(args: argparse.Namespace) -> None:
    """Inside a step's process: its figures, or why not, as JSON in the work folder."""
    try:
        result = {"status": "ok", **globals()[f"step_{args.step}"](args)}
    except Skipped as e:
        result = {"status": "skipped", "reason": str(e)}
    except Exception as e:  # noqa: BLE001  (a step's failure is a finding; the next step still runs)
        result = {"status": "failed", "reason": f"{type(e).__name__}: {e}"[-1500:]}
    path = args.work / "steps" / f"{args.step}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))


def summary(results: dict[str, Any]) -> str:
    lines = ["# gemmaforge GPU check", "", f"{results['started']}, {results['seconds']} s in all", "",
             "| step | status | seconds | figures or reason |", "|---|---|---|---|"]
    for name, r in results["steps"].items():
        figures = r.get("reason") or ", ".join(f"{k} {v}" for k, v in r.items()
                                               if k not in ("status", "seconds") and not isinstance(v, dict | list))
        lines.append(f"| {name} | {r['status']} | {r.get('seconds', '')} | {figures} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where gpu_check.json, summary.md and log.txt go")
    parser.add_argument("--work", type=Path, help="runs and models (default: a folder beside --out)")
    parser.add_argument("--model", default="gemma3-270m", help="the model the runs train (default: the embedded)")
    parser.add_argument("--random-weights", type=Path, metavar="FOLDER",
                        help="config and tokenizer files: random weights of that architecture (see above)")
    parser.add_argument("--budget-s", type=float, default=470, help="the whole check's time limit (s)")
    parser.add_argument("--dry-run", action="store_true", help="skip the GPU steps: the plumbing alone")
    parser.add_argument("--cpu", action="store_true",
                        help="run every step's body on the CPU, on a short run: the check's own test (see above)")
    parser.add_argument("--step", choices=list(STEPS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.work = args.work or args.out.parent / f"{args.out.name}-work"
    if args.step:
        one_step(args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "log.txt").write_text("")
    begin, deadline = time.perf_counter(), time.monotonic() + args.budget_s
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "dry_run": args.dry_run,
                               "cpu": args.cpu,
                               "budget_s": args.budget_s, "steps": {}}
    for name in STEPS:
        results["steps"][name] = run_step(name, args, deadline)
        print(f"{name}: {results['steps'][name]['status']} ({results['steps'][name].get('seconds')} s)", flush=True)
    results["seconds"] = round(time.perf_counter() - begin, 1)
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "summary.md").write_text(summary(results))
    print(summary(results))


if __name__ == "__main__":
    main()

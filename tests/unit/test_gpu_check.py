"""benchmarks/gpu_check.py's plumbing on a machine without a GPU: every step reported, the GPU steps skipped with
the reason, the CPU ones run; a step's failure or time limit never stops the check."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_reports_every_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--dry-run"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((out / "gpu_check.json").read_text())
    steps = results["steps"]
    assert list(steps) == list(load_script().STEPS)
    for name in ("matmul", "train_bf16", "qlora", "merge_export_verify", "serve", "generate_static", "serve_profile",
                 "serve_fleet", "vllm"):
        assert steps[name] == {"status": "skipped", "reason": "no GPU: --dry-run"}
    assert steps["environment"]["status"] == "ok" and steps["environment"]["versions"]["torch"]
    assert steps["doctor"]["status"] == "ok" and json.loads((out / "doctor.json").read_text())["schema"]
    summary = (out / "summary.md").read_text()
    assert all(f"| {name} | {step['status']} |" in summary for name, step in steps.items())
    assert "===== doctor" in (out / "log.txt").read_text()


def test_a_failing_step_is_a_finding_and_the_budget_is_kept(tmp_path: Path, monkeypatch) -> None:
    check = load_script()
    args = argparse.Namespace(out=tmp_path, work=tmp_path / "work", model="m", random_weights=None, dry_run=False,
                              budget_s=10, step="matmul", cpu=False)

    def broken(_args):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(check, "step_matmul", broken)
    check.one_step(args)
    assert json.loads((tmp_path / "work" / "steps" / "matmul.json").read_text()) == {
        "status": "failed", "reason": "RuntimeError: out of memory"}
    late = check.run_step("environment", args, deadline=time.monotonic() + 1)
    assert late == {"status": "skipped", "reason": "no time left in the 10 s budget"}


@pytest.mark.slow
def test_cpu_mode_runs_every_step_body_on_a_tiny_model(tmp_path: Path, tiny_gemma3_dir: Path) -> None:
    """--cpu: the step bodies a GPU session relies on (random weights of a given architecture, plan and train with
    the monitor, merge, GGUF export and llama.cpp verification, serve with 8 clients) run end to end and report
    their figures; QLoRA says why it cannot run there."""
    architecture = tmp_path / "architecture"
    architecture.mkdir()
    for file in tiny_gemma3_dir.iterdir():
        if file.suffix != ".safetensors":
            shutil.copyfile(file, architecture / file.name)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--cpu", "--random-weights",
                           str(architecture), "--budget-s", "900"], capture_output=True, text=True, timeout=1000)
    assert proc.returncode == 0, proc.stderr
    steps = json.loads((out / "gpu_check.json").read_text())["steps"]
    log = (out / "log.txt").read_text()
    assert steps["qlora"]["status"] == "skipped" and "need a GPU" in steps["qlora"]["reason"]
    assert steps["vllm"]["status"] == "skipped"
    for name in ("environment", "doctor", "matmul", "model", "train_bf16", "merge_export_verify", "serve",
                 "generate_static", "serve_profile", "serve_fleet"):
        assert steps[name]["status"] == "ok", (name, steps[name], log[-3000:])
    assert steps["matmul"]["device"] == "cpu" and steps["matmul"]["bf16_tflops"] > 0
    assert steps["model"]["architecture"] == "Gemma3ForCausalLM" and steps["model"]["random_weights"]
    train = steps["train_bf16"]
    assert train["steps"] == 4 and train["samples_per_second"] > 0 and train["mfu"] > 0
    assert train["planned_peak_bytes"] > 0 and set(train["plan_parts"]) >= {"weights", "activations", "logits"}
    verify = steps["merge_export_verify"]
    assert verify["merge_s"] > 0 and verify["export_gguf_s"] > 0 and verify["top1_agreement"] >= 0.9
    assert steps["serve"]["clients"] == 8
    assert steps["generate_static"]["decode_tok_s"] > 0 and "static cache (cpu" in steps["generate_static"]["engine"]
    for clients in ("clients_1", "clients_8"):  # each section's time per token, and all of it accounted for
        profile = steps["serve_profile"][clients]
        assert profile["tokens"] > 0 and profile["forward_ms"] > 0 and profile["choose_ms"] > 0
        assert profile["accept_ms"] > 0 and profile["rest_ms"] >= 0
    fleet = steps["serve_fleet"]  # two adapters' requests shared the steps, and every case answered
    assert fleet["most_adapters_in_a_forward"] == 2
    assert all(fleet[f"{case} tok_s"] > 0 for case in ("base model", "one adapter", "2 adapters, shared steps",
                                                       "2 adapters, turns"))

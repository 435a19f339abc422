"""The device monitor (recorded GPU tool outputs as fake executables on PATH) and the training stage's
troubleshooting: out of memory, NaN advice by arch, slow-step findings."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from gemmaforge.cli import main
from gemmaforge.recipe import troubleshoot
from gemmaforge.system.gpu_tools import GpuQuery
from gemmaforge.system.monitor import MONITOR_KEYS, DeviceMonitor, status_line, visible_index
from gemmaforge.train.loss import NonFiniteLoss
from gemmaforge.train.memory_plan import Device, Plan
from tests.fake_gpu_tools import failing, install_fake_tools, read_calls
from tests.helpers import run_config, write_config

TOOLS = Path(__file__).parents[1] / "fixtures" / "gpu_tools"
XTX_BYTES = 25753026560


def tools_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **tools: object) -> Path:
    bin_dir = tmp_path / "bin"
    install_fake_tools(bin_dir, **tools)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return bin_dir


def test_the_monitor_reports_the_rx_7900_xtx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tools_on_path(tmp_path, monkeypatch, rocm_smi=TOOLS / "rocm_smi_rx7900xtx.json")
    monitor = DeviceMonitor(index=0).start()
    monitor.stop()
    row = monitor.fields()
    assert set(row) <= set(MONITOR_KEYS) and row["rss_bytes"] > 0  # a CPU torch: its counters are the RSS
    assert "7900 XTX" in row["gpu_name"] and row["gpu_memory_total_bytes"] == XTX_BYTES
    assert (row["gpu_utilization_pct"], row["gpu_power_w"], row["gpu_temperature_c"]) == (97, 302, 71)
    used = row["gpu_memory_used_bytes"] / 2**30
    assert status_line(row) == f"gpu {row['gpu_name']} 97% {used:.2f}/23.98 GiB 71°C 302 W"
    assert monitor.problems == []


def test_unreadable_fields_show_as_unknown_and_each_reason_is_logged_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tools_on_path(tmp_path, monkeypatch, rocm_smi=TOOLS / "malformed_rocm_smi_bad_values.json")
    monitor = DeviceMonitor(index=0)
    monitor.poll()
    problems = list(monitor.problems)
    monitor.poll()
    assert monitor.problems == problems and len(problems) == len(set(problems)) >= 3
    assert any("GPU use" in line and "'abc'" in line for line in problems)
    row = monitor.fields()
    assert row["gpu_name"] == "Radeon RX 7900 XTX"
    assert row["gpu_utilization_pct"] is None and row["gpu_temperature_c"] is None and row["gpu_power_w"] is None
    assert status_line(row).startswith("gpu Radeon RX 7900 XTX ? ") and status_line(row).endswith("? ?")


def test_a_failing_tool_or_a_raising_query_never_stops_anything(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    tools_on_path(tmp_path, monkeypatch, rocm_smi=failing("rocm-smi: cannot open /dev/kfd", status=1))
    monitor = DeviceMonitor(index=0, interval_s=0.01).start()
    assert monitor._thread is None and monitor.reading is None  # nothing to poll: no thread at all
    assert any("cannot open /dev/kfd" in line for line in monitor.problems)
    monitor.stop()

    def broken() -> GpuQuery:
        raise RuntimeError("boom")

    monitor = DeviceMonitor(query=broken, index=0)
    monitor.poll()
    assert monitor.problems == ["GPU monitor: RuntimeError: boom"]
    row = monitor.fields()
    assert "gpu_name" not in row and status_line(row).startswith("rss ")


def test_on_a_gpu_each_row_has_torchs_allocator_counters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/training.md (device monitor): on a GPU each metrics.jsonl row carries torch_allocated_bytes and
    torch_reserved_bytes (torch.cuda's counters, mocked here) beside the tools' fields, instead of rss_bytes."""
    from gemmaforge.train.callbacks import MetricsCallback

    tools_on_path(tmp_path, monkeypatch, rocm_smi=TOOLS / "rocm_smi_rx7900xtx.json")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 5 * 2**30)
    monitor = DeviceMonitor(index=0)
    monitor.poll()
    fields = monitor.fields()
    assert (fields["torch_allocated_bytes"], fields["torch_reserved_bytes"]) == (3 * 2**30, 5 * 2**30)
    assert "rss_bytes" not in fields and fields["gpu_memory_total_bytes"] == XTX_BYTES
    metrics = tmp_path / "metrics.jsonl"
    state = type("State", (), {"global_step": 1, "is_world_process_zero": True})()
    MetricsCallback(metrics, writes=True).on_log(None, state, None, logs={"loss": 2.5, **fields})
    row = json.loads(metrics.read_text())
    assert row == {"step": 1, "loss": 2.5, **fields}


def test_the_thread_polls_until_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tools_on_path(tmp_path, monkeypatch, rocm_smi=TOOLS / "rocm_smi_rx7900xtx.json")
    monitor = DeviceMonitor(index=0, interval_s=0.05).start()
    deadline = time.monotonic() + 30
    while len(read_calls(bin_dir)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    monitor.stop()
    calls = len(read_calls(bin_dir))
    time.sleep(0.3)
    assert calls >= 3 and len(read_calls(bin_dir)) == calls
    assert DeviceMonitor(index=0).interval_s == 5  # docs/training.md: every 5 s


def test_the_monitor_watches_the_gpu_this_process_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1,0")
    assert visible_index(0) == 1 and visible_index(1) == 0 and visible_index(2) == 2
    tools_on_path(tmp_path, monkeypatch, rocm_smi=TOOLS / "rocm_smi_two_cards.json")
    monitor = DeviceMonitor()
    monitor.poll()
    assert monitor.reading is not None and monitor.reading.index == 1 and monitor.reading.temperature_c == 38


def test_the_monitor_never_logs_another_gpus_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tools_on_path(tmp_path, monkeypatch, rocm_smi=TOOLS / "rocm_smi_rx7900xtx.json")  # one card, index 0
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "2,3")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    assert visible_index(0) == 3
    monitor = DeviceMonitor()
    monitor.poll()
    assert monitor.reading is None and monitor.problems == [
        "GPU monitor: the tools report GPU(s) 0, not this process's GPU (index 3)"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f6b2c1e")
    assert visible_index(0) is None


@pytest.mark.parametrize(("fixture", "power", "problems"), [("rocm_smi_rx7900xtx.json", 302, False),
                                                            ("malformed_rocm_smi_bad_values.json", None, True)])
@pytest.mark.slow
def test_training_logs_what_the_gpu_tools_say(tmp_path: Path, tiny_gemma3_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str], fixture: str, power: int | None,
                                             problems: bool) -> None:
    tools_on_path(tmp_path, monkeypatch, rocm_smi=TOOLS / fixture)
    config = write_config(tmp_path, tiny_gemma3_dir, max_steps=2, save_steps=100, eval_strategy="no")
    assert main(["train", str(config)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    assert len(steps) == 2 and all(row["gpu_power_w"] == power and row["rss_bytes"] > 0 for row in steps)
    assert all("7900 XTX" in row["gpu_name"] for row in steps)
    assert not {"amdsmi", "pynvml"} & set(sys.modules)  # the tools run as programs, their libraries stay out
    record = json.loads((tmp_path / "run" / "manifest.json").read_text())["stages"]["train"]
    assert bool(record["monitor_problems"]) == problems
    assert record["planned_peak_bytes"] > 0 and 0 <= record["padding_share"] < 1
    if problems:
        assert "(shown as unknown)" in capsys.readouterr().err


@pytest.mark.slow
def test_out_of_memory_stops_with_the_planners_advice(tmp_path: Path, tiny_gemma3_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 2147483648 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr("gemmaforge.recipe.sft.SupervisedLossTrainer.training_step", out_of_memory)
    config = write_config(tmp_path, tiny_gemma3_dir, max_steps=2, save_steps=100, eval_strategy="no")
    assert main(["train", str(config)]) == 1
    out = " ".join(capsys.readouterr().err.split())
    assert "out of memory on this CPU ([enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator:" in out
    # The default batch is 4 with no accumulation; the advice shrinks it and keeps the effective batch.
    smaller = re.search(r"train.per_device_train_batch_size=(\d+) train.gradient_accumulation_steps=(\d+) "
                        r"\(the same effective batch\)", out)
    assert smaller and int(smaller[1]) < 4 and int(smaller[1]) * int(smaller[2]) >= 4
    assert "train.gradient_checkpointing=true" in out and "gemmaforge plan CONFIG" in out
    assert not (tmp_path / "run" / "adapter").exists()


def test_cpu_allocator_failures_count_as_out_of_memory() -> None:
    assert troubleshoot.is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: "
                                                      "can't allocate memory: you tried to allocate 8589934592 bytes."))
    assert troubleshoot.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory."))
    assert troubleshoot.is_out_of_memory(MemoryError())
    assert troubleshoot.is_out_of_memory(RuntimeError("HIP error: out of memory\nHIP kernel errors might be ..."))
    assert troubleshoot.is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED "
                                                      "when calling cublasCreate"))
    assert not troubleshoot.is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_out_of_memory_advice_without_a_plan_or_anything_smaller() -> None:
    advice = troubleshoot.diagnose_out_of_memory(MemoryError(), None, run_config(
        train={"per_device_train_batch_size": 1, "cutoff_len": 64, "gradient_checkpointing": True}))
    assert advice.startswith("out of memory (MemoryError). Try: ") and "batch_size=" not in advice
    assert "cutoff_len=" not in advice and "gradient_checkpointing=" not in advice and "smaller model" in advice
    advice = troubleshoot.diagnose_out_of_memory(MemoryError(), None,
                                                 run_config(train={"per_device_train_batch_size": 8}))
    assert "train.per_device_train_batch_size=6 train.gradient_accumulation_steps=2" in advice
    assert "train.gradient_checkpointing=true" in advice and "train.cutoff_len=" in advice


def test_out_of_memory_advice_on_a_gpu_names_the_allocator_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(troubleshoot, "_hip", lambda: True)
    plan = Plan(Device("gpu", "Radeon RX 7900 XTX", 24 * 2**30, 0), 8, 1024, False, {"weights": 2**30}, 0,
                largest_batch=4)
    advice = troubleshoot.diagnose_out_of_memory(torch.OutOfMemoryError("HIP out of memory"), plan,
                                                 run_config(train={"per_device_train_batch_size": 8}))
    assert "train.per_device_train_batch_size=3 train.gradient_accumulation_steps=3" in advice
    assert "PYTORCH_HIP_ALLOC_CONF=expandable_segments:True" in advice and "model.load_in_4bit=true" in advice


@pytest.mark.parametrize(("arch", "override", "precision", "says"), [
    ("gfx1030", None, "bf16", "gfx1030 (RDNA1/2) has no bf16 hardware: set train.precision=fp32"),
    ("gfx1100", "11.0.0", "bf16", "HSA_OVERRIDE_GFX_VERSION=11.0.0 runs kernels built for another arch"),
    (None, None, "fp16", "fp16 overflows in gemma3's activations: set train.precision=bf16"),
])
def test_non_finite_advice_depends_on_the_arch(monkeypatch: pytest.MonkeyPatch, arch: str | None,
                                               override: str | None, precision: str, says: str) -> None:
    from gemmaforge.families import FAMILIES

    monkeypatch.setattr(troubleshoot, "_rocm_arch", lambda: arch)
    if override:
        monkeypatch.setenv("HSA_OVERRIDE_GFX_VERSION", override)
    else:
        monkeypatch.delenv("HSA_OVERRIDE_GFX_VERSION", raising=False)
    advice = troubleshoot.diagnose_non_finite(NonFiniteLoss(7, float("nan")), run_config(), precision,
                                              FAMILIES["gemma3"])
    assert says in advice and "at step 7" in advice
    assert ("no bf16 hardware" in advice) == (arch == "gfx1030")


def test_slow_step_findings() -> None:
    clock = troubleshoot.StepClock()
    clock.waiting, clock.computing = 3.0, 7.0
    findings = troubleshoot.slow_step_findings(clock, 0.4, run_config(train={"packing": False}),
                                               "attention runs on SDPA's slow math kernel", "")
    assert findings[0].startswith("30% of training time waited for batches: set train.dataloader_num_workers=2")
    assert findings[1] == ("40% of the positions in each batch were padding: "
                           "train.packing=true packs examples into full rows")
    assert findings[2] == "attention runs on SDPA's slow math kernel"
    # where packing is set aside (pictures, sound, pairs), it is not what the finding suggests
    padded = troubleshoot.slow_step_findings(clock, 0.4, run_config(), None, "examples hold images or sound")
    assert padded[1] == ("40% of the positions in each batch were padding: padded batches (examples hold images or "
                         "sound): a smaller train.per_device_train_batch_size with more gradient_accumulation_steps "
                         "pads less")
    clock.waiting = 0.1
    assert troubleshoot.slow_step_findings(clock, 0.1, run_config(), None, "") == []


@pytest.mark.parametrize(("hip", "fix"), [("6.4.43482", "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1"),
                                         (None, "a newer torch build may have a kernel for this GPU")])
def test_a_gpu_without_a_fused_attention_kernel_is_a_finding(monkeypatch: pytest.MonkeyPatch, hip: str | None,
                                                             fix: str) -> None:
    """docs/training.md: the SDPA math-kernel fallback is detected on a GPU (the probe's answer faked here) and becomes
    a slow-step finding with the fix for this torch build; with a fused kernel, or no GPU, none."""
    import torch

    from gemmaforge.system import sdpa_probe

    assert sdpa_probe.attention_finding(256, torch.bfloat16) is None  # this machine: no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(sdpa_probe, "fused_attention_backend", lambda *a: (None, "flash_attention: No kernel"))
    finding = sdpa_probe.attention_finding(256, torch.bfloat16)
    assert finding.startswith("attention runs on SDPA's slow math kernel at head_dim 256 (flash_attention: No kernel)")
    assert fix in finding
    monkeypatch.setattr(sdpa_probe, "fused_attention_backend", lambda *a: ("flash_attention", ""))
    assert sdpa_probe.attention_finding(256, torch.bfloat16) is None


@pytest.mark.parametrize(("hip", "cuda", "tool", "card"), [("6.4.43482", None, "rocm-smi", "7900 XTX"),
                                                           (None, "12.6", "nvidia-smi", "RTX 4090"),
                                                           (None, None, "rocm-smi", "7900 XTX")])
def test_the_monitor_reads_the_tools_of_this_torch_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         hip: str | None, cuda: str | None, tool: str,
                                                         card: str) -> None:
    """docs/training.md: a ROCm torch reads the AMD tools, a CUDA torch `nvidia-smi`, even with both vendors' tools on
    PATH (an AMD APU beside an NVIDIA card); the other vendor's tool is never run. A CPU build reads the first that
    answers."""
    from gemmaforge.system.monitor import tools_for_this_torch

    bin_dir = tools_on_path(tmp_path, monkeypatch, rocm_smi=TOOLS / "rocm_smi_rx7900xtx.json",
                            nvidia_smi=TOOLS / "nvidia_smi_one.csv")
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    assert tools_for_this_torch() == (("amd-smi", "rocm-smi") if hip else ("nvidia-smi",) if cuda else
                                      ("amd-smi", "rocm-smi", "nvidia-smi"))
    monitor = DeviceMonitor(index=0)
    monitor.poll()
    assert monitor.reading is not None and monitor.reading.source == tool and card in monitor.reading.name
    assert {call[0] for call in read_calls(bin_dir)} == {tool}

"""`gemmaforge doctor` on this CPU machine, on a described RX 7900 XTX machine (recorded rocm-smi/amd-smi outputs
as fake executables, a KFD topology in a temporary sysfs), and its ROCm rules on synthetic facts."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest

from gemmaforge import doctor as doc
from gemmaforge.cli import main
from gemmaforge.system.gpu_tools import GpuQuery, GpuReading
from gemmaforge.system.rocm import arch_from_target_version, has_bf16, kfd_gpus, override_arch, visible_order
from tests.fake_gpu_tools import install_fake_tools

TOOLS = Path(__file__).parents[1] / "fixtures" / "gpu_tools"
XTX_BYTES = 25753026560


# The --json schema's check ids, in order, as docs/gpu-setup.md documents them (new ids are only ever added at the end)
DOCUMENTED_IDS = ["platform", "torch", "devices", "gpu_tools", "driver_access", "arch_support", "hsa_override", "bf16",
                  "sdpa", "flash_attn", "bitsandbytes", "conflicts", "disk", "hf_token", "llama_cpp", "ollama"]


def test_the_gpu_setup_page_documents_every_check_id() -> None:
    """docs/gpu-setup.md's table under `gemmaforge doctor` names each id once, in the schema's order, and counts them.
    """
    page = (Path(__file__).parents[2] / "docs" / "gpu-setup.md").read_text(encoding="utf-8")
    section = page.split("## `gemmaforge doctor")[1].split("\n## ")[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    assert [name for row in rows for name in re.findall(r"`(\w+)`", row)] == DOCUMENTED_IDS
    assert "Sixteen checks" in section and len(DOCUMENTED_IDS) == 16


def run_doctor_json(capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    code = main(["doctor", "--json"])
    return code, json.loads(capsys.readouterr().out)


def by_id(result: dict) -> dict[str, dict]:
    return {c["id"]: c for c in result["checks"]}


def test_doctor_passes_on_this_machine_and_says_why_bf16_is_or_is_not_used(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")  # no GPU tool here; keep the real PATH after
    monkeypatch.delenv("HSA_OVERRIDE_GFX_VERSION", raising=False)
    code, result = run_doctor_json(capsys)
    assert code == 0 and result["status"] in ("pass", "warn")
    # the --json schema docs/gpu-setup.md documents, key for key
    assert result["schema"] == "gemmaforge-doctor/1"
    assert set(result) == {"schema", "gemmaforge", "status", "summary", "checks", "gpus", "precision"}
    assert set(result["summary"]) == {"pass", "warn", "fail", "skip"}
    assert sum(result["summary"].values()) == len(result["checks"])
    assert all(set(c) == {"id", "title", "status", "detail", "fix"} for c in result["checks"])
    assert set(result["precision"]) == {"bf16", "reason"}
    assert [c["id"] for c in result["checks"]] == DOCUMENTED_IDS
    assert all(c["status"] in ("pass", "warn", "skip") for c in result["checks"])
    assert all(c["fix"] for c in result["checks"] if c["status"] in ("warn", "fail"))
    checks = by_id(result)
    flags = [f for f in ("avx512_bf16", "amx_bf16") if f in Path("/proc/cpuinfo").read_text().split()]
    reason = checks["bf16"]["detail"]
    if flags:
        assert result["precision"]["bf16"] is True and flags[0] in reason and "trains in bf16" in reason
    else:
        assert result["precision"]["bf16"] is False and "neither avx512_bf16 nor amx_bf16" in reason
    assert "CPU build" in checks["torch"]["detail"]
    assert checks["sdpa"]["status"] in ("pass", "warn") and "CPU" in checks["sdpa"]["detail"]
    assert checks["driver_access"]["status"] == "skip"


def amd_machine(tmp_path: Path, *, kfd: bool = True, gfx: int = 110000, more: tuple[int, ...] = ()) -> doc.Host:
    """A temporary sysfs with one CPU node and AMD GPU nodes (gfx, *more), and a /dev with (or without) kfd."""
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    nodes = sysfs / "class/kfd/kfd/topology/nodes"
    for node, (version, vendor) in enumerate([(0, 0), *((v, 4098) for v in (gfx, *more))]):
        (nodes / str(node)).mkdir(parents=True)
        (nodes / str(node) / "properties").write_text(
            f"cpu_cores_count {16 if node == 0 else 0}\ngfx_target_version {version}\nvendor_id {vendor}\n")
    (sysfs / "module" / "amdgpu").mkdir(parents=True)
    (dev / "dri").mkdir(parents=True)
    if kfd:
        (dev / "kfd").write_text("")
        (dev / "dri" / "renderD128").write_text("")
    return doc.Host(sysfs=sysfs, dev=dev, env={}, home=tmp_path, runs=tmp_path)


def test_doctor_reports_the_rx_7900_xtx_the_rocm_tools_describe(tmp_path, monkeypatch, capsys) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    install_fake_tools(bin_dir, amd_smi_metric=TOOLS / "amd_smi_metric_rx7900xtx_list.json",
                       amd_smi_static=TOOLS / "amd_smi_static_rx7900xtx_list.json",
                       rocm_smi=TOOLS / "rocm_smi_rx7900xtx.json")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    host = amd_machine(tmp_path, kfd=False)
    facts = doc.gather(host)
    result = doc.report(facts, doc.run_checks(facts))
    (gpu,) = result["gpus"]
    assert "7900 XTX" in gpu["name"] and gpu["arch"] == "gfx1100" and gpu["memory_total_bytes"] == XTX_BYTES
    assert gpu["utilization_pct"] is not None and gpu["power_w"] is not None and gpu["temperature_c"] is not None
    checks = by_id(result)
    assert checks["gpu_tools"]["status"] == "pass" and "7900 XTX" in checks["gpu_tools"]["detail"]
    assert f"{gpu['power_w']:.0f} W" in checks["gpu_tools"]["detail"] and "24.0 GiB" in checks["gpu_tools"]["detail"]
    # this machine's torch is a CPU build: with an AMD GPU present that is the walkthroughs' first mistake
    assert checks["torch"]["status"] == "fail" and "download.pytorch.org/whl/rocm" in checks["torch"]["fix"]
    assert checks["driver_access"]["status"] == "fail" and "/dev/kfd" in checks["driver_access"]["detail"]
    assert result["status"] == "fail"
    assert doc.doctor(False, host) == 1
    text = capsys.readouterr().out  # as printed: the tool's name in brackets is text, not console markup
    assert "FAIL" in text and "fix: pip uninstall -y torch" in text
    assert f"Radeon RX 7900 XTX (gfx1100): 18.5/24.0 GiB used, 97% busy, 71°C, 302 W [{gpu['source']}]" in text


@pytest.mark.parametrize(("fixture", "status"), [("nvidia_smi_na_power.csv", "pass"),
                                                 ("malformed_rocm_smi_bad_values.json", "warn")])
def test_a_sensor_the_card_lacks_is_not_a_warning_but_garbage_is(tmp_path, monkeypatch, fixture, status) -> None:
    bin_dir = tmp_path / "bin"
    tool = {"nvidia_smi": TOOLS / fixture} if fixture.startswith("nvidia") else {"rocm_smi": TOOLS / fixture}
    install_fake_tools(bin_dir, **tool)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    facts = doc.gather(doc.Host(sysfs=tmp_path, dev=tmp_path, env={}, home=tmp_path, runs=tmp_path))
    check = doc.check_gpu_tools(facts)
    assert check.status == status and facts.tools.problems
    assert (check.fix is None) == (status == "pass")
    if status == "pass":
        assert "not reported by the card: nvidia-smi gpu 0: 'power.draw' is '[N/A]'" in check.detail


def test_doctor_command_exits_1_when_a_check_fails_and_survives_garbage_tool_output(tmp_path, monkeypatch,
                                                                                     capsys) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    install_fake_tools(bin_dir, rocm_smi=TOOLS / "malformed_truncated.json")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("HSA_OVERRIDE_GFX_VERSION", "eleven")
    code = main(["doctor"])
    out = capsys.readouterr().out
    assert code == 1  # the malformed override fails; the unreadable rocm-smi output is only a finding
    assert "not MAJOR.MINOR.STEPPING" in out and "rocm-smi" in out and "Traceback" not in out


def test_driver_access_passes_with_the_devices_open(tmp_path) -> None:
    facts = doc.Facts(amd_machine(tmp_path), doc.TorchFacts("2.6.0", "6.4", None), GpuQuery([], []),
                      kfd_gpus(tmp_path / "sys"), (True, "x"), None)
    check = doc.check_driver_access(facts)
    assert check.status in ("pass", "warn") and "render node" in check.detail  # warn: not in the groups by name


def rocm_facts(tmp_path: Path, gfx: int, arch_list: list[str], env: dict[str, str]) -> doc.Facts:
    host = amd_machine(tmp_path, gfx=gfx)
    host.env = env
    spoofed = override_arch(env["HSA_OVERRIDE_GFX_VERSION"]) if "HSA_OVERRIDE_GFX_VERSION" in env else None
    arch = spoofed or arch_from_target_version(gfx)
    torch_facts = doc.TorchFacts("2.6.0+rocm6.4", "6.4.0", None, [{"name": "GPU", "arch": arch, "memory_bytes": 1}],
                                 arch_list)
    return doc.Facts(host, torch_facts, GpuQuery([GpuReading(0, "rocm-smi", "GPU", arch)], []),
                     kfd_gpus(host.sysfs), (has_bf16(arch_from_target_version(gfx)), "x"), ("flash_attention", ""))


@pytest.mark.parametrize(("gfx", "arch_list", "override", "status", "says"), [
    (110000, ["gfx1030", "gfx1100"], "11.0.0", "warn", "supported natively"),  # the walkthrough's 7900 XTX setting
    (110000, ["gfx1030", "gfx1100"], None, "pass", "not needed"),
    (100301, ["gfx1030", "gfx1100"], None, "fail", "HSA_OVERRIDE_GFX_VERSION=10.3.0"),  # RX 6700 XT
    (100301, ["gfx1030", "gfx1100"], "10.3.0", "pass", "gfx1030's kernels"),
    (100301, ["gfx1030", "gfx1100"], "11.0.0", "fail", "does not match"),
    (110000, ["gfx1100"], "1100", "fail", "not MAJOR.MINOR.STEPPING"),
])
def test_hsa_override_advice(tmp_path, gfx, arch_list, override, status, says) -> None:
    env = {"HSA_OVERRIDE_GFX_VERSION": override} if override else {}
    check = doc.check_hsa_override(rocm_facts(tmp_path, gfx, arch_list, env))
    assert check.status == status and says in check.detail + (check.fix or "")


def test_arch_support_uses_the_drivers_arch_not_the_spoofed_one(tmp_path) -> None:
    facts = rocm_facts(tmp_path, 100301, ["gfx1030", "gfx1100"], {})
    check = doc.check_arch_support(facts)
    assert check.status == "fail" and "gfx1031" in check.detail and check.fix.endswith("=10.3.0")
    assert facts.real_archs == ["gfx1031"]


def test_an_apus_gpu_beside_a_supported_card_is_hidden_not_overridden(tmp_path) -> None:
    # an RX 7900 XTX (gfx1100) and a Ryzen 7000's built-in gfx1036: one override would break the XTX
    host = amd_machine(tmp_path, gfx=110000, more=(100306,))
    torch_facts = doc.TorchFacts("2.6.0+rocm6.4", "6.4.0", None,
                                 [{"name": "XTX", "arch": "gfx1100", "memory_bytes": 1}],
                                 ["gfx1030", "gfx1100"])
    facts = doc.Facts(host, torch_facts, GpuQuery([], []), kfd_gpus(host.sysfs), (True, "x"), None)
    assert facts.real_archs == ["gfx1100", "gfx1036"]
    for check in (doc.check_arch_support(facts), doc.check_hsa_override(facts)):
        assert check.fix == "export HIP_VISIBLE_DEVICES=0 (only the GPUs with kernels in this build)"
    host.env = {"HIP_VISIBLE_DEVICES": "0"}
    assert facts.real_archs == ["gfx1100"]
    assert doc.check_arch_support(facts).status == "pass" and doc.check_hsa_override(facts).status == "pass"


def test_a_cuda_torch_beside_an_amd_apu_is_not_replaced(tmp_path) -> None:
    host = amd_machine(tmp_path, gfx=110003)  # a Ryzen 7840HS's gfx1103 beside an RTX 4070
    torch_facts = doc.TorchFacts("2.6.0+cu126", None, "12.6",
                                 [{"name": "RTX 4070", "arch": "sm_89", "memory_bytes": 1}])
    facts = doc.Facts(host, torch_facts, GpuQuery([], []), kfd_gpus(host.sysfs), (True, "x"), None)
    assert doc.check_torch(facts).status == "pass"
    assert doc.check_torch(replace(facts, torch=doc.TorchFacts("2.6.0+cu126", None, "12.6"))).status == "fail"


def test_rocm_numbers_gpus_through_rocr_then_hip_visible_devices() -> None:
    assert visible_order(4, {}) == [0, 1, 2, 3]
    assert visible_order(4, {"ROCR_VISIBLE_DEVICES": "2,3", "HIP_VISIBLE_DEVICES": "1"}) == [3]
    assert visible_order(4, {"CUDA_VISIBLE_DEVICES": "1,0"}) == [1, 0]
    assert visible_order(4, {"HIP_VISIBLE_DEVICES": "2", "CUDA_VISIBLE_DEVICES": "1"}) == [2]  # HIP's own wins
    assert visible_order(4, {"HIP_VISIBLE_DEVICES": ""}) == [] and visible_order(2, {"ROCR_VISIBLE_DEVICES": "5"}) == []


def test_bf16_is_decided_by_the_real_arch_and_conflicting_packages_fail(tmp_path, monkeypatch) -> None:
    assert has_bf16("gfx1100") and has_bf16("gfx90a") and has_bf16("gfx942") and not has_bf16("gfx1030")
    assert [arch_from_target_version(v) for v in (110000, 90010, 100300, 120001)] == \
        ["gfx1100", "gfx90a", "gfx1030", "gfx1201"]
    facts = rocm_facts(tmp_path, 100300, ["gfx1030"], {})
    monkeypatch.setattr(doc, "_dist_version", lambda name: "26.0.0" if name == "amdsmi" else None)
    check = doc.check_conflicts(facts)
    assert check.status == "fail" and "pip uninstall -y amdsmi" in check.fix


def test_kfd_topology_that_is_unreadable_or_odd_is_skipped(tmp_path) -> None:
    nodes = tmp_path / "class/kfd/kfd/topology/nodes"
    (nodes / "0").mkdir(parents=True)
    (nodes / "0" / "properties").write_text("garbage\ngfx_target_version x\n")
    (nodes / "notanode").mkdir()
    (nodes / "1").mkdir()  # no properties file
    assert kfd_gpus(tmp_path) == []


def test_checks_are_registered_once_in_the_documented_order_and_a_broken_one_is_a_warning(tmp_path,
                                                                                        monkeypatch) -> None:
    assert doc.CHECK_IDS == tuple(DOCUMENTED_IDS) and len({c.title for c in doc.CHECKS}) == len(doc.CHECKS)
    with pytest.raises(AssertionError, match="'disk' registered twice"):
        doc.check("disk", "Free disk again")(doc.check_disk)

    def broken(facts: doc.Facts) -> doc.Finding:
        raise OSError("no such file: /sys/x")

    registered = {c.id: c for c in doc.CHECKS}
    monkeypatch.setattr(doc, "CHECKS", [doc.Registered("disk", registered["disk"].title, broken)])
    facts = doc.Facts(doc.Host(env={}, home=tmp_path, runs=tmp_path), doc.TorchFacts(), GpuQuery([], []), [],
                      (False, "x"), None)
    (found,) = doc.run_checks(facts)
    assert (found.id, found.title, found.status) == ("disk", "Free disk", "warn")
    assert found.detail == "the check itself failed: OSError: no such file: /sys/x"


def test_the_rocm_wheel_index_and_the_tools_come_from_the_injected_host(tmp_path) -> None:
    """A ROCm 6.3 machine and a PATH with `ollama` and `llama-server`, described in a temporary folder."""
    rocm, bin_dir = tmp_path / "rocm", tmp_path / "bin"
    (rocm / ".info").mkdir(parents=True)
    (rocm / ".info" / "version").write_text("6.3.2-111\n")
    bin_dir.mkdir()
    for tool, out in (("ollama", "ollama version is 0.30.1"), ("llama-server", "")):
        (bin_dir / tool).write_text(f"#!/bin/sh\necho '{out}'\n")
        (bin_dir / tool).chmod(0o755)
    host = doc.Host(env={"PATH": str(bin_dir)}, rocm=rocm, home=tmp_path, runs=tmp_path)
    assert doc.rocm_index_url(host) == "https://download.pytorch.org/whl/rocm6.3"
    assert doc.rocm_index_url(replace(host, rocm=tmp_path / "none")) == "https://download.pytorch.org/whl/rocm6.4"
    facts = doc.Facts(host, doc.TorchFacts(error="ImportError: no torch"), GpuQuery([], []), [], (False, "x"), None)
    assert "--index-url https://download.pytorch.org/whl/rocm6.3" in doc.check_torch(facts).fix
    ollama = doc.check_ollama(facts)
    assert ollama.status == "pass" and ollama.detail == f"{bin_dir / 'ollama'}: ollama version is 0.30.1"
    assert "binaries on PATH: llama-server" in doc.check_llama_cpp(facts).detail
    nothing = replace(facts, host=replace(host, env={"PATH": str(tmp_path / "empty")}))
    assert doc.check_ollama(nothing).status == "warn" and "llama-server" not in doc.check_llama_cpp(nothing).detail


def test_doctor_says_which_backends_llama_cpp_was_built_for(tmp_path) -> None:
    """A CUDA or ROCm machine whose llama-cpp-python has no GPU backend is told that `serve --engine llamacpp` runs
    on the CPU and how to rebuild it; a build with the machine's backend passes. The installed (CPU) build lists
    its backends from llama.cpp's own system info."""
    from gemmaforge.system.llamacpp_build import gpu_layers, llama_cpp_backends

    host = doc.Host(env={"PATH": ""}, home=tmp_path, runs=tmp_path)
    nvidia = doc.TorchFacts("2.6.0+cu126", None, "12.6", [{"name": "H100", "arch": "sm_90", "memory_bytes": 1}])
    facts = doc.Facts(host, nvidia, GpuQuery([], []), [], (True, "x"), None, ["CPU"])
    finding = doc.check_llama_cpp(facts)
    assert finding.status == "warn" and "without CUDA" in finding.detail and "-DGGML_CUDA=on" in finding.fix
    assert doc.check_llama_cpp(replace(facts, llama_backends=["CUDA", "CPU"])).status == "pass"
    rocm = replace(facts, torch=doc.TorchFacts("2.6.0+rocm6.4", "6.4.0", None), llama_backends=["CPU"])
    assert "-DGGML_HIP=on" in doc.check_llama_cpp(rocm).fix
    assert doc.check_llama_cpp(replace(rocm, llama_backends=["ROCm", "CPU"])).status == "pass"
    backends = llama_cpp_backends()  # this machine's build: the CPU backend, and a GPU one where it was built in
    assert "CPU" in backends and gpu_layers() == (-1 if len(backends) > 1 else 0)
    assert doc.check_llama_cpp(replace(facts, torch=doc.TorchFacts("2.6.0"))).detail.endswith("built for CPU")


def test_the_hugging_face_token_is_looked_for_where_huggingface_hub_keeps_it(tmp_path) -> None:
    (tmp_path / "hf").mkdir()
    facts = doc.Facts(doc.Host(env={"HF_HOME": str(tmp_path / "hf")}, home=tmp_path, runs=tmp_path),
                      doc.TorchFacts(), GpuQuery([], []), [], (False, "x"), None)
    assert doc.check_hf_token(facts).status == "warn"
    (tmp_path / "hf" / "token").write_text("hf_abc\n")
    assert doc.check_hf_token(facts).status == "pass"
    saved = replace(facts, host=replace(facts.host, env={"XDG_CACHE_HOME": str(tmp_path)}))  # ~/.cache moved
    assert doc.check_hf_token(saved).status == "warn"
    (tmp_path / "huggingface").mkdir()
    (tmp_path / "huggingface" / "token").write_text("hf_abc")
    assert doc.check_hf_token(saved).status == "pass"
    assert doc.check_hf_token(replace(facts, host=replace(facts.host, env={"HF_TOKEN": "hf_x"}))).status == "pass"


def described(tmp_path: Path, torch_facts: doc.TorchFacts,
              sdpa: tuple[str | None, str] | None = ("flash_attention", "")) -> doc.Facts:
    """Facts of a machine described only by its torch (no KFD topology, no GPU tool, an empty /dev)."""
    host = doc.Host(sysfs=tmp_path, dev=tmp_path, env={}, home=tmp_path, runs=tmp_path)
    return doc.Facts(host, torch_facts, GpuQuery([], []), [], (True, "x"), sdpa)


def rocm_torch(arch: str = "gfx1100") -> doc.TorchFacts:
    return doc.TorchFacts("2.6.0+rocm6.4", "6.4.0", None,
                          [{"name": "AMD Radeon RX 7900 XTX", "arch": arch, "memory_bytes": XTX_BYTES}], [arch])


def cuda_torch() -> doc.TorchFacts:
    return doc.TorchFacts("2.6.0+cu126", None, "12.6",
                          [{"name": "NVIDIA GeForce RTX 4090", "arch": "sm_89", "memory_bytes": 24 * 2**30}])


def test_devices_names_every_device_torch_sees_with_its_arch_and_memory(tmp_path: Path) -> None:
    """docs/gpu-setup.md: `devices` lists every device torch sees: name, arch (gcnArchName on ROCm), memory."""
    torch_facts = rocm_torch()
    torch_facts.devices.append({"name": "AMD Instinct MI300X", "arch": "gfx942", "memory_bytes": 192 * 2**30})
    check = doc.check_devices(described(tmp_path, torch_facts))
    assert check.status == "pass" and check.fix is None
    assert check.detail == "0: AMD Radeon RX 7900 XTX (gfx1100, 24.0 GiB); 1: AMD Instinct MI300X (gfx942, 192.0 GiB)"


def test_bf16_is_decided_by_the_rocm_arch_rdna4_included_and_by_compute_capability_on_cuda(monkeypatch) -> None:
    """docs/gpu-setup.md: bf16 on CUDA sm80+, on ROCm by the arch (CDNA and RDNA3/4 yes, RDNA1/2 no, whatever
    torch.cuda.is_bf16_supported() says)."""
    from types import SimpleNamespace

    import torch

    from gemmaforge.train.precision import bf16_decision

    assert has_bf16("gfx1201") and has_bf16("gfx1200") and has_bf16("gfx908") and not has_bf16("gfx1010")
    monkeypatch.delenv("HSA_OVERRIDE_GFX_VERSION", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)  # what ROCm always says

    def device(name: str, major: int, minor: int, arch: str = "") -> None:
        props = SimpleNamespace(name=name, major=major, minor=minor, gcnArchName=arch)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)

    monkeypatch.setattr(torch.version, "hip", None)
    device("NVIDIA A100", 8, 0)
    assert bf16_decision() == (True, "NVIDIA A100 (compute capability 8.0) has bf16 hardware")
    device("Tesla T4", 7, 5)
    assert bf16_decision() == (False, "Tesla T4 (compute capability 7.5) has no bf16 hardware: fp32")
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    device("AMD Radeon RX 9070 XT", 12, 0, "gfx1201:xnack-")
    assert bf16_decision() == (True, "AMD Radeon RX 9070 XT (gfx1201) has bf16 hardware")
    device("AMD Radeon RX 6800", 10, 3, "gfx1030")
    uses, reason = bf16_decision()
    assert not uses and "(gfx1030) has no bf16 hardware" in reason


def test_sdpa_warns_with_a_fix_when_no_fused_kernel_runs(tmp_path: Path) -> None:
    """docs/gpu-setup.md: `sdpa` passes when a fused kernel (flash or memory-efficient) runs forward and backward."""
    fused = doc.check_sdpa(described(tmp_path, rocm_torch(), ("flash_attention", "")))
    assert fused.status == "pass" and fused.fix is None
    assert fused.detail == "flash attention kernel runs forward and backward on the GPU"
    efficient = doc.check_sdpa(described(tmp_path, doc.TorchFacts("2.6.0", None, None), ("efficient_attention", "")))
    assert efficient.status == "pass" and efficient.detail.endswith("on the CPU")
    math_only = doc.check_sdpa(described(tmp_path, rocm_torch(), (None, "head_dim 256 is not supported")))
    assert math_only.status == "warn" and "slow math kernel (head_dim 256 is not supported)" in math_only.detail
    assert math_only.fix.startswith("export TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1")
    assert doc.check_sdpa(described(tmp_path, cuda_torch(), (None, "x"))).fix == "a newer torch build"
    assert doc.check_sdpa(described(tmp_path, doc.TorchFacts(), None)).status == "skip"


def installed(monkeypatch: pytest.MonkeyPatch, **versions: str) -> None:
    """Pretend that exactly these distributions are installed (by their pip names, '-' written '_')."""
    monkeypatch.setattr(doc, "_dist_version", lambda name: versions.get(name.replace("-", "_")))


def test_flash_attn_is_looked_up_and_judged_by_arch(tmp_path: Path, monkeypatch) -> None:
    """docs/gpu-setup.md: `flash_attn` installed, and with kernels for this arch (not needed: training uses SDPA)."""
    installed(monkeypatch)
    missing = doc.check_flash_attn(described(tmp_path, rocm_torch()))
    assert missing.status == "skip" and missing.detail.startswith("not installed")
    installed(monkeypatch, flash_attn="2.7.4")
    assert doc.check_flash_attn(described(tmp_path, rocm_torch("gfx1100"))).status == "pass"
    assert doc.check_flash_attn(described(tmp_path, cuda_torch())) == doc.Finding(
        "pass", "2.7.4 installed (not needed: gemmaforge trains with SDPA)")
    rdna2 = doc.check_flash_attn(described(tmp_path, rocm_torch("gfx1030")))
    assert rdna2.status == "warn" and "no ROCm kernels for gfx1030" in rdna2.detail and "uninstall" in rdna2.fix


def test_bitsandbytes_needs_0_50_on_rocm(tmp_path: Path, monkeypatch) -> None:
    """docs/gpu-setup.md: `bitsandbytes` installed, with kernels for this arch; QLoRA needs bitsandbytes 0.50+ on ROCm.
    """
    installed(monkeypatch)
    missing = doc.check_bitsandbytes(described(tmp_path, rocm_torch()))
    assert missing.status == "warn" and "not installed" in missing.detail
    assert missing.fix == "pip install 'bitsandbytes>=0.50'"
    installed(monkeypatch, bitsandbytes="0.49.2")
    old = doc.check_bitsandbytes(described(tmp_path, rocm_torch()))
    assert old.status == "warn" and old.detail == "0.49.2 predates official ROCm support (0.50)"
    assert old.fix == "pip install -U 'bitsandbytes>=0.50'"
    assert doc.check_bitsandbytes(described(tmp_path, cuda_torch())).status == "pass"  # the 0.50 floor is ROCm's
    assert doc.check_bitsandbytes(described(tmp_path, doc.TorchFacts("2.6.0", None, None))).status == "skip"
    installed(monkeypatch, bitsandbytes="0.50.0")
    assert doc.check_bitsandbytes(described(tmp_path, rocm_torch())) == doc.Finding("pass", "0.50.0")
    rdna2 = doc.check_bitsandbytes(described(tmp_path, rocm_torch("gfx1030")))
    assert rdna2.status == "warn" and rdna2.detail == "no ROCm kernels for gfx1030"


@pytest.mark.parametrize("package", ["pynvml", "nvidia_ml_py"])
def test_pynvml_beside_a_rocm_torch_warns(tmp_path: Path, monkeypatch, package: str) -> None:
    """docs/gpu-setup.md: `conflicts` is pip amdsmi or pynvml beside a ROCm torch (pynvml's current name: nvidia-ml-py).
    """
    installed(monkeypatch, **{package: "12.570.86"})
    check = doc.check_conflicts(described(tmp_path, rocm_torch()))
    assert check.status == "warn" and "pynvml 12.570.86 beside a ROCm torch" in check.detail
    assert check.fix == "pip uninstall -y pynvml nvidia-ml-py"
    assert doc.check_conflicts(described(tmp_path, cuda_torch())).status == "pass"  # NVIDIA's own library there
    installed(monkeypatch)
    assert doc.check_conflicts(described(tmp_path, rocm_torch())).status == "pass"


@pytest.mark.parametrize(("models_free", "runs_free", "status"), [
    (2 * 2**30 - 1, 100 * 2**30, "fail"),
    (100 * 2**30, 2 * 2**30 - 1, "fail"),
    (2 * 2**30 - 1, 5 * 2**30, "fail"),  # a later warning does not hide a failure
    (2 * 2**30, 100 * 2**30, "warn"),
    (100 * 2**30, 20 * 2**30 - 1, "warn"),
    (20 * 2**30, 20 * 2**30, "pass"),
])
def test_disk_fails_below_2_gib_and_warns_below_20_gib_where_models_or_runs_go(tmp_path: Path, monkeypatch,
                                                                              models_free: int, runs_free: int,
                                                                              status: str) -> None:
    """docs/gpu-setup.md: `disk` is the free space where models (GEMMAFORGE_HOME) and runs go; the worse place decides.
    """
    import shutil

    models, runs = tmp_path / "models", tmp_path / "runs"
    models.mkdir()
    runs.mkdir()
    free = {models: models_free, runs: runs_free}
    monkeypatch.setattr(doc.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**40, 0, free[Path(path)]))
    facts = described(tmp_path, doc.TorchFacts())
    facts.host = replace(facts.host, env={"GEMMAFORGE_HOME": str(models)}, home=tmp_path / "elsewhere", runs=runs)
    check = doc.check_disk(facts)
    assert check.status == status and (check.fix is None) == (status == "pass")
    assert check.detail == (f"models {models}: {models_free / 2**30:.1f} GiB free; "
                            f"runs {runs}: {runs_free / 2**30:.1f} GiB free")


def test_a_cpu_torch_beside_an_nvidia_gpu_fails_with_the_cuda_install_line(tmp_path, monkeypatch) -> None:
    """docs/gpu-setup.md: a CPU torch build beside an NVIDIA GPU (the recorded `nvidia-smi` of one card on PATH) fails
    the torch check with the CUDA wheel index line; a CUDA build beside it passes."""
    from gemmaforge.system.gpu_tools import query_gpus

    install_fake_tools(tmp_path / "bin", nvidia_smi=TOOLS / "nvidia_smi_one.csv")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    tools = query_gpus()
    assert [gpu.source for gpu in tools.gpus] == ["nvidia-smi"]
    host = doc.Host(sysfs=tmp_path, dev=tmp_path, env={}, home=tmp_path, runs=tmp_path)
    facts = doc.Facts(host, doc.TorchFacts("2.6.0+cpu"), tools, [], (False, "x"), None)
    check = doc.check_torch(facts)
    assert check.status == "fail" and check.detail == "torch 2.6.0+cpu, CPU build, but this machine has an NVIDIA GPU"
    assert check.fix == "pip uninstall -y torch && pip install torch --index-url https://download.pytorch.org/whl/cu128"
    assert doc.check_torch(replace(facts, torch=cuda_torch())).status == "pass"


@pytest.mark.parametrize(("groups", "missing"), [({"render", "video", "users"}, []), ({"video"}, ["render"]),
                                                 ({"render"}, ["video"]), (set(), ["render", "video"])])
def test_driver_access_passes_in_the_render_and_video_groups_and_warns_outside(tmp_path, monkeypatch,
                                                                              groups: set[str],
                                                                              missing: list[str]) -> None:
    """docs/gpu-setup.md: `driver_access` checks render/video group membership: with /dev/kfd and the render node open,
    it passes in both groups and warns, naming the missing group(s) and the usermod line, otherwise."""
    monkeypatch.setattr(doc, "_group_names", lambda: groups)
    facts = doc.Facts(amd_machine(tmp_path), doc.TorchFacts("2.6.0", "6.4", None), GpuQuery([], []),
                      kfd_gpus(tmp_path / "sys"), (True, "x"), None)
    check = doc.check_driver_access(facts)
    opened = "/dev/kfd and 1 render node(s) open read-write"
    if missing:
        assert (check.status, check.detail) == ("warn", f"{opened}, but you are not in group(s) {', '.join(missing)}")
        assert check.fix.startswith("sudo usermod -a -G render,video $LOGNAME")
    else:
        assert (check.status, check.detail, check.fix) == ("pass", opened, None)


def test_doctor_gives_a_gpu_tool_5_seconds_and_survives_one_that_hangs(tmp_path, monkeypatch) -> None:
    """docs/gpu-setup.md: output of a tool that hangs (5 s) never crashes doctor: the tools are run with a 5 s timeout
    (cut short here so the test does not wait), and the reason is in the check's detail."""
    import subprocess

    from tests.fake_gpu_tools import hanging

    bin_dir = tmp_path / "bin"
    install_fake_tools(bin_dir, nvidia_smi=hanging(30))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    timeouts: list[object] = []
    real_run = subprocess.run

    def run(argv: list[str], *args: object, **kwargs: object) -> subprocess.CompletedProcess:
        if str(argv[0]).startswith(str(bin_dir)):
            timeouts.append(kwargs["timeout"])
            kwargs["timeout"] = 0.5
        return real_run(argv, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", run)
    facts = doc.gather(doc.Host(sysfs=tmp_path, dev=tmp_path, env={}, home=tmp_path, runs=tmp_path))
    assert timeouts == [5] and facts.tools.gpus == []
    assert facts.tools.problems == ["nvidia-smi: no answer within 5 s"]
    check = doc.check_gpu_tools(facts)
    assert check.status == "skip" and "(unreadable: nvidia-smi: no answer within 5 s)" in check.detail

"""`gemmaforge doctor`: can this machine train, export and serve, and if not, the one command that fixes it.

Every check gives PASS, WARN, FAIL or SKIP (does not apply here) with what it found and, unless it passed, a
fix: the commands the ROCm walkthroughs spend pages on. Facts come from the kernel driver's files, the
vendors' command-line tools (system/gpu_tools.py) and torch; `Host` names where the files are, so tests can
describe an AMD machine on one without a GPU.

The JSON report (`--json`, schema "gemmaforge-doctor/1"):
  {"schema": "gemmaforge-doctor/1", "gemmaforge": VERSION, "status": "pass"|"warn"|"fail",
   "summary": {"pass": N, "warn": N, "fail": N, "skip": N},
   "checks": [{"id": ID, "title": TEXT, "status": "pass"|"warn"|"fail"|"skip", "detail": TEXT, "fix": TEXT|null}],
   "gpus": [{"index", "source", "name", "arch", "utilization_pct", "memory_used_bytes", "memory_total_bytes",
             "temperature_c", "power_w"}],          (null where the tool did not say)
   "precision": {"bf16": BOOL, "reason": TEXT}}
Every registered check id (CHECK_IDS) appears once, in that order; new ids are only ever added. A new check is one
function below under `@check(id, title)`, returning a Finding.
"""

from __future__ import annotations

import grp
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gemmaforge import __version__
from gemmaforge.system.gpu_tools import GpuQuery, query_gpus
from gemmaforge.system.llamacpp_build import BUILD_LINES, llama_cpp_backends
from gemmaforge.system.memory import total_ram
from gemmaforge.system.rocm import (
    AMD_VENDOR_ID,
    OVERRIDE_FOR,
    KfdNode,
    has_bf16,
    kfd_gpus,
    override_arch,
    visible_order,
)

SCHEMA = "gemmaforge-doctor/1"
# bitsandbytes >= 0.50 ships ROCm kernels for these archs (rocm.md)
BNB_ROCM_ARCHS = ("gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1151",
                  "gfx1152", "gfx1153", "gfx1200", "gfx1201")
DISK_WARN, DISK_FAIL = 20 * 2**30, 2 * 2**30
GiB = 2**30


@dataclass
class Finding:
    """What a check found; `fix` says what to do unless it passed."""

    status: str  # pass | warn | fail | skip
    detail: str
    fix: str | None = None


@dataclass
class Check:
    """A finding under its check's id and title, as the report lists it."""

    id: str
    title: str
    status: str
    detail: str
    fix: str | None = None


@dataclass(frozen=True)
class Registered:
    id: str
    title: str
    run: Callable[[Facts], Finding]


CHECKS: list[Registered] = []  # in the report's order: the order of the definitions below


def check(id: str, title: str) -> Callable[[Callable[[Facts], Finding]], Callable[[Facts], Finding]]:
    """Register a check under its id (the JSON report's key, never renamed) and title."""

    def register(run: Callable[[Facts], Finding]) -> Callable[[Facts], Finding]:
        assert id not in {c.id for c in CHECKS}, f"doctor check {id!r} registered twice"
        CHECKS.append(Registered(id, title, run))
        return run

    return register


@dataclass
class TorchFacts:
    version: str | None = None
    hip: str | None = None
    cuda: str | None = None
    devices: list[dict[str, Any]] = field(default_factory=list)  # name, arch, memory_bytes
    arch_list: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def build(self) -> str:
        if self.version is None:
            return "not installed"
        return f"ROCm {self.hip}" if self.hip else f"CUDA {self.cuda}" if self.cuda else "CPU"


@dataclass
class Host:
    """Where doctor looks: the real machine by default."""

    sysfs: Path = Path("/sys")
    dev: Path = Path("/dev")
    env: Mapping[str, str] = field(default_factory=lambda: os.environ)  # its PATH: where ollama and llama.cpp are
    rocm: Path = Path("/opt/rocm")
    home: Path = Path.home() / ".cache" / "gemmaforge"
    runs: Path = field(default_factory=Path.cwd)


@dataclass
class Facts:
    host: Host
    torch: TorchFacts
    tools: GpuQuery
    kfd: list[KfdNode]
    bf16: tuple[bool, str]
    sdpa: tuple[str | None, str] | None  # (fused backend or None, reason); None when torch cannot run
    llama_backends: list[str] | None = None  # what llama-cpp-python was built for; None: not importable

    @property
    def amd_present(self) -> bool:
        return any(n.vendor_id == AMD_VENDOR_ID for n in self.kfd) or any(
            g.source in ("amd-smi", "rocm-smi") for g in self.tools.gpus) or (self.host.dev / "kfd").exists()

    @property
    def real_archs(self) -> list[str]:
        """The driver's archs, else what the tools or torch say (which an HSA override may have changed)."""
        gpus = [n for n in self.kfd if n.vendor_id == AMD_VENDOR_ID]
        archs = [gpus[i].arch for i in visible_order(len(gpus), self.host.env)]  # those ROCm will use
        return archs or [g.arch for g in self.tools.gpus if g.arch] or [d["arch"] for d in self.torch.devices
                                                                         if d.get("arch", "").startswith("gfx")]


def torch_facts() -> TorchFacts:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - a broken install is a finding, not a crash
        return TorchFacts(error=f"{type(exc).__name__}: {exc}")
    facts = TorchFacts(torch.__version__, torch.version.hip, torch.version.cuda)
    try:
        if torch.cuda.is_available():
            facts.arch_list = [a.split(":")[0] for a in torch.cuda.get_arch_list()]
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                arch = getattr(props, "gcnArchName", "").split(":")[0] or f"sm_{props.major}{props.minor}"
                facts.devices.append({"name": props.name, "arch": arch, "memory_bytes": props.total_memory})
    except Exception as exc:  # noqa: BLE001 - e.g. hipErrorNoBinaryForGpu while creating the context
        facts.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return facts


def gather(host: Host | None = None, tools: Callable[[], GpuQuery] = query_gpus) -> Facts:
    from gemmaforge.system.sdpa_probe import fused_attention_backend
    from gemmaforge.train.precision import bf16_decision

    host = host or Host()
    facts = torch_facts()
    sdpa = bf16 = None
    if facts.version is not None and facts.error is None:
        import torch

        bf16 = bf16_decision()
        device = "cuda" if facts.devices else "cpu"
        try:
            sdpa = fused_attention_backend(256, torch.bfloat16 if bf16[0] else torch.float32, device)
        except Exception as exc:  # noqa: BLE001 - the probe itself failing is what it reports
            sdpa = (None, f"{type(exc).__name__}: {exc}")
    return Facts(host, facts, tools(), kfd_gpus(host.sysfs), bf16 or (False, "torch is not usable"), sdpa,
                 _llama_backends())


def _llama_backends() -> list[str] | None:
    try:
        return llama_cpp_backends()
    except Exception:  # noqa: BLE001 - not installed, or a build that fails to load: check_llama_cpp says which
        return None


# ---------------------------------------------------------------------------- checks


@check("platform", "OS and Python")
def check_platform(f: Facts) -> Finding:
    return Finding("pass",
                   f"{platform.system()} {platform.release()} ({platform.machine()}), "
                   f"Python {platform.python_version()}, "
                   f"gemmaforge {__version__}")


def rocm_index_url(host: Host) -> str:
    """The PyTorch wheel index for the installed ROCm (its .info/version), else a current one."""
    try:
        version = (host.rocm / ".info" / "version").read_text().strip()
        return f"https://download.pytorch.org/whl/rocm{'.'.join(version.split('.')[:2])}"
    except OSError:
        return "https://download.pytorch.org/whl/rocm6.4"


@check("torch", "PyTorch build")
def check_torch(f: Facts) -> Finding:
    t = f.torch
    if t.version is None:
        return Finding("fail", f"torch cannot be imported ({t.error})",
                       f"pip install torch --index-url {rocm_index_url(f.host)}  "
                       "(ROCm; CUDA and CPU builds: pytorch.org)")
    detail = f"torch {t.version}, {t.build} build"
    if f.amd_present and not t.hip and not (t.cuda and t.devices):  # an APU's GPU beside a working CUDA card
        return Finding("fail", f"{detail}, but this machine has an AMD GPU: it cannot use it",
                       f"pip uninstall -y torch && pip install torch --index-url {rocm_index_url(f.host)}")
    nvidia = any(g.source == "nvidia-smi" for g in f.tools.gpus)
    if nvidia and not t.cuda:
        return Finding("fail", f"{detail}, but this machine has an NVIDIA GPU",
                       "pip uninstall -y torch && pip install torch --index-url https://download.pytorch.org/whl/cu128")
    if t.error:
        return Finding("fail", f"{detail}; the GPU runtime failed: {t.error}",
                       "run `gemmaforge doctor` again after the fixes below (driver access, arch support)")
    return Finding("pass", detail)


@check("devices", "Devices torch sees")
def check_devices(f: Facts) -> Finding:
    if f.torch.devices:
        listed = "; ".join(f"{i}: {d['name']} ({d['arch']}, {d['memory_bytes'] / GiB:.1f} GiB)"
                           for i, d in enumerate(f.torch.devices))
        return Finding("pass", listed)
    cores, ram = os.cpu_count() or 0, total_ram()
    detail = f"no GPU visible to torch: training runs on the CPU ({cores} cores, {ram / GiB:.1f} GiB RAM)"
    if f.amd_present or f.tools.gpus:
        return Finding("fail", detail.replace("training runs", "training would run"),
                       "fix the checks marked FAIL above and below (torch build, driver access)")
    return Finding("pass", detail)


@check("gpu_tools", "GPU monitoring tools")
def check_gpu_tools(f: Facts) -> Finding:
    if not f.tools.gpus:
        if f.amd_present:
            return Finding("warn",
                           "no rocm-smi or amd-smi answered" + _problems(f.tools.problems),
                           "sudo apt install rocm-smi-lib amd-smi-lib (part of ROCm: amdgpu-install --usecase=rocm)")
        return Finding("skip",
                       "no GPU tool found (amd-smi, rocm-smi, nvidia-smi)" + _problems(f.tools.problems))
    described = "; ".join(describe_gpu(g.as_dict()) for g in f.tools.gpus)
    # 'N/A' / '[Not Supported]' is how the tools say a card has no such sensor: unknown, but nothing to fix
    unreadable = [line for line in f.tools.problems if "N/A" not in line and "Not Supported" not in line]
    absent = [line for line in f.tools.problems if line not in unreadable]
    detail = described + (f" (not reported by the card: {'; '.join(absent)})" if absent else "")
    return Finding("warn" if unreadable else "pass", detail + _problems(unreadable),
                   "a newer tool version may print these fields; the monitor shows them as unknown" if unreadable
                   else None)


def describe_gpu(gpu: Mapping[str, Any]) -> str:
    """'card 0 Radeon RX 7900 XTX (gfx1100): 0.5/24.0 GiB used, 3% busy, 45°C, 33 W [rocm-smi]', '?' for unknowns."""

    def value(key: str, fmt: str, scale: float = 1) -> str:
        return "?" if gpu.get(key) is None else fmt.format(gpu[key] / scale)

    arch = f" ({gpu['arch']})" if gpu.get("arch") else ""
    return (f"card {gpu['index']} {gpu.get('name') or 'unknown GPU'}{arch}: "
            f"{value('memory_used_bytes', '{:.1f}', GiB)}/{value('memory_total_bytes', '{:.1f}', GiB)} GiB used, "
            f"{value('utilization_pct', '{:.0f}%')} busy, {value('temperature_c', '{:.0f}°C')}, "
            f"{value('power_w', '{:.0f} W')} [{gpu['source']}]")


def _problems(problems: list[str]) -> str:
    return f" (unreadable: {'; '.join(problems)})" if problems else ""


@check("driver_access", "AMD driver and device access")
def check_driver_access(f: Facts) -> Finding:
    if not f.amd_present:
        return Finding("skip", "no AMD GPU on this machine")
    kfd, dri = f.host.dev / "kfd", sorted((f.host.dev / "dri").glob("renderD*"))
    if not (f.host.sysfs / "module" / "amdgpu").exists() or not kfd.exists():
        return Finding("fail", "the amdgpu kernel driver is not loaded (/dev/kfd is missing)",
                       "sudo amdgpu-install --usecase=rocm --no-dkms (or --usecase=dkms,rocm), then reboot")
    groups = _group_names()
    missing = [g for g in ("render", "video") if g not in groups]
    blocked = [str(p) for p in (kfd, *dri) if not os.access(p, os.R_OK | os.W_OK)]
    if blocked:
        return Finding("fail",
                       f"cannot open {', '.join(blocked)} read-write (groups: {', '.join(sorted(groups)) or 'none'})",
                       "sudo usermod -a -G render,video $LOGNAME, then log out and in (or reboot); in Docker: "
                       "--device=/dev/kfd --device=/dev/dri --group-add video --group-add render")
    detail = f"/dev/kfd and {len(dri)} render node(s) open read-write"
    if missing:
        return Finding("warn", f"{detail}, but you are not in group(s) {', '.join(missing)}",
                       "sudo usermod -a -G render,video $LOGNAME (access may come from elsewhere now)")
    return Finding("pass", detail)


def _group_names() -> set[str]:
    names = set()
    for gid in os.getgroups():
        try:
            names.add(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue
    return names


@check("arch_support", "GPU arch in this torch build")
def check_arch_support(f: Facts) -> Finding:
    if not f.amd_present:
        return Finding("skip", "no AMD GPU on this machine")
    archs = f.real_archs
    if not archs:
        return Finding("warn", "the GPU's arch is unknown (no KFD topology, no tool reported it)",
                       "install ROCm's rocm-smi, or check `rocminfo | grep gfx`")
    if not f.torch.hip or not f.torch.arch_list:
        return Finding("skip", f"GPU arch {', '.join(archs)}; torch is not a working ROCm build")
    override = f.host.env.get("HSA_OVERRIDE_GFX_VERSION")
    spoofed = override_arch(override) if override else None
    missing = [a for a in archs if a not in f.torch.arch_list and not spoofed]
    if missing:
        fixes = {OVERRIDE_FOR[a] for a in missing if a in OVERRIDE_FOR}
        if len(fixes) == 1 and len(missing) == len(archs):
            fix = f"export HSA_OVERRIDE_GFX_VERSION={fixes.pop()}"
        elif len(missing) < len(archs):  # an override applies to every GPU: it would break the supported ones
            fix = hide_gpus(archs, f.torch.arch_list)
        else:
            fix = f"install a torch build whose arch list has {', '.join(missing)} (pytorch.org, ROCm wheels)"
        return Finding("fail",
                       f"{', '.join(missing)} not in this build's kernels ({', '.join(f.torch.arch_list)}): "
                       "'HIP error: invalid device function'", fix)
    return Finding("pass", f"{', '.join(archs)} has kernels in this build")


def hide_gpus(archs: list[str], arch_list: list[str]) -> str:
    """The fix that keeps only the GPUs this torch build has kernels for (numbered as torch numbers them now)."""
    keep = ",".join(str(i) for i, arch in enumerate(archs) if arch in arch_list)
    return f"export HIP_VISIBLE_DEVICES={keep} (only the GPUs with kernels in this build)"


@check("hsa_override", "HSA_OVERRIDE_GFX_VERSION")
def check_hsa_override(f: Facts) -> Finding:
    override = f.host.env.get("HSA_OVERRIDE_GFX_VERSION")
    archs = f.real_archs if f.amd_present else []
    if override is None:
        needed = sorted({OVERRIDE_FOR[a] for a in archs if a in OVERRIDE_FOR and a not in f.torch.arch_list})
        native = [a for a in archs if a in f.torch.arch_list]
        if needed and f.torch.hip and native:  # e.g. an APU's gfx1036 beside an RX 7900 XTX
            return Finding("warn",
                           f"not set, rightly: {', '.join(native)} runs natively and the override would apply to every "
                           "GPU; the GPUs without kernels must be hidden instead", hide_gpus(archs, f.torch.arch_list))
        if needed and f.torch.hip:
            return Finding("fail", f"needed for {', '.join(archs)} and not set",
                           f"export HSA_OVERRIDE_GFX_VERSION={needed[0]}")
        return Finding("pass" if archs else "skip",
                       "not set, and not needed" + (f" ({', '.join(archs)} runs its own kernels)" if archs else ""))
    spoofed = override_arch(override)
    if spoofed is None:
        return Finding("fail", f"{override!r} is not MAJOR.MINOR.STEPPING (e.g. 10.3.0)",
                       "unset HSA_OVERRIDE_GFX_VERSION, or set it as 10.3.0 / 11.0.0")
    if not archs:
        return Finding("warn", f"set to {override} ({spoofed}) on a machine without an AMD GPU",
                       "unset HSA_OVERRIDE_GFX_VERSION")
    native = [a for a in archs if a in f.torch.arch_list or (not f.torch.arch_list and a not in OVERRIDE_FOR)]
    if native:
        return Finding("warn",
                       f"set to {override} ({spoofed}), but {', '.join(native)} is supported natively; the override "
                       "applies to every GPU and makes torch report the spoofed arch",
                       "unset HSA_OVERRIDE_GFX_VERSION (remove it from ~/.bashrc)")
    if any(a[:5] != spoofed[:5] for a in archs) or (f.torch.arch_list and spoofed not in f.torch.arch_list):
        expected = sorted({OVERRIDE_FOR[a] for a in archs if a in OVERRIDE_FOR})
        return Finding("fail",
                       f"set to {override} ({spoofed}), which does not match the GPU ({', '.join(archs)})"
                       + (" or has no kernels in this build" if f.torch.arch_list else ""),
                       f"export HSA_OVERRIDE_GFX_VERSION={expected[0]}" if expected
                       else "unset HSA_OVERRIDE_GFX_VERSION")
    return Finding("pass", f"{override}: {', '.join(archs)} runs {spoofed}'s kernels, as needed")


@check("bf16", "bf16 decision")
def check_bf16(f: Facts) -> Finding:
    uses, reason = f.bf16
    archs = f.real_archs if f.amd_present else []
    detail = f"precision auto trains in {'bf16' if uses else 'fp32'}: {reason}"
    if f.torch.hip and archs and not all(has_bf16(a) for a in archs):
        detail += f" (by the real arch: {', '.join(archs)})"
    return Finding("pass", detail)


@check("sdpa", "Fused attention (SDPA) at head_dim 256")
def check_sdpa(f: Facts) -> Finding:
    if f.sdpa is None:
        return Finding("skip", "torch is not usable")
    backend, reason = f.sdpa
    where = "the GPU" if f.torch.devices else "the CPU"
    if backend:
        return Finding("pass", f"{backend.replace('_', ' ')} kernel runs forward and backward on {where}")
    fix = ("export TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1 (AOTriton's kernels for archs it marks experimental)"
           if f.torch.hip else "a newer torch build")
    return Finding("warn", f"no fused kernel on {where}; attention falls back to the slow math kernel "
                   f"({reason})", fix)


@check("flash_attn", "flash-attn package")
def check_flash_attn(f: Facts) -> Finding:
    version = _dist_version("flash-attn") or _dist_version("flash_attn")
    if version is None:
        return Finding("skip", "not installed; not needed: gemmaforge trains with PyTorch SDPA")
    archs = f.real_archs if f.torch.hip else []
    unsupported = [a for a in archs if not a.startswith(("gfx90a", "gfx94", "gfx95", "gfx11", "gfx12"))]
    if unsupported:
        return Finding("warn", f"{version} installed; no ROCm kernels for {', '.join(unsupported)}",
                       "pip uninstall flash-attn (SDPA is used anyway)")
    return Finding("pass", f"{version} installed (not needed: gemmaforge trains with SDPA)")


@check("bitsandbytes", "bitsandbytes (QLoRA: model.load_in_4bit)")
def check_bitsandbytes(f: Facts) -> Finding:
    version = _dist_version("bitsandbytes")
    if not f.torch.devices:
        return Finding("skip", "QLoRA needs a GPU; LoRA on the full-precision base works here")
    if version is None:
        return Finding("warn", "not installed: model.load_in_4bit is refused",
                       "pip install 'bitsandbytes>=0.50'")
    if f.torch.hip:
        too_old = _older_than(version, (0, 50))
        unsupported = [a for a in f.real_archs if a not in BNB_ROCM_ARCHS]
        if too_old or unsupported:
            why = f"{version} predates official ROCm support (0.50)" if too_old else \
                f"no ROCm kernels for {', '.join(unsupported)}"
            return Finding("warn", why, "pip install -U 'bitsandbytes>=0.50'")
    return Finding("pass", f"{version}")


@check("conflicts", "Conflicting packages")
def check_conflicts(f: Facts) -> Finding:
    if not f.torch.hip:
        return Finding("pass", "none (checked: pip amdsmi, pynvml beside a ROCm torch)")
    amdsmi, pynvml = _dist_version("amdsmi"), _dist_version("pynvml") or _dist_version("nvidia-ml-py")
    if amdsmi:
        return Finding("fail", f"pip amdsmi {amdsmi} beside a ROCm torch: torch.cuda.device_count() "
                       "can return 0", "pip uninstall -y amdsmi (use ROCm's own amd-smi command)")
    if pynvml:
        return Finding("warn", f"pynvml {pynvml} beside a ROCm torch (NVIDIA's library, unused here)",
                       "pip uninstall -y pynvml nvidia-ml-py")
    return Finding("pass", "none (no pip amdsmi or pynvml beside the ROCm torch)")


@check("disk", "Free disk")
def check_disk(f: Facts) -> Finding:
    places = {"models": f.host.env.get("GEMMAFORGE_HOME") or str(f.host.home), "runs": str(f.host.runs)}
    found = []
    worst = "pass"
    for what, path in places.items():
        free = shutil.disk_usage(_existing(Path(path))).free
        found.append(f"{what} {path}: {free / GiB:.1f} GiB free")
        worst = "fail" if free < DISK_FAIL else "warn" if free < DISK_WARN and worst != "fail" else worst
    fix = None if worst == "pass" else "free some space: a 270M run needs ~3 GiB (merged model and GGUF files), " \
        "a 4B run ~30 GiB; GEMMAFORGE_HOME moves the model cache"
    return Finding(worst, "; ".join(found), fix)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@check("hf_token", "Hugging Face token")
def check_hf_token(f: Facts) -> Finding:
    env = f.host.env
    token = env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN")
    if not token:  # where huggingface_hub keeps the token `hf auth login` saved (huggingface_hub.constants)
        hf_home = env.get("HF_HOME") or str(Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface")
        try:
            token = Path(env.get("HF_TOKEN_PATH") or Path(hf_home) / "token").expanduser().read_text().strip()
        except OSError:  # an unreadable token file is the same as none
            token = None
    if token:
        return Finding("pass", "found: gated models (google/gemma-*) can download after you accept "
                       "their license on huggingface.co")
    return Finding("warn", "none: the embedded gemma3-270m and local folders need none; gated "
                   "google/gemma-* hub ids do", "hf auth login (after accepting the Gemma license on huggingface.co)")


@check("llama_cpp", "llama.cpp")
def check_llama_cpp(f: Facts) -> Finding:
    binaries = [b for b in ("llama-cli", "llama-server", "llama-quantize") if _which(b, f.host)]
    tools = f"; binaries on PATH: {', '.join(binaries)}" if binaries else ""
    version = _dist_version("llama-cpp-python")
    if version is None:
        return Finding("warn", f"llama-cpp-python not installed: K-quant GGUF export, "
                       f"`export verify` and `--engine llamacpp` need it{tools}", "pip install llama-cpp-python")
    backends = f.llama_backends
    built = f" built for {', '.join(backends)}" if backends else ""
    gpu = "ROCm" if f.torch.hip else "CUDA" if f.torch.cuda and f.torch.devices else None
    if gpu and backends is not None and gpu not in backends:  # `serve --engine llamacpp` would run on the CPU
        return Finding("warn", f"llama-cpp-python {version}{built}: without {gpu}, `serve --engine llamacpp` "
                       f"decodes on the CPU{tools}", BUILD_LINES[gpu])
    return Finding("pass", f"llama-cpp-python {version}{built}{tools}")


@check("ollama", "Ollama")
def check_ollama(f: Facts) -> Finding:
    path = _which("ollama", f.host)
    if path is None:
        return Finding("warn", "no `ollama` on PATH: `export ollama --create` needs it (`gemmaforge "
                       "serve` speaks Ollama's API without it)", "curl -fsSL https://ollama.com/install.sh | sh")
    try:
        out = subprocess.run([path, "--version"], check=False, capture_output=True, text=True, timeout=5,
                             errors="replace")
        version = (out.stdout or out.stderr).strip().splitlines()[-1] if (out.stdout or out.stderr).strip() else "?"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Finding("warn", f"{path} does not answer --version ({type(exc).__name__})",
                       "reinstall: curl -fsSL https://ollama.com/install.sh | sh")
    return Finding("pass", f"{path}: {version}")


CHECK_IDS = tuple(c.id for c in CHECKS)


def run_checks(facts: Facts) -> list[Check]:
    checks = []
    for registered in CHECKS:
        try:
            finding = registered.run(facts)
        except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
            finding = Finding("warn", f"the check itself failed: {type(exc).__name__}: {exc}")
        checks.append(Check(registered.id, registered.title, finding.status, finding.detail, finding.fix))
    return checks


def report(facts: Facts, checks: list[Check]) -> dict[str, Any]:
    summary = {s: sum(c.status == s for c in checks) for s in ("pass", "warn", "fail", "skip")}
    status = "fail" if summary["fail"] else "warn" if summary["warn"] else "pass"
    return {"schema": SCHEMA, "gemmaforge": __version__, "status": status, "summary": summary,
            "checks": [asdict(c) for c in checks], "gpus": [g.as_dict() for g in facts.tools.gpus],
            "precision": {"bf16": facts.bf16[0], "reason": facts.bf16[1]}}


def render(result: dict[str, Any]) -> str:
    """Rich markup; the checks' own text is escaped (details like '[rocm-smi]' or "pip install 'x[server]'")."""
    from gemmaforge.console import escape

    colour = {"pass": "green", "warn": "yellow", "fail": "red", "skip": "dim"}
    lines = [f"[bold]gemmaforge doctor[/] {result['gemmaforge']}"]
    for c in result["checks"]:
        lines.append(f"  [{colour[c['status']]}]{c['status'].upper():4}[/]  "
                     f"{escape(c['title'])}: {escape(c['detail'])}")
        if c["fix"]:
            lines.append(f"        fix: {escape(c['fix'])}")
    s = result["summary"]
    lines.append(f"{s['pass']} passed, {s['warn']} warnings, {s['fail']} failed, {s['skip']} not applicable")
    return "\n".join(lines)


def doctor(as_json: bool, host: Host | None = None) -> int:
    """Print the report; 1 when a check failed, else 0."""
    from rich.console import Console

    facts = gather(host)
    result = report(facts, run_checks(facts))
    if as_json:
        print(json.dumps(result, indent=2, ensure_ascii=False))
    else:  # the report is the command's output: stdout, unlike the stages' progress
        Console(soft_wrap=True, highlight=False).print(render(result))
    return 1 if result["status"] == "fail" else 0


def _which(tool: str, host: Host) -> str | None:
    return shutil.which(tool, path=host.env.get("PATH", os.defpath))


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _older_than(version: str, minimum: tuple[int, int]) -> bool:
    parts = [int(p) for p in version.split(".")[:2] if p.isdigit()]
    return tuple(parts) < minimum if len(parts) == 2 else False

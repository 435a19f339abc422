"""GPU use, memory, temperature and power, read from the vendors' command-line tools.

The tools run as programs and their printed output is parsed here; their Python bindings are never imported,
because a pip `amdsmi` installed beside a ROCm build of torch made `torch.cuda.device_count()` return 0.
The parsers never raise: whatever they cannot read becomes one line in `GpuQuery.problems`, so a monitor
keeps running on a tool version that prints something new.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass

TOOLS: tuple[str, ...] = ("amd-smi", "rocm-smi", "nvidia-smi")

AMD_SMI_METRIC_ARGS = ("metric", "-u", "-m", "-p", "-t", "--json")
AMD_SMI_STATIC_ARGS = ("static", "--asic", "--vram", "--json")
ROCM_SMI_ARGS = ("--showuse", "--showmeminfo", "vram", "--showtemp", "--showpower", "--showproductname", "--json")
NVIDIA_COLUMNS = ("index", "name", "utilization.gpu", "memory.used", "memory.total", "temperature.gpu", "power.draw")
NVIDIA_SMI_ARGS = ("--query-gpu=" + ",".join(NVIDIA_COLUMNS), "--format=csv,noheader,nounits")

MIB = 1024**2
# amd-smi labels memory "MB" but computes it as bytes // (1024 * 1024), so its MB are MiB (and GB read as GiB).
# A bare number, without a unit, is amd-smi of ROCm 6.0, which printed the same MiB counts as plain integers.
_AMD_UNITS = {"B": 1, "KB": 1024, "MB": MIB, "MIB": MIB, "GB": 1024**3, "GIB": 1024**3}
# Each quantity under the names tool versions gave it, preferred first: MI300X has no edge sensor, so its
# temperature falls back to junction/hotspot; MI300 and APUs report the current socket power, not an average.
_ROCM_TEMPERATURE = ("Temperature (Sensor edge) (C)", "Temperature (Sensor junction) (C)")
_ROCM_POWER = ("Average Graphics Package Power (W)", "Current Socket Graphics Package Power (W)")
_AMD_USE = ("usage.gfx_activity", "usage.gfx_usage")  # gfx_usage: amd-smi of ROCm 6.0
_AMD_POWER = ("power.socket_power", "power.current_power")  # current_power: amd-smi of ROCm 6.0
_AMD_TEMPERATURE = ("temperature.edge", "temperature.hotspot")


@dataclass(frozen=True)
class GpuReading:
    """One GPU as one tool saw it; a field is None when the tool did not say or said something unreadable."""

    index: int
    source: str
    name: str | None = None
    arch: str | None = None
    utilization_pct: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class GpuQuery:
    """The readings of every GPU found, and one line per output or field that could not be read."""

    gpus: list[GpuReading]
    problems: list[str]


def _shown(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _number(raw: object) -> float | None:
    """A finite number from a JSON number or a numeric string (the tools print both), else None."""
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        return None
    try:
        value = float(raw.strip() if isinstance(raw, str) else raw)
    except (ValueError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def _first(where: str, problems: list[str], candidates: Sequence[tuple[str, object]]) -> float | None:
    """The first readable value among the fields present (None means absent). A problem is noted only when
    fields are present and none reads, so a sensor the card lacks is not reported on every poll."""
    present = [(label, raw) for label, raw in candidates if raw is not None]
    for _, raw in present:
        value = _number(raw)
        if value is not None:
            return value
    if present:
        label, raw = present[0]
        problems.append(f"{where}: {label!r} is {_shown(raw)}, not a number")
    return None


def _bytes(value: float | None, factor: int = 1) -> int | None:
    return None if value is None or not math.isfinite(value * factor) else round(value * factor)


def _text(raw: object) -> str | None:
    if not isinstance(raw, str) or raw.strip() in ("", "N/A"):
        return None
    return raw.strip()


def _load_json(tool: str, text: str, problems: list[str]) -> object:
    """The JSON document in a tool's output, skipping the warning lines some versions print before it
    (amd-smi prints its missing-group warning on stdout); None, with a problem, when there is none."""
    error = None
    offset = 0
    for line in text.splitlines(keepends=True):
        stripped = line.lstrip()
        if stripped[:1] in ("{", "["):
            try:
                return json.JSONDecoder().raw_decode(text, offset + len(line) - len(stripped))[0]
            except (ValueError, RecursionError) as exc:
                error = error or str(exc)  # the first document is the one the tool meant
        offset += len(line)
    problems.append(f"{tool}: output is not JSON ({error or 'no line starts with { or [: ' + _shown(text.strip())})")
    return None


def _field(card: dict[str, object], *names: str) -> list[tuple[str, object]]:
    """(key, value) for each name the card has, ignoring case: older rocm-smi wrote "(c)" and "Card series"."""
    keys = {str(key).lower(): key for key in card}
    return [(keys[name.lower()], card[keys[name.lower()]]) for name in names if name.lower() in keys]


def _field_text(card: dict[str, object], name: str) -> str | None:
    return next((_text(value) for _, value in _field(card, name)), None)


def parse_rocm_smi(text: str) -> GpuQuery:
    """Readings from `rocm-smi --showuse --showmeminfo vram --showtemp --showpower --showproductname --json`."""
    problems: list[str] = []
    data = _load_json("rocm-smi", text, problems)
    if data is not None and not isinstance(data, dict):
        problems.append(f"rocm-smi: expected an object of cards, got {_shown(data)}")
    gpus = []
    for key, card in data.items() if isinstance(data, dict) else ():
        match = re.fullmatch(r"card([0-9]+)", key)
        if match is None:
            continue  # "system" (driver version) and any other key that is not a card
        where = f"rocm-smi {key}"
        if not isinstance(card, dict):
            problems.append(f"{where}: expected an object of fields, got {_shown(card)}")
            continue
        gpus.append(
            GpuReading(
                index=int(match[1]),
                source="rocm-smi",
                name=_field_text(card, "Card Series"),
                arch=_field_text(card, "GFX Version"),
                utilization_pct=_first(where, problems, _field(card, "GPU use (%)")),
                memory_used_bytes=_bytes(_first(where, problems, _field(card, "VRAM Total Used Memory (B)"))),
                memory_total_bytes=_bytes(_first(where, problems, _field(card, "VRAM Total Memory (B)"))),
                temperature_c=_first(where, problems, _field(card, *_ROCM_TEMPERATURE)),
                power_w=_first(where, problems, _field(card, *_ROCM_POWER)),
            )
        )
    return GpuQuery(sorted(gpus, key=lambda gpu: gpu.index), problems)


def _amd_entries(tool: str, text: str, problems: list[str]) -> dict[int, dict[str, object]]:
    """The per-GPU objects of amd-smi JSON by GPU index: a list in amd-smi 24.x, {"gpu_data": [...]} later."""
    data = _load_json(tool, text, problems)
    if isinstance(data, dict) and "gpu_data" in data:
        data = data["gpu_data"]
    if data is None:
        return {}
    if not isinstance(data, list):
        problems.append(f"{tool}: expected a list of GPUs, got {_shown(data)}")
        return {}
    entries = {}
    for entry in data:
        index = entry.get("gpu") if isinstance(entry, dict) else None
        if isinstance(entry, dict) and isinstance(index, int) and not isinstance(index, bool):
            entries[index] = entry
        else:
            problems.append(f"{tool}: skipped an entry without a GPU index: {_shown(entry)}")
    return entries


def _amd_leaf(where: str, problems: list[str], entry: object, path: str) -> tuple[object, object]:
    """(value, unit) at a path such as "usage.gfx_activity", (None, None) when absent; amd-smi 24+ wraps each
    value as {"value": v, "unit": u}. A section that is not an object (amd-smi prints "usage": "N/A") is noted
    once for all its fields."""
    node = entry
    keys = path.split(".")
    for depth, key in enumerate(keys):
        if node is None:
            return None, None
        if not isinstance(node, dict):
            line = f"{where}: {'.'.join(keys[:depth])!r} is {_shown(node)}, not an object"
            if line not in problems:
                problems.append(line)
            return None, None
        node = node.get(key)
    if isinstance(node, dict) and "value" in node:
        return node["value"], node.get("unit")
    return node, None


def _amd_number(where: str, problems: list[str], entry: object, paths: Sequence[str]) -> float | None:
    return _first(where, problems, [(path, _amd_leaf(where, problems, entry, path)[0]) for path in paths])


def _amd_bytes(where: str, problems: list[str], entry: object, path: str) -> int | None:
    value, unit = _amd_leaf(where, problems, entry, path)
    factor = _AMD_UNITS.get("MB" if unit is None else str(unit).upper())
    if factor is None:
        problems.append(f"{where}: {path!r} has an unknown unit {_shown(unit)}")
        return None
    return _bytes(_first(where, problems, [(path, value)]), factor)


def parse_amd_smi(metric_text: str, static_text: str | None = None) -> GpuQuery:
    """Readings from `amd-smi metric -u -m -p -t --json`; names, arches (and the VRAM size when the metric
    lacks it) from `amd-smi static --asic --vram --json` when given."""
    problems: list[str] = []
    metrics = _amd_entries("amd-smi metric", metric_text, problems)
    statics = {} if static_text is None else _amd_entries("amd-smi static", static_text, problems)
    gpus = []
    for index, entry in metrics.items():
        where, static_where, static = f"amd-smi gpu {index}", f"amd-smi static gpu {index}", statics.get(index)
        total = _amd_bytes(where, problems, entry, "mem_usage.total_vram")
        if total is None and static is not None:
            total = _amd_bytes(static_where, problems, static, "vram.size")
        gpus.append(
            GpuReading(
                index=index,
                source="amd-smi",
                name=_text(_amd_leaf(static_where, problems, static, "asic.market_name")[0]),
                arch=_text(_amd_leaf(static_where, problems, static, "asic.target_graphics_version")[0]),
                utilization_pct=_amd_number(where, problems, entry, _AMD_USE),
                memory_used_bytes=_amd_bytes(where, problems, entry, "mem_usage.used_vram"),
                memory_total_bytes=total,
                temperature_c=_amd_number(where, problems, entry, _AMD_TEMPERATURE),
                power_w=_amd_number(where, problems, entry, _AMD_POWER),
            )
        )
    return GpuQuery(sorted(gpus, key=lambda gpu: gpu.index), problems)


def parse_nvidia_smi(text: str) -> GpuQuery:
    """Readings from `nvidia-smi --query-gpu=<NVIDIA_COLUMNS> --format=csv,noheader,nounits` (memory in MiB;
    "[N/A]" or "[Not Supported]" where a value is missing)."""
    problems: list[str] = []
    gpus = []
    unread = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) < len(NVIDIA_COLUMNS) or not re.fullmatch(r"[0-9]+", cells[0]):
            unread.append(line)
            continue
        index = int(cells[0])
        where = f"nvidia-smi gpu {index}"
        # A comma inside the name would shift the numbers, so they are taken from the end of the row.
        use, used, total, temperature, power = (
            _first(where, problems, [(column, cell)])
            for column, cell in zip(NVIDIA_COLUMNS[2:], cells[-5:], strict=True)
        )
        gpus.append(
            GpuReading(
                index=index,
                source="nvidia-smi",
                name=_text(", ".join(cells[1:-5])),
                utilization_pct=use,
                memory_used_bytes=_bytes(used, MIB),
                memory_total_bytes=_bytes(total, MIB),
                temperature_c=temperature,
                power_w=power,
            )
        )
    if unread:
        problems.append(
            f"nvidia-smi: {len(unread)} line(s) are not rows of {', '.join(NVIDIA_COLUMNS)}, "
            f"the first {_shown(unread[0])}"
        )
    return GpuQuery(sorted(gpus, key=lambda gpu: gpu.index), problems)


def _run(label: str, argv: list[str], timeout_s: float, problems: list[str]) -> str | None:
    """A tool's stdout, or None with a problem line when it cannot be had."""
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, encoding="utf-8", errors="replace", timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        problems.append(f"{label}: no answer within {timeout_s:g} s")
        return None
    except OSError as exc:
        problems.append(f"{label}: could not run ({exc})")
        return None
    # rocm-smi exits non-zero when any one sensor cannot be read (a card without HBM or edge sensors), after
    # printing good JSON: an answer that looks like JSON is parsed whatever the status, and judged by the parser
    if done.returncode != 0 and not done.stdout.lstrip().startswith(("{", "[")):
        message = done.stderr.strip() or done.stdout.strip()
        problems.append(f"{label}: exited with status {done.returncode} ({_shown(message)})")
        return None
    return done.stdout


# `amd-smi static` (names, archs) never changes while a process runs, and each amd-smi run costs about a second of
# CPU: the monitor asks once per tool path
_STATIC: dict[str, str] = {}


def _static(path: str, timeout_s: float, problems: list[str]) -> str | None:
    if path not in _STATIC:
        text = _run("amd-smi static", [path, *AMD_SMI_STATIC_ARGS], timeout_s, problems)
        if text is None:
            return None
        _STATIC[path] = text
    return _STATIC[path]


def _query(tool: str, path: str, timeout_s: float, problems: list[str]) -> GpuQuery | None:
    if tool == "amd-smi":
        metric = _run("amd-smi metric", [path, *AMD_SMI_METRIC_ARGS], timeout_s, problems)
        static = None if metric is None else _static(path, timeout_s, problems)
        return None if metric is None else parse_amd_smi(metric, static)
    parse, args = (parse_rocm_smi, ROCM_SMI_ARGS) if tool == "rocm-smi" else (parse_nvidia_smi, NVIDIA_SMI_ARGS)
    text = _run(tool, [path, *args], timeout_s, problems)
    return None if text is None else parse(text)


def query_gpus(tools: Sequence[str] | None = None, timeout_s: float = 5.0) -> GpuQuery:
    """Readings from the first tool (in order, default TOOLS) that is installed and reports a GPU. A missing
    tool is skipped silently; one that fails or reports nothing adds problem lines and the next is tried."""
    problems: list[str] = []
    for tool in TOOLS if tools is None else tools:
        if tool not in TOOLS:
            problems.append(f"{tool}: not one of the GPU tools read here ({', '.join(TOOLS)})")
            continue
        path = shutil.which(tool)
        if path is None:
            continue
        result = _query(tool, path, timeout_s, problems)
        if result is None:
            continue
        problems.extend(result.problems)
        if result.gpus:
            return GpuQuery(result.gpus, problems)
        if not result.problems:
            problems.append(f"{tool}: reported no GPUs")
    return GpuQuery([], problems)

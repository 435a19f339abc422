"""GPU readings parsed from recorded amd-smi / rocm-smi / nvidia-smi outputs, and `query_gpus` run against fake
tools on PATH. tests/fixtures/gpu_tools/README.md says where each output format comes from."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from gemmaforge.system.gpu_tools import (
    AMD_SMI_METRIC_ARGS,
    AMD_SMI_STATIC_ARGS,
    NVIDIA_SMI_ARGS,
    ROCM_SMI_ARGS,
    GpuQuery,
    GpuReading,
    parse_amd_smi,
    parse_nvidia_smi,
    parse_rocm_smi,
    query_gpus,
)
from tests.fake_gpu_tools import FakeRun, failing, hanging, install_fake_tools, read_calls

FIXTURES = Path(__file__).parents[1] / "fixtures" / "gpu_tools"
MIB = 1024**2

# The RX 7900 XTX as every AMD fixture records it: 24560 MiB of VRAM, 18942 MiB in use, 97 % busy, 71 C edge, 302 W.
XTX_TOTAL = 25753026560
XTX_USED = 18942 * MIB
XTX_AMD_SMI = GpuReading(
    index=0,
    source="amd-smi",
    name="AMD Radeon RX 7900 XTX",
    arch="gfx1100",
    utilization_pct=97.0,
    memory_used_bytes=XTX_USED,
    memory_total_bytes=XTX_TOTAL,
    temperature_c=71.0,
    power_w=302.0,
)


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


# ----------------------------------------------------------------------------------------------------- rocm-smi


def test_rocm_smi_rx_7900_xtx() -> None:
    result = parse_rocm_smi(fixture("rocm_smi_rx7900xtx.json"))
    # rocm-smi names the card without the vendor prefix amd-smi gives; every reading is the same.
    assert result == GpuQuery([replace(XTX_AMD_SMI, source="rocm-smi", name="Radeon RX 7900 XTX")], [])


def test_rocm_smi_mi300x_reads_socket_power_and_falls_back_to_junction_temperature() -> None:
    [gpu] = parse_rocm_smi(fixture("rocm_smi_mi300x.json")).gpus
    assert (gpu.name, gpu.arch) == ("AMD Instinct MI300X OAM", "gfx942")
    assert gpu.power_w == 684.0  # "Current Socket Graphics Package Power (W)"
    assert gpu.temperature_c == 63.0  # no edge sensor: junction
    assert (gpu.memory_total_bytes, gpu.memory_used_bytes, gpu.utilization_pct) == (206141652992, 160 * 1024**3, 100.0)


def test_rocm_smi_two_cards_of_an_older_version_without_gfx_version() -> None:
    result = parse_rocm_smi(fixture("rocm_smi_two_cards.json"))
    assert result.problems == []  # the "system" section is not a card
    assert [gpu.index for gpu in result.gpus] == [0, 1]
    assert all("7900 XTX" in (gpu.name or "") and gpu.arch is None for gpu in result.gpus)
    assert [(gpu.utilization_pct, gpu.memory_used_bytes, gpu.temperature_c, gpu.power_w) for gpu in result.gpus] == [
        (97.0, XTX_USED, 71.0, 302.0),
        (0.0, 794341376, 38.0, 19.0),
    ]


def test_rocm_smi_sorts_cards_and_skips_warning_lines_before_the_json() -> None:
    cards = json.loads(fixture("rocm_smi_two_cards.json"))
    reordered = {"system": cards["system"], "card1": cards["card1"], "card0": cards["card0"]}
    text = "WARNING: AMD GPU device(s) is/are in a low-power state. Check power control/runtime_status\n\n"
    result = parse_rocm_smi(text + json.dumps(reordered))
    assert [gpu.index for gpu in result.gpus] == [0, 1] and result.problems == []


def test_rocm_smi_older_lowercase_keys() -> None:
    text = '{"card3": {"Temperature (Sensor edge) (c)": "77.0", "Card series": "Vega 10 XT [Radeon RX Vega 64]"}}'
    [gpu] = parse_rocm_smi(text).gpus
    assert (gpu.index, gpu.temperature_c, gpu.name) == (3, 77.0, "Vega 10 XT [Radeon RX Vega 64]")


def test_rocm_smi_unreadable_values_are_none_with_a_problem_per_field() -> None:
    result = parse_rocm_smi(fixture("malformed_rocm_smi_bad_values.json"))
    [gpu] = result.gpus
    assert gpu == GpuReading(index=0, source="rocm-smi", name="Radeon RX 7900 XTX")
    assert result.problems == [
        "rocm-smi card0: 'GPU use (%)' is 'abc', not a number",
        "rocm-smi card0: 'VRAM Total Used Memory (B)' is 'N/A', not a number",
        "rocm-smi card0: 'VRAM Total Memory (B)' is '24 GiB', not a number",
        "rocm-smi card0: 'Temperature (Sensor edge) (C)' is 'hot', not a number",
        "rocm-smi card0: 'Average Graphics Package Power (W)' is 'N/A (Secondary die)', not a number",
        "rocm-smi card1: expected an object of fields, got 'N/A'",
    ]


# ------------------------------------------------------------------------------------------------------ amd-smi


@pytest.mark.parametrize("metric", ["amd_smi_metric_rx7900xtx_list.json", "amd_smi_metric_rx7900xtx_gpu_data.json"])
@pytest.mark.parametrize("static", ["amd_smi_static_rx7900xtx_list.json", "amd_smi_static_rx7900xtx_gpu_data.json"])
def test_amd_smi_list_and_gpu_data_shapes_read_the_same(metric: str, static: str) -> None:
    assert parse_amd_smi(fixture(metric), fixture(static)) == GpuQuery([XTX_AMD_SMI], [])


def test_amd_smi_of_rocm_6_0_prints_bare_numbers_under_older_names() -> None:
    result = parse_amd_smi(fixture("amd_smi_metric_rocm60.json"), fixture("amd_smi_static_rx7900xtx_list.json"))
    assert result == GpuQuery([XTX_AMD_SMI], [])


def test_amd_smi_without_static_has_no_name_but_every_metric() -> None:
    anonymous = replace(XTX_AMD_SMI, name=None, arch=None)
    assert parse_amd_smi(fixture("amd_smi_metric_rx7900xtx_gpu_data.json")) == GpuQuery([anonymous], [])


def test_amd_smi_group_warning_before_the_json_is_skipped() -> None:
    result = parse_amd_smi(fixture("amd_smi_metric_group_warning.txt"), fixture("amd_smi_static_rx7900xtx_list.json"))
    assert result == GpuQuery([XTX_AMD_SMI], [])


def test_amd_smi_na_values_are_none_with_a_problem_naming_the_field() -> None:
    result = parse_amd_smi(fixture("amd_smi_metric_na.json"), fixture("amd_smi_static_rx7900xtx_list.json"))
    [gpu] = result.gpus
    assert (gpu.utilization_pct, gpu.memory_used_bytes, gpu.power_w) == (None, None, None)
    assert gpu.temperature_c == 45.0  # edge is N/A: hotspot, and no problem for a sensor the card lacks
    assert (gpu.memory_total_bytes, gpu.name) == (XTX_TOTAL, "AMD Radeon RX 7900 XTX")
    assert result.problems == [
        "amd-smi gpu 0: 'usage' is 'N/A', not an object",
        "amd-smi gpu 0: 'mem_usage.used_vram' is 'N/A', not a number",
        "amd-smi gpu 0: 'power.socket_power' is 'N/A', not a number",
    ]


def test_amd_smi_memory_units_and_vram_size_from_static() -> None:
    metric = json.dumps([{"gpu": 2, "mem_usage": {"used_vram": {"value": 1.5, "unit": "GB"}}}])
    static = json.dumps({"gpu_data": [{"gpu": 2, "vram": {"size": {"value": 24560, "unit": "MB"}}}]})
    [gpu] = parse_amd_smi(metric, static).gpus
    assert (gpu.index, gpu.memory_used_bytes, gpu.memory_total_bytes) == (2, 1536 * MIB, XTX_TOTAL)


def test_amd_smi_unexpected_structure() -> None:
    result = parse_amd_smi(fixture("malformed_amd_smi_unexpected.json"), fixture("malformed_json_list_of_strings.json"))
    assert result.gpus == [GpuReading(index=1, source="amd-smi")]
    assert result.problems == [
        "amd-smi metric: skipped an entry without a GPU index: 'gpu0'",
        "amd-smi metric: skipped an entry without a GPU index: {'usage': {'gfx_activity': {'value': 5, 'unit': '%'}}}",
        "amd-smi static: skipped an entry without a GPU index: 'card0'",
        "amd-smi static: skipped an entry without a GPU index: 'card1'",
        "amd-smi gpu 1: 'mem_usage.total_vram' has an unknown unit 'parsecs'",
        "amd-smi gpu 1: 'usage.gfx_activity' is 'abc', not a number",
        "amd-smi gpu 1: 'temperature' is [1, 2], not an object",
        "amd-smi gpu 1: 'power' is 7, not an object",
    ]


# --------------------------------------------------------------------------------------------------- nvidia-smi


def test_nvidia_smi_one_gpu() -> None:
    assert parse_nvidia_smi(fixture("nvidia_smi_one.csv")) == GpuQuery(
        [
            GpuReading(
                index=0,
                source="nvidia-smi",
                name="NVIDIA GeForce RTX 4090",
                utilization_pct=98.0,
                memory_used_bytes=20345 * MIB,
                memory_total_bytes=24564 * MIB,
                temperature_c=72.0,
                power_w=431.25,
            )
        ],
        [],
    )


def test_nvidia_smi_two_gpus() -> None:
    result = parse_nvidia_smi(fixture("nvidia_smi_two.csv"))
    assert result.problems == []
    assert [(g.index, g.name, g.utilization_pct, g.memory_used_bytes, g.power_w) for g in result.gpus] == [
        (0, "NVIDIA A100-SXM4-80GB", 100.0, 71234 * MIB, 389.51),
        (1, "NVIDIA A100-SXM4-80GB", 0.0, 4 * MIB, 61.02),
    ]
    assert {g.memory_total_bytes for g in result.gpus} == {81920 * MIB}


def test_nvidia_smi_missing_values() -> None:
    result = parse_nvidia_smi(fixture("nvidia_smi_na_power.csv"))
    [gpu] = result.gpus
    assert (gpu.power_w, gpu.temperature_c, gpu.memory_total_bytes) == (None, 44.0, 2004 * MIB)
    assert result.problems == ["nvidia-smi gpu 0: 'power.draw' is '[N/A]', not a number"]
    older = parse_nvidia_smi("1, Tesla K80, [Not Supported], 0, 11441, 30, 25.68\n")
    assert older.gpus[0].utilization_pct is None and older.gpus[0].power_w == 25.68
    assert older.problems == ["nvidia-smi gpu 1: 'utilization.gpu' is '[Not Supported]', not a number"]


def test_nvidia_smi_comma_in_a_name_and_unsorted_rows() -> None:
    result = parse_nvidia_smi("1, Quadro RTX 8000, Rev. B, 5, 100, 46080, 40, 70.1\n0, Tesla T4, 0, 0, 15360, 35, 27\n")
    assert [(gpu.index, gpu.name, gpu.utilization_pct) for gpu in result.gpus] == [
        (0, "Tesla T4", 0.0),
        (1, "Quadro RTX 8000, Rev. B", 5.0),
    ]


# ---------------------------------------------------------------------------------------------- malformed input

PARSERS = {"rocm-smi": parse_rocm_smi, "amd-smi": parse_amd_smi, "nvidia-smi": parse_nvidia_smi}
MALFORMED = [
    "malformed_truncated.json",
    "malformed_html.html",
    "malformed_nvidia_driver_error.txt",
    "malformed_json_string.json",
    "malformed_json_list_of_strings.json",
    "",
]


@pytest.mark.parametrize("tool", PARSERS)
@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_output_gives_no_reading_and_a_problem(tool: str, name: str) -> None:
    result = PARSERS[tool](fixture(name) if name else "")
    assert result.gpus == []
    assert all(problem.startswith(tool) for problem in result.problems)
    assert result.problems or (tool, name) == ("nvidia-smi", "")  # CSV with no rows is no GPU, not an error


def test_truncated_json_names_the_tool_and_the_error() -> None:
    [problem] = parse_rocm_smi(fixture("malformed_truncated.json")).problems
    assert problem.startswith("rocm-smi: output is not JSON (Unterminated string")


VALID = {
    "rocm-smi": ["rocm_smi_rx7900xtx.json", "rocm_smi_mi300x.json", "rocm_smi_two_cards.json"],
    "amd-smi": [
        "amd_smi_metric_rx7900xtx_list.json",
        "amd_smi_metric_rx7900xtx_gpu_data.json",
        "amd_smi_metric_na.json",
        "amd_smi_metric_rocm60.json",
        "amd_smi_static_rx7900xtx_gpu_data.json",
    ],
    "nvidia-smi": ["nvidia_smi_one.csv", "nvidia_smi_two.csv", "nvidia_smi_na_power.csv"],
}


def check(result: object) -> None:
    assert isinstance(result, GpuQuery)
    assert all(isinstance(gpu, GpuReading) for gpu in result.gpus)
    assert all(isinstance(problem, str) for problem in result.problems)
    json.dumps([gpu.as_dict() for gpu in result.gpus], allow_nan=False)


def garbled(rng: random.Random, value: object) -> object:
    """The same JSON shape with some values swapped for ones of the wrong kind."""
    if isinstance(value, dict):
        return {key: garbled(rng, item) for key, item in value.items()}
    if isinstance(value, list):
        return [garbled(rng, item) for item in value]
    if rng.random() < 0.3:
        return rng.choice([None, True, -1, 1e308, "1e999", "nan", "abc", "", [], {}, {"value": "x"}, [1, 2], 10**30])
    return value


def test_fuzz_parsers_never_raise() -> None:
    rng = random.Random(1234)
    texts = []
    for name in [name for names in VALID.values() for name in names] + [n for n in MALFORMED if n]:
        text = fixture(name)
        texts += [text[:cut] for cut in range(0, len(text), 7)]
    for name in VALID["rocm-smi"] + VALID["amd-smi"]:
        texts += [json.dumps(garbled(rng, json.loads(fixture(name)))) for _ in range(20)]
    texts += [bytes(rng.randrange(256) for _ in range(rng.randrange(200))).decode("latin-1") for _ in range(200)]
    texts += ["[" * 100_000, "{" * 50_000, '{"card0": ' * 5_000, "\u2028{\x00", "0, a, 1, 2, 3, 4, 5\n" * 3]
    texts += [
        "0, \u0661, 1, 2, 3, 4, 5",
        "\u0661, x, 1, 2, 3, 4, 5",
        '[{"gpu": true}, {"gpu": 10000000000000000000000}]',
    ]
    for text in texts:
        for parse in PARSERS.values():
            check(parse(text))
        check(parse_amd_smi(fixture("amd_smi_metric_rx7900xtx_list.json"), text))


def test_as_dict_is_json_ready_and_keeps_none() -> None:
    reading = GpuReading(index=1, source="nvidia-smi", name="Tesla T4", power_w=27.5)
    assert json.loads(json.dumps(reading.as_dict())) == {
        "index": 1,
        "source": "nvidia-smi",
        "name": "Tesla T4",
        "arch": None,
        "utilization_pct": None,
        "memory_used_bytes": None,
        "memory_total_bytes": None,
        "temperature_c": None,
        "power_w": 27.5,
    }


# ------------------------------------------------------------------------------------ query_gpus with fake tools


@pytest.fixture
def bin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty directory that is the whole PATH, so no real GPU tool of this machine is found."""
    path = tmp_path / "bin"
    path.mkdir()
    monkeypatch.setenv("PATH", str(path))
    return path


AMD_METRIC = FIXTURES / "amd_smi_metric_rx7900xtx_list.json"
AMD_STATIC = FIXTURES / "amd_smi_static_rx7900xtx_gpu_data.json"
ROCM = FIXTURES / "rocm_smi_rx7900xtx.json"
NVIDIA = FIXTURES / "nvidia_smi_two.csv"


def test_query_prefers_amd_smi_and_runs_each_command_once(bin_dir: Path) -> None:
    install_fake_tools(bin_dir, amd_smi_metric=AMD_METRIC, amd_smi_static=AMD_STATIC, rocm_smi=ROCM, nvidia_smi=NVIDIA)
    assert query_gpus() == GpuQuery([XTX_AMD_SMI], [])
    assert read_calls(bin_dir) == [["amd-smi", *AMD_SMI_METRIC_ARGS], ["amd-smi", *AMD_SMI_STATIC_ARGS]]
    assert query_gpus() == GpuQuery([XTX_AMD_SMI], [])  # the static facts (name, arch) are asked once
    assert read_calls(bin_dir)[2:] == [["amd-smi", *AMD_SMI_METRIC_ARGS]]


def test_query_falls_through_a_failing_amd_smi_to_rocm_smi(bin_dir: Path) -> None:
    install_fake_tools(bin_dir, amd_smi_metric=failing("ERROR: amdgpu driver not loaded", status=2), rocm_smi=ROCM)
    result = query_gpus()
    assert [(gpu.source, gpu.name, gpu.memory_total_bytes) for gpu in result.gpus] == [
        ("rocm-smi", "Radeon RX 7900 XTX", XTX_TOTAL)
    ]
    assert result.problems == ["amd-smi metric: exited with status 2 ('ERROR: amdgpu driver not loaded')"]
    assert read_calls(bin_dir) == [["amd-smi", *AMD_SMI_METRIC_ARGS], ["rocm-smi", *ROCM_SMI_ARGS]]


def test_query_reads_rocm_smi_json_printed_before_a_nonzero_exit(bin_dir: Path) -> None:
    # rocm-smi exits 2 when one sensor of --showtemp is missing (the XTX has no HBM sensors), after good JSON
    answer = FakeRun(stdout=ROCM.read_bytes(), status=2)
    install_fake_tools(bin_dir, rocm_smi=answer)
    result = query_gpus()
    assert result == GpuQuery([replace(XTX_AMD_SMI, source="rocm-smi", name="Radeon RX 7900 XTX")], [])


def test_query_keeps_amd_smi_metrics_when_static_fails(bin_dir: Path) -> None:
    install_fake_tools(bin_dir, amd_smi_metric=AMD_METRIC, amd_smi_static=failing("static: segfault"), rocm_smi=ROCM)
    result = query_gpus()
    assert result.gpus == [replace(XTX_AMD_SMI, name=None, arch=None)]
    assert result.problems == ["amd-smi static: exited with status 1 ('static: segfault')"]


def test_query_times_out_a_hanging_tool(bin_dir: Path) -> None:
    install_fake_tools(bin_dir, amd_smi_metric=hanging(30), nvidia_smi=NVIDIA)
    result = query_gpus(timeout_s=0.5)  # the tool would hang 30 s: its problem line says it was cut
    assert [gpu.source for gpu in result.gpus] == ["nvidia-smi", "nvidia-smi"]
    assert result.problems == ["amd-smi metric: no answer within 0.5 s"]


def test_query_tries_the_next_tool_after_garbage_or_no_gpus(bin_dir: Path) -> None:
    install_fake_tools(
        bin_dir,
        amd_smi_metric="[]\n",
        amd_smi_static="[]\n",
        rocm_smi=FIXTURES / "malformed_html.html",
        nvidia_smi=NVIDIA,
    )
    result = query_gpus()
    assert len(result.gpus) == 2
    assert result.problems[0] == "amd-smi: reported no GPUs"
    assert result.problems[1].startswith("rocm-smi: output is not JSON (no line starts with { or [")


def test_query_without_tools_is_empty(bin_dir: Path) -> None:
    assert query_gpus() == GpuQuery([], [])


def test_query_reports_when_every_tool_fails(bin_dir: Path) -> None:
    install_fake_tools(
        bin_dir, rocm_smi=failing("rocm-smi: no devices"), nvidia_smi=FIXTURES / "malformed_truncated.json"
    )
    result = query_gpus()
    assert result.gpus == [] and [problem.split(":")[0] for problem in result.problems] == ["rocm-smi", "nvidia-smi"]


def test_query_only_the_tools_asked_for_in_their_order(bin_dir: Path) -> None:
    install_fake_tools(bin_dir, amd_smi_metric=AMD_METRIC, amd_smi_static=AMD_STATIC, nvidia_smi=NVIDIA)
    result = query_gpus(["nvidia-smi", "amd-smi"])
    assert {gpu.source for gpu in result.gpus} == {"nvidia-smi"}
    assert read_calls(bin_dir) == [["nvidia-smi", *NVIDIA_SMI_ARGS]]
    assert query_gpus(["xpu-smi"]).problems == [
        "xpu-smi: not one of the GPU tools read here (amd-smi, rocm-smi, nvidia-smi)"
    ]


def test_query_decodes_bad_bytes(bin_dir: Path) -> None:
    install_fake_tools(bin_dir, nvidia_smi=FakeRun(stdout=b"0, NVIDIA \xff GPU, 1, 2, 3, 4, 5\n"))
    [gpu] = query_gpus().gpus
    assert (gpu.name, gpu.power_w) == ("NVIDIA \ufffd GPU", 5.0)

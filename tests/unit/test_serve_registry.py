"""What `gemmaforge serve` loads, decided before any request: the transformers engine's weight type."""

from __future__ import annotations

from pathlib import Path

import pytest

from gemmaforge.models import default_home


@pytest.mark.slow
def test_dtype_auto_serves_bf16_where_the_hardware_has_it(tiny_gemma3_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` without --dtype is auto: bf16 weights when the bf16 probe finds hardware bf16, else fp32."""
    import torch

    import gemmaforge.train.precision as precision
    from gemmaforge.cli import build_parser
    from gemmaforge.cli.serve import serve_options
    from gemmaforge.serve.registry import Registry

    options = serve_options(build_parser().parse_args(["serve", str(tiny_gemma3_dir)]))
    assert options.dtype == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU's flags decide
    for flags, dtype, level in ((["avx512_bf16"], torch.bfloat16, "BF16"), ([], torch.float32, "F32")):
        monkeypatch.setattr(precision, "cpu_bf16_flags", lambda flags=flags: flags)
        registry = Registry(default_home(), dtype=options.dtype)
        try:
            served = registry.add(str(tiny_gemma3_dir))
            assert next(served.engine.model.parameters()).dtype == dtype
            assert served.details["quantization_level"] == level  # as /api/show and /api/tags report it
        finally:
            registry.close()

"""Rows on different LoRA adapters in one forward (inference/adapter_mix.py): each row computes what its adapter
computes alone, trained token rows included, and the serving engine decodes a LoRA fleet in shared steps."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from gemmaforge.families import FAMILIES
from gemmaforge.inference.jobs import Job, Params
from tests.engine_recording import RecordingEngine, submit_together
from tests.helpers import trained_adapter

MARKER_ROWS = [105, 106]  # <start_of_turn>, <end_of_turn> in the real tokenizer the tiny models carry


def save_adapter(base: Path, folder: Path, seed: int, **lora: object) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return trained_adapter(model, folder, seed, trainable_token_indices=MARKER_ROWS, **lora)


@pytest.fixture(scope="module")
def adapters_of(text_checkpoint_of, tmp_path_factory: pytest.TempPathFactory):
    """family -> two plain LoRA adapters of different ranks, targets and scaling (mixable), and a DoRA one (not)."""
    made: dict[str, dict[str, Path]] = {}

    def make(family: str) -> dict[str, Path]:
        if family not in made:
            base, root = text_checkpoint_of(family), tmp_path_factory.mktemp(f"mixed-adapters-{family}")
            made[family] = {
                "small": save_adapter(base, root / "small", 7, r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
                "wide": save_adapter(base, root / "wide", 2, r=8, lora_alpha=8, use_rslora=True,
                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"]),
                "dora": save_adapter(base, root / "dora", 3, r=4, lora_alpha=8, use_dora=True,
                                     target_modules=["q_proj", "v_proj"]),
            }
        return made[family]

    return make


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])  # Gemma 4: per-layer inputs, KV shared by the last layers
def test_each_row_computes_what_its_adapter_computes_alone(family: str, text_checkpoint_of, adapters_of) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from gemmaforge.inference.adapter_mix import AdapterMix
    from gemmaforge.train.template_tokens import use_sparse_template_tokens

    adapters = adapters_of(family)
    model = AutoModelForCausalLM.from_pretrained(text_checkpoint_of(family), dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(model, adapters["small"], adapter_name="small")
    mix = AdapterMix(peft)
    for name in ("small", "wide", "dora"):  # loaded one by one, as serve loads them: each load resets forwards
        if name != "small":
            peft.load_adapter(adapters[name], adapter_name=name)
        use_sparse_template_tokens(peft)
        mix.refresh(list(adapters)[:list(adapters).index(name) + 1])
    assert mix.slots == {"small": 1, "wide": 2}
    assert "LoRA variant (DoraLinearVariant)" in (mix.unmixable("dora") or "")

    tokenizer_ids = [2, 105, 1000, 106, 2000, 3000, 106]  # the markers (105, 106) in the input: their rows count
    ids = torch.tensor([tokenizer_ids] * 3)
    alone = []
    with torch.inference_mode():
        for row, adapter in enumerate(("small", "wide", None)):
            if adapter is None:
                peft.base_model.disable_adapter_layers()
            else:
                peft.base_model.enable_adapter_layers()
                peft.set_adapter(adapter)
            alone.append(model(ids[row:row + 1]).logits[0])
        peft.base_model.disable_adapter_layers()  # the DoRA adapter, if active, must not reach a mixed row
        with mix.rows(torch.tensor([1, 2, 0]), {"small", "wide"}):
            mixed = model(ids).logits
    for row in range(3):
        torch.testing.assert_close(mixed[row], alone[row], atol=1e-5, rtol=1e-5)
    # the check bites: each adapter changes the logits, its trained marker rows (output side) included
    assert (alone[0] - alone[2]).abs().max() > 1e-2 and (alone[1] - alone[0]).abs().max() > 1e-2
    assert (alone[0][:, 106] - alone[2][:, 106]).abs().max() > 1e-2
    # outside rows(), the layers compute as PEFT does
    peft.base_model.enable_adapter_layers()
    peft.set_adapter("wide")
    with torch.inference_mode():
        torch.testing.assert_close(model(ids[:1]).logits[0], alone[1])


def test_a_lora_fleet_decodes_in_shared_steps(tiny_gemma3_dir: Path, adapters_of) -> None:
    """Four requests at once, on the base model, two plain adapters and a DoRA one: the first three share every
    step, the DoRA one takes turns; each answer equals the same request's answer alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_gemma3_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32)
    engine = RecordingEngine(model, tokenizer, FAMILIES["gemma3"])
    for name, path in adapters_of("gemma3").items():
        engine.load_adapter(name, path)
    prompt = tokenizer("<bos><start_of_turn>user\ncoffee or tea?<end_of_turn>\n<start_of_turn>model\n",
                       add_special_tokens=False).input_ids
    lanes = (None, "small", "wide", "dora")

    async def answer(adapters: tuple[str | None, ...]) -> list[Job]:
        loop = asyncio.get_running_loop()
        return await submit_together(engine, [Job(prompt, Params(max_tokens=12, temperature=0), adapter, loop)
                                              for adapter in adapters])

    try:
        alone_jobs = [asyncio.run(answer((adapter,)))[0] for adapter in lanes]  # kept: chosen is keyed by id()
        alone = [engine.chosen[id(job)] for job in alone_jobs]
        assert engine.most_adapters_in_a_forward == 1
        together = asyncio.run(answer(lanes))
    finally:
        engine.close()
    assert [engine.chosen[id(job)] for job in together] == alone
    assert len({tuple(tokens) for tokens in alone}) == 4  # every adapter answers its own way
    assert all(len(tokens) == 12 for tokens in alone)  # none stops early: the shared three decode together throughout
    assert engine.most_adapters_in_a_forward == 3 and engine.widest_batch == 3  # base, small, wide; dora alone

"""Packing computes what separate examples compute; chunked cross-entropy equals the plain one."""

from __future__ import annotations

import pytest
import torch

from gemmaforge.train.collate import RightPadCollator
from gemmaforge.train.loss import chunked_cross_entropy, supervised_loss
from gemmaforge.train.packing import PackedCollator, pack_examples
from tests.helpers import example


def test_first_fit_decreasing_keeps_every_example_once() -> None:
    examples = [example(n, 2, i) for i, n in enumerate([30, 5, 17, 29, 8, 12, 3, 31])]
    rows = pack_examples(examples, cutoff_len=32)
    assert sum(r["examples"][0] for r in rows) == 8
    assert all(len(r["input_ids"]) <= 32 for r in rows)
    assert sorted(len(r["input_ids"]) for r in rows) == sorted([31, 30, 29 + 3, 17 + 12, 8 + 5])
    for row in rows:  # positions restart at each example's <bos>
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0]
        assert all(row["input_ids"][i] == 2 for i in starts)


@pytest.fixture(scope="module")
def tiny_model(tiny_gemma3_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32).eval()


def test_packed_rows_compute_what_separate_examples_compute(tiny_model) -> None:
    examples = [example(n, 4, i) for i, n in enumerate([21, 9, 14, 6])]
    padded = RightPadCollator(0)(examples)
    packed = PackedCollator(0)(pack_examples(examples, cutoff_len=32))
    assert packed["input_ids"].shape[0] < len(examples)
    with torch.no_grad():
        expected = supervised_loss(tiny_model, padded, None)
        got = supervised_loss(tiny_model, packed, None)
    assert torch.allclose(got, expected, atol=1e-5), (got, expected)
    # without the per-example positions, attention would cross examples and the loss would change
    crossed = {**packed, "segments": None,
               "position_ids": torch.arange(packed["input_ids"].shape[1]).repeat(packed["input_ids"].shape[0], 1)}
    with torch.no_grad():
        assert not torch.allclose(supervised_loss(tiny_model, crossed, None), expected, atol=1e-3)


def test_chunked_cross_entropy_equals_torchs_in_value_and_gradient() -> None:
    """Against torch's own cross-entropy on the full soft-capped logits (a cap of 3 that bites: logits reach ~4)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    hidden = (torch.randn(50, 16) * 4).requires_grad_(True)
    targets = torch.randint(0, 300, (50,))
    logits = head(hidden)
    assert logits.abs().max() > 3
    plain = torch.nn.functional.cross_entropy((torch.tanh(logits / 3.0) * 3.0).float(), targets, reduction="sum")
    grads_plain = torch.autograd.grad(plain, [hidden, head.weight])
    chunked = chunked_cross_entropy(hidden, targets, head, softcap=3.0, chunk_size=7)
    grads_chunked = torch.autograd.grad(chunked, [hidden, head.weight])
    assert torch.allclose(plain, chunked, atol=1e-4)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads_plain, grads_chunked))


@pytest.mark.parametrize("sliding_window", [64, 8])  # 8: the window cuts into the longer examples
def test_per_example_attention_equals_the_masked_row(tiny_gemma3_dir, sliding_window: int) -> None:
    """gemmaforge_packed (each example through SDPA alone, split by the collator's segments) gives the loss and
    gradients of transformers' SDPA with the block-diagonal mask it builds from the restarting positions."""
    from transformers import AutoModelForCausalLM

    from gemmaforge.train import packed_attention

    examples = [example(n, 4, i) for i, n in enumerate([21, 9, 14, 6, 30])]
    packed = PackedCollator(0)(pack_examples(examples, cutoff_len=32))
    results = []
    for implementation in ("sdpa", packed_attention.register()):
        model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32,
                                                     sliding_window=sliding_window,
                                                     attn_implementation=implementation)
        batch = packed if implementation != "sdpa" else {**packed, "segments": None}
        loss = supervised_loss(model, batch, None)
        loss.backward()
        results.append((loss.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()))
    (loss_ref, grad_ref), (loss_ours, grad_ours) = results
    torch.testing.assert_close(loss_ours, loss_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_ours, grad_ref, rtol=1e-4, atol=1e-6)


def test_per_example_attention_keeps_the_padding_mask_of_unpacked_batches(tiny_gemma3_dir) -> None:
    from transformers import AutoModelForCausalLM

    from gemmaforge.train import packed_attention

    padded = RightPadCollator(0)([example(n, 4, i) for i, n in enumerate([21, 9, 14])])
    losses = []
    for implementation in ("sdpa", packed_attention.register()):
        model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32,
                                                     attn_implementation=implementation)
        with torch.no_grad():
            losses.append(supervised_loss(model, padded, None))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)

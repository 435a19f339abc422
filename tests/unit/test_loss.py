import torch
from transformers import AutoModelForCausalLM

from gemmaforge.chat.conversation import IGNORE_INDEX
from gemmaforge.train.loss import supervised_loss


def batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 5000, (3, 24), generator=g)
    labels = ids.clone()
    labels[:, :9] = IGNORE_INDEX  # prompt
    labels[2, 18:] = IGNORE_INDEX  # padding of a shorter row
    attention = torch.ones_like(ids)
    attention[2, 18:] = 0
    return {"input_ids": ids, "attention_mask": attention, "labels": labels}


def test_equals_transformers_loss_without_full_logits(tiny_gemma3_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32)
    inputs = batch(0)
    with torch.no_grad():
        reference = model(**inputs).loss
        ours = supervised_loss(model, inputs, None)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


def test_item_count_makes_accumulated_micro_batches_equal_one_batch(tiny_gemma3_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32)
    a, b = batch(1), batch(2)
    whole = {k: torch.cat([a[k], b[k]]) for k in a}
    items = (whole["labels"][:, 1:] != IGNORE_INDEX).sum()
    with torch.no_grad():
        accumulated = supervised_loss(model, a, items) + supervised_loss(model, b, items)
        single = supervised_loss(model, whole, None)
    torch.testing.assert_close(accumulated, single, rtol=1e-5, atol=1e-6)


def test_the_output_layer_runs_only_at_supervised_positions(tiny_gemma3_dir) -> None:
    """Forward and backward of a training step multiply by the 262,144 x H output weight for exactly the positions
    whose next token is supervised (twice each: logits, then their gradient), never for prompt or padding."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32)
    model.get_input_embeddings().weight.requires_grad_(False)  # frozen and tied, as LoRA trains it
    vocab, hidden = model.get_input_embeddings().weight.shape

    class OutputLayerRows(TorchDispatchMode):
        rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                a, b = (args[1], args[2]) if func is torch.ops.aten.addmm.default else (args[0], args[1])
                if vocab in (*a.shape, *b.shape):
                    self.rows += a.shape[-2] * a.shape[-1] * b.shape[-1] // (vocab * hidden)
            return func(*args, **(kwargs or {}))

    inputs = batch(0)
    supervised = int((inputs["labels"][:, 1:] != IGNORE_INDEX).sum())
    with OutputLayerRows() as counted:
        supervised_loss(model, inputs, None, chunk_size=16).backward()
    assert supervised < inputs["input_ids"].numel() * 0.6 and counted.rows == 2 * supervised

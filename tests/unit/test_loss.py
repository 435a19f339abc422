import torch
from transformers import AutoModelForCausalLM

from gemmaforge.templates import IGNORE_INDEX
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

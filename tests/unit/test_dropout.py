import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from gemmaforge.train.dropout import ByteMaskDropout, use_byte_mask_dropout


def test_drops_at_rate_p_scales_the_rest_and_backpropagates_through_the_same_mask() -> None:
    torch.manual_seed(0)
    x = torch.randn(400, 500, requires_grad=True)
    y = ByteMaskDropout(0.1).train()(x)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.9) < 0.005
    torch.testing.assert_close(y[kept], x[kept] / 0.9)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, kept.float() / 0.9)


def test_what_backward_keeps_is_a_bool_mask_not_a_copy_of_the_input() -> None:
    """nn.Dropout keeps a mask of the input's dtype (4 bytes per element in fp32); ours keeps 1-byte bools."""
    saved: list[torch.Tensor] = []
    x = torch.randn(64, 32, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = ByteMaskDropout(0.1).train()(x)
    assert [(t.dtype, tuple(t.shape)) for t in saved] == [(torch.bool, (64, 32))]
    y.sum().backward()


def test_identity_in_eval_mode_and_at_p_zero() -> None:
    x = torch.randn(3, 4)
    assert ByteMaskDropout(0.5).eval()(x) is x
    assert ByteMaskDropout(0.0).train()(x) is x


def test_replaces_every_lora_dropout(tiny_gemma3_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]))
    assert use_byte_mask_dropout(model) == 2 * 2  # 2 layers x 2 targets
    assert not any(type(m) is torch.nn.Dropout for m in model.modules())

import torch
from transformers import AutoModelForCausalLM

from gemmaforge.train.geglu import use_recomputed_gelu


def test_values_and_gradients_equal_the_original_mlp(tiny_gemma3_dir) -> None:
    ids = torch.randint(5, 5000, (2, 12), generator=torch.Generator().manual_seed(0))
    results = []
    for patched in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32)
        if patched:
            assert use_recomputed_gelu(model) == 2  # one MLP per layer
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if "mlp" in n}))
    (loss_ref, grads_ref), (loss_ours, grads_ours) = results
    torch.testing.assert_close(loss_ours, loss_ref)
    assert grads_ours.keys() == grads_ref.keys() and len(grads_ours) == 6
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads_ours[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_keeps_two_tensors_of_the_mlp_width_instead_of_three() -> None:
    gate = torch.randn(8, 32, requires_grad=True)
    up = torch.randn(8, 32, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.nn.functional.gelu(gate, approximate="tanh") * up
    plain = len(saved)
    saved.clear()
    from gemmaforge.train.geglu import GatedGelu

    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        GatedGelu.apply(gate, up)
    assert (plain, len(saved)) == (3, 2)

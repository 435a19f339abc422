import pytest
import torch
from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

from gemmaforge.train.linear_cross_entropy import fusable_output_layer, linear_cross_entropy
from gemmaforge.train.loss import chunked_cross_entropy

VOCAB, HIDDEN = 300, 16


def plain_cross_entropy(hidden: torch.Tensor, targets: torch.Tensor, layer: torch.nn.Module,
                        softcap: float | None, chunk_size: int = 0, per_token: bool = False) -> torch.Tensor:
    """torch's own cross-entropy (summed, or per row) on the full logits: the reference, with nothing of ours in it."""
    logits = layer(hidden)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none" if per_token else "sum")


def output_layer(trained_tokens: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    linear = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    linear.weight.requires_grad_(False)
    if not trained_tokens:
        return linear
    layer = TrainableTokensLayer(linear, adapter_name="default", token_indices=[7, 250])
    layer.update_layer("default", token_indices=[7, 250])
    with torch.no_grad():
        layer.trainable_tokens_delta["default"].add_(torch.randn(2, HIDDEN))  # differ from the frozen rows
    return layer


@pytest.mark.parametrize("trained_tokens", [False, True])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("chunk_size", [5, 64])
@pytest.mark.parametrize("per_token", [False, True], ids=["summed", "per-token"])
def test_fused_loss_and_gradients_equal_torchs_cross_entropy(trained_tokens: bool, softcap: float | None,
                                                             chunk_size: int, per_token: bool) -> None:
    """Summed (SFT's loss) and per row (a preference loss's sequence log-probabilities, each row weighed by its own
    upstream gradient)."""
    layer = output_layer(trained_tokens)
    upstream = torch.rand(23) * 2 - 0.5 if per_token else torch.tensor(0.37)  # as with accumulation, or per row
    hidden = torch.randn(23, HIDDEN) * 4  # logits up to ~5: a cap of 3 bites
    targets = torch.randint(0, VOCAB, (23,))
    targets[:3] = torch.tensor([7, 250, 7])  # trained rows as targets too
    results = []
    for fused in (False, True):
        h = hidden.clone().requires_grad_(True)
        layer.zero_grad()
        compute = linear_cross_entropy if fused else plain_cross_entropy
        loss = compute(h, targets, layer, softcap, chunk_size, per_token=per_token)
        (loss * upstream).sum().backward()
        trained = [p.grad.clone() for p in layer.parameters() if p.requires_grad]
        results.append((loss.detach(), h.grad.clone(), trained))
    (loss_ref, dh_ref, dp_ref), (loss_ours, dh_ours, dp_ours) = results
    torch.testing.assert_close(loss_ours, loss_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dh_ours, dh_ref, rtol=1e-4, atol=1e-6)
    assert len(dp_ours) == len(dp_ref) == (1 if trained_tokens else 0)
    for ours, ref in zip(dp_ours, dp_ref):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-6)


def test_without_grad_the_plain_chunked_loss_is_used() -> None:
    """Evaluation wants no gradient: the fused path (which computes one in forward) steps aside, and the
    chunked loss the caller falls back to has the fused value."""
    layer = output_layer(trained_tokens=True)
    hidden, targets = torch.randn(9, HIDDEN), torch.randint(0, VOCAB, (9,))
    fused = linear_cross_entropy(hidden, targets, layer, None, 4)
    with torch.no_grad():
        assert linear_cross_entropy(hidden, targets, layer, None, 4) is None
        chunked = chunked_cross_entropy(hidden, targets, layer, None, 4)
        reference = plain_cross_entropy(hidden, targets, layer, None)
    torch.testing.assert_close(fused.detach(), reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked, reference, rtol=1e-5, atol=1e-5)


def test_a_trained_output_layer_is_left_to_autograd() -> None:
    trained = torch.nn.Linear(HIDDEN, VOCAB, bias=False)  # weight requires grad (modules_to_save)
    with_bias = torch.nn.Linear(HIDDEN, VOCAB)
    with_bias.requires_grad_(False)
    assert fusable_output_layer(trained) is None
    assert fusable_output_layer(with_bias) is None
    assert linear_cross_entropy(torch.randn(2, HIDDEN), torch.tensor([1, 2]), trained, None, 4) is None


@pytest.mark.parametrize(("dtype", "softcap"), [(torch.bfloat16, None), (torch.bfloat16, 30.0),
                                                (torch.float32, None), (torch.float32, 30.0)])
def test_a_chunk_holds_the_bytes_per_logit_the_planner_prices(dtype: torch.dtype, softcap: float | None) -> None:
    """The measured peak of one chunk's loss and gradient, per supervised position and vocabulary entry, is what
    the memory planner's logit_bytes says (6 in bf16, 4 in fp32, 8 with soft-capping) within 2%: the n x V
    buffers are all there is (a narrow hidden size leaves the rest negligible)."""
    from transformers import Gemma2Config

    from gemmaforge.train.linear_cross_entropy import _chunk_loss
    from gemmaforge.train.memory_plan import logit_bytes
    from tests.tensor_memory import PeakTensorMemory

    n, vocab, hidden = 64, 8192, 8
    h, weight = torch.randn(n, hidden, dtype=dtype), torch.randn(vocab, hidden, dtype=dtype)
    targets = torch.randint(0, vocab, (n,))
    inputs = sum(x.untyped_storage().nbytes() for x in (h, weight, targets))
    with PeakTensorMemory(h, weight, targets) as tracked:  # the inputs are counted, then taken off the peak
        loss, dlogits = _chunk_loss(h, targets, weight, None, None, softcap, True)
    assert dlogits.shape == (n, vocab) and loss.shape == (n,) and bool(torch.isfinite(loss).all())
    config = Gemma2Config(final_logit_softcapping=softcap)
    assert (tracked.peak - inputs) / (n * vocab) == pytest.approx(logit_bytes(config, dtype), rel=0.02)
    assert logit_bytes(config, dtype) == (8 if softcap else 6 if dtype == torch.bfloat16 else 4)


def test_the_output_layer_costs_two_multiplies_per_supervised_token() -> None:
    """Forward and backward together multiply each supervised hidden state by the V x H output weight twice
    (logits, then dh); the plain chunked loss, which recomputes each chunk's logits in backward, needs three."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OutputLayerMultiplies(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.macs = 0  # multiply-accumulates of products with a vocabulary-sized operand

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
                a, b = (args[1], args[2]) if func is torch.ops.aten.addmm.default else (args[0], args[1])
                if VOCAB in (*a.shape, *b.shape):
                    self.macs += a.shape[-2] * a.shape[-1] * b.shape[-1]
            return func(*args, **(kwargs or {}))

    layer, n = output_layer(trained_tokens=False), 23
    hidden, targets = torch.randn(n, HIDDEN), torch.randint(0, VOCAB, (n,))
    counts = []
    for compute in (linear_cross_entropy, chunked_cross_entropy):
        h = hidden.clone().requires_grad_(True)
        with OutputLayerMultiplies() as counter:
            compute(h, targets, layer, None, 5).backward()
        counts.append(counter.macs / (n * VOCAB * HIDDEN))
    assert counts == [2, 3]


def test_over_many_chunks_forward_and_backward_hold_one_chunk_of_logits_at_a_time() -> None:
    """Four chunks through the fused loss, forward and backward: the peak is one chunk's n x V buffers (4 bytes per
    logit in fp32), not four; a loss that kept its logits for backward would peak at all of them."""
    from tests.tensor_memory import PeakTensorMemory

    chunk, chunks, vocab, hidden = 64, 4, 8192, 8
    linear = torch.nn.Linear(hidden, vocab, bias=False).requires_grad_(False)
    h = torch.randn(chunk * chunks, hidden, requires_grad=True)
    targets = torch.randint(0, vocab, (chunk * chunks,))
    inputs = sum(x.untyped_storage().nbytes() for x in (h, linear.weight, targets))
    with PeakTensorMemory(h, linear.weight, targets) as tracked:
        linear_cross_entropy(h, targets, linear, None, chunk).backward()
    one_chunk = chunk * vocab * 4
    print(f"peak above the inputs: {(tracked.peak - inputs) / one_chunk:.3f} chunks of logits")
    assert h.grad is not None and one_chunk <= tracked.peak - inputs < 1.1 * one_chunk

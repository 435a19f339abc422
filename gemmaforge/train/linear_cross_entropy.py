"""The output layer and the cross-entropy in one pass, with the gradient computed in the forward.

For a chunk of supervised hidden states h (n, H) and the frozen output weight W (V, H):

    logits = h W^T (soft-capped where the family does), loss = sum(logsumexp(logits) - logits[target])
    dlogits = softmax(logits) - onehot(target)  (times the soft-cap derivative), dh = dlogits W

The forward keeps dh (n x H) and drops the chunk's n x V logits at once, and the backward only scales
dh by the incoming gradient. Computing the loss through autograd instead needs the logits in backward:
kept, they are the largest activation of a small Gemma (262,144 per supervised token); recomputed
(checkpointing), they cost a third n x V x H multiply per token on top of these two.

Chat-marker rows trained with PEFT's trainable tokens (see template_tokens.py) are handled here too:
their logits come from the trained rows, and their gradient goes back to those rows.
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.trainable_tokens.layer import TrainableTokensLayer
from peft.utils.other import TrainableTokensWrapper

from gemmaforge.train.template_tokens import token_index


class LinearCrossEntropy(torch.autograd.Function):
    """Cross-entropy of (hidden @ weight^T, rows `index` replaced by hidden @ delta^T) against targets, summed
    or, with `per_token`, one per row (what a preference loss sums per sequence). Gradients flow to hidden and
    delta; weight must be frozen. Per row, the delta's gradient is kept as d loss / d logits of the K trained rows
    (n x K) and weighed by the incoming gradient in backward, where the summed loss keeps their sum (K x H)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
                delta: torch.Tensor | None, index: torch.Tensor | None, softcap: float | None,
                chunk_size: int, per_token: bool = False) -> torch.Tensor:
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[3]
        grad_hidden = torch.zeros_like(hidden) if needs_grad else None
        trained = delta.to(weight.dtype) if delta is not None else None  # (K, H)
        correction = trained - weight[index] if trained is not None else None  # trained rows minus the frozen ones
        grad_delta = d_tokens = None
        if trained is not None and needs_grad and per_token:
            d_tokens = torch.zeros((hidden.shape[0], trained.shape[0]), dtype=torch.float32, device=hidden.device)
        elif delta is not None and needs_grad:
            grad_delta = torch.zeros_like(delta, dtype=torch.float32)
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            h, t = hidden[start:start + chunk_size], targets[start:start + chunk_size]  # (n, H), (n,)
            losses[start:start + chunk_size], dlogits = _chunk_loss(h, t, weight, trained, index, softcap, needs_grad)
            if dlogits is None:
                continue
            assert grad_hidden is not None  # dlogits only when gradients are needed
            grad_hidden[start:start + chunk_size] = dlogits @ weight
            if trained is not None:
                assert correction is not None
                d_trained = dlogits[:, index]  # (n, K)
                grad_hidden[start:start + chunk_size] += d_trained @ correction
                if d_tokens is not None:
                    d_tokens[start:start + chunk_size] = d_trained.float()
                else:
                    assert grad_delta is not None
                    grad_delta += (d_trained.T @ h).float()
            del dlogits  # before the next chunk's logits: one chunk's n x V buffers alive at a time
        ctx.save_for_backward(grad_hidden, grad_delta, d_tokens, hidden if d_tokens is not None else None)
        ctx.delta_dtype = delta.dtype if delta is not None else None
        ctx.per_token = per_token
        return losses if per_token else losses.sum()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_delta, d_tokens, hidden = ctx.saved_tensors
        scale = grad_loss[:, None] if ctx.per_token else grad_loss  # (n, 1) per row, or the summed loss's scalar
        d_hidden = grad_hidden * scale.to(grad_hidden.dtype) if ctx.needs_input_grad[0] else None
        d_delta = None
        if ctx.needs_input_grad[3]:
            d_delta = ((d_tokens * scale.float()).T @ hidden.float() if d_tokens is not None
                       else grad_delta * grad_loss).to(ctx.delta_dtype)
        return d_hidden, None, None, d_delta, None, None, None, None


def _chunk_loss(h: torch.Tensor, t: torch.Tensor, weight: torch.Tensor, trained: torch.Tensor | None,
                index: torch.Tensor | None, softcap: float | None,
                needs_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(n,) the loss of each row of one chunk and, when wanted, d loss / d logits in the weight's dtype. Its n x V
    buffers
    die on return; at most two fp32 ones live at once with soft-capping (the capped values and the logits), one
    without (plus the training dtype's copy while it converts): what the memory planner prices."""
    logits = (h @ weight.T).float()  # (n, V)
    if trained is not None:
        logits[:, index] = (h @ trained.T).float()
    capped = None
    if softcap:
        capped = logits.div_(softcap).tanh_()
        logits = capped * softcap
    target_logits = logits.gather(1, t[:, None]).squeeze(1)  # (n,)
    top = logits.amax(dim=-1, keepdim=True)  # (n, 1)
    probs = logits.sub_(top).exp_()  # unnormalised softmax, in place: no second n x V buffer
    total = probs.sum(dim=-1)  # (n,)
    loss = top.squeeze(1) + total.log() - target_logits  # logsumexp - target logit
    if not needs_grad:
        return loss, None
    dlogits = probs.div_(total[:, None])
    dlogits[torch.arange(len(t), device=t.device), t] -= 1
    if capped is not None:
        dlogits.mul_(capped.square_().neg_().add_(1))  # the soft-cap's derivative 1 - tanh^2, in place
        del capped
    del logits, probs
    return loss, dlogits.to(weight.dtype)


def fusable_output_layer(layer: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """(frozen weight, trained rows, their token ids) when `layer` is a bias-free linear output layer whose
    weight is frozen, optionally with one active set of PEFT trainable tokens; None for anything else (a
    trained full output layer, a bias, merged or several adapters), which takes the autograd path."""
    delta = index = None
    if isinstance(layer, TrainableTokensWrapper):  # how a PEFT model holds the layer
        layer = layer.token_adapter if layer.active_adapters else layer.original_module
    if isinstance(layer, TrainableTokensLayer):
        adapters = [name for name in layer.active_adapters if name in layer.trainable_tokens_delta]
        if layer.disable_adapters or layer.merged or len(adapters) > 1:
            return None
        if adapters:
            delta = layer.trainable_tokens_delta[adapters[0]]
            index = token_index(layer, adapters[0], delta.device)
        layer = layer.base_layer
    if type(layer) is not torch.nn.Linear or layer.bias is not None or layer.weight.requires_grad:
        return None
    return layer.weight, delta, index


def linear_cross_entropy(hidden: torch.Tensor, targets: torch.Tensor, output_layer: Any, softcap: float | None,
                         chunk_size: int, per_token: bool = False) -> torch.Tensor | None:
    """Cross-entropy through `output_layer`, summed or per row, fused (see the module docstring); None when the
    layer cannot be fused or no gradient is wanted (the caller's plain chunked loss is then cheaper)."""
    parts = fusable_output_layer(output_layer) if torch.is_grad_enabled() else None  # evaluation: nothing to fuse
    if parts is None:
        return None
    weight, delta, index = parts
    return LinearCrossEntropy.apply(hidden, targets, weight, delta, index, softcap, chunk_size, per_token)

"""Loss over supervised positions only.

Gemma 3's output layer has 262,144 rows: computed for every position it is most of a small
model's FLOPs and activation memory. Prompt and padding positions carry no loss, so the
output layer runs only on the hidden states whose next token is supervised.
"""

from __future__ import annotations

import math
import time
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import ModelOutput

from gemmaforge.chat.conversation import IGNORE_INDEX
from gemmaforge.system.memory import peak_memory_bytes
from gemmaforge.system.monitor import DeviceMonitor
from gemmaforge.train.linear_cross_entropy import linear_cross_entropy
from gemmaforge.train.reward_head import REWARD_HEAD, pooled_rewards
from gemmaforge.train.trainer_shims import ShimmedTrainer


def supervised_loss(
    model: Any, inputs: dict[str, torch.Tensor], num_items: int | torch.Tensor | None, chunk_size: int = 1024
) -> torch.Tensor:
    """Mean next-token cross-entropy over supervised positions (sum / num_items when the trainer
    counts items across gradient accumulation, exactly like transformers' own causal-LM loss).
    Packed batches come with position_ids, their segments and no attention mask (see train/packing.py)."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden, targets = supervised_states(_last_hidden(causal_lm, inputs), inputs["labels"],
                                        inputs.get("supervised_positions"))
    output_layer = causal_lm.get_output_embeddings()
    softcap = _softcap(causal_lm)
    loss = linear_cross_entropy(hidden, targets, output_layer, softcap, chunk_size)
    if loss is None:  # an output layer that is itself trained (modules_to_save) goes through autograd
        loss = chunked_cross_entropy(hidden, targets, output_layer, softcap, chunk_size)
    denominator = num_items if num_items is not None else targets.shape[0]
    if isinstance(denominator, torch.Tensor):
        denominator = denominator.to(loss.device)
    return loss / denominator


def sequence_logps(model: Any, inputs: dict[str, torch.Tensor],
                   chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) the summed log-probability of each row's supervised tokens (fp32), and (B,) how many there are: what a
    preference loss compares. The output layer runs on the supervised positions only, `chunk_size` at a time, fused
    with the loss as supervised_loss runs it."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    labels = inputs["labels"]
    keep = labels[:, 1:] != IGNORE_INDEX  # (B, T-1): position t predicts token t+1
    hidden, targets = _last_hidden(causal_lm, inputs)[:, :-1][keep], labels[:, 1:][keep]
    rows = torch.arange(labels.shape[0], device=labels.device).unsqueeze(1).expand_as(keep)[keep]
    output_layer, softcap = causal_lm.get_output_embeddings(), _softcap(causal_lm)
    token_losses = linear_cross_entropy(hidden, targets, output_layer, softcap, chunk_size, per_token=True)
    if token_losses is None:  # no gradient wanted, or an output layer that trains: through autograd
        token_losses = chunked_cross_entropy(hidden, targets, output_layer, softcap, chunk_size, reduction="none")
    token_logps = -token_losses
    logps = torch.zeros(labels.shape[0], dtype=torch.float32, device=token_logps.device)
    return logps.index_add(0, rows.to(token_logps.device), token_logps), keep.sum(dim=1)


def sequence_rewards(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B,) a reward model's score of each (right-padded) row: its head on the last attended position; the output
    layer never runs."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    return pooled_rewards(getattr(causal_lm, REWARD_HEAD), _last_hidden(causal_lm, inputs), inputs["attention_mask"])


def supervised_log_probs(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N, V) the log-softmax over the whole vocabulary at the N positions whose next token is supervised (fp32):
    what a divergence between two models' answers compares. For a few rows at a time (evaluation)."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden, _ = supervised_states(_last_hidden(causal_lm, inputs), inputs["labels"], None)
    logits = causal_lm.get_output_embeddings()(hidden).float()
    softcap = _softcap(causal_lm)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits.log_softmax(dim=-1)


def _last_hidden(causal_lm: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The decoder's last hidden states. Packed batches come with position_ids, their segments and no attention
    mask (see train/packing.py)."""
    if "position_ids" in inputs:  # packed: the attention reads where each example ends from the segments
        body = causal_lm.model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=False,
                               **({"segments": inputs["segments"]} if inputs.get("segments") is not None else {}))
    else:
        body = causal_lm.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False,
                               **_media_inputs(causal_lm, inputs))
    return body.last_hidden_state


def _softcap(causal_lm: Any) -> float | None:
    # multimodal configs keep the text model's settings in text_config
    return getattr(causal_lm.config.get_text_config(), "final_logit_softcapping", None)


def supervised_states(last_hidden: torch.Tensor, labels: torch.Tensor,
                      positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, H) hidden states of the N positions whose next token is supervised, and those N tokens. `positions`
    (the collator's flat indices, train/collate.py) gathers them without asking the device how many there are,
    which a boolean mask would."""
    if positions is None:
        keep = labels[:, 1:] != IGNORE_INDEX  # (B, T-1): position t predicts token t+1
        return last_hidden[:, :-1][keep], labels[:, 1:][keep]
    positions = positions.to(last_hidden.device)
    return (last_hidden.reshape(-1, last_hidden.shape[-1]).index_select(0, positions),
            labels.reshape(-1).index_select(0, positions + 1))


# What a batch with images or clips brings (train/collate.py MediaBatches): the image processor's and the feature
# extractor's outputs and the token types
MEDIA_INPUTS = ("pixel_values", "image_position_ids", "input_features", "input_features_mask", "token_type_ids",
                "mm_token_type_ids")


def _media_inputs(causal_lm: Any, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch's image and audio inputs, pixels and audio features in the dtype the model computes in."""
    found = {key: inputs[key] for key in MEDIA_INPUTS if inputs.get(key) is not None}
    for key in ("pixel_values", "input_features"):
        if key in found:
            found[key] = found[key].to(causal_lm.dtype)
    return found


def chunked_cross_entropy(
    hidden: torch.Tensor, targets: torch.Tensor, output_layer: Any, softcap: float | None, chunk_size: int,
    reduction: str = "sum",
) -> torch.Tensor:
    """Cross-entropy of output_layer(hidden) against targets (summed, or per row with reduction="none"),
    `chunk_size` rows at a time. Above one chunk each chunk's logits are recomputed in backward instead of kept, so
    at most chunk_size x vocabulary logits ever exist; a single chunk runs plainly (no recompute)."""

    def chunk_loss(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logits = output_layer(h)  # (n, V)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return F.cross_entropy(logits.float(), t, reduction=reduction)

    if hidden.shape[0] <= chunk_size:
        return chunk_loss(hidden, targets)
    chunks = [torch.utils.checkpoint.checkpoint(chunk_loss, h, t, use_reentrant=False)
              for h, t in zip(hidden.split(chunk_size), targets.split(chunk_size))]
    return torch.cat(chunks) if reduction == "none" else torch.stack(chunks).sum()


@dataclass
class SequenceLogps(ModelOutput):
    """What the installed forward returns when asked for `sequence_logps`: see `sequence_logps`."""

    logps: torch.Tensor | None = None
    counts: torch.Tensor | None = None


@dataclass
class SequenceRewards(ModelOutput):
    """What the installed forward returns when asked for `rewards`: see `sequence_rewards`."""

    rewards: torch.Tensor | None = None


def install_supervised_forward(model: Any, chunk_size: int) -> None:
    """Make the causal LM's own forward return `supervised_loss` (and no logits). The Trainer then calls
    the top-level model as usual, so wrappers around it (PEFT, DistributedDataParallel, whose forward
    arms the gradient all-reduce) stay on the path."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model

    def forward(self: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                num_items_in_batch: Any = None, **extra: Any) -> ModelOutput:
        inputs: dict[str, Any] = {"input_ids": input_ids, "labels": labels,
                                  "supervised_positions": extra.get("supervised_positions")}
        inputs.update({"position_ids": position_ids, "segments": extra.get("segments")} if position_ids is not None
                      else {"attention_mask": attention_mask, **{k: extra.get(k) for k in MEDIA_INPUTS}})
        if extra.get("sequence_logps"):  # a preference method's forward: each row's log-probability
            return SequenceLogps(*sequence_logps(self, inputs, chunk_size))
        if extra.get("rewards"):  # a reward model's forward: each row's score
            return SequenceRewards(sequence_rewards(self, inputs))
        return CausalLMOutputWithPast(loss=supervised_loss(self, inputs, num_items_in_batch, chunk_size))

    causal_lm.forward = types.MethodType(forward, causal_lm)


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or infinite at `step`."""

    def __init__(self, step: int, loss: float):
        super().__init__(f"loss {loss} at step {step}")
        self.step, self.loss = step, loss


class SupervisedLossTrainer(ShimmedTrainer):
    """A Trainer for a model prepared with `install_supervised_forward`: its loss is `supervised_loss`, already
    normalised by the item count of the whole accumulated batch (so the Trainer must not divide it by the
    accumulation steps again). It stops at the first non-finite loss (read at each log and checkpoint), and adds
    supervised tokens/s and peak memory to every log."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.model_accepts_loss_kwargs = True  # makes the Trainer count num_items_in_batch
        self.loss_is_scaled_for_ga = True
        self.supervised_tokens = 0  # since the last log
        self.examples_trained = self.supervised_trained = 0  # by this process's loop
        self.positions = self.padding = 0  # of the batches trained: for the slow-step findings
        self.last_log_time = time.perf_counter()
        self.unchecked_losses: list[tuple[int, torch.Tensor]] = []  # (step, loss) not yet read back
        self.monitor: DeviceMonitor | None = None  # its readings join every training log

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        counts = inputs.pop("counts")  # counted on the host by the collator (train/collate.py)
        self.supervised_tokens += counts.supervised
        self.supervised_trained += counts.supervised
        self.examples_trained += counts.examples
        self.positions += counts.positions
        self.padding += counts.padding
        loss = super().training_step(model, inputs, num_items_in_batch)
        # read back at the next log or checkpoint, all at once: a read at every step would stop the host until the
        # GPU has finished the step, so it could never queue the next one while the GPU works
        self.unchecked_losses.append((self.state.global_step + 1, loss.detach()))
        return loss

    def check_finite(self) -> None:
        """NonFiniteLoss for the first NaN/inf loss since the last check: before anything is logged or saved."""
        if not self.unchecked_losses:
            return
        steps, losses = zip(*self.unchecked_losses)
        self.unchecked_losses = []
        for step, value in zip(steps, torch.stack(losses).float().tolist()):
            if not math.isfinite(value):
                raise NonFiniteLoss(step, value)

    def before_checkpoint(self) -> None:
        self.check_finite()  # a checkpoint of weights trained on a NaN would be resumed from

    @property
    def padding_share(self) -> float:
        return self.padding / self.positions if self.positions else 0.0

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        self.check_finite()
        if "loss" in logs:
            now = time.perf_counter()
            logs["supervised_tokens_per_second"] = round(
                self.supervised_tokens / max(now - self.last_log_time, 1e-9), 1
            )
            logs["peak_memory_bytes"] = peak_memory_bytes()
            self.supervised_tokens, self.last_log_time = 0, now
            if self.monitor is not None:
                logs.update(self.monitor.fields())
        super().log(logs, start_time)

    def prediction_step(self, model: Any, inputs: dict[str, torch.Tensor], prediction_loss_only: bool,
                        ignore_keys: Any = None) -> tuple[torch.Tensor, None, None]:
        """Evaluation needs the loss only; never build full-vocabulary logits for it."""
        inputs = self._prepare_inputs(inputs)
        inputs.pop("counts", None)
        with torch.no_grad():
            loss = model(**inputs).loss
        return loss.detach(), None, None

"""The packed attention's kernels compute what transformers' masked attention computes (loss and gradients within
1e-5 in fp32), a packed training step reads nothing back from the device, and the kernel of each layer is chosen
as train.attention says (measured on the device for `auto` where several can run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gemmaforge.errors import UserError
from gemmaforge.train import packed_attention
from gemmaforge.train.attention_kernels import supports
from gemmaforge.train.kernel_choice import CACHE_NAME, choose_kernels
from gemmaforge.train.loss import supervised_loss
from gemmaforge.train.packing import PackedCollator, pack_examples
from gemmaforge.train.segments import PackedSegments
from tests.helpers import example

EXAMPLES = [example(n, 4, i) for i, n in enumerate([21, 9, 14, 6, 30])]


def packed_batch() -> dict:
    return PackedCollator(0)(pack_examples(EXAMPLES, cutoff_len=32))


def loss_and_grads(checkpoint: Path, attention: str, batch: dict, kernel: str | None = None, **config: object):
    """The loss and every parameter's gradient; the loss alone for flex, which has no backward on the CPU (its
    backward is flex_attention's own, run on a GPU by benchmarks/gpu_train_compare.py)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation=attention,
                                                 **config)
    if kernel:
        packed_attention.use_kernels(model, {m.head_dim: kernel for m in packed_attention.attention_modules(model)})
    with torch.set_grad_enabled(kernel != "flex"):
        loss = supervised_loss(model, batch, None)
    if kernel == "flex":
        return loss, ()
    return loss.detach(), torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])


def assert_same(got: tuple, want: tuple) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_segments_come_from_the_collator_with_each_rows_padding_as_its_own() -> None:
    rows = [{"input_ids": [2] * n, "labels": [2] * n, "position_ids": list(range(n)), "lengths": [n],
             "examples": [1]} for n in (5, 3)]
    batch = PackedCollator(0)(rows)
    segments = batch["segments"]
    assert segments.rows == [[5], [3, 2]] and segments.max_length == 5
    assert segments.cu_seqlens(torch.device("cpu")).tolist() == [0, 5, 8, 10]
    assert segments.document_ids(torch.device("cpu")).tolist() == [[0] * 5, [0, 0, 0, 1, 1]]
    # the same as reading the positions back, which the collator's lengths avoid
    assert PackedSegments.from_position_ids(batch["position_ids"]).rows == segments.rows
    with pytest.raises(ValueError, match="sum to 4"):
        PackedSegments([[3]], 4)


@pytest.mark.parametrize("kernel", ["segments", "flex"])
@pytest.mark.parametrize("sliding_window", [64, 8])  # 8: the window cuts into the longer examples
def test_gemma3_kernels_equal_the_masked_sdpa(tiny_gemma3_dir: Path, kernel: str, sliding_window: int) -> None:
    batch = packed_batch()
    want = loss_and_grads(tiny_gemma3_dir, "sdpa", {**batch, "segments": None}, sliding_window=sliding_window)
    got = loss_and_grads(tiny_gemma3_dir, packed_attention.register(), batch, kernel, sliding_window=sliding_window)
    assert_same(got, want)


@pytest.mark.parametrize("kernel", ["segments", "flex"])
def test_gemma2_kernels_soft_cap_as_its_eager_attention(text_checkpoint_of, kernel: str) -> None:
    """A cap low enough to bite (the tiny model's scores are far below Gemma 2's 50): the capped loss differs from
    the uncapped one by 3e-4, 30 times the tolerance, and the kernels equal transformers' eager attention."""
    checkpoint, batch = text_checkpoint_of("gemma2"), packed_batch()
    reference = {**batch, "segments": None}
    want = loss_and_grads(checkpoint, "eager", reference, attn_logit_softcapping=0.02)
    uncapped = loss_and_grads(checkpoint, "eager", reference, attn_logit_softcapping=None)
    assert abs(float(want[0] - uncapped[0])) > 1e-4
    got = loss_and_grads(checkpoint, packed_attention.register(), batch, kernel, attn_logit_softcapping=0.02)
    assert_same(got, want)


class DeviceReads(TorchDispatchMode):
    """Records every operator whose result the host must wait for: a scalar read (`.item()`, `.tolist()`,
    `int()`, `if tensor`) or an output whose size depends on the values (nonzero, boolean-mask indexing)."""

    WAITING = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "unique",
               "repeat_interleave"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name().split("::")[-1].removesuffix(".default")
        if name in self.WAITING or (name.startswith("index.") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else []))):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_a_packed_training_step_reads_nothing_back_from_the_device(tiny_gemma3_dir: Path) -> None:
    """Forward, loss and backward of a LoRA model as training wraps it, on a packed batch from the collator: no
    operator whose answer the host waits for. Without the collator's segments and positions (the fallback that
    reads the positions back), the same check sees the reads, so it can fail."""
    from transformers import AutoModelForCausalLM

    from gemmaforge.families import FAMILIES
    from gemmaforge.train.wrapping import wrap_for_training
    from tests.helpers import run_config

    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32)
    model = wrap_for_training(model, run_config(train={"packing": True}), FAMILIES["gemma3"], ["q_proj", "v_proj"],
                              template_ids=None).train()
    batch = packed_batch()
    counts = batch.pop("counts")
    assert counts.examples == len(EXAMPLES)
    for fallback, expect_reads in ((False, False), (True, True)):
        inputs = {**batch, "segments": None, "supervised_positions": None} if fallback else batch
        with DeviceReads() as reads:
            loss = model(**inputs).loss
            loss.backward()
        assert bool(reads.seen) == expect_reads, reads.seen


def sample() -> PackedSegments:
    return packed_batch()["segments"]


def test_auto_on_the_cpu_takes_segments_without_measuring(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32)

    def measure(*_):
        raise AssertionError("measured on the CPU")

    choice = choose_kernels("auto", model, torch.device("cpu"), torch.float32, sample(), tmp_path, measure)
    assert set(choice.kernels.values()) == {"segments"} and not choice.timings_ms
    assert "the CPU's fastest" in choice.notes[0]


@pytest.mark.parametrize("kernel", ["flash", "flex"])
def test_a_gpu_kernel_asked_for_on_the_cpu_is_refused_naming_the_key(tiny_gemma3_dir: Path, tmp_path: Path,
                                                                    kernel: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32)
    with pytest.raises(UserError, match=f"train.attention={kernel}: {kernel} needs a GPU"):
        choose_kernels(kernel, model, torch.device("cpu"), torch.float32, sample(), tmp_path)


def test_several_kernels_are_measured_once_per_shape(tiny_gemma3_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Where several kernels can run (a GPU; here flex is let through on the CPU), each is timed on the run's shape;
    a kernel that fails there is left out (flex has no backward on the CPU); the next run of the same shape reads
    the measurement back instead of measuring again."""
    from transformers import AutoModelForCausalLM

    from gemmaforge.train import kernel_choice

    monkeypatch.setattr(kernel_choice, "unavailable", lambda kernel, device: None if kernel != "flash" else "absent")
    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32)
    choice = choose_kernels("auto", model, torch.device("cpu"), torch.float32, sample(), tmp_path)
    (head_dim, timings), = choice.timings_ms.items()
    assert list(timings) == ["segments"] and timings["segments"] > 0  # measured for real; flex failed
    assert choice.kernels == {head_dim: "segments"}
    cached = json.loads((tmp_path / CACHE_NAME).read_text())
    assert list(cached.values()) == [timings]

    def measure(*_):
        raise AssertionError("measured again")

    assert choose_kernels("auto", model, torch.device("cpu"), torch.float32, sample(), tmp_path, measure).kernels \
        == choice.kernels
    # the fastest is kept, and said with every timing
    timed = {"segments": 0.004, "flex": 0.001}
    fresh = choose_kernels("auto", model, torch.device("cpu"), torch.float32, sample(), tmp_path / "fresh",
                           lambda kernel, *_: timed[kernel])
    assert fresh.kernels == {head_dim: "flex"}
    assert fresh.notes == [f"head size {head_dim}: flex, the fastest measured on this device "
                           "(flex 1 ms, segments 4 ms)"]


def test_flash_leaves_head_sizes_above_256_to_another_kernel() -> None:
    """Gemma 4 31B's global layers have head size 512, beyond FlashAttention 2; its sliding layers 256."""
    assert supports("flash", 256, torch.bfloat16) is None
    assert "up to 256, not 512" in supports("flash", 512, torch.bfloat16)
    assert "bf16 or fp16" in supports("flash", 128, torch.float32)
    assert supports("segments", 512, torch.float32) is None and supports("flex", 512, torch.bfloat16) is None


def test_attention_other_than_auto_needs_packing() -> None:
    from gemmaforge.config import TrainConfig

    with pytest.raises(ValueError, match="attention=flash is the kernel of packed rows"):
        TrainConfig(attention="flash", packing=False)

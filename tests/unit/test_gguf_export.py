"""GGUF export of a tiny random Gemma 3, read back with gguf-py's own reader."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import MODEL_TENSOR, Keys, TokenType
from gguf import GGMLQuantizationType as QType
from safetensors.torch import load_file, save_file

from gemmaforge.config import GGUF_QUANTS, ExportConfig
from gemmaforge.errors import UserError
from gemmaforge.export import gguf as gguf_export
from gemmaforge.export.gguf import _QUANTS, write_gguf
from gemmaforge.export.gguf_vocab import load_vocab
from gemmaforge.export.quantize import K_QUANTS
from gemmaforge.gguf_file import GGUFFile, read_gguf
from gemmaforge.model_spec import read_spec

ARCH = "gemma3"
N_VOCAB = 262144
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
FOLDER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"

# HF module inside model.layers.N -> GGUF tensor (spelled from gguf's constants, not its HF map)
LAYER_TENSORS = {
    "input_layernorm": MODEL_TENSOR.ATTN_NORM,
    "self_attn.q_proj": MODEL_TENSOR.ATTN_Q,
    "self_attn.k_proj": MODEL_TENSOR.ATTN_K,
    "self_attn.v_proj": MODEL_TENSOR.ATTN_V,
    "self_attn.o_proj": MODEL_TENSOR.ATTN_OUT,
    "self_attn.q_norm": MODEL_TENSOR.ATTN_Q_NORM,
    "self_attn.k_norm": MODEL_TENSOR.ATTN_K_NORM,
    "post_attention_layernorm": MODEL_TENSOR.ATTN_POST_NORM,
    "pre_feedforward_layernorm": MODEL_TENSOR.FFN_PRE_NORM,
    "post_feedforward_layernorm": MODEL_TENSOR.FFN_POST_NORM,
    "mlp.gate_proj": MODEL_TENSOR.FFN_GATE,
    "mlp.up_proj": MODEL_TENSOR.FFN_UP,
    "mlp.down_proj": MODEL_TENSOR.FFN_DOWN,
}


def expected_names(n_layers: int) -> dict[str, str]:
    """HF tensor name -> GGUF tensor name for a tied Gemma3ForCausalLM."""
    names = {
        "model.embed_tokens.weight": gguf.TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD] + ".weight",
        "model.norm.weight": gguf.TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM] + ".weight",
    }
    for i in range(n_layers):
        for module, tensor in LAYER_TENSORS.items():
            names[f"model.layers.{i}.{module}.weight"] = gguf.TENSOR_NAMES[tensor].format(bid=i) + ".weight"
    return names


def field(reader: GGUFFile, key: str):
    return reader.fields[key].value


def llm_key(key: str) -> str:
    return key.format(arch=ARCH)


def values(tensor) -> np.ndarray:
    """A GGUF tensor as float32 in numpy (row-major HF) order."""
    return gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(
        [int(n) for n in reversed(tensor.shape)]
    )


@pytest.fixture(scope="module")
def source(tiny_gemma3_dir: Path) -> dict[str, np.ndarray]:
    return {k: v.float().numpy() for k, v in load_file(tiny_gemma3_dir / "model.safetensors").items()}


@pytest.fixture(scope="module")
def config(tiny_gemma3_dir: Path) -> dict:
    return json.loads((tiny_gemma3_dir / "config.json").read_text())


def with_tied_lm_head(model_dir: Path, target: Path) -> Path:
    """A copy whose safetensors also hold lm_head.weight (some merges save it although tied)."""
    shutil.copytree(model_dir, target)
    tensors = load_file(target / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def with_own_chat_template(model_dir: Path, target: Path) -> Path:
    """A copy with its own chat template in chat_template.jinja (where transformers saves it)."""
    shutil.copytree(model_dir, target)
    (target / "chat_template.jinja").write_text(FOLDER_TEMPLATE, encoding="utf-8")
    return target


@pytest.fixture(scope="module")
def written(tiny_gemma3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, GGUFFile]:
    """One file per quant (reading back a 262k vocabulary takes a while: each is read once)."""
    out = tmp_path_factory.mktemp("gguf")
    sources = {
        "f32": tiny_gemma3_dir,
        "f16": tiny_gemma3_dir,
        "q8_0": with_tied_lm_head(tiny_gemma3_dir, out / "with-lm-head"),
        "q4_0": with_own_chat_template(tiny_gemma3_dir, out / "with-template"),
    }
    readers = {}
    for quant, model_dir in sources.items():
        template = TEMPLATE if quant == "f16" else None
        path = write_gguf(model_dir, out / f"tiny-{quant}.gguf", quant, chat_template=template)
        readers[quant] = read_gguf(path)
    return readers


# ---------------------------------------------------------------------------- tensors


@pytest.mark.parametrize("quant", ["f32", "f16", "q8_0"])
def test_tensor_set_shapes_and_types(written, source, config, quant):
    names = expected_names(config["num_hidden_layers"])
    tensors = {t.name: t for t in written[quant].tensors}
    # no `output.weight`: embeddings are tied (and the q8_0 source also holds lm_head.weight)
    assert set(tensors) == set(names.values())
    weight_type = {"f32": QType.F32, "f16": QType.F16, "q8_0": QType.Q8_0}[quant]
    for hf_name, gguf_name in names.items():
        t = tensors[gguf_name]
        assert [int(n) for n in reversed(t.shape)] == list(source[hf_name].shape), gguf_name
        want = QType.F32 if source[hf_name].ndim == 1 else weight_type  # token_embd too
        assert t.tensor_type == want, gguf_name


def test_norms_are_stored_plus_one(written, source, config):
    for hf_name, gguf_name in expected_names(config["num_hidden_layers"]).items():
        if hf_name.endswith("norm.weight"):
            t = next(t for t in written["f16"].tensors if t.name == gguf_name)
            assert np.array_equal(values(t), source[hf_name] + 1.0), gguf_name
            assert np.abs(source[hf_name]).max() > 0  # the fixture randomizes norms


@pytest.mark.parametrize(("quant", "rtol"), [("f32", 0.0), ("f16", 1e-3)])
def test_float_values_match_source(written, source, config, quant, rtol):
    tensors = {t.name: t for t in written[quant].tensors}
    for hf_name, gguf_name in expected_names(config["num_hidden_layers"]).items():
        want = source[hf_name] + (1.0 if hf_name.endswith("norm.weight") else 0.0)
        np.testing.assert_allclose(values(tensors[gguf_name]), want, rtol=rtol, atol=1e-7, err_msg=gguf_name)


def test_q4_0_dequantizes_close_to_source_and_keeps_the_embedding_at_8_bits(written, source, config):
    tensors = {t.name: t for t in written["q4_0"].tensors}
    for hf_name, gguf_name in expected_names(config["num_hidden_layers"]).items():
        if source[hf_name].ndim == 2:
            t = tensors[gguf_name]
            assert t.tensor_type == (QType.Q8_0 if gguf_name == "token_embd.weight" else QType.Q4_0), gguf_name
            w = source[hf_name]
            step = np.abs(w.reshape(-1, 32)).max(axis=1, keepdims=True) / (127 if t.tensor_type == QType.Q8_0 else 8)
            err = np.abs(values(t) - w).reshape(-1, 32)
            assert np.all(err <= step * 1.01), gguf_name  # within one quantization step of the block


@pytest.mark.parametrize("quant", sorted(K_QUANTS))
def test_k_quants_go_through_llama_cpps_quantizer(quant: str, tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    path = write_gguf(tiny_gemma3_dir, tmp_path / f"tiny-{quant}.gguf", quant)
    reader = read_gguf(path)
    assert field(reader, Keys.General.FILE_TYPE) == getattr(gguf.LlamaFileType, f"MOSTLY_{quant.upper()}")
    assert field(reader, "tokenizer.ggml.model") == "llama"
    assert {t.name for t in reader.tensors} == set(expected_names(2).values())
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"tiny-{quant}.gguf"]  # the f16 source is gone


def test_k_quant_without_llama_cpp_is_a_clear_error(tiny_gemma3_dir: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if it were not installed
    with pytest.raises(UserError, match="q6_k is made by llama.cpp's quantizer: pip install llama-cpp-python"):
        write_gguf(tiny_gemma3_dir, tmp_path / "tiny-q6_k.gguf", "q6_k")
    assert list(tmp_path.iterdir()) == []


def test_q8_0_dequantizes_close_to_source(written, source, config):
    tensors = {t.name: t for t in written["q8_0"].tensors}
    for hf_name, gguf_name in expected_names(config["num_hidden_layers"]).items():
        if source[hf_name].ndim == 2:
            w = source[hf_name]
            blocks = np.abs(w.reshape(-1, 32)).max(axis=1, keepdims=True)  # Q8_0: 32 values per scale
            err = np.abs(values(tensors[gguf_name]) - w).reshape(-1, 32)
            assert np.all(err <= blocks / 127), gguf_name  # half a step, plus the f16 scale's rounding


# ---------------------------------------------------------------------------- metadata


@pytest.mark.parametrize(("quant", "file_type"), [("f32", 0), ("f16", 1), ("q8_0", 7)])
def test_hyperparameters(written, config, quant, file_type):
    r = written[quant]
    assert field(r, Keys.General.ARCHITECTURE) == ARCH
    assert field(r, Keys.General.FILE_TYPE) == file_type
    assert field(r, llm_key(Keys.LLM.BLOCK_COUNT)) == config["num_hidden_layers"]
    assert field(r, llm_key(Keys.LLM.CONTEXT_LENGTH)) == config["max_position_embeddings"]
    assert field(r, llm_key(Keys.LLM.EMBEDDING_LENGTH)) == config["hidden_size"]
    assert field(r, llm_key(Keys.LLM.FEED_FORWARD_LENGTH)) == config["intermediate_size"]
    assert field(r, llm_key(Keys.Attention.HEAD_COUNT)) == config["num_attention_heads"]
    assert field(r, llm_key(Keys.Attention.HEAD_COUNT_KV)) == config["num_key_value_heads"]
    assert field(r, llm_key(Keys.Attention.KEY_LENGTH)) == config["head_dim"]
    assert field(r, llm_key(Keys.Attention.VALUE_LENGTH)) == config["head_dim"]
    assert field(r, llm_key(Keys.Attention.SLIDING_WINDOW)) == config["sliding_window"]
    assert field(r, llm_key(Keys.Attention.LAYERNORM_RMS_EPS)) == pytest.approx(config["rms_norm_eps"])
    rope = config["rope_parameters"]
    assert field(r, llm_key(Keys.Rope.FREQ_BASE)) == rope["full_attention"]["rope_theta"]
    assert field(r, llm_key(Keys.Rope.FREQ_BASE_SWA)) == rope["sliding_attention"]["rope_theta"]
    assert llm_key(Keys.Rope.SCALING_TYPE) not in r.fields  # default RoPE: nothing to scale


def test_vocabulary_metadata(written):
    r = written["q8_0"]
    assert field(r, Keys.Tokenizer.MODEL) == "llama"
    assert field(r, Keys.Tokenizer.PRE) == "default"
    tokens = field(r, Keys.Tokenizer.LIST)
    types = field(r, Keys.Tokenizer.TOKEN_TYPE)
    scores = field(r, Keys.Tokenizer.SCORES)
    embd = next(t for t in r.tensors if t.name == gguf.TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD] + ".weight")
    assert len(tokens) == len(types) == len(scores) == N_VOCAB == int(embd.shape[1])
    assert (
        field(r, Keys.Tokenizer.PAD_ID),
        field(r, Keys.Tokenizer.EOS_ID),
        field(r, Keys.Tokenizer.BOS_ID),
        field(r, Keys.Tokenizer.UNK_ID),
    ) == (0, 1, 2, 3)
    assert tokens[:4] == ["<pad>", "<eos>", "<bos>", "<unk>"]
    assert field(r, Keys.Tokenizer.ADD_BOS) is True
    assert field(r, Keys.Tokenizer.ADD_EOS) is False
    assert field(r, Keys.Tokenizer.ADD_PREFIX) is False
    assert Keys.Tokenizer.CHAT_TEMPLATE not in r.fields  # the tiny model's tokenizer has none

    # the token kinds llama.cpp relies on, at ids fixed by Gemma 3's vocabulary
    assert (tokens[105], types[105]) == ("<start_of_turn>", TokenType.CONTROL)
    assert (tokens[106], types[106]) == ("<end_of_turn>", TokenType.CONTROL)
    assert (tokens[107], types[107]) == ("\n", TokenType.USER_DEFINED)
    assert (tokens[138], types[138]) == ("  ", TokenType.USER_DEFINED)  # runs of spaces, as typed
    assert (tokens[238], types[238]) == ("<0x00>", TokenType.BYTE)
    normal = np.array(types) == TokenType.NORMAL
    assert normal.sum() > 250_000
    assert np.all(np.diff(np.array(scores)[normal]) < 0)  # merge priority follows the id order


def test_chat_template_argument_is_written(written):
    assert field(written["f16"], Keys.Tokenizer.CHAT_TEMPLATE) == TEMPLATE


def test_a_folders_own_chat_template_goes_into_its_gguf(written):
    """docs/export.md (export gguf PATH): a checkpoint folder's own template is kept; a folder without one writes none.
    """
    assert field(written["q4_0"], Keys.Tokenizer.CHAT_TEMPLATE) == FOLDER_TEMPLATE
    assert Keys.Tokenizer.CHAT_TEMPLATE not in written["f32"].fields


def test_tokenizer_model_gives_the_same_vocabulary(tiny_gemma3_dir, tmp_path):
    """A SentencePiece tokenizer.model, when present, is the source; built here from the
    tokenizer.json vocabulary, it must come out the same."""
    from sentencepiece import sentencepiece_model_pb2

    from_json = load_vocab(tiny_gemma3_dir, N_VOCAB, read_spec(tiny_gemma3_dir).special_token_ids)
    proto = sentencepiece_model_pb2.ModelProto()
    for token, score, kind in zip(from_json.tokens, from_json.scores, from_json.types):
        proto.pieces.add(piece=token, score=score, type=kind)  # GGUF token types use SPM's numbering
    spm_dir = tmp_path / "spm"
    spm_dir.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_gemma3_dir / name, spm_dir / name)
    (spm_dir / "tokenizer.model").write_bytes(proto.SerializeToString())
    assert load_vocab(spm_dir, N_VOCAB, read_spec(spm_dir).special_token_ids) == from_json


# ---------------------------------------------------------------------------- inputs and failures


def test_unknown_quant_names_value_and_choices(tiny_gemma3_dir, tmp_path):
    with pytest.raises(UserError, match="q3_k_s") as e:
        write_gguf(tiny_gemma3_dir, tmp_path / "x.gguf", "q3_k_s")
    assert all(q in str(e.value) for q in GGUF_QUANTS)
    assert list(tmp_path.iterdir()) == []


def test_missing_config_and_weights_name_the_path(tiny_gemma3_dir, tmp_path):
    with pytest.raises(UserError, match=str(tmp_path)):
        write_gguf(tmp_path, tmp_path / "x.gguf", "f16")
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(tiny_gemma3_dir / "config.json", no_weights / "config.json")
    with pytest.raises(UserError, match=r"no weights in .*no-weights"):
        write_gguf(no_weights, tmp_path / "x.gguf", "f16")


@pytest.mark.parametrize("architecture", ["PaliGemmaForConditionalGeneration", "Gemma3nForConditionalGeneration",
                                          "LlamaForCausalLM"])
def test_unsupported_checkpoints_are_a_user_error_naming_what_is_supported(architecture, tiny_gemma3_dir, tmp_path):
    model_dir = tmp_path / "checkpoint"
    model_dir.mkdir()
    config = json.loads((tiny_gemma3_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(dict(config, architectures=[architecture])))
    with pytest.raises(UserError, match=f"{architecture}.*supported.*Gemma3ForConditionalGeneration"):
        write_gguf(model_dir, tmp_path / "x.gguf", "f16")


def test_failed_write_leaves_nothing_behind(tiny_gemma3_dir, tmp_path, monkeypatch):
    out = tmp_path / "model.gguf"
    out.write_bytes(b"previous export")
    calls = []

    def fail_on_third(self, tensor, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # after the header and some tensor data are on disk
            raise OSError("disk full")
        return original(self, tensor, *args, **kwargs)

    original = gguf_export.gguf.GGUFWriter.write_tensor_data
    monkeypatch.setattr(gguf_export.gguf.GGUFWriter, "write_tensor_data", fail_on_third)
    with pytest.raises(OSError, match="disk full"):
        write_gguf(tiny_gemma3_dir, out, "q8_0")
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]  # no temporary file left
    assert out.read_bytes() == b"previous export"  # an earlier export is not clobbered


def test_config_offers_exactly_the_quants_the_writer_has() -> None:
    assert set(GGUF_QUANTS) == set(_QUANTS) | set(K_QUANTS)
    assert set(ExportConfig.model_fields["gguf"].annotation.__args__[0].__args__) == set(GGUF_QUANTS)


def test_cli_converts_any_hf_gemma_checkpoint(tiny_gemma3_dir: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from gemmaforge.cli import main

    checkpoint = shutil.copytree(tiny_gemma3_dir, tmp_path / "my-gemma")
    assert main(["export", "gguf", str(checkpoint), "--quant", "q8_0"]) == 0
    reader = read_gguf(checkpoint / "my-gemma-q8_0.gguf")
    assert field(reader, Keys.General.NAME) == "my-gemma" and field(reader, Keys.General.FILE_TYPE) == 7
    assert main(["export", "gguf", str(checkpoint), "--output", str(tmp_path / "out" / "x.gguf")]) == 0
    assert field(read_gguf(tmp_path / "out" / "x.gguf"), Keys.General.FILE_TYPE) == 1  # f16 by default

    assert main(["export", "gguf", str(checkpoint), "--quant", "f16", "--quant", "q8_0", "--output", "y.gguf"]) == 2
    assert "--output names one file; give exactly one --quant" in capsys.readouterr().err
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    assert main(["export", "gguf", str(checkpoint)]) == 2
    assert "model_type 'llama' is not a Gemma text model" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.rglob("*.gguf")) == ["my-gemma-q8_0.gguf", "x.gguf"]  # nothing partial
    assert main(["export", "gguf", str(tmp_path / "out")]) == 2
    assert "not a run directory (no run.yaml)" in capsys.readouterr().err


def test_a_disk_without_room_is_refused_before_writing(tiny_gemma3_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=10 * 2**20))
    with pytest.raises(UserError, match=r"0\.01 GiB free, the GGUF file needs 0\.\d\d GiB"):
        write_gguf(tiny_gemma3_dir, tmp_path / "tiny-f16.gguf", "f16")
    assert list(tmp_path.iterdir()) == []


def test_sharded_checkpoint_exports_like_a_single_file(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir).save_pretrained(sharded, max_shard_size="10MB")
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json"):
        if (tiny_gemma3_dir / name).is_file():
            shutil.copy(tiny_gemma3_dir / name, sharded / name)
    assert len(list(sharded.glob("model-*.safetensors"))) > 1 and (sharded / "model.safetensors.index.json").is_file()
    one = read_gguf(write_gguf(tiny_gemma3_dir, tmp_path / "one.gguf", "f16"))
    many = read_gguf(write_gguf(sharded, tmp_path / "many.gguf", "f16"))
    assert [t.name for t in one.tensors] == [t.name for t in many.tensors]
    for a, b in zip(one.tensors, many.tensors):
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name

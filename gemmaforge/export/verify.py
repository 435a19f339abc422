"""`gemmaforge export verify`: prove every exported GGUF against the merged model it came from.

For each gguf/model-<quant>.gguf (whole or split): read it back with the gguf package (every key, every tensor's
bytes), load it in llama.cpp, and compare its next-token distributions with the merged transformers
model's at every position of a few val conversations: top-1 agreement and mean KL(merged || GGUF).
An f16 file below 99% top-1 agreement means the export is wrong, not merely lossy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from gemmaforge.chat.conversation import Message
from gemmaforge.errors import StageError
from gemmaforge.families import Family
from gemmaforge.models import load_tokenizer
from gemmaforge.runs import RunDir, atomic_write_text

F16_MIN_TOP1 = 0.99
MAX_TOKENS = 256  # per conversation: enough positions, bounded logits memory (tokens x 262k floats)


def verify_run(run: RunDir, family: Family, n_prompts: int = 8) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    merged = run.require(run.merged_dir / "config.json", "merge").parent
    files = run.model_ggufs()
    if not files:
        run.require(run.gguf_dir / "model-<quant>.gguf", "export gguf")
    tokenizer = load_tokenizer(merged)
    sequences = prepared_sequences(run, tokenizer, family, n_prompts)
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    with torch.no_grad():
        reference = [model(torch.tensor([ids])).logits[0].numpy() for ids in sequences]  # (T, V) each
    del model
    results = {}
    for quant, parts in files.items():  # llama.cpp opens a split file through its first shard
        results[quant] = {"file": str(parts[0]), "shards": len(parts), **read_back(parts),
                          **compare(parts[0], sequences, reference)}
    report = {"prompts": len(sequences), "positions": sum(map(len, sequences)), "files": results}
    atomic_write_text(run.gguf_dir / "verify.json", json.dumps(report, indent=2) + "\n")
    f16 = results.get("f16")
    if f16 is not None and f16["top1_agreement"] < F16_MIN_TOP1:
        raise StageError(
            f"{f16['file']}: top-1 agreement with the merged model is {f16['top1_agreement']:.2%}, below "
            f"{F16_MIN_TOP1:.0%}: the f16 export does not compute what the merged model computes"
        )
    return report


def prepared_sequences(run: RunDir, tokenizer: Any, family: Family, n: int) -> list[list[int]]:
    """Up to n token sequences from the prepared data (val, else train): conversations in the training chat format,
    or raw text (<bos> text) for a continued-pretraining run."""
    val = run.require(run.data_dir / "val.jsonl", "data")
    for path in (val, run.data_dir / "train.jsonl"):
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()[:n] if line]
        if rows:
            texts = [tokenizer.bos_token + row["text"] if "text" in row
                     else family.chat.render(text_only(row["messages"], family)).text for row in rows]
            return [tokenizer(text, add_special_tokens=False).input_ids[:MAX_TOKENS] for text in texts]
    return []


def text_only(messages: list[Message], family: Family) -> list[Message]:
    """The conversation without its image placeholders: the text model's logits are compared here (images go
    through the projector, which eval's llama.cpp engine answers with)."""
    return [{**m, "content": m["content"].replace(family.chat.image, "")} for m in messages]


def read_back(parts: list[Path]) -> dict[str, Any]:
    """Every key and every tensor of the file (all its shards), decoded: a malformed value, a tensor of an unknown
    type or one running past the end of its file fails here."""
    from gemmaforge.gguf_file import GGUFFormatError, read_gguf

    keys, tensors, tensor_bytes, types = 0, 0, 0, set[str]()
    for path in parts:
        try:
            file = read_gguf(path)
        except GGUFFormatError as e:
            raise StageError(str(e)) from None
        tensor_bytes += sum(t.data.nbytes for t in file.tensors)
        types.update(t.tensor_type.name for t in file.tensors)
        keys += len(file.fields)
        tensors += len(file.tensors)
    return {"bytes": sum(p.stat().st_size for p in parts), "keys": keys, "tensors": tensors,
            "tensor_bytes": tensor_bytes, "tensor_types": sorted(types)}


def compare(path: Path, sequences: list[list[int]], reference: list[np.ndarray]) -> dict[str, Any]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(map(len, sequences)) + 8, logits_all=True,
                          n_threads=None, verbose=False)
    agree: list[bool] = []
    kls: list[float] = []
    for ids, want in zip(sequences, reference):
        llm.reset()
        llm.eval(ids)
        got = np.asarray(llm.scores[: len(ids)], dtype=np.float64)  # (T, V)
        agree.extend(got.argmax(axis=1) == want.argmax(axis=1))
        kls.extend(kl_divergence(want.astype(np.float64), got))
    return {"top1_agreement": round(float(np.mean(agree)), 4), "mean_kl": round(float(np.mean(kls)), 5)}


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(softmax(p) || softmax(q)) per row, in nats."""
    log_p = p_logits - _logsumexp(p_logits)
    log_q = q_logits - _logsumexp(q_logits)
    return (np.exp(log_p) * (log_p - log_q)).sum(axis=1)


def _logsumexp(x: np.ndarray) -> np.ndarray:
    top = x.max(axis=1, keepdims=True)
    return top + np.log(np.exp(x - top).sum(axis=1, keepdims=True))

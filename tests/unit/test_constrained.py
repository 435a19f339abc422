"""The transformers engine's structured output (gemmaforge/inference/constrained.py) on Gemma's real tokenizer:
the mask lets a valid answer through token by token, closes the turn only once the value is complete, and
reads schemas as llama.cpp (and so Ollama) reads them."""

from __future__ import annotations

import json

import pytest
import torch

from gemmaforge.inference.constrained import Grammars, closed

ORDER = {"type": "object", "properties": {"drink": {"enum": ["latte", "espresso"]}, "cups": {"type": "integer"}},
         "required": ["drink", "cups"]}


@pytest.fixture(scope="module")
def grammars(gemma3_tokenizer) -> Grammars:
    stops = [gemma3_tokenizer.eos_token_id, gemma3_tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    return Grammars(gemma3_tokenizer, stops)


def allowed_after(grammars: Grammars, spec: str, ids: list[int]) -> torch.Tensor:
    """The finite logits after replaying `ids` (each must have been allowed)."""
    matcher = grammars.matcher(spec)
    for token in ids:
        logits = torch.zeros(262144)
        matcher.mask(logits)
        assert torch.isfinite(logits[token]), token
        matcher.advance(token)
    logits = torch.zeros(262144)
    matcher.mask(logits)
    return torch.isfinite(logits)


def test_a_valid_answer_passes_and_only_a_complete_one_may_end(grammars: Grammars, gemma3_tokenizer) -> None:
    end_of_turn = gemma3_tokenizer.convert_tokens_to_ids("<end_of_turn>")
    spec = json.dumps(ORDER)
    answer = gemma3_tokenizer.encode('{"drink": "latte", "cups": 2}', add_special_tokens=False)
    midway = allowed_after(grammars, spec, answer[:-1])
    assert not midway[end_of_turn] and 0 < int(midway.sum()) < 262144
    done = allowed_after(grammars, spec, answer)
    assert done[end_of_turn] and done[gemma3_tokenizer.eos_token_id]
    # JSON mode: any object, and nothing but an object may begin
    first = allowed_after(grammars, "json", [])
    assert first[gemma3_tokenizer.encode("{", add_special_tokens=False)[0]]
    assert not first[gemma3_tokenizer.encode("[", add_special_tokens=False)[0]]
    assert not first[end_of_turn]


def test_properties_a_schema_does_not_list_are_refused_unless_it_allows_them(grammars: Grammars,
                                                                               gemma3_tokenizer) -> None:
    prefix = gemma3_tokenizer.encode('{"drink": "latte", "cups": 2', add_special_tokens=False)
    comma = gemma3_tokenizer.encode(",", add_special_tokens=False)[0]
    assert not allowed_after(grammars, json.dumps(ORDER), prefix)[comma]  # no third property
    assert allowed_after(grammars, json.dumps({**ORDER, "additionalProperties": True}), prefix)[comma]


def test_closed_reads_schemas_as_llama_cpp_does() -> None:
    nested = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"a": {"type": "string"}}},  # a property named "properties"
        "tags": {"type": "array", "items": {"type": "object", "properties": {"t": {"type": "string"}}}},
        "open": {"type": "object", "properties": {}, "additionalProperties": {"type": "integer"}},
    }, "$defs": {"Cup": {"type": "object", "properties": {"size": {"type": "integer"}}}},
        "anyOf": [{"properties": {"x": {}}}]}
    got = closed(nested)
    assert got["additionalProperties"] is False
    assert got["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in got["properties"]  # the name -> schema map itself is left alone
    assert got["properties"]["tags"]["items"]["additionalProperties"] is False
    assert got["properties"]["open"]["additionalProperties"] == {"type": "integer"}
    assert got["$defs"]["Cup"]["additionalProperties"] is False and got["anyOf"][0]["additionalProperties"] is False
    assert closed({"type": "object"}) == {"type": "object"}  # no properties listed: any object
    assert "additionalProperties" not in nested  # the caller's schema is not changed


def test_a_schema_that_cannot_be_enforced_says_why(grammars: Grammars) -> None:
    for schema, reason in (({"type": "objectx"}, "Invalid type: objectx"),
                           ({"$ref": "#/nowhere"}, "does not exist"),
                           ({"type": "string", "pattern": "("}, "unclosed group")):
        with pytest.raises(ValueError, match=reason):
            grammars.compile(json.dumps(schema))

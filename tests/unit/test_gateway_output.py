"""How SGLang's outputs (whole, or cumulative / incremental stream chunks) become the gateway's choices."""

from __future__ import annotations

import pytest
from helpers.sglang_chunks import Fed
from pydantic import ValidationError

from tandem_inference.gateway.outputs import Output, usage
from tandem_inference.gateway.schemas import ChatRequest, CompletionRequest


def chunk(
    text: str | None, ids: list[int], total: int, finish: str | None = None, logprobs: bool = True
) -> dict:
    meta: dict = {"completion_tokens": total, "finish_reason": {"type": finish} if finish else None}
    if logprobs:
        meta["output_token_logprobs"] = [[-float(i), i, None] for i in ids]
    return {"text": text, "output_ids": ids, "meta_info": meta}


def test_a_whole_result() -> None:
    out = Fed()
    out.update(chunk("abc", [4, 5, 6], 3, finish="length"))
    assert (out.text, out.token_ids, out.logprobs, out.finish_reason) == (
        "abc",
        [4, 5, 6],
        [-4.0, -5.0, -6.0],
        "length",
    )
    other = Fed()
    other.update(
        {"text": "x", "output_ids": [9], "meta_info": {"finish_reason": {"type": "stop", "matched": 2}}}
    )
    assert other.token_ids == [9] and other.logprobs == [] and other.finish_reason == "stop"


@pytest.mark.parametrize("cumulative", [True, False])
def test_stream_chunks_cumulative_or_incremental_give_the_same_result(cumulative: bool) -> None:
    steps = [("He", [1]), ("llo", [2]), (" you", [3, 4])]
    out, deltas, text, ids = Fed(), [], "", []
    for n, (piece, new) in enumerate(steps):
        text, ids = text + piece, ids + new
        last = n == len(steps) - 1
        c = chunk(
            text if cumulative else piece, ids if cumulative else new, len(ids), "stop" if last else None
        )
        deltas.append(out.update(c))
    assert deltas == [("He", 0), ("llo", 1), (" you", 2)]
    assert (
        out.text == "Hello you" and out.token_ids == [1, 2, 3, 4] and out.logprobs == [-1.0, -2.0, -3.0, -4.0]
    )
    assert out.finish_reason == "stop"


def test_half_decoded_characters_are_held_back() -> None:
    out = Fed()
    assert out.update(chunk("a\ufffd", [1], 1)) == ("a", 0)
    assert out.update(chunk("a\u00e9", [1, 2], 2)) == ("\u00e9", 1)
    assert out.update(chunk(None, [1, 2, 3], 3, finish="length")) == ("", 2)  # no text in this chunk
    assert out.token_ids == [1, 2, 3] and out.text == "a\u00e9"


def test_request_models() -> None:
    body = ChatRequest.model_validate(
        {
            "model": "r",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ],
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "ignored",
        }
    )
    assert body.messages[0].as_template_input() == {"role": "user", "content": "ab"}
    assert body.n == 1 and body.temperature is None and body.stream is True
    assert CompletionRequest.model_validate({"model": "r", "prompt": [1, 2]}).prompt == [1, 2]
    for bad in (
        {"model": "r", "messages": []},
        {"model": "", "messages": [{"role": "user", "content": "x"}]},
        {"model": "r", "messages": [{"role": "user", "content": "x"}], "top_p": 0},
    ):
        with pytest.raises(ValidationError):
            ChatRequest.model_validate(bad)
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "r", "prompt": ["a", "b"]})


def test_cached_prompt_tokens_reach_the_usage() -> None:
    """SGLang's meta_info.cached_tokens becomes OpenAI's usage.prompt_tokens_details.cached_tokens."""
    first, second = Fed(), Fed()
    c1 = chunk("a", [4], 1, finish="length")
    c1["meta_info"]["cached_tokens"] = 0
    c2 = chunk("b", [5], 1, finish="length")
    c2["meta_info"]["cached_tokens"] = 7
    first.update(c1)
    second.update(c2)
    both = usage([1] * 8, [first.out, second.out])
    assert both["prompt_tokens_details"] == {"cached_tokens": 7}
    assert (both["prompt_tokens"], both["completion_tokens"]) == (8, 2)
    assert usage([1, 2], [Output()])["prompt_tokens_details"] == {"cached_tokens": 0}


def test_logprob_bytes_are_the_tokens_own_even_where_a_token_is_part_of_a_character(tiny_model) -> None:
    """OpenAI's `bytes` let a client join tokens back into characters: a byte-level token that is
    one byte of a character (the tiny model's id 100 is the byte 0xA4) must give that byte, not
    the encoding of U+FFFD that its text alone decodes to."""
    from transformers import AutoTokenizer

    from tandem_inference.gateway.responses import ResponseFormat

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert tokenizer.decode([100]) == "\ufffd"
    out = Output(token_ids=[300, 100], logprobs=[-0.5, -1.5], token_texts=[None, None],
                 top_logprobs=[None, [(-1.5, 100, None), (-2.0, 300, None)]])
    entries = ResponseFormat(tokenizer, "base").chat_logprobs(out, 0)
    assert [e["bytes"] for e in entries] == [list(b"user"), [0xA4]]
    assert [t["bytes"] for t in entries[1]["top_logprobs"]] == [[0xA4], list(b"user")]

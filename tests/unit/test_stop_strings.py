"""Stop strings in streamed text: what may be sent before the engine decides (stops.py, gateway.Output)."""

from __future__ import annotations

from helpers.sglang_chunks import Fed
from hypothesis import assume, example, given
from hypothesis import strategies as st

from tandem_inference.stops import cut_at_stop, first_stop, sendable

texts = st.text(alphabet="ab e8w\n", max_size=12)
stop_lists = st.lists(st.text(alphabet="ab e8w\n", min_size=1, max_size=4), min_size=1, max_size=3)


@given(texts, texts, stop_lists)
@example(" wvid", "e8 wv", ["e8 w"])
@example("xa", "b", ["ab", "bx"])
def test_what_is_sent_is_kept_by_every_continuation(text: str, more: str, stops: list[str]) -> None:
    sent = sendable(text, stops)
    assert text.startswith(sent)
    assert cut_at_stop(text + more, stops).startswith(sent)


@given(texts, stop_lists)
def test_only_what_may_begin_a_stop_string_is_held_back(text: str, stops: list[str]) -> None:
    assume(cut_at_stop(text, stops) == text)  # a running text: no stop string is whole yet
    held = text[len(sendable(text, stops)) :]
    assert held == "" or any(s.startswith(held) for s in stops)


@given(texts, stop_lists)
@example("xab", ["ab", "a"])
def test_the_text_is_cut_where_the_first_stop_string_begins(text: str, stops: list[str]) -> None:
    hit = first_stop(text, stops)
    if hit is None:
        assert cut_at_stop(text, stops) == text
        assert not any(s in text for s in stops)
        return
    at, stop = hit
    assert text.find(stop) == at
    assert cut_at_stop(text, stops) == text[:at]
    assert all((text.find(s), s) >= hit for s in stops if s in text)  # of two at one place, the first sorted


def test_half_decoded_characters_wait_for_the_rest() -> None:
    assert sendable("ab\ufffd", []) == "ab"
    assert sendable("ab\ufffd\ufffd", ["zz"]) == "ab"


def engine_chunks(texts: list[str], finish: str) -> list[dict]:
    """Cumulative /generate stream chunks, one token each, as SGLang and the transformers engine send them."""
    chunks = []
    for n, text in enumerate(texts, start=1):
        meta = {
            "completion_tokens": n,
            "finish_reason": {"type": finish} if n == len(texts) else None,
            "output_token_logprobs": [[-1.0, i, None] for i in range(n)],
        }
        chunks.append({"text": text, "output_ids": list(range(n)), "meta_info": meta})
    return chunks


def test_a_stop_string_across_two_tokens_is_never_streamed() -> None:
    # tokens " wvid", "e8", " w": the stop string "e8 w" spans the last two; the engine then cuts the text
    out = Fed(stops=["e8 w"])
    deltas = [out.update(c)[0] for c in engine_chunks([" wvid", " wvide8", " wvid"], "stop")]
    assert "".join(deltas) == out.text == " wvid"
    assert deltas == [" wvid", "", ""]


def test_a_held_back_start_that_was_no_stop_string_is_sent_later() -> None:
    out = Fed(stops=["e8 w"])
    deltas = [out.update(c)[0] for c in engine_chunks([" wvid", " wvide8", " wvide8!"], "length")]
    assert deltas == [" wvid", "", "e8!"]


def test_top_logprobs_follow_their_tokens_in_cumulative_and_incremental_chunks() -> None:
    top = [[[-0.5, 7, None], [-1.5, 8, None]], [[-0.1, 9, "x"], [-3.0, 7, None]]]
    whole = Fed()
    for n in (1, 2):
        whole.update({"text": "", "output_ids": [7, 9][:n], "meta_info": {
            "completion_tokens": n, "output_token_logprobs": [[-0.5, 7, None], [-0.1, 9, None]][:n],
            "output_top_logprobs": top[:n]}})
    pieces = Fed()
    for n in (1, 2):
        pieces.update({"text": "", "output_ids": [[7], [9]][n - 1], "meta_info": {
            "completion_tokens": n, "output_token_logprobs": [[[-0.5, 7, None]], [[-0.1, 9, None]]][n - 1],
            "output_top_logprobs": [top[n - 1]]}})
    expected = [[(-0.5, 7, None), (-1.5, 8, None)], [(-0.1, 9, "x"), (-3.0, 7, None)]]
    assert whole.top_logprobs == pieces.top_logprobs == expected

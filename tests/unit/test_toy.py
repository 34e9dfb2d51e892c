from __future__ import annotations

from pathlib import Path

from tandem import Completion
from tandem.dev.toy import PROMPTS, digit_share, digit_token_ids, prompts_for


def completion(ids: list[int]) -> Completion:
    return Completion(text="", prompt_ids=[1], completion_ids=ids, rollout_logprobs=[-1.0] * len(ids), version=0)


def test_digit_tokens_are_the_ten_ascii_digits(tiny_model: Path) -> None:
    from tokenizers import Tokenizer

    digits = digit_token_ids(tiny_model)
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    assert sorted(tok.decode([i]) for i in digits) == [str(d) for d in range(10)]


def test_reward_is_the_share_of_digit_tokens() -> None:
    digits = frozenset({5, 6})
    assert digit_share(completion([5, 6, 7, 8]), digits) == 0.5
    assert digit_share(completion([7]), digits) == 0.0
    assert digit_share(completion([]), digits) == 0.0


def test_prompts_cycle() -> None:
    assert prompts_for(0, 3) == list(PROMPTS[:3])
    assert len(set(prompts_for(1, len(PROMPTS)))) == len(PROMPTS)

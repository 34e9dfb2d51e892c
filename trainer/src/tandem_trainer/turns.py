"""Multi-turn trajectories: the chat template's turn-start token, and spans that must not hold it.

A multi-turn trajectory (an episode) interleaves what the model sampled (loss mask 1) with the
template's tokens of the messages between its turns: tool results, user turns (mask 0). Every
such message opens with the template's turn-start token (`<|im_start|>` in ChatML/Qwen), so a
trained span that holds one carries a message the model did not write: training on it would
teach the policy to produce tool results. A job with such a trajectory is refused, naming the
trajectory and the position.

The token is found from the tokenizer's own chat template, not from a list of known names:
render a conversation with and without one more message; the first special token of the text
that message added opens it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from jinja2.exceptions import TemplateError

from tandem.jobs import TrainJob
from tandem_trainer.errors import JobRejected

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def turn_start(tokenizer: PreTrainedTokenizerBase) -> tuple[int, str] | None:
    """The id and text of the special token that opens each message, or None when the
    tokenizer has no chat template or its messages open without a special token."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    first = [{"role": "user", "content": "x"}]
    try:
        before = tokenizer.apply_chat_template(first, tokenize=False)
        after = tokenizer.apply_chat_template([*first, {"role": "assistant", "content": "y"}], tokenize=False)
    except (TemplateError, ValueError, TypeError) as exc:
        log.warning("turns.no_template_check: the chat template does not render a plain conversation (%s); "
                    "multi-turn trajectories are not checked for messages inside trained spans", exc)
        return None
    if not isinstance(before, str) or not isinstance(after, str) or not after.startswith(before):
        return None
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    for token_id in tokenizer.encode(after[len(before):], add_special_tokens=False):
        if token_id in special:
            return token_id, str(tokenizer.convert_ids_to_tokens(token_id))
    return None


def check_trained_spans(job: TrainJob, start_id: int, start_text: str) -> None:
    """Refuse a trajectory whose explicit loss mask trains on a turn-start token.

    Only trajectories with a `loss_mask` are multi-turn; a single-turn completion (no mask) is
    what the model sampled, token for token, whatever it holds.
    """
    for g, group in enumerate(job.groups):
        for t, traj in enumerate(group.trajectories):
            if traj.loss_mask is None:
                continue
            for position, (token, trained) in enumerate(zip(traj.completion_ids, traj.loss_mask, strict=True)):
                if trained and token == start_id:
                    field = f"groups.{g}.trajectories.{t}.loss_mask"
                    raise JobRejected(
                        f"{field}: completion token {position} is {start_text!r} (id {start_id}), the chat "
                        "template's turn start, and its loss mask is 1: a message the model did not sample "
                        "(a tool result or a user turn) is inside a trained span; give the template's tokens "
                        "of every message between turns mask 0",
                        field=field,
                    )

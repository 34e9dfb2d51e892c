"""OpenAI-shaped replies built from the engine's outputs, plus tandem's own extension.

Chat and completions differ in object names, where the text goes and how logprobs are listed
(chat: one entry per token with its alternatives; completions: parallel lists and a
{token: logprob} map per position). Both carry a `tandem` object with the run, version and
adapter that served, and the exact prompt and completion token ids and logprobs for training.
Token texts the engine did not send are decoded with the base model's tokenizer. A chat reply
that calls the request's tools carries them as `tool_calls` (tool_calls.py); streamed chunks
carry the model's text as it comes.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

from tandem_inference.bodies import by_text
from tandem_inference.gateway import tool_calls
from tandem_inference.gateway.outputs import Output
from tandem_inference.gateway.schemas import Kind
from tandem_inference.routing import Route

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: A byte-level BPE token's characters back to its bytes (GPT-2's table, Qwen's and Llama 3's too).
BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}  # type: ignore[no-untyped-call]
#: A sentencepiece byte-fallback token.
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class ResponseFormat:
    """Builds the OpenAI-shaped parts of replies, whole or streamed."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, base_model: str) -> None:
        self.tokenizer = tokenizer
        self.base_model = base_model

    def envelope(self, kind: Kind, route: Route, *, stream: bool) -> dict[str, Any]:
        """The fields around the choices: id, object, created, model."""
        obj = {"chat": "chat.completion", "text": "text_completion"}[kind]
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        if stream and kind == "chat":
            obj += ".chunk"
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
                "model": route.name(self.base_model)}

    def choice(self, kind: Kind, index: int, out: Output, logprobs: bool,
               tools: Collection[str] = ()) -> dict[str, Any]:
        """One whole choice of a reply that is not streamed; a chat's calls of `tools` are parsed."""
        choice: dict[str, Any] = {"index": index, "finish_reason": out.finish_reason or "stop"}
        if kind == "chat":
            parsed = tool_calls.parse(out.text, tools)
            choice["message"] = {"role": "assistant", "content": parsed.content}
            if parsed.tool_calls:
                choice["message"]["tool_calls"] = parsed.tool_calls
                choice["finish_reason"] = "tool_calls"
            choice["logprobs"] = {"content": self.chat_logprobs(out, 0)} if logprobs else None
        else:
            choice["text"] = out.text
            choice["logprobs"] = self.text_logprobs(out, 0) if logprobs else None
        return choice

    def delta(self, kind: Kind, i: int, out: Output, text: str, start: int, logprobs: bool) -> dict[str, Any]:
        """The streamed choice `i` with new `text` and the tokens from `start` on."""
        if kind == "chat":
            lp = {"content": self.chat_logprobs(out, start)} if logprobs else None
            return {"index": i, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}
        return {"index": i, "text": text, "logprobs": self.text_logprobs(out, start) if logprobs else None,
                "finish_reason": None}

    @staticmethod
    def role(n: int) -> list[dict[str, Any]]:
        """The first chunk of a streamed chat: the assistant's role for each of the n choices."""
        return [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for j in range(n)]

    @staticmethod
    def finish(kind: Kind, i: int, reason: str) -> dict[str, Any]:
        """The streamed end of choice `i`."""
        if kind == "chat":
            return {"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}
        return {"index": i, "text": "", "logprobs": None, "finish_reason": reason}

    def chat_logprobs(self, out: Output, start: int) -> list[dict[str, Any]]:
        entries = []
        for i in range(start, len(out.logprobs)):
            token = self._token_text(out, i)
            tops = out.top_logprobs[i] if i < len(out.top_logprobs) else None
            top = [{"token": t, "logprob": lp, "bytes": self._bytes(tid, t)}
                   for (t, lp), (_, tid, _) in zip(self._alternatives(out, i), tops or (), strict=True)]
            entries.append({"token": token, "logprob": out.logprobs[i], "bytes": self._bytes(out.token_ids[i], token),
                            "top_logprobs": top})
        return entries

    def _bytes(self, token_id: int, text: str) -> list[int]:
        """The token's own bytes (OpenAI's `bytes`): a byte-level token that is part of a character
        decodes to U+FFFD alone, so its bytes come from the token itself, not from that text."""
        if "\ufffd" not in text:
            return list(text.encode())
        raw = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(raw, str):
            if (hex_byte := BYTE_TOKEN.fullmatch(raw)) is not None:  # sentencepiece's <0xA4>
                return [int(hex_byte[1], 16)]
            if raw and all(ch in BYTE_OF_CHAR for ch in raw):  # GPT-2's byte-level alphabet
                return [BYTE_OF_CHAR[ch] for ch in raw]
        return list(text.encode())

    def text_logprobs(self, out: Output, start: int) -> dict[str, Any]:
        tokens = [self._token_text(out, i) for i in range(start, len(out.logprobs))]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        top = None
        if any(t is not None for t in out.top_logprobs):  # asked for: OpenAI's {token: logprob} per position
            top = [by_text(self._alternatives(out, i)) for i in range(start, len(out.logprobs))]
        return {"tokens": tokens, "token_logprobs": out.logprobs[start:], "top_logprobs": top,
                "text_offset": offsets}

    @staticmethod
    def extension(route: Route, input_ids: list[int], outputs: list[Output], temperature: float) -> dict[str, Any]:
        """The `tandem` object: which version served, and the token ids and logprobs for training,
        with the temperature whose distribution the logprobs are under (`policy_temperature`)."""
        return {"run": route.run, "version": route.version, "adapter": route.adapter,
                "prompt_token_ids": input_ids,
                "completion_token_ids": [o.token_ids for o in outputs],
                "completion_logprobs": [o.logprobs for o in outputs],
                "temperature": temperature}

    def _token_text(self, out: Output, i: int) -> str:
        text = out.token_texts[i] if i < len(out.token_texts) else None
        return text if text is not None else self._decode(out.token_ids[i])

    def _alternatives(self, out: Output, i: int) -> list[tuple[str, float]]:
        """(token text, logprob) of the alternatives the engine listed at position `i`, best first."""
        tops = out.top_logprobs[i] if i < len(out.top_logprobs) else None
        return [(text if text is not None else self._decode(tid), lp) for lp, tid, text in tops or ()]

    def _decode(self, token_id: int) -> str:
        """The text of one token (the engine did not send it)."""
        text = self.tokenizer.decode([token_id])
        return text if isinstance(text, str) else "".join(text)

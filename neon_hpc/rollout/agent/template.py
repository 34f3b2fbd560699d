"""The conversation in tokens: which pieces the environment appends, and how they look.

Token-in, token-out: the model's outputs are never re-tokenized; the environment only
appends (system, user, tool messages, role tags).  So the final sequence is exactly the
concatenation of the turns, and turn ``k+1``'s prompt starts with everything before it,
which is what delta router replay needs (``neon_hpc/replay``).

Format (special tags of the ``xrd-tiny`` tokenizer)::

    <|system|>SYSTEM<|end|><|user|>TASK<|end|><|assistant|>   model output ...
    <|end|><|tool|>RESULT<|end|><|assistant|>                 model output ...
    (final turn, when forcing an answer) ... <|assistant|><answer>   model output ...
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tags:
    system: str = "<|system|>"
    user: str = "<|user|>"
    assistant: str = "<|assistant|>"
    tool: str = "<|tool|>"
    end: str = "<|end|>"
    tool_call: str = "<tool_call>"
    tool_call_end: str = "</tool_call>"
    answer: str = "<answer>"
    answer_end: str = "</answer>"


TAGS = Tags()


class ChatTemplate:
    """Renders the environment's pieces as token ids with one tokenizer."""

    def __init__(self, tokenizer, tags: Tags = TAGS):
        self.tok, self.tags = tokenizer, tags

    def _ids(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def opening(self, system: str, user: str) -> list[int]:
        t = self.tags
        return self._ids(f"{t.system}{system}{t.end}{t.user}{user}{t.end}{t.assistant}")

    def after_output(self, role: str, content: str, last_token: int | None = None) -> list[int]:
        """Close the model's turn (unless its last token already did), add a tool/user
        message, and open the next assistant turn."""
        t = self.tags
        tag = t.tool if role == "tool" else t.user
        close = "" if last_token is not None and last_token == self.tok.token_id(t.end) else t.end
        return self._ids(f"{close}{tag}{content}{t.end}{t.assistant}")

    def force_answer(self) -> list[int]:
        return self._ids(self.tags.answer)

    def stop_token_ids(self) -> list[int]:
        """Generation stops after a tool call, an answer, or end of sequence."""
        ids = [self.tok.eos_id]
        for tag in (self.tags.tool_call_end, self.tags.answer_end, self.tags.end):
            try:
                ids.append(self.tok.token_id(tag))
            except KeyError:
                pass  # an HF tokenizer without our tags: stop strings are checked in text
        return ids


class TemplateError(ValueError):
    """A model's chat template cannot be extended by appending (token-in, token-out needs that)."""


class HFChatTemplate:
    """A real model's own chat template (``tokenizer.apply_chat_template``), append-only.

    The opening is the rendered system + user messages with the generation prompt.  What the
    environment appends after a model output is found by rendering the conversation with a
    probe as the assistant's content, with and without the next message, and keeping what
    follows the probe: the template's closing of the assistant turn (minus the end token the
    model already emitted), the tool message, and the next generation prompt.  Templates that
    rewrite earlier turns (e.g. drop past reasoning) are refused with :class:`TemplateError`.
    """

    PROBE = "\u2063neon-probe\u2063"

    def __init__(self, tokenizer, tags: Tags = TAGS):
        self.tok, self.tags = tokenizer, tags
        self.hf = tokenizer.hf
        self._head: list[dict] = []
        self._tool_role: str | None = None

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.hf.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)

    def opening(self, system: str, user: str) -> list[int]:
        self._head = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return list(self.tok.encode(self._render(self._head, True)))

    def _suffix(self, role: str, content: str) -> str:
        convo = self._head + [{"role": "assistant", "content": self.PROBE}]
        before = self._render(convo, False)
        after = self._render(convo + [{"role": role, "content": content}], True)
        cut = after.find(self.PROBE)
        if cut < 0 or before[:cut + len(self.PROBE)] != after[:cut + len(self.PROBE)]:
            raise TemplateError("the chat template rewrites earlier turns; token-level episodes need "
                                "a template that only appends")
        return after[cut + len(self.PROBE):]

    def _role_for_tool(self) -> str:
        if self._tool_role is None:
            try:
                probe = self._suffix("tool", "neon-tool-probe")
                self._tool_role = "tool" if "neon-tool-probe" in probe else "user"
            except Exception:  # noqa: BLE001 - templates without a tool role raise in Jinja
                self._tool_role = "user"
        return self._tool_role

    def after_output(self, role: str, content: str, last_token: int | None = None) -> list[int]:
        suffix = self._suffix(self._role_for_tool() if role == "tool" else "user", content)
        if last_token is not None:
            emitted = self.tok.decode([last_token])
            if emitted and suffix.startswith(emitted):
                suffix = suffix[len(emitted):]
        return list(self.tok.encode(suffix))

    def force_answer(self) -> list[int]:
        return list(self.tok.encode(self.tags.answer))

    def stop_token_ids(self) -> list[int]:
        ids = [self.tok.eos_id]
        for tag in (self.tags.tool_call_end, self.tags.answer_end):
            try:
                ids.append(self.tok.token_id(tag))
            except KeyError:
                pass
        return ids


def make_template(tokenizer):
    """Our tags for our tokenizers; the model's own chat template for an HF tokenizer."""
    if getattr(tokenizer, "hf", None) is not None and getattr(tokenizer.hf, "chat_template", None):
        return HFChatTemplate(tokenizer)
    return ChatTemplate(tokenizer)

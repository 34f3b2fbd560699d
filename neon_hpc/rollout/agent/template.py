"""The conversation in tokens: which pieces the environment appends, and how they look.

Token-in, token-out: the model's outputs are never re-tokenized; the environment only
appends (system, user, tool messages, role tags).  So the final sequence is exactly the
concatenation of the turns, and turn ``k+1``'s prompt starts with everything before it,
which is what delta router replay needs (``neon_hpc/replay``).

Layout (special tags of the ``xrd-tiny`` tokenizer)::

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

    def after_output(self, role: str, content: str) -> list[int]:
        """Close the model's turn, add a tool/user message, and open the next assistant turn."""
        t = self.tags
        tag = t.tool if role == "tool" else t.user
        return self._ids(f"{t.end}{tag}{content}{t.end}{t.assistant}")

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

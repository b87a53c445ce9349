"""The token ids the chat template puts between a model turn and the next: what the agent loop appends after a turn
(and what SFT puts between the turns of a multi-turn demonstration), so the history is never re-tokenized.

The model's turn ends with the EOS token it generated. The template's text for the observation is the difference
between a probe conversation rendered with the observation and the generation prompt and the same conversation
rendered without them; the template's own text after the assistant's EOS (Qwen's ``"\\n"`` after
``<|im_end|>``, which the model does not generate) goes in front. verl's ToolAgentLoop builds its observation
tokens the same way.

    turns = TurnTemplate(tokenizer)
    ids = turns.observation_ids([{"role": "tool", "content": "3145"}])   # built-in tiny model: "<|tool|>3145<|assistant|>"
"""

from __future__ import annotations

from typing import Any, Sequence

PROBE = [{"role": "user", "content": "P"}, {"role": "assistant", "content": "A"}]


class TurnTemplate:
    """A tokenizer's chat template, as token ids between turns (module docstring)."""

    def __init__(self, tokenizer, tools: Sequence[dict] | None = None):
        self.tok, self.tools = tokenizer, list(tools) if tools else None
        eos = tokenizer.eos_token
        self.eos_token_id = tokenizer.eos_token_id
        self.base = self._render(PROBE, generation_prompt=False)
        at = self.base.rfind(eos) if eos else -1
        if at < 0 or not self.base[:at].rstrip().endswith(PROBE[1]["content"]):
            raise ValueError(f"chat template: an assistant turn does not end with the EOS token {eos!r}, so a model "
                             "turn that stops at EOS cannot be continued with an observation")
        self.after_eos = self.base[at + len(eos):]

    def _render(self, messages: list, *, generation_prompt: bool) -> Any:
        """The template's text of one conversation (a list of messages), or of each of a list of them."""
        kwargs = {"tools": self.tools} if self.tools else {}
        return self.tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                            **kwargs)

    def observation_ids(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token ids of ``messages`` (tool results, or an environment's user message) after the model's EOS, up to
        and including the next assistant turn's generation prompt."""
        return self.observations_ids([messages])[0]

    def observations_ids(self, observations: Sequence[Sequence[dict[str, Any]]]) -> list[list[int]]:
        """:meth:`observation_ids` of each of ``observations``, tokenized in one call."""
        if not observations:
            return []
        texts = []
        # one call renders them all: the template's inputs (its tools' schemas) are prepared once
        for full in self._render([PROBE + list(m) for m in observations], generation_prompt=True):
            if not full.startswith(self.base):
                raise ValueError("chat template: rendering more messages changes the text of the earlier ones, so "
                                 "observations cannot be appended as tokens")
            texts.append(self.after_eos + full[len(self.base):])
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def assistant_ids(self, content: str) -> list[int]:
        """A demonstration's assistant turn as the model would generate it: its text, then EOS."""
        return self.tok(content, add_special_tokens=False)["input_ids"] + [self.eos_token_id]

    def conversation_ids(self, messages: Sequence[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """The turns after a prompt (assistant turns, and tool or user messages between them) as response ids and
        their loss mask: 1 on the assistant turns' tokens (EOS included), 0 on the template's tokens between."""
        ids: list[int] = []
        mask: list[int] = []
        between: list[dict[str, Any]] = []
        for m in messages:
            if m["role"] != "assistant":
                between.append(m)
                continue
            if between:
                obs = self.observation_ids(between)
                ids, mask, between = ids + obs, mask + [0] * len(obs), []
            turn = self.assistant_ids(m["content"])
            ids, mask = ids + turn, mask + [1] * len(turn)
        if between:
            raise ValueError("a demonstration must end with an assistant turn")
        return ids, mask

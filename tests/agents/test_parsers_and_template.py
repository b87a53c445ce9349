"""The hermes tool-call parser, and the chat template as token ids between turns (rlcore.agents.template): the
built-in tiny template and a Qwen-style one whose turn ends with text after the EOS token."""

from __future__ import annotations

import pytest

from rlcore.agents.parsers import PARSERS, ToolCall
from rlcore.agents.template import TurnTemplate
from rlcore.engine.tiny_model import build_char_tokenizer

hermes = PARSERS.get("hermes")


@pytest.mark.parametrize("text, content, calls", [
    ("just 12", "just 12", []),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', "", [ToolCall("add", {"a": 1})]),
    ('a<tool_call>\n{"name":"f","arguments":"{\\"x\\": 2}"}\n</tool_call>b<tool_call>{"name":"g"}</tool_call>',
     "ab", [ToolCall("f", {"x": 2}), ToolCall("g", {})]),
])
def test_hermes_reads_calls_and_keeps_the_text_outside_them(text, content, calls):
    turn = hermes.parse(text)
    assert turn.content == content and turn.calls == calls


@pytest.mark.parametrize("text, error", [
    ("<tool_call>{name: 1}</tool_call>", "not valid JSON"),
    ('<tool_call>["add"]</tool_call>', "expected a JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '"arguments" should be an object'),
    ('<tool_call>{"name": "f", "arguments": {}}', "not closed"),
])
def test_hermes_returns_unreadable_calls_with_their_error(text, error):
    (call,) = hermes.parse(text).calls
    assert call.error is not None and error in call.error


def test_hermes_format_round_trips():
    calls = [ToolCall("add", {"a": 1, "b": [2, 3]}), ToolCall("g", {})]
    assert hermes.parse(hermes.format(calls)).calls == calls


def test_tiny_template_observation_and_conversation_ids():
    tok = build_char_tokenizer()
    turns = TurnTemplate(tok)
    ids = turns.observation_ids([{"role": "tool", "content": "42"}])
    assert tok.decode(ids) == "<|tool|>42<|assistant|>"
    conv, mask = turns.conversation_ids([{"role": "assistant", "content": "ab"}, {"role": "tool", "content": "7"},
                                         {"role": "assistant", "content": "7"}])
    want = tok("ab")["input_ids"] + [tok.eos_token_id] + turns.observation_ids(
        [{"role": "tool", "content": "7"}]) + tok("7")["input_ids"] + [tok.eos_token_id]
    assert conv == want
    obs = len(turns.observation_ids([{"role": "tool", "content": "7"}]))
    assert mask == [1, 1, 1] + [0] * obs + [1, 1]
    # the whole conversation's template text, tokenized at once, is the same tokens: nothing was re-tokenized apart
    full = tok.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"},
                                    {"role": "tool", "content": "7"}, {"role": "assistant", "content": "7"}],
                                   tokenize=False)
    prompt = tok.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False, add_generation_prompt=True)
    assert tok(prompt, add_special_tokens=False)["input_ids"] + conv == tok(full, add_special_tokens=False)["input_ids"]


QWEN_STYLE = ("{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}"
              "\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
              "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_with_text_after_the_eos_puts_it_before_the_observation():
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN_STYLE
    turns = TurnTemplate(tok)
    assert turns.after_eos == "\n"
    ids = turns.observation_ids([{"role": "tool", "content": "5"}])
    assert tok.decode(ids) == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    conv, _ = turns.conversation_ids([{"role": "assistant", "content": "c"}, {"role": "tool", "content": "5"},
                                      {"role": "assistant", "content": "5"}])
    full = tok.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "c"},
                                    {"role": "tool", "content": "5"}, {"role": "assistant", "content": "5"}],
                                   tokenize=False)
    prompt = tok.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False, add_generation_prompt=True)
    # the trailing "\n" after the last <|im_end|> is the next turn's business, as after every model turn
    assert tok(prompt, add_special_tokens=False)["input_ids"] + conv + tok("\n")["input_ids"] == \
        tok(full, add_special_tokens=False)["input_ids"]


def test_a_template_whose_assistant_turn_does_not_end_with_eos_is_refused():
    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="does not end with the EOS token"):
        TurnTemplate(tok)


def test_observations_of_many_rows_are_each_rows_own_template_tokens():
    tok = build_char_tokenizer()
    turns = TurnTemplate(tok)
    got = turns.observations_ids([[{"role": "tool", "content": "5"}],
                                  [{"role": "tool", "name": "x", "content": "ab"}, {"role": "tool", "content": "c"}],
                                  [{"role": "user", "content": "step 1"}], [{"role": "tool", "content": "5"}]])
    texts = ["<|tool|>5<|assistant|>", "<|tool|>ab<|tool|>c<|assistant|>", "<|user|>step 1<|assistant|>",
             "<|tool|>5<|assistant|>"]
    assert got == [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert turns.observations_ids([]) == []

"""What a request to ``rlcore serve`` may hold (pydantic models of the OpenAI bodies it takes), and one line naming
the field for a request that does not validate. The API itself: :mod:`rlcore.serve.app`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


# ---------------------------------------------------------------------------------------------- requests

# As vLLM: temperatures under GREEDY_BELOW are greedy, those under MIN_TEMPERATURE are raised to it (dividing the
# logits by a temperature near 0 overflows to inf, and the softmax of inf is NaN).
GREEDY_BELOW = 1e-5
MIN_TEMPERATURE = 1e-2
MAX_STOP_STRINGS = 16


class _Body(BaseModel):
    # strict: "2" is not an int, true is not a number; NaN and infinities (Python's json accepts them) are refused;
    # unknown fields are kept for _refuse_unsupported
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class SamplingRequest(_Body):
    model: str | None = None
    n: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # not OpenAI; as in vLLM: 0 or -1 = off
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: Annotated[str, Field(min_length=1)]
    arguments: str
    """A JSON object, as text (OpenAI's format)."""


class ToolCallItem(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart] | None, Field(validate_default=True)] = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content_present(cls, value: Any, info: ValidationInfo) -> Any:
        """Only an assistant's message may leave out its content (OpenAI: one that carries tool calls)."""
        role = info.data.get("role")  # absent when the role itself failed: that error is the one reported
        if value is None and role not in ("assistant", None):
            raise ValueError(f"a {role} message needs content (text or text parts)")
        return value


class FunctionDefinition(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class ChatRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None


# field -> the values that leave the output as this server makes it
UNSUPPORTED = {"stream": (None, False), "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
               "logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
               "response_format": (None, {"type": "text"})}
FIELD_NAMES = {name for m in (CompletionRequest, ChatRequest, ChatMessage, TextPart, ToolCallItem, FunctionCall,
                              ToolDefinition, FunctionDefinition) for name in m.model_fields}



def validation_error(err: RequestValidationError) -> tuple[str, str | None]:
    """One line and the field's dotted name for FastAPI's validation errors. A field declared as a union
    fails once per member (loc ends with the member's type, e.g. ``prompt.list[str]``): those become one
    "expected one of" line."""
    errors = err.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return "The request body is not valid JSON" + (f" ({detail})" if detail else ""), None

    def path(e: dict) -> tuple[list[str], list[str]]:
        names: list[str] = []
        tags: list[str] = []
        for part in tuple(e["loc"])[1:] if tuple(e["loc"])[:1] == ("body",) else e["loc"]:
            if not tags and (isinstance(part, int) or part in FIELD_NAMES):
                names.append(str(part))
            else:
                tags.append(str(part))
        return names, tags

    if tuple(first["loc"]) == ("body",) and isinstance(first.get("input"), bytes):  # not parsed: not sent as JSON
        return "The request body must be a JSON object sent with the header Content-Type: application/json", None
    names, tags = path(first)
    param = ".".join(names) or None
    where = param or "request body"
    got = first.get("input")
    shown = f" (got {got!r})" if got is not None and len(repr(got)) <= 60 and first["type"] != "missing" else ""
    same = [e for e in errors if path(e)[0] == names]
    if len(same) > 1 and all(path(e)[1] for e in same):
        members = list(dict.fromkeys(path(e)[1][0] for e in same))
        return f"{where}: expected one of {', '.join(members)}{shown}", param
    return f"{where}: {first['msg']}{shown}", param

"""Request bodies of the OpenAI-compatible HTTP API, validated by pydantic.

Field names, defaults and ranges follow OpenAI's API (temperature 1, max_tokens 16 for
completions); top_k, min_p and repeat_penalty are llama.cpp's extensions. Unknown fields are
ignored, as OpenAI-compatible servers do, so clients that send more still work."""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: Union[dict, bool] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's response_format: free text, any JSON object, or JSON following a schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Body):
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=10.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = None
    stop: Union[str, list[str], None] = Field(None, validate_default=True)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repeat_penalty: float = Field(1.0, gt=0.0, le=10.0, allow_inf_nan=False)
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    best_of: int = Field(1, ge=1, le=1, description="one candidate per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # Structured output (coordinator/text/structured_output.py): OpenAI's response_format, or
    # llama.cpp's json_schema and grammar (GBNF or Lark) fields, or a regex.
    response_format: ResponseFormat | None = None
    json_schema: Any = None  # checked by structured_output.grammar_for, which names what is wrong
    grammar: str | None = None
    regex: str | None = None

    @field_validator("seed")
    @classmethod
    def _seed(cls, v):
        """llama.cpp's convention, as the CLI's --seed: -1 asks for a random seed (as none does)."""
        if v is not None and not -1 <= v < 2 ** 64:
            raise ValueError("choose -1 (random) or a seed from 0 to 2**64 - 1")
        return None if v == -1 else v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters")
        return [s for s in stops if s]


class TextPart(_Body):
    type: Literal["text"]
    text: str


MAX_TOOLS = 128


class FunctionDef(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments (checked when a call is constrained by it)
    strict: bool | None = None


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Body):
    name: str
    arguments: Union[str, dict]


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None
    reasoning_content: str | None = None  # an assistant's earlier thinking (Qwen3's template shows the last turn's)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Union[Literal["auto", "none", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # reasoning models (coordinator/serve/thinking.py): the thinking apart ("auto") or left in
    # content ("none"); its budget in tokens (-1: none), or OpenAI's effort levels as budgets;
    # variables for the chat template (enable_thinking, ...)
    reasoning_format: Literal["none", "auto"] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    reasoning_budget: int | None = Field(None, ge=-1)
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[StrictInt]]  # token ids: not true/false or "1"
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False

    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v:
            raise ValueError("suffix (insertion) is not supported")
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v):
        if v:  # said, rather than ignored: the reply would not hold what the client asked for
            raise ValueError("echo is not supported: the completion holds the new text only")
        return v

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("one prompt per request (n=1)")
            return v[0]
        return v


MAX_TOKENIZE_CHARS = 1 << 20  # /tokenize's text: a long document, not the whole body limit


class TokenizeRequest(_Body):
    content: str = Field(max_length=MAX_TOKENIZE_CHARS)
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(_Body):
    tokens: list[StrictInt]

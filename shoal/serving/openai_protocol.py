"""The OpenAI wire format: request bodies (validated) and their `SamplingParams`.

Requests are pydantic models that ignore unknown fields, as OpenAI does. A value pydantic
cannot read, or one `SamplingParams` refuses, becomes a 400 `ApiError` naming the field
(`param`); the server never answers 422 or 500 for bad input.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from pydantic import BaseModel, ConfigDict, StrictInt, field_validator

from shoal.sampling import MAX_LOGPROBS, SamplingParams
from shoal.serving.errors import bad_request, field_of
from shoal.structured_output import StructuredOutput

MAX_N = 128  # choices per request
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_LEGACY_LOGPROBS = 5  # /v1/completions `logprobs` (OpenAI's limit)


def _has_lone_surrogate(value) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, (list, tuple)):
        return any(_has_lone_surrogate(v) for v in value)
    return False


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @field_validator("*", mode="after")
    @classmethod
    def _text_is_unicode(cls, value):
        """A string with a lone surrogate ("\\ud800": valid JSON, not text) is a 400
        naming its field, never a failure further on (hashing a cache_salt, tokenizing)."""
        if _has_lone_surrogate(value):
            raise ValueError("must be valid Unicode text (it holds a lone surrogate)")
        return value


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None


class _GenerationBody(_Body):
    """Fields shared by both endpoints (OpenAI's and the extensions after `# shoal`)."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float = 1.0  # OpenAI's default: sampling; 0 is greedy
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # shoal (vLLM's names)
    top_k: int = 0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[StrictInt] | None = None
    cache_salt: str | None = None
    # sampling beyond OpenAI's basics (ranges checked by SamplingParams, 400 naming the field)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[str, float] | None = None
    # structured output: OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: dict | None = None
    guided_json: object = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None
    # tool calling (chat only: serving/tools.py)
    tools: list | None = None
    tool_choice: str | dict | None = None
    # vLLM's: each prompt token's logprob and the top k (not streamed)
    prompt_logprobs: int | None = None
    # accepted by OpenAI or vLLM, not built here: a value that asks for them is a 400
    # naming the field (never ignored); their neutral values pass (clients send those)
    functions: list | None = None
    function_call: str | dict | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise bad_request(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}",
                              "stop")
        if any(not s for s in stop):
            raise bad_request("stop strings must not be empty", "stop")
        return stop

    def _refuse_unsupported(self) -> None:
        """400 naming the first field that asks for what this server does not do yet."""
        asked = {
            "functions": bool(self.functions),
            "function_call": self.function_call not in (None, "none", "auto"),
        }
        for name, is_asked in asked.items():
            if is_asked:
                raise bad_request(f"{name} is not supported by this server yet (the request "
                                  "was not run; leave the field out)", name)

    @property
    def asks_structured_output(self) -> bool:
        rf = self.response_format
        return ((rf is not None and rf.get("type", "text") != "text") or any(
            getattr(self, name) is not None for name in (
                "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "structured_outputs")))

    def structured_output(self) -> StructuredOutput | None:
        """What the output must match, from whichever field asked (at most one may); 400
        naming the field for a malformed or invalid one."""
        asked = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type", "text")
            if kind == "json_object":
                asked.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise bad_request("response_format.json_schema.schema must be a JSON schema "
                                      "object", "response_format")
                asked.append(("response_format", {"json_schema": schema}))
            elif kind != "text":
                raise bad_request(f"response_format.type must be text, json_object or "
                                  f"json_schema, got {kind!r:.40}", "response_format")
        for name, key in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                asked.append((name, {key: getattr(self, name)}))
        if self.structured_outputs is not None:
            keys = {"json": "json_schema", "regex": "regex", "choice": "choice",
                    "grammar": "grammar", "json_object": "json_object"}
            given = {keys[k]: v for k, v in self.structured_outputs.items() if k in keys
                     and v is not None}
            unknown = set(self.structured_outputs) - set(keys)
            if unknown or len(given) != 1:
                raise bad_request("structured_outputs takes exactly one of json, regex, choice, "
                                  "grammar, json_object", "structured_outputs")
            asked.append(("structured_outputs", given))
        if not asked:
            return None
        if len(asked) > 1:
            raise bad_request(f"{asked[1][0]}: give one structured output constraint, not "
                              f"{asked[0][0]} and {asked[1][0]}", asked[1][0])
        name, fields = asked[0]
        if isinstance(fields.get("json_schema"), str):  # vLLM takes a schema's JSON text too
            try:
                fields = {"json_schema": json.loads(fields["json_schema"])}
            except ValueError:
                raise bad_request(f"{name} must be a JSON schema", name) from None
        if "json_schema" in fields and not isinstance(fields["json_schema"], dict):
            raise bad_request(f"{name} must be a JSON schema object", name)
        if self.ignore_eos and not self.stop_token_ids:
            raise bad_request("ignore_eos cannot be used with structured output: it ends at "
                              "the model's end-of-sequence token", "ignore_eos")
        try:
            return StructuredOutput(**fields)
        except (TypeError, ValueError) as e:
            message = str(e).split(" is not valid: ", 1)[-1]
            raise bad_request(f"{name} is not a valid constraint: {message}", name) from None

    def _logit_bias(self) -> dict[int, float]:
        """logit_bias with its keys (token ids as JSON strings) read as ints."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                out[int(key)] = value
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {key!r:.40}",
                                  "logit_bias") from None
        return out

    def _sampling(self, max_tokens: int | None, num_logprobs: int | None,
                  forced: StructuredOutput | None = None,
                  prompt_logprobs: int | None = None) -> SamplingParams:
        """The choices' sampling (choice i of a seeded request gets seed + i); 400 naming
        the field that SamplingParams refuses, or that asks for an unsupported feature.
        max_tokens None: set per prompt later. `forced`: the grammar of a forced tool call."""
        self._refuse_unsupported()
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got "
                                  f"{self.prompt_logprobs}", "prompt_logprobs")
            if self.stream:
                raise bad_request("prompt_logprobs are not streamed: send stream: false",
                                  "prompt_logprobs")
            prompt_logprobs = max(self.prompt_logprobs, prompt_logprobs or 0)
        structured = self.structured_output()
        if forced is not None:
            if structured is not None:
                raise bad_request("tool_choice: a forced tool call cannot be combined with "
                                  "another structured output constraint", "tool_choice")
            structured = forced
        if not 1 <= self.n <= MAX_N:
            raise bad_request(f"n must be an integer in [1, {MAX_N}], got {self.n}", "n")
        try:
            return SamplingParams(
                # without a limit: a stand-in until the prompt's length is known
                max_tokens=max_tokens if max_tokens is not None else max(self.min_tokens, 1),
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                seed=self.seed, stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos, logprobs=num_logprobs, min_tokens=self.min_tokens,
                min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                logit_bias=self._logit_bias(), structured_output=structured,
                prompt_logprobs=prompt_logprobs)
        except (TypeError, ValueError) as e:
            raise bad_request(str(e), field_of(str(e))) from e


class ChatCompletionRequest(_GenerationBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None

    def conversation(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them (text parts joined)."""
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        out = []
        for i, m in enumerate(self.messages):
            content = m.content
            if isinstance(content, list):
                if any(p.type != "text" or p.text is None for p in content):
                    raise bad_request("only text content parts are supported",
                                      f"messages.{i}.content")
                content = "".join(p.text for p in content)
            message = {"role": m.role, "content": content or ""}
            for name in ("tool_calls", "tool_call_id", "name"):
                if getattr(m, name) is not None:
                    message[name] = getattr(m, name)
            out.append(message)
        return out

    def sampling(self, forced: StructuredOutput | None = None) -> SamplingParams:
        """`forced`: the grammar of a forced tool call (tool_choice required or named)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        top = self.top_logprobs or 0
        if not 0 <= top <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}",
                              "top_logprobs")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        param = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        _check_max_tokens(limit, param)
        return self._sampling(limit, top if self.logprobs else None, forced)


class CompletionRequest(_GenerationBody):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: int | None = 16  # OpenAI's default for this endpoint
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """One or several prompts, each text or token ids."""
        p = self.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts or any(len(x) == 0 for x in prompts):
            raise bad_request("prompt must not be empty", "prompt")
        if self.echo and self.stream and self.logprobs is not None:
            raise bad_request("echo with logprobs is not streamed (the prompt's logprobs come "
                              "with the answer): send stream: false", "echo")
        if self.tools or self.tool_choice not in (None, "none", "auto"):
            name = "tools" if self.tools else "tool_choice"
            raise bad_request(f"{name} is only taken by /v1/chat/completions", name)
        if self.suffix:
            raise bad_request("suffix is not supported by this server yet", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported by this server yet (only best_of "
                              "equal to n)", "best_of")
        return prompts

    def sampling(self) -> SamplingParams:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LEGACY_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_LEGACY_LOGPROBS}], got "
                              f"{self.logprobs}", "logprobs")
        _check_max_tokens(self.max_tokens, "max_tokens")
        # echo with logprobs: the prompt's tokens get theirs too (OpenAI's scoring shape)
        echoed = self.logprobs if self.echo and self.logprobs is not None else None
        return self._sampling(self.max_tokens, self.logprobs, prompt_logprobs=echoed)


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's): a prompt's token ids as generation would use them."""

    model: str | None = None
    prompt: str | list[StrictInt] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # what generation does; False is refused
    add_generation_prompt: bool = True  # (messages) likewise

    def text_or_conversation(self) -> str | list[int] | list[dict[str, str]]:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        for name in ("add_special_tokens", "add_generation_prompt"):
            if not getattr(self, name):
                raise bad_request(f"{name}: false is not supported (tokens are counted as "
                                  "generation uses them)", name)
        if self.messages is not None:
            return ChatCompletionRequest(messages=self.messages).conversation()
        if not self.prompt:
            raise bad_request("prompt must not be empty", "prompt")
        return self.prompt


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[StrictInt]


def _check_max_tokens(value: int | None, param: str) -> None:
    if value is not None and value < 1:
        raise bad_request(f"{param} must be at least 1, got {value}", param)


def for_prompt(sampling: SamplingParams, num_prompt_tokens: int, max_request_len: int,
               has_limit: bool, index: int) -> SamplingParams:
    """The sampling of choice `index` of one prompt: without a token limit, up to the end
    of the context; a seeded request's choices draw different numbers (seed + index)."""
    changes: dict = {}
    if not has_limit:
        changes["max_tokens"] = max(max_request_len - num_prompt_tokens, 1)
        changes["min_tokens"] = min(sampling.min_tokens, changes["max_tokens"])
    if sampling.seed is not None and index:
        changes["seed"] = sampling.seed + index
    try:
        return replace(sampling, **changes) if changes else sampling
    except (TypeError, ValueError) as e:
        raise bad_request(str(e), field_of(str(e))) from e


@dataclass(frozen=True)
class Usage:
    """Token counts of one response."""

    prompt_tokens: int
    completion_tokens: int
    local_prefix_tokens: int  # prompt tokens served from a rank's own prefix cache
    pool_tokens: int  # prompt tokens loaded from the KV pool

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {
                    "cached_tokens": self.local_prefix_tokens + self.pool_tokens,
                    # shoal: where the cached tokens came from
                    "local_prefix_tokens": self.local_prefix_tokens,
                    "pool_tokens": self.pool_tokens}}

"""Tool calling on /v1/chat/completions: `tools` and `tool_choice` in, `tool_calls` out.

Two formats, picked from the model's chat template:
- "hermes" (Qwen 2.5 / Qwen 3, Hermes, and any template that does not render tools):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call;
- "llama3_json" (Llama 3.1+ templates, which use `<|python_tag|>`): the whole answer is one
  JSON object `{"name": ..., "parameters": {...}}`.
A template that renders tools gets them as `tools=`; for one that does not, the tools and
the hermes instructions go into the system message, earlier calls into the assistant's
text and tool results into `<tool_response>` blocks (as Qwen's template renders them).

`tool_choice`: "auto" (the default with tools): the model may answer or call, and calls
found in its text are returned as `tool_calls` (text that does not parse stays content);
"required" and a named function: the output is constrained by a grammar to calls (to that
function, with arguments matching its `parameters` schema); "none": tools are left out.
Streamed, content flows until a call may begin; the calls come in the last delta.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from shoal.serving.errors import bad_request
from shoal.structured_output import StructuredOutput

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
NO_ARGUMENTS = {"type": "object", "properties": {}}
HERMES_SYSTEM = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation as the chat template takes it, with the tools it renders (or None)."""

    messages: list[dict]
    tools: list[dict] | None = None


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict

    def as_openai(self) -> dict:
        function = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


def tool_format(chat_template: str | None) -> tuple[str, bool]:
    """(format, whether the template renders `tools`) of a chat template."""
    template = chat_template or ""
    renders = "tools" in template
    if renders and PYTHON_TAG in template and HERMES_OPEN not in template:
        return "llama3_json", True
    return "hermes", renders


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools, how they must be used, and the model's format."""

    tools: tuple[Tool, ...]
    mode: str  # "auto" | "required" | "named"
    named: str | None  # the function `tool_choice` names
    fmt: str  # "hermes" | "llama3_json"
    template_renders_tools: bool

    @classmethod
    def from_request(cls, tools: list | None, tool_choice, chat_template: str | None
                     ) -> "ToolUse | None":
        """None when no tool may be called (no tools, or tool_choice "none"); 400 naming
        the field for a malformed tool or choice."""
        parsed = tuple(_tool(i, t) for i, t in enumerate(tools or []))
        names = [t.name for t in parsed]
        if len(set(names)) != len(names):
            raise bad_request("tools: function names must be unique", "tools")
        mode, named = _choice(tool_choice, names)
        if not parsed or mode == "none":
            return None
        fmt, renders = tool_format(chat_template)
        return cls(parsed, mode, named, fmt, renders)

    def constraint(self) -> StructuredOutput | None:
        """The grammar that forces calls ("required": one or more; named: one call of it);
        400 naming `tools` if a function's parameters are not a usable schema."""
        try:
            return self._constraint()
        except ValueError as e:
            raise bad_request(f"tools: a function's parameters are not a usable JSON schema "
                              f"({str(e).split(' is not valid: ', 1)[-1]})", "tools") from None

    def _constraint(self) -> StructuredOutput | None:
        if self.mode == "auto":
            return None
        tools = [t for t in self.tools if self.mode == "required" or t.name == self.named]
        key = "parameters" if self.fmt == "llama3_json" else "arguments"
        call = {"anyOf": [{"type": "object", "additionalProperties": False,
                           "required": ["name", key],
                           "properties": {"name": {"const": t.name}, key: t.parameters}}
                          for t in tools]}
        if self.fmt == "llama3_json":
            return StructuredOutput(json_schema=json.dumps(call))
        repeat = ' ("\\n" call)*' if self.mode == "required" else ""
        return StructuredOutput(grammar=(
            f'start: call{repeat}\ncall: "{HERMES_OPEN}\\n" body "\\n{HERMES_CLOSE}"\n'
            f"body: %json {json.dumps(call)}"))

    def render(self, messages: list[dict]) -> ChatPrompt:
        """The tools given to a template that renders them, else written into the
        conversation in the hermes format."""
        messages = [_with_dict_arguments(m) for m in messages]
        if self.template_renders_tools:
            return ChatPrompt(messages, [t.as_openai() for t in self.tools])
        listed = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in self.tools)
        system = HERMES_SYSTEM.format(tools=listed)
        out = []
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = "\n".join(f"{HERMES_OPEN}\n" + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                    ensure_ascii=False) + f"\n{HERMES_CLOSE}" for c in m["tool_calls"])
                m = {"role": "assistant", "content": ((m.get("content") or "") + "\n" + calls).strip()}
            elif m["role"] == "tool":
                m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n"
                     "</tool_response>"}
            out.append({"role": m["role"], "content": m.get("content") or ""})
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
        return ChatPrompt(out)

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a whole answer: calls that parse and name a known
        function become tool_calls; everything else stays content (None if empty)."""
        names = {t.name for t in self.tools}
        calls: list[dict] = []
        if self.fmt == "llama3_json":
            body = text.strip().removeprefix(PYTHON_TAG).strip()
            call = _call(body, names, "parameters")
            return (None, [call]) if call else (text or None, [])
        content = []
        last = 0
        for m in HERMES_BLOCK.finditer(text):
            call = _call(m.group(1), names, "arguments")
            if call is None:
                continue
            content.append(text[last:m.start()])
            calls.append(call)
            last = m.end()
        content.append(text[last:])
        rest = "".join(content).strip() if calls else text
        return rest or None, calls

    def stream(self) -> "ToolStream":
        return ToolStream(self)


class ToolStream:
    """One streamed choice: `feed(text)` returns the content to send now (text before
    where a call may begin); `finish()` the rest of the content and the calls."""

    def __init__(self, use: ToolUse):
        self._use = use
        self._text = ""
        self._sent = 0
        self._holding = use.mode != "auto"  # forced: the whole answer is calls

    def feed(self, text: str) -> str:
        self._text += text
        if self._holding:
            return ""
        hold = self._hold_from()
        out = self._text[self._sent:hold]
        self._sent = max(self._sent, hold)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        rest = self._text[self._sent:]
        content, calls = self._use.parse(rest)
        return content or "", calls

    def _hold_from(self) -> int:
        """Where a call may begin in the text so far (its length: nowhere)."""
        text = self._text
        if self._use.fmt == "llama3_json":
            if self._sent == 0:
                head = text.lstrip()
                if not head or head.startswith("{") or PYTHON_TAG.startswith(head[:len(PYTHON_TAG)]):
                    return 0
            return len(text)
        at = text.find(HERMES_OPEN, self._sent)
        if at >= 0:
            self._holding = True
            return at
        for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):  # a marker's start
            if HERMES_OPEN.startswith(text[-k:]):
                return len(text) - k
        return len(text)


def _tool(i: int, spec) -> Tool:
    where = f"tools.{i}"
    if not isinstance(spec, dict) or spec.get("type", "function") != "function":
        raise bad_request(f"{where}: each tool must be {{\"type\": \"function\", \"function\": "
                          "{...}}", where)
    fn = spec.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"{where}.function must be an object", f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise bad_request(f"{where}.function.name must be 1-64 letters, digits, _ or -, got "
                          f"{name!r:.80}", f"{where}.function.name")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.function.description must be a string",
                          f"{where}.function.description")
    parameters = fn.get("parameters", NO_ARGUMENTS)
    if not isinstance(parameters, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object",
                          f"{where}.function.parameters")
    return Tool(name, description, parameters)


def _choice(tool_choice, names: list[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not names:
            raise bad_request("tool_choice \"required\" needs tools", "tool_choice")
        return tool_choice, None
    name = None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
    if name is None:
        raise bad_request("tool_choice must be \"none\", \"auto\", \"required\" or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names {name!r:.80}, which is not one of the tools",
                          "tool_choice")
    return "named", name


def _call(body: str, names: set[str], key: str) -> dict | None:
    """A tool call from its JSON text (`key`: where its arguments are), or None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _with_dict_arguments(message: dict) -> dict:
    """A message whose tool calls carry their arguments as objects (what templates expect;
    OpenAI sends them as JSON text)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for c in calls:
        fn = dict(c.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass
        out.append({**c, "function": fn})
    return {**message, "tool_calls": out}

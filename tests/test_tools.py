"""Tool calling's parts without a model: formats from chat templates, rendering into the
conversation, parsing calls out of text (whole and streamed), the forcing grammars, and
400s naming the field. The server drives them end to end in test_serve.py."""

from __future__ import annotations

import json

import pytest

from shoal.serving.errors import ApiError
from shoal.serving.tools import ToolUse, tool_format

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
QWEN = "{% if tools %}...<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> <tool_call> {% endif %}"
LLAMA = "{% if tools %}{{ tools | tojson }}{% endif %}<|python_tag|>{{ '<|eom_id|>' }}"
PLAIN = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def use(choice=None, template=PLAIN, tools=(WEATHER, TIME)) -> ToolUse:
    return ToolUse.from_request(list(tools), choice, template)


def test_the_format_follows_the_template():
    assert tool_format(QWEN) == ("hermes", True)
    assert tool_format(LLAMA) == ("llama3_json", True)
    assert tool_format(PLAIN) == ("hermes", False)
    assert tool_format(None) == ("hermes", False)
    assert use("none") is None and ToolUse.from_request(None, "auto", PLAIN) is None


def test_hermes_calls_parse_and_the_rest_stays_content():
    u = use()
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>')
    content, calls = u.parse(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # an unknown function, or JSON that does not parse, is not a call
    for bad in ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                '<tool_call>{"name": "get_time", "arguments": </tool_call>', "plain answer"):
        assert u.parse(bad) == (bad, [])


def test_llama3_json_calls_parse():
    u = use(template=LLAMA)
    content, calls = u.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    assert u.parse("It is sunny.") == ("It is sunny.", [])


@pytest.mark.parametrize("template, pieces", [
    (PLAIN, ["Sure", ", checking. <to", "ol_call>\n{\"name\": \"get_time\", ", "\"arguments\": {}}",
             "\n</tool_call>"]),
    (LLAMA, ["  {\"name\": \"get_time\",", " \"parameters\": {}}"]),
])
def test_streamed_content_stops_where_a_call_may_begin(template, pieces):
    stream = use(template=template).stream()
    sent = "".join(stream.feed(p) for p in pieces)
    rest, calls = stream.finish()
    assert "tool_call" not in sent + rest and "{" not in sent + rest
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    if template == PLAIN:
        assert sent + rest == "Sure, checking. "
    plain = use(template=template).stream()
    text = "".join(plain.feed(p) for p in ["No call ", "<b>here</b>", " at all."])
    assert text + plain.finish()[0] == "No call <b>here</b> at all." and not plain.finish()[1]


def test_a_template_without_tools_gets_them_in_the_system_message():
    u = use()
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [{
                   "id": "c1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "-3 C"}]
    prompt = u.render(history)
    assert prompt.tools is None
    system, asked, called, result = prompt.messages
    assert system["role"] == "system" and '"name": "get_weather"' in system["content"]
    assert "<tool_call>" in system["content"] and asked == history[0]
    assert called["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                 '{"city": "Oslo"}}\n</tool_call>')
    assert result == {"role": "user", "content": "<tool_response>\n-3 C\n</tool_response>"}
    mine = u.render([{"role": "system", "content": "Be brief."}, history[0]]).messages
    assert mine[0]["content"].startswith("Be brief.\n\n") and len(mine) == 2
    rendered = use(template=QWEN).render(history)  # a template that renders tools gets them
    assert [t["function"]["name"] for t in rendered.tools] == ["get_weather", "get_time"]
    assert rendered.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


def test_forcing_grammars():
    import llguidance
    assert use("auto").constraint() is None
    named = use({"type": "function", "function": {"name": "get_weather"}}).constraint()
    assert named.grammar and "get_time" not in named.grammar
    assert "get_time" in use("required").constraint().grammar
    schema = json.loads(use("required", template=LLAMA).constraint().json_schema)
    assert {s["properties"]["name"]["const"] for s in schema["anyOf"]} == {"get_weather", "get_time"}
    for spec in (named, use("required").constraint()):  # each compiles
        assert llguidance.LLMatcher.validate_grammar(spec.grammar_text()) == ""


@pytest.mark.parametrize("tools, choice, param", [
    ([{"type": "retrieval"}], None, "tools.0"),
    ([{"type": "function"}], None, "tools.0.function"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None,
     "tools.0.function.parameters"),
    ([WEATHER, WEATHER], None, "tools"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
    ([], "required", "tool_choice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
     "required", "tools"),
])
def test_bad_tools_name_the_field(tools, choice, param):
    with pytest.raises(ApiError) as e:
        u = ToolUse.from_request(tools, choice, PLAIN)
        u.constraint()
    assert e.value.status == 400 and e.value.param == param

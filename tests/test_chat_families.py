"""Token-in/token-out rendering per model family, against each family's own chat template.

Property: prompt ids + sampled ids (+ end-of-turn) + observation deltas equal the template's render
of the whole conversation, except exactly where the family's template rewrites the past:

- qwen2, llama3: never (their templates are prefix-stable for these conversations).
- qwen3: an assistant turn with a ``<think>`` block that precedes a user message loses the block
  in a re-render (Qwen3 keeps reasoning only after the last user message).
- mistral: with tools, a user message among the observations moves ``[AVAILABLE_TOOLS]`` to it
  (Mistral lists tools right before the last user message).
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.rollout.chat import ChatRenderer
from agentrl.rollout.tool_calls import FAMILY_TOOL_PARSERS, ToolCall, ToolCallParser, format_tool_calls

FAMILIES = ["qwen2", "qwen3", "llama3", "mistral"]
END_OF_TURN = {"qwen2": "<|im_end|>", "qwen3": "<|im_end|>", "llama3": "<|eot_id|>", "mistral": "</s>"}
WORDS = "the a answer is tool call result apples books Tom Anna how many left total".split()
TOOLS = [
    {"type": "function", "function": {"name": "calculate", "description": "Evaluate an arithmetic expression.",
                                      "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "search", "description": "Search the notes.",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                                                       "k": {"type": "integer"}}}}},
]

sentence = st.lists(st.sampled_from(WORDS) | st.integers(0, 9999).map(str), min_size=1, max_size=8).map(" ".join)
tool_call = st.tuples(st.sampled_from(["calculate", "search"]),
                      st.dictionaries(st.sampled_from(["expression", "query", "k"]), sentence | st.integers(0, 99),
                                      max_size=2))


@st.composite
def conversations(draw, family):
    """(initial messages, tools, [(assistant text, has_think, observation messages)])."""
    initial = ([{"role": "system", "content": draw(sentence)}] if draw(st.booleans()) else []) + [
        {"role": "user", "content": draw(sentence)}]
    tools = draw(st.sampled_from([None, TOOLS[:1], TOOLS]))
    parser = FAMILY_TOOL_PARSERS[family]
    turns = []
    for _ in range(draw(st.integers(1, 4))):
        calls = draw(st.lists(tool_call, max_size=2))
        text = format_tool_calls(calls, parser) if calls else draw(sentence)
        think = family == "qwen3" and draw(st.booleans())
        if think:
            text = f"<think>\n{draw(sentence)}\n</think>\n\n{text}"
        if calls and draw(st.booleans()):
            obs = [{"role": "tool", "content": draw(sentence)} for _ in calls]
        else:
            obs = [{"role": "user", "content": draw(sentence)}]
        turns.append((text, think, obs))
    return initial, tools, turns


def documented_difference(family, tools, turns):
    """Whether the family's template re-renders this conversation differently from its deltas."""
    user_after = [any(m["role"] == "user" for _, _, obs in turns[i:] for m in obs) for i in range(len(turns))]
    if family == "qwen3":
        return any(think and later for (_, think, _), later in zip(turns, user_after))
    if family == "mistral":
        return bool(tools) and user_after[0]
    return False


@pytest.fixture(scope="module", params=FAMILIES)
def family_renderer(request, tiny_family_dir):
    from transformers import AutoTokenizer

    return request.param, ChatRenderer(AutoTokenizer.from_pretrained(tiny_family_dir(request.param)))


def test_end_of_turn_token_is_read_from_the_template(family_renderer):
    family, r = family_renderer
    assert r.end_of_turn == END_OF_TURN[family] and r.end_of_turn_id in r.stop_token_ids
    if family == "llama3":  # the tokenizer's EOS is another token; generation also stops at <|eom_id|>
        tok = r.tokenizer
        assert tok.eos_token == "<|end_of_text|>" and tok.convert_tokens_to_ids("<|eom_id|>") in r.stop_token_ids


@given(data=st.data())
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
def test_deltas_equal_the_whole_render_except_where_the_family_rewrites_the_past(family_renderer, data):
    family, r = family_renderer
    initial, tools, turns = data.draw(conversations(family))
    ids = r.prompt_ids(initial, tools)
    messages = list(initial)
    for text, _, obs in turns:
        ids += r.encode(text) + [r.end_of_turn_id] + r.observation_delta_ids(obs)
        messages += [{"role": "assistant", "content": text}, *obs]
    whole = r.encode(r.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True))
    assert (ids != whole) == documented_difference(family, tools, turns), r.tokenizer.decode(ids)


@given(calls=st.lists(tool_call, min_size=1, max_size=3))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_sampled_calls_decode_and_parse_in_the_familys_format(family_renderer, calls):
    """What the env sees of a sampled call (special tokens kept, stop tokens dropped) parses back."""
    family, r = family_renderer
    name = FAMILY_TOOL_PARSERS[family]
    text = format_tool_calls(calls, name)
    seen = r.decode(r.encode(text) + [r.end_of_turn_id])
    assert seen == text
    parsed = ToolCallParser(name, r.tokenizer).parse(seen)
    assert parsed.items == [ToolCall(n, a) for n, a in calls]


def test_structured_tool_calls_render_as_the_format_writes_them(family_renderer):
    """An assistant message with ``tool_calls`` renders the text format_tool_call writes."""
    family, r = family_renderer
    calls = [("calculate", {"expression": "1 + 2"}), ("search", {"query": "apples", "k": 3})]
    structured = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}
    as_text = {"role": "assistant", "content": format_tool_calls(calls, FAMILY_TOOL_PARSERS[family])}
    user = [{"role": "user", "content": "hi"}]
    render = lambda m: r.tokenizer.apply_chat_template(user + [m], tokenize=False)  # noqa: E731
    assert render(structured) == render(as_text)

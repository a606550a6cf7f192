import json

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from agentrl.rollout.chat import ChatRenderer, format_tool_call, parse_tool_calls


def test_parse_single_call():
    p = parse_tool_calls('Let me compute. <tool_call>{"name": "calculate", "arguments": {"expression": "1+2"}}</tool_call>')
    assert [(c.name, c.arguments) for c in p.calls] == [("calculate", {"expression": "1+2"})]
    assert p.errors == [] and p.content == "Let me compute."


def test_parse_reports_each_bad_block():
    text = "<tool_call>{bad json}</tool_call><tool_call>[1]</tool_call><tool_call>{\"arguments\": {}}</tool_call><tool_call>"
    p = parse_tool_calls(text)
    assert p.calls == []
    assert len(p.errors) == 4


def test_arguments_as_json_string():
    p = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>')
    assert p.calls[0].arguments == {"x": 2}


@given(st.text(max_size=300))
@settings(max_examples=200)
def test_parse_never_raises(text):
    p = parse_tool_calls(text)
    assert isinstance(p.calls, list) and isinstance(p.errors, list)


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20),
       st.dictionaries(st.text(min_size=1, max_size=8), st.integers() | st.text(max_size=10), max_size=3))
@settings(max_examples=100)
def test_format_parse_roundtrip(name, args):
    assume("</tool_call>" not in name)  # the one string the format cannot carry
    p = parse_tool_calls(format_tool_call(name, args))
    assert [(c.name, c.arguments) for c in p.calls] == [(name, json.loads(json.dumps(args)))]


def test_observation_delta_equals_full_render_suffix(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    r = ChatRenderer(tok)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    prompt = r.prompt_ids(msgs)
    reply = r.encode(format_tool_call("calculate", {"expression": "2+3"})) + [r.eos_token_id]
    obs = [{"role": "tool", "content": "5"}]
    ids = prompt + reply + r.observation_delta_ids(obs)
    full = tok.apply_chat_template(
        msgs + [{"role": "assistant", "content": format_tool_call("calculate", {"expression": "2+3"})}] + obs,
        tokenize=False, add_generation_prompt=True)
    assert tok.decode(ids) == full


def test_decode_keeps_tool_call_tags_and_drops_eos(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    r = ChatRenderer(tok)
    text = format_tool_call("calculate", {"expression": "2+3"})
    assert r.decode(r.encode(text) + [r.eos_token_id]) == text
    assert parse_tool_calls(r.decode(r.encode(text))).calls


def test_render_cache_returns_what_a_fresh_render_does(tiny_model_dir):
    """Prompts and deltas are cached by their JSON: a hit equals a fresh render, any change of a
    message, a tool or of key order renders anew, and a caller's edit of the list it got back
    does not reach the cache."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    r, fresh = ChatRenderer(tok), ChatRenderer(tok)
    tools = [{"type": "function", "function": {"name": "f", "description": "d",
                                               "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    first = r.prompt_ids(msgs, tools)
    first.append(-1)  # the caller's copy
    assert r.prompt_ids(msgs, tools) == fresh.encode(fresh._template(msgs, tools, True))
    assert r.prompt_ids(msgs) == fresh.encode(fresh._template(msgs, None, True)) != r.prompt_ids(msgs, tools)
    other = [msgs[0], {"role": "user", "content": "What is 2+4?"}]
    assert r.prompt_ids(other, tools) == fresh.encode(fresh._template(other, tools, True))
    reordered = [{"type": "function", "function": {"name": "f", "parameters": tools[0]["function"]["parameters"],
                                                   "description": "d"}}]
    assert r.prompt_ids(msgs, reordered) == fresh.encode(fresh._template(msgs, reordered, True))
    for obs in ([{"role": "tool", "content": "5"}], [{"role": "tool", "content": "6"}], [{"role": "tool", "content": "5"}]):
        assert r.observation_delta_ids(obs) == fresh._delta_ids(obs)
    assert len(r._rendered) == 6  # 4 prompts, 2 deltas (the third delta was a hit)


def test_malformed_calls_log_nothing_after_vllm_reconfigures_logging():
    """vLLM re-applies its logging config when an engine starts in the process (the bench, a
    colocated engine), which resets the level of every vllm.* logger: the parser's traceback per
    malformed call must stay silent anyway (it cost ~0.3 ms per reply on the endpoint)."""
    import logging

    from vllm.logger import _configure_vllm_root_logger
    from vllm.tool_parsers import ToolParserManager

    from agentrl.rollout.tool_calls import ToolCallParser

    parser = ToolCallParser("hermes")
    _configure_vllm_root_logger()  # what an engine starting in this process does
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    log = logging.getLogger(ToolParserManager.get_tool_parser("hermes").__module__)
    log.addHandler(handler)
    try:
        assert parser.parse('<tool_call>\n{"name": "f", "arguments": {"x": "unterminated</tool_call>').errors
    finally:
        log.removeHandler(handler)
    assert seen == []

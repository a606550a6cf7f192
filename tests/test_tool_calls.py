"""Tool-call parsing through vLLM's parsers: formats, errors, config, and robustness properties."""

import json
import time

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from agentrl.config import ConfigError, load_config
from agentrl.rollout.tool_calls import (
    FORMATTED_PARSERS,
    ToolCall,
    ToolCallParser,
    detect_tool_parser,
    format_tool_call,
    format_tool_calls,
    known_parser_names,
    parse_tool_calls,
)

PARSERS = list(FORMATTED_PARSERS)  # every format agentrl writes: hermes, llama3_json, mistral and aliases


@pytest.fixture(scope="module", params=PARSERS)
def parser(request):
    return ToolCallParser(request.param)


def test_registry_read_without_importing_vllm():
    import subprocess
    import sys

    code = ("import sys; from agentrl.rollout.tool_calls import known_parser_names; n = known_parser_names(); "
            "assert 'vllm' not in sys.modules, 'vllm imported'; print(len(n), 'hermes' in n, 'llama3_json' in n)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    count, *flags = out.split()
    assert int(count) > 40 and flags == ["True", "True"]


def test_unknown_parser_name_fails_at_config_time_with_did_you_mean():
    with pytest.raises(ConfigError, match=r"rollout\.tool_parser.*Did you mean 'llama3_json'"):
        load_config(None, ["rollout.tool_parser=llama3-json"])
    assert load_config(None, ["rollout.tool_parser=pythonic"]).rollout.tool_parser == "pythonic"
    assert load_config(None, []).rollout.tool_parser == "auto"
    assert set(PARSERS) <= set(known_parser_names())


def test_format_tool_call_names_the_formats_it_writes():
    with pytest.raises(ValueError, match="no writer for tool parser 'kimi_k2'.*hermes"):
        format_tool_call("f", {}, "kimi_k2")


@pytest.mark.parametrize("name", PARSERS)
def test_several_calls_in_order_and_answers_without_calls(name):
    p = ToolCallParser(name)
    text = format_tool_calls([("calculate", {"expression": "1+2"}), ("search", {"q": "x", "k": [1, {"a": None}]})], name)
    r = p.parse(text)
    assert r.items == [ToolCall("calculate", {"expression": "1+2"}), ToolCall("search", {"q": "x", "k": [1, {"a": None}]})]
    assert r.errors == []
    for answer in ("The answer is 5.", "The set {1, 2} has 2 elements.", ""):
        r = p.parse(answer)
        assert (r.items, r.content) == ([], answer)


@pytest.mark.parametrize(("name", "bad"), [
    ("hermes", "<tool_call>{not json}</tool_call>"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": </tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}'),
    ("mistral", "[TOOL_CALLS]f[ARGS]{not json"),
])
def test_a_malformed_call_is_an_error_in_its_place(name, bad):
    good = format_tool_call("g", {"y": 2}, name)
    sep = "; " if name == "llama3_json" else ""
    # Marker formats keep the good calls around a bad block; Llama's bare JSON has no blocks to cut.
    r = ToolCallParser(name).parse(good + sep + bad if name != "llama3_json" else bad)
    assert r.errors, r.items
    assert r.errors[-1].startswith("malformed tool call") or "arguments are not valid JSON" in r.errors[-1]
    if name != "llama3_json":
        assert r.items[0] == ToolCall("g", {"y": 2}) and isinstance(r.items[1], str)


def test_calls_past_max_calls_are_not_parsed():
    text = format_tool_call("f", {}) * 50
    r = ToolCallParser("hermes").parse(text, max_calls=3)
    assert len(r.calls) == 3 and "too many tool calls in one message (50); at most 3" in r.errors[0]


def test_arguments_written_as_a_json_string_are_accepted():
    r = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>')
    assert r.calls == [ToolCall("f", {"x": 2})]


@pytest.mark.parametrize(("family", "expected"), [
    ("qwen2", "hermes"), ("qwen3", "hermes"), ("llama3", "llama3_json"), ("mistral", "mistral")])
def test_auto_reads_the_checkpoints_family(family, expected, tiny_family_dir):
    assert detect_tool_parser(tiny_family_dir(family)) == expected


def test_auto_fails_clearly_on_an_unknown_family(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mystery"}))
    with pytest.raises(ValueError, match="set rollout.tool_parser"):
        detect_tool_parser(tmp_path)


# --- robustness properties ------------------------------------------------------------------------

names = st.text(st.characters(whitelist_categories=("L", "N"), whitelist_characters="_"), min_size=1, max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12)
arguments = st.dictionaries(st.text(max_size=10), json_values, max_size=4)
FRAGMENTS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "{", "}", "[", "]", '"',
             '"name": ', '"arguments": ', '"parameters": ', "; ", ",", ":", "\n", "\\", "\ud800", "\udfff", "null"]


@st.composite
def adversarial_text(draw):
    pieces = draw(st.lists(st.one_of(
        st.sampled_from(FRAGMENTS),
        st.text(max_size=30),  # any code point, lone surrogates included
        st.builds(lambda n, a, p: format_tool_call(n, a, p), names, arguments, st.sampled_from(PARSERS)),
        st.builds(lambda c, k: c * k, st.sampled_from(["{", "[", '{"name": ', "<tool_call>", "[TOOL_CALLS]"]),
                  st.integers(1, 300)),
        st.builds(lambda k: format_tool_call("f", {"x": "a" * k}), st.integers(1000, 20000)),  # huge arguments
    ), max_size=12))
    return "".join(pieces)


@given(text=adversarial_text())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_parsers_never_raise_on_adversarial_text(parser, text):
    r = parser.parse(text)
    assert all(isinstance(i, (ToolCall, str)) for i in r.items)
    assert len(r.items) == len(r.calls) + len(r.errors)
    assert all(isinstance(c.arguments, dict) and c.name for c in r.calls)


@given(calls=st.lists(st.tuples(names, arguments), min_size=1, max_size=4))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_format_tool_call_round_trips(parser, calls):
    text = format_tool_calls(calls, parser.name)
    assume(all(marker not in json.dumps(a) for _, a in calls for marker in ("[TOOL_CALLS]", "<tool_call>")))
    r = parser.parse(text)
    assert r.errors == [] and [(c.name, c.arguments) for c in r.calls] == [(n, json.loads(json.dumps(a))) for n, a in calls]


PATHOLOGICAL = {
    "unterminated blocks": lambda n: "<tool_call>{" * (n // 12),
    "nested braces": lambda n: '{"name": ' * (n // 9),
    "open brackets": lambda n: "[TOOL_CALLS]f[ARGS]" + "[" * n,
    "many calls": lambda n: "".join(format_tool_call("f", {"x": 1}, p) for p in PARSERS) * (n // 200),
    "huge argument": lambda n: format_tool_call("f", {"x": "a" * n}),
    "many markers": lambda n: "[TOOL_CALLS]<tool_call><|python_tag|>" * (n // 36),
    "many objects": lambda n: '{"a": 1}; ' * (n // 10),
}


def _best_time(parser, text, repeats=3):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        parser.parse(text)
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.parametrize("case", list(PATHOLOGICAL))
def test_parse_time_grows_linearly_with_text_size(parser, case):
    """8x the text may cost at most ~3x more than 8x the time: a quadratic parser would take 64x.
    The best of three runs per size, and a floor of 2 ms, keep machine noise out of the ratio."""
    small, large = PATHOLOGICAL[case](20_000), PATHOLOGICAL[case](160_000)
    t_small, t_large = _best_time(parser, small), _best_time(parser, large)
    assert t_large <= 24 * max(t_small, 2e-3), (case, t_small, t_large)


def test_env_tool_parser_kwarg():
    import gymnasium as gym

    import agentrl.envs  # noqa: F401

    env = gym.make("agentrl/Calculator-v0", tool_parser="llama3_json")
    env.reset(seed=0)
    inner = env.unwrapped
    assert inner.format_tool_call("calculate", {"expression": "2 + 3"}) == format_tool_call(
        "calculate", {"expression": "2 + 3"}, "llama3_json")
    obs, *_ = env.step(inner.format_tool_call("calculate", {"expression": "2 + 3"}))
    assert obs == [{"role": "tool", "content": "5"}]
    with pytest.raises(ValueError, match="tool_parser: unknown tool parser 'mistrall'. Did you mean 'mistral'"):
        gym.make("agentrl/Calculator-v0", tool_parser="mistrall")

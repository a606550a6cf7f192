"""Chat templates of the tiny models, one per family, written here from each family's documented format.

Each follows its family where the token-in/token-out loop can tell: where tools are described,
the tool-call syntax (the one :func:`agentrl.rollout.tool_calls.format_tool_call` writes), the role tool
results come back in, and the token that ends an assistant turn. Tools are listed as one-line
signatures rather than full JSON schemas: a ~1M-parameter model learns faster from a prompt of
~80 tokens than of ~250. (Jinja runs with trim_blocks: a newline right after a block tag is
written as ``{{ '\\n' }}``.)

- qwen2 (Qwen2.5): ChatML turns ending in ``<|im_end|>``; tools in the system turn; calls as
  ``<tool_call>{json}</tool_call>``; consecutive tool results in one user turn, each wrapped in
  ``<tool_response>``.
- qwen3: as qwen2, and an assistant turn's ``<think>...</think>`` block is kept only after the
  last user message: a re-render drops the reasoning of earlier turns.
- llama3 (Llama 3.1-3.3): header tokens, turns ending in ``<|eot_id|>`` (the tokenizer's EOS is
  ``<|end_of_text|>``); ``Environment: ipython`` and the tool list with the JSON-call
  instruction in the first user message; calls as ``{"name": ..., "parameters": {...}}``; tool
  results in ``ipython`` turns.
- mistral (tokenizer v11+): ``[SYSTEM_PROMPT]``, tools in ``[AVAILABLE_TOOLS]`` right before the
  *last* user message (a re-render moves them when a later user message appears), calls as
  ``[TOOL_CALLS]name[ARGS]{json}``, results in ``[TOOL_RESULTS]``, assistant turns ending in
  ``</s>``; no assistant header, so the generation prompt is empty.

This module knows nothing of models or tokenizers: it holds strings.
"""

from __future__ import annotations

__all__ = ["TEMPLATES"]

# One line per tool: "- name(arg, ...): description".
_TOOL_LINES = (
    "{% for tool in tools %}{% set fn = tool.function if tool.function is defined else tool %}"
    "- {{ fn.name }}({% for arg in (fn.parameters or {}).get('properties', {}) %}{{ arg }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}): {{ fn.description }}\n{% endfor %}"
)
_FN = "{% set fn = call.function if call.function is defined else call %}"

_CHATML_SYSTEM = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\nCall one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>\n"
    + _TOOL_LINES + "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
)
_CHATML_CALLS = (
    "{% for call in message.tool_calls or [] %}" + _FN +
    "{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ fn.name }}\", \"arguments\": {{ fn.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}"
)
_CHATML_TOOL_AND_OTHERS = (
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif message.role == 'system' %}"
    "{% if not loop.first %}<|im_start|>system\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QWEN2 = (
    _CHATML_SYSTEM
    + "{% for message in messages %}"
    "{% if message.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ message.content or '' }}" + _CHATML_CALLS + "<|im_end|>\n"
    + _CHATML_TOOL_AND_OTHERS
)

QWEN3 = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for message in messages %}{% if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
    "{% endfor %}"
    + _CHATML_SYSTEM
    + "{% for message in messages %}"
    "{% if message.role == 'assistant' %}"
    "{% set content = message.content or '' %}"
    "{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}"
    "<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_user %}<think>\n{{ reasoning }}\n</think>\n\n{% endif %}"
    "{% else %}<|im_start|>assistant\n{% endif %}"
    "{{ content }}" + _CHATML_CALLS + "<|im_end|>\n"
    + _CHATML_TOOL_AND_OTHERS
)

LLAMA3 = (
    "<|begin_of_text|>"
    "{% set system = messages[0].content if messages and messages[0].role == 'system' else none %}"
    "{% if tools or system is not none %}<|start_header_id|>system<|end_header_id|>\n\n"
    "{% if tools %}Environment: ipython\n{% endif %}{{ system if system is not none else '' }}<|eot_id|>{% endif %}"
    "{% set ns = namespace(first_user=true) %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% if not loop.first %}<|start_header_id|>system<|end_header_id|>\n\n{{ message.content }}<|eot_id|>{% endif %}"
    "{% elif message.role == 'tool' or message.role == 'ipython' %}"
    "<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{% elif message.role == 'assistant' %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}" + _FN +
    "{% if not loop.first %}; {% endif %}"
    "{\"name\": \"{{ fn.name }}\", \"parameters\": {{ fn.arguments | tojson }}}"
    "{% endfor %}<|eot_id|>"
    "{% else %}"
    "<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n"
    "{% if message.role == 'user' and tools and ns.first_user %}"
    "Answer with a JSON function call {\"name\": function name, \"parameters\": {argument: value}} "
    "to one of:\n" + _TOOL_LINES + "{{ '\\n' }}{% endif %}"
    "{% if message.role == 'user' %}{% set ns.first_user = false %}{% endif %}"
    "{{ message.content }}<|eot_id|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

MISTRAL = (
    "<s>"
    "{% set ns = namespace(last_user=-1) %}"
    "{% for message in messages %}{% if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}[SYSTEM_PROMPT]{{ message.content }}[/SYSTEM_PROMPT]"
    "{% elif message.role == 'user' %}"
    "{% if tools and loop.index0 == ns.last_user %}[AVAILABLE_TOOLS]" + _TOOL_LINES + "[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ message.content }}[/INST]"
    "{% elif message.role == 'assistant' %}{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}" + _FN +
    "[TOOL_CALLS]{{ fn.name }}[ARGS]{{ fn.arguments | tojson }}{% endfor %}</s>"
    "{% elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]"
    "{% endif %}"
    "{% endfor %}"
)

TEMPLATES = {"qwen2": QWEN2, "qwen3": QWEN3, "llama3": LLAMA3, "mistral": MISTRAL}

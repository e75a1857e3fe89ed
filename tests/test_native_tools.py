"""Models whose chat template calls tools natively (Qwen's family, the `gpu` profile's): a toolworld episode
rendered with a Qwen-style template (written here, on the tiny model's tokenizer: nothing is downloaded) has
the template's tool instructions once and each tool result inside exactly one ``<tool_response>``."""

from __future__ import annotations

import json

# The structure of Qwen2.5's chat template (system + "# Tools", tool results grouped into one user turn,
# each inside <tool_response>), in the Hermes/Qwen conventions lopd's suites parse.
QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _qwen_style_tokenizer(tiny_model_path):
    from lopd_core.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_path)
    tokenizer.chat_template = QWEN_STYLE_TEMPLATE
    return tokenizer


def test_a_toolworld_episode_renders_with_a_qwen_style_template_exactly(tiny_model_path):
    from lopd_core.envs import get_suite
    from lopd_core.records.chat import template_supports_tools, template_wraps_tool_responses
    from lopd_core.rollout.oracle import oracle_episode

    tokenizer = _qwen_style_tokenizer(tiny_model_path)
    assert template_supports_tools(tokenizer) and template_wraps_tool_responses(tokenizer)
    suite = get_suite("toolworld")
    task = next(t for t in suite.tasks("train", 50, level=2, seed=0) if t.oracle.count("<tool_call>") >= 2)
    episode = oracle_episode(tokenizer, suite, task)
    text = tokenizer.decode(episode.token_ids, clean_up_tokenization_spaces=False)

    system, *turns = episode.messages
    tools = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in task.tools)
    expected = (f"<|im_start|>system\n{system['content']}\n\n# Tools\n\nYou may call one or more functions to assist "
                f"with the user query.\n\nYou are provided with function signatures within <tools></tools> XML "
                f"tags:\n<tools>{tools}\n</tools>\n\nFor each function call, return a json object with function "
                "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
                "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n")
    for m in turns:  # the worked examples, the request, the episode; a tool message is the environment's text
        role = "user" if m["role"] == "tool" else m["role"]
        expected += f"<|im_start|>{role}\n{m['content']}<|im_end|>\n"
    assert text == expected
    # the environment's observations are already <tool_response> blocks: the template wrapped none again,
    # and the instructions are the template's alone
    observations = [m["content"] for m in turns if m["role"] == "tool"]
    assert len(observations) >= 2
    assert text.count("<tool_response>") == sum(o.count("<tool_response>") for o in observations)
    assert "<tool_response>\n<tool_response>" not in text
    assert text.count("You are provided with function signatures") == 1 and "You can call functions" not in text
    # the assistant's own turns are exactly what it generated (mask 1), the template's text around them is not
    generated = tokenizer.decode([i for i, m in zip(episode.token_ids, episode.assistant_mask, strict=True) if m],
                                 clean_up_tokenization_spaces=False)
    assert generated == "".join(m["content"] + "<|im_end|>" for m in turns[episode.initial_messages - 1:]
                                if m["role"] == "assistant")


def test_a_template_without_native_tools_gets_the_fallback_preamble_once(tiny_tokenizer):
    from lopd_core.records.chat import render_text, template_wraps_tool_responses

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": '<tool_call>{"name": "f", "arguments": {}}</tool_call>'},
                {"role": "tool", "content": "<tool_response>\n1\n</tool_response>"}]
    assert not template_wraps_tool_responses(tiny_tokenizer)  # SmolLM2's template: our wrapping stays
    text = render_text(tiny_tokenizer, messages, tools)
    assert text.count("You can call functions") == 1 and text.count("<tool_response>\n1\n</tool_response>") == 1


def test_several_results_of_one_turn_are_one_user_turn_each_wrapped_once(tiny_model_path):
    from lopd_core.records.chat import render_text

    tokenizer = _qwen_style_tokenizer(tiny_model_path)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": "<tool_call>a</tool_call>\n<tool_call>b</tool_call>"},
                {"role": "tool", "content": "<tool_response>\n1\n</tool_response>\n<tool_response>\n{\"x\": 2}\n"
                                            "</tool_response>"}]
    text = render_text(tokenizer, messages)  # no tools: the template's plain system turn
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"
                    "<tool_call>a</tool_call>\n<tool_call>b</tool_call><|im_end|>\n<|im_start|>user\n"
                    "<tool_response>\n1\n</tool_response>\n<tool_response>\n{\"x\": 2}\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n")

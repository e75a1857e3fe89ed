"""Token alignment of the chat rendering helpers (SmolLM2 tokenizer and template)."""

from lopd_core.records.chat import encode, render_prompt_ids, render_text, turn_suffix_ids

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def test_fallback_puts_tools_in_the_system_message(tiny_tokenizer):
    text = render_text(tiny_tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], TOOLS)
    system = text.split("<|im_end|>")[0]
    assert "Be brief." in system and "get_weather" in system and "<tool_call>" in system


def test_incremental_ids_equal_a_full_render(tiny_tokenizer):
    tok = tiny_tokenizer
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "weather in Oslo?"}]
    prompt = render_prompt_ids(tok, msgs, TOOLS)
    reply = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    generated = encode(tok, reply) + [tok.convert_tokens_to_ids("<|im_end|>")]
    obs = {"role": "tool", "content": "<tool_response>3 C</tool_response>"}
    suffix = turn_suffix_ids(tok, msgs, generated, [obs], TOOLS)
    ids = prompt + generated + suffix
    full = render_text(tok, [*msgs, {"role": "assistant", "content": reply}, obs], TOOLS)
    assert tok.decode(ids) == full
    # a generation cut by the length limit gets its end-of-turn from the suffix
    cut = encode(tok, reply[:20])
    suffix_cut = turn_suffix_ids(tok, msgs, cut, [obs], TOOLS)
    assert tok.decode(suffix_cut).startswith("<|im_end|>")

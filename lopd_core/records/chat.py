"""Chat rendering to token ids, shared by the agent loop and every teacher that re-prompts a trajectory.

Two rules keep student and teacher sequences aligned token for token:

1. the initial prompt is rendered once with the chat template (``render_prompt_ids``) and everything the
   policy generated afterwards is kept as ids, never re-tokenised;
2. text the template inserts between turns (end of turn, the tool response turn, the next assistant
   header) is found by rendering with a sentinel in place of the assistant content and splitting at it
   (``turn_suffix_ids``) — the same trick the latent span uses; we never search for the pad id (in SmolLM2
   the pad token is ``<|im_end|>``, which also closes every turn).

Tools: where the tokenizer's chat template references ``tools`` they are passed to
``apply_chat_template(..., tools=...)`` and the template writes the tool instructions (nothing of ours is
added); otherwise (SmolLM2's template) :func:`tools_system_prompt` is appended to the system message — a
documented fallback in the Hermes/Qwen style the suites parse. The environments return one ``tool`` message
holding a ``<tool_response>`` per call; a template that wraps tool results in ``<tool_response>`` itself
(Qwen's) gets them as one bare ``tool`` message per response instead (:func:`native_tool_messages`), so each
result is wrapped exactly once. The calls are the same ``<tool_call>`` JSON in both conventions.
"""

from __future__ import annotations

import json
import re
from typing import Any

from lopd_core.records.experience import shorten_observation

SENTINEL = "\u2063LOPD-SENTINEL\u2063"


def template_supports_tools(tokenizer) -> bool:
    template = tokenizer.chat_template or ""
    return "tools" in template


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The fallback tool preamble for templates without native tool support."""
    lines = [
        "You can call functions. The available functions, as JSON schemas, are:",
        "<tools>",
        *(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools),
        "</tools>",
        'To call a function, reply with one JSON object per call inside tags: '
        '<tool_call>{"name": "function_name", "arguments": {"arg": "value"}}</tool_call>',
        "The result comes back inside <tool_response></tool_response>. When you have everything you need, "
        "answer the user in plain text without a tool call.",
    ]
    return "\n".join(lines)


def with_tools_fallback(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages with the tool preamble merged into the system message (added when absent)."""
    if not tools:
        return messages
    preamble = tools_system_prompt(tools)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + preamble}, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]


_TOOL_RESPONSE = re.compile(r"<tool_response>\n?(.*?)\n?</tool_response>", re.DOTALL)


def template_wraps_tool_responses(tokenizer) -> bool:
    """Whether the chat template puts ``tool`` messages inside ``<tool_response>`` tags itself (Qwen's does)."""
    return "<tool_response>" in (tokenizer.chat_template or "")


def native_tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each ``tool`` message made of ``<tool_response>`` blocks split into one ``tool``
    message per block holding its bare content (what a template that wraps tool results expects)."""
    out = []
    for m in messages:
        bodies = _TOOL_RESPONSE.findall(str(m.get("content") or "")) if m.get("role") == "tool" else []
        out.extend([{**m, "content": body} for body in bodies] if bodies else [m])
    return out


def render_text(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
                add_generation_prompt: bool = True) -> str:
    if template_wraps_tool_responses(tokenizer):
        messages = native_tool_messages(messages)
    if tools and template_supports_tools(tokenizer):
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    return tokenizer.apply_chat_template(with_tools_fallback(messages, tools), tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def encode(tokenizer, text: str) -> list[int]:
    """Tokenise rendered template text (it already contains the special tokens)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render_prompt_ids(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of the initial prompt, ending with the assistant header."""
    return encode(tokenizer, render_text(tokenizer, messages, tools))


def end_of_turn_ids(tokenizer) -> list[int]:
    """Ids that end an assistant turn (the engines stop on them)."""
    ids = {tokenizer.eos_token_id}
    for tok in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None:
            ids.add(tid)
    return sorted(i for i in ids if i is not None)


def turn_suffix_ids(tokenizer, messages: list[dict[str, Any]], generated_ids: list[int],
                    next_messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
                    add_generation_prompt: bool | None = None) -> list[int]:
    """Ids the template inserts after an assistant turn whose tokens were ``generated_ids``.

    ``messages`` is the conversation before the assistant turn; ``next_messages`` are the messages that
    follow it (a tool response, …; empty at the end of the episode). The result starts with the
    end-of-turn text unless the generation already ended with an end-of-turn id, and ends with the next
    assistant header when ``next_messages`` is non-empty (or when ``add_generation_prompt`` is True: another
    assistant turn follows directly).
    """
    probe = [*messages, {"role": "assistant", "content": SENTINEL}, *next_messages]
    if add_generation_prompt is None:
        add_generation_prompt = bool(next_messages)
    text = render_text(tokenizer, probe, tools, add_generation_prompt=add_generation_prompt)
    after = text.split(SENTINEL, 1)[1]
    if generated_ids and generated_ids[-1] in end_of_turn_ids(tokenizer):
        eot_text = tokenizer.decode([generated_ids[-1]])
        if after.startswith(eot_text):
            after = after[len(eot_text):]
    return encode(tokenizer, after)


def render_turns(tokenizer, messages: list[dict[str, Any]]) -> str:
    """Chat turns rendered with the model's template but with no system turn at all.

    Templates insert a default system prompt when the conversation has none (SmolLM2's "You are a helpful
    AI assistant named SmolLM…"); an experience shown to a teacher or an encoder must not carry one. The
    turns are rendered behind a sentinel system turn, which is then cut off whole.
    """
    normalised = [{**m, "content": m.get("content") or ""} for m in messages]
    head = render_text(tokenizer, [{"role": "system", "content": SENTINEL}], None, add_generation_prompt=False)
    full = render_text(tokenizer, [{"role": "system", "content": SENTINEL}, *normalised], None,
                       add_generation_prompt=False)
    if not full.startswith(head):
        raise ValueError("the chat template renders a system turn differently when turns follow it; "
                         "render_turns cannot cut it off (a template this project does not support yet)")
    return full[len(head):]


OBSERVATION_STEPS = (None, 200, 100, 50)
"""When turns do not fit, tool observations are shortened to these many characters in turn, then whole
turns are dropped from the end."""


def fit_turns(tokenizer, turns: list[dict[str, Any]], *, max_tokens: int) -> list[dict[str, Any]]:
    """``turns`` cut to render (:func:`render_turns`) in at most ``max_tokens`` tokens, never inside an action.

    Observations are shortened first, then whole turns are dropped from the end, so the request and the
    first action stay; only a request that alone is too long is cut, by tokens.
    """
    def size(candidate: list[dict[str, Any]]) -> int:
        return len(encode(tokenizer, render_turns(tokenizer, candidate)))

    fitted = turns
    for max_chars in OBSERVATION_STEPS:
        fitted = turns if max_chars is None else [
            {**m, "content": shorten_observation(str(m.get("content") or ""), max_chars=max_chars)}
            if m.get("role") == "tool" else m for m in turns]
        if size(fitted) <= max_tokens:
            return fitted
    while len(fitted) > 1:
        fitted = fitted[:-1]
        if size(fitted) <= max_tokens:
            return fitted
    request = dict(fitted[0]) if fitted else {"role": "user", "content": ""}
    ids = encode(tokenizer, str(request.get("content") or ""))
    while ids and size([{**request, "content": tokenizer.decode(ids)}]) > max_tokens:
        ids = ids[: max(len(ids) - max(len(ids) // 8, 1), 0)]
    return [{**request, "content": tokenizer.decode(ids)}]

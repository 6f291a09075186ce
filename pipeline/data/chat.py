"""Chat templates for training: assistant-only loss masks on any template, and templates for base models.

Assistant tokens without `{% generation %}` markers: the conversation is rendered turn by turn. For the
assistant message k, the template renders `messages[:k]` with the generation prompt (what the model is
given at inference) and `messages[:k+1]`; the characters the second adds after their common prefix are
that turn. Trailing whitespace is left out of the span: the template's end-of-turn token (ChatML's
`<|im_end|>`) is trained, the newline some templates put between turns is not (the model stops at the
end-of-turn token; the newline belongs to the layout, exactly as TRL's marker-patched templates do).
The whole conversation is tokenised once and every token overlapping a span is trained. Everything the
template inserts itself (default system prompts, metadata, an empty think block in the generation
prompt) lies outside the spans.

The turn-by-turn rendering is valid only for a prefix-preserving template: each `messages[:k+1]` must
render to the start of the whole conversation. Templates that rewrite earlier turns (for example by
dropping earlier think blocks) are refused, naming the row.

Tool calling (TRL's format: assistant turns with `tool_calls`, `tool` turns with the results, a `tools` column of
JSON schemas): the row's tools reach the template (`apply_chat_template(tools=...)`), a tool call is part of its
assistant turn (trained), a tool result is context. A template that leaves a row's tools, tool calls or tool
results out of its text (one that takes no tools) is refused, naming the row.

Base models: `model.chat_template` names a template, the built-in `chatml` or a Jinja file. When its
end-of-turn marker is not one token of the vocabulary, it is added as a special token, the embeddings
are resized (`pipeline.train.models.fit_model`) and it becomes the eos of the tokenizer and of the model's
generation config (as TRL's `clone_chat_template` does), so the model learns to stop. The tokenizer is saved
with each checkpoint, so eval and sampling, which load the checkpoint's tokenizer, use the same template.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pipeline.data.formats import tool_name
from pipeline.errors import ConfigError

CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
BUILTIN = {"chatml": (CHATML, "<|im_end|>", "<|im_start|>")}  # name -> (template, end-of-turn, other markers)


def template_text(name: str) -> str:
    """The Jinja text of `model.chat_template`: a built-in name (`chatml`) or a file path."""
    if name in BUILTIN:
        return BUILTIN[name][0]
    path = Path(name)
    if not path.is_file():
        raise ConfigError(f"model.chat_template={name!r} is neither a built-in ({', '.join(BUILTIN)}) nor a file")
    return path.read_text(encoding="utf-8")


def template_markers(name: str) -> tuple[str, ...]:
    """The special markers a configured template writes, end-of-turn first (ChatML's for a ChatML-style file)."""
    if name in BUILTIN:
        return BUILTIN[name][1:]
    text = template_text(name)
    return ("<|im_end|>", "<|im_start|>") if "<|im_end|>" in text else ()


def apply_template(tok: Any, name: str) -> Any:
    """Set the configured template on `tok`; register its markers as special tokens, the end-of-turn as eos.

    Returns `tok`. New tokens make the vocabulary larger than the model's embeddings: `models.fit_model` resizes them.
    """
    if not name:
        return tok
    tok.chat_template = template_text(name)
    markers = template_markers(name)
    if markers and any(len(tok.encode(m, add_special_tokens=False)) != 1 for m in markers):
        tok.add_special_tokens({"additional_special_tokens": list(markers)}, replace_extra_special_tokens=False)
    if markers:
        tok.eos_token = markers[0]
    return tok


def stand_in_tokenizer(name: str) -> Any:
    """A tokenizer without a vocabulary of its own (a word is one unknown token) that carries `model.chat_template`
    `name` (`apply_template`): it renders rows as the tokenizer of any model with that template would, so the
    template is checked before the model it is for exists (a base model not built yet)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    return apply_template(tok, name)


def template_kwargs(kwargs: dict | None) -> dict:
    """A row's chat-template kwargs without the None values (Arrow fills the keys other rows set with None)."""
    return {k: v for k, v in (kwargs or {}).items() if v is not None}


def render_row(tok: Any, stage: Any, row: dict, what: str) -> None:
    """Render a normalised row as its stage will (assistant spans for assistant-only loss, prompts with the
    generation prompt, prompt + chosen / rejected / completion); an error of the template is a ConfigError
    `what: reason`."""
    kwargs, tools = row.get("chat_template_kwargs"), row.get("tools")
    try:
        if "messages" in row and stage.get("format", "chat") == "chat" and stage.get("assistant_only_loss"):
            assistant_spans(tok, row["messages"], kwargs, what, tools)
        elif "messages" in row:
            render(tok, row["messages"], kwargs, tools=tools, where=what)
        if "prompt" in row:
            render(tok, row["prompt"], kwargs, generation_prompt=True, where=what)
            for answer in ("chosen", "rejected", "completion"):
                if answer in row:
                    render(tok, row["prompt"] + row[answer], kwargs, where=what)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - jinja2's errors and whatever a template raises (raise_exception)
        reason = " ".join(str(err).split())[:300] or type(err).__name__
        raise ConfigError(f"{what}: {reason}") from None


def template_inputs(messages: list[dict], tools: str | list | None) -> tuple[list[dict], list | None]:
    """A row's messages and tools as a template takes them: tools decoded from their JSON text, and the null fields
    Arrow gives a message of a column whose other messages carry tool calls left out (TRL's `remove_none_values`)."""
    if any(len(m) > 2 for m in messages):  # more than role and content
        from trl.trainer.utils import remove_none_values

        messages = remove_none_values(messages)
    return messages, json.loads(tools) if isinstance(tools, str) else tools


def _left_out(text: str, messages: list[dict], tools: list | None) -> str:
    """The first of a row's tools, tool calls and tool results (the start of its first line: a template may quote
    the rest) that its rendered `text` leaves out; '' if none."""
    parts = [("tool", tool_name(t)) for t in tools or []]
    parts += [("tool call", tool_name(c)) for m in messages for c in m.get("tool_calls") or []]
    parts += [("tool result", m["content"].strip().split("\n")[0][:40]) for m in messages if m["role"] == "tool"]
    return next((f"the {what} {value!r}" for what, value in parts if value and str(value) not in text), "")


def render(tok: Any, messages: list[dict], kwargs: dict, generation_prompt: bool = False, tools: Any = None,
           where: str = "a row") -> str:
    """The template's text for `messages` (no tokenisation), with the row's template kwargs and tools; a template
    that fails on, or leaves out, a tool, tool call or tool result of the row is a ConfigError naming `where`."""
    messages, tools = template_inputs(messages, tools)
    calling = bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    try:
        text = tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                       add_generation_prompt=generation_prompt, **template_kwargs(kwargs))
        missing = _left_out(text, messages, tools) if calling else ""
    except Exception as err:  # noqa: BLE001 - jinja2's errors and whatever a template raises
        if not calling:
            raise
        missing = f"the row's tool calling ({' '.join(str(err).split())[:200] or type(err).__name__})"
    if missing:
        raise ConfigError(f"{where}: {missing} is missing from the chat template's text: the template takes no tools "
                          "(apply_chat_template's tools=, tool_calls, tool turns); set model.chat_template to a "
                          "template that renders them")
    return text


def assistant_spans(tok: Any, messages: list[dict], kwargs: dict, where: str,
                    tools: Any = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant turn (end-of-turn token included; a
    tool call is part of its turn).

    Raises ConfigError naming `where` (source and row) for an empty assistant turn or a template that is
    not prefix-preserving, or that leaves out the row's tool calling.
    """
    full = render(tok, messages, kwargs, tools=tools, where=where)
    spans = []
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        if not str(message.get("content") or "").strip() and not message.get("tool_calls"):
            asked = next((str(m.get("content")) for m in messages[:k] if m.get("role") == "user"), "")
            raise ConfigError(f"{where} (user: {asked[:60]!r}): assistant turn {k + 1} is empty; drop the row or "
                              "give it content")
        prompt = render(tok, messages[:k], kwargs, generation_prompt=True, tools=tools, where=where) if k else ""
        turn = render(tok, messages[:k + 1], kwargs, tools=tools, where=where)
        if not full.startswith(turn):
            raise ConfigError(f"{where}: the chat template is not prefix-preserving (messages 1..{k + 1} do not "
                              "render as the start of the whole conversation, e.g. it rewrites earlier turns), so "
                              "assistant turns cannot be located; split multi-turn rows into one row per assistant "
                              "turn or set assistant_only_loss=false")
        start = len(os.path.commonprefix([prompt, turn]))
        end = len(turn.rstrip())
        if end > start:
            spans.append((start, end))
    return full, spans


def tokenise_masked(tok: Any, messages: list[dict], kwargs: dict, where: str, tools: Any = None) -> dict:
    """`input_ids` of the rendered conversation and `assistant_masks` (1 on every assistant-turn token)."""
    full, spans = assistant_spans(tok, messages, kwargs, where, tools)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s < b and e > a for a, b in spans)) for s, e in enc["offset_mapping"]]
    return {"input_ids": enc["input_ids"], "assistant_masks": mask}


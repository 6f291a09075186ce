"""The row formats TRL documents (https://huggingface.co/docs/trl/dataset_formats), by the columns a row has once
`pipeline.data.mixtures.normalise` has read it, and the target columns a source's `columns` may map.

A stage kind names the formats it trains on (`StageKind.formats`); the preflight refuses a row of any other
format, naming them. Normalised, prompt-completion rows are conversations (`messages`: the prompt's turns, then
the completion's as assistant turns), and a preference row always has its prompt (an implicit one is the turns
chosen and rejected share). This module is light: the config loader reads it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

TARGETS = ("messages", "text", "prompt", "completion", "chosen", "rejected", "label", "answer", "user", "assistant",
           "system", "tools", "chat_template_kwargs")
# format -> (the columns its rows have once normalised, how the messages name it: its columns as TRL names them)
FORMATS: dict[str, tuple[tuple[str, ...], str]] = {
    "language modeling": (("text",), "language modeling (text)"),
    "conversational": (("messages",), "conversational (messages)"),
    "prompt-completion": (("messages",), "prompt-completion (prompt, completion)"),
    "preference": (("prompt", "chosen", "rejected"), "preference (prompt, chosen, rejected; or chosen, rejected "
                                                     "sharing an implicit prompt)"),
    "unpaired preference": (("prompt", "completion", "label"), "unpaired preference (prompt, completion, label)"),
    "prompt with answer": (("prompt", "answer"), "prompt-only with its answer (prompt, answer)"),
    "prompt-only": (("prompt",), "prompt-only (prompt)"),
}


def fits(row: Iterable[str], formats: list[str]) -> bool:
    """Whether a normalised row (its columns) is of one of `formats`."""
    return any(set(FORMATS[f][0]) <= set(row) for f in formats)


def describe(formats: list[str]) -> str:
    """`formats` in words, for messages: `preference (prompt, chosen, rejected; ...) or ...`."""
    return " or ".join(FORMATS[f][1] for f in formats)


def of_row(row: Iterable[str]) -> str:
    """What a normalised row (its columns) is, in words (conversations and prompt-completion rows look alike)."""
    found = [f for f in FORMATS if set(FORMATS[f][0]) <= set(row)]
    if "conversational" in found:
        return "conversational (messages; a prompt-completion row becomes one)"
    return FORMATS[found[0]][1] if found else f"a row of {', '.join(sorted(row)) or 'nothing'}"


def tool_name(call: Any) -> Any:
    """The function name of a tool call or a tool's schema: OpenAI's `{type: function, function: {name, ...}}`, or
    `{name, ...}`; None when it names none."""
    function = call.get("function") if isinstance(call, dict) and isinstance(call.get("function"), dict) else call
    return function.get("name") if isinstance(function, dict) else None

"""Secrets never reach run files: config values whose key names a token, secret, password or API key are
replaced by `REDACTED` in everything the run writes, and their values are scrubbed from log lines.

A key names a secret when one of its words (split at `_`, `-`, `.` and camelCase) is `secret(s)`, `password`,
`passwd`, `passphrase`, `credential(s)`, `apikey` or `bearer`, or a pair of them is `api key` / `access key` /
`private key` / `auth key`, or it ends in `auth` (`hf_auth`) or in `key` after a service's or a key's kind
(`KEY_OWNERS`: `wandb_key`, `ssh_key`), or its last word is `token` after anything but a tokenizer's special-token
name (`hub_token`,
`hf_token`, `token`, `access_token` are secrets; `eos_token`, `pad_token`, `max_new_tokens`, `tokenizer` are not).
The real values stay in memory: the trainers get them (`protect` keeps them out of pickles such as Trainer's
`training_args.bin`). Redacting a config without secrets returns it unchanged, so fingerprints of ordinary configs
do not move, and a secret's value is never part of a fingerprint (changing a token changes nothing there).
"""

from __future__ import annotations

import logging
import re
from typing import Any

REDACTED = "<redacted>"
SECRET_WORDS = {"secret", "secrets", "password", "passwd", "passphrase", "credential", "credentials", "apikey",
                "bearer"}
SECRET_PAIRS = {("api", "key"), ("access", "key"), ("private", "key"), ("auth", "key")}
KEY_OWNERS = {"wandb", "ssh", "hf", "hub", "openai", "comet", "neptune", "signing", "encryption"}  # `<owner>_key`
# tokenizer fields that name a special token, not a credential (eos_token, pad_token, ...)
SPECIAL_TOKENS = {"pad", "eos", "bos", "unk", "sep", "cls", "mask", "start", "end", "stop", "image", "audio",
                  "video", "special", "chat", "think"}
MIN_SCRUBBED = 4  # shorter values are not scrubbed from free text (they would mangle ordinary words)
_known: set[str] = set()  # secret values seen by `remember`, scrubbed from text by `scrub`


def _words(key: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", key)
    return [w for w in re.split(r"[^a-zA-Z0-9]+", spaced.lower()) if w]


def is_secret(key: Any) -> bool:
    """Whether a config key (a field name, or a dotted `section.key`: its last part counts) names a secret."""
    words = _words(str(key).rpartition(".")[2])
    if not words:
        return False
    if SECRET_WORDS & set(words) or SECRET_PAIRS & set(zip(words, words[1:], strict=False)):
        return True
    if len(words) > 1 and (words[-1] == "auth" or words[-1] == "key" and words[-2] in KEY_OWNERS):
        return True  # hf_auth, basic_auth; wandb_key, ssh_key
    return words[-1] == "token" and (len(words) == 1 or words[-2] not in SPECIAL_TOKENS)


def config(value: Any) -> Any:
    """A copy of a plain config value (dicts, lists, scalars) with every secret-keyed value, at any depth,
    replaced by `REDACTED` (None and empty values are left as they are: nothing to hide)."""
    if isinstance(value, dict):
        return {k: REDACTED if is_secret(k) and v not in (None, "") else config(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(config(v) for v in value)
    return value


def argv(args: list[str]) -> list[str]:
    """Command-line arguments with the value of every `key=value` whose key names a secret redacted."""
    out = []
    for arg in args:
        key, eq, value = str(arg).partition("=")
        out.append(f"{key}={REDACTED}" if eq and value and is_secret(key) else arg)
    return out


def secrets(value: Any) -> set[str]:
    """The string values of secret keys in a plain config value, at any depth."""
    found: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            if is_secret(k) and isinstance(v, str | int) and not isinstance(v, bool) and str(v):
                found.add(str(v))
            else:
                found |= secrets(v)
    elif isinstance(value, list | tuple):
        for v in value:
            found |= secrets(v)
    return found


def remember(cfg: Any) -> None:
    """Note the secret values of a run config (an OmegaConf config or a plain dict) so that `scrub` and the
    log filter hide them from free text."""
    from omegaconf import DictConfig, OmegaConf

    plain = [cfg]
    if isinstance(cfg, DictConfig):  # both forms: `${oc.env:HF_TOKEN}` and the token it resolves to
        plain = [OmegaConf.to_container(cfg, resolve=False)]
        try:
            plain.append(OmegaConf.to_container(cfg, resolve=True))
        except Exception:  # noqa: BLE001 - an interpolation that does not resolve: only its text is known
            pass
    _known.update(s for value in plain for s in secrets(value) if len(s) >= MIN_SCRUBBED)


def scrub(text: str) -> str:
    """`text` with every remembered secret value replaced by `REDACTED`."""
    for value in sorted(_known, key=len, reverse=True):
        if value in text:
            text = text.replace(value, REDACTED)
    return text


class Secret(str):
    """A secret string: used as itself in memory, pickled (and so saved by torch.save) as `REDACTED`."""

    def __reduce__(self) -> tuple:
        return (str, (REDACTED,))

    def __reduce_ex__(self, protocol: Any) -> tuple:
        return self.__reduce__()

    def __copy__(self) -> Secret:
        return self

    def __deepcopy__(self, memo: dict) -> Secret:
        return self

    def __repr__(self) -> str:
        return repr(REDACTED)


def protect(values: dict) -> dict:
    """`values` (a trainer's keyword arguments) with each secret-keyed string wrapped in `Secret`: the trainer
    gets the real value, and a pickle of its arguments holds `REDACTED` instead."""
    return {k: Secret(v) if is_secret(k) and isinstance(v, str) and v else v for k, v in values.items()}


class LogFilter(logging.Filter):
    """Scrubs remembered secret values from a log record's message (and its traceback) before it is written."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _known:
            return True
        message = record.getMessage()
        clean = scrub(message)
        if clean != message:
            record.msg, record.args = clean, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub(record.exc_text)
        return True

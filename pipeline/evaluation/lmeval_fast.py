"""lm-eval with its repeated work done once: the same scores and answers, in less time.

On a small model `lm_eval.simple_evaluate` spends a good part of its time outside the model:
- Every prompt and target field of every document compiles its Jinja template anew: about 1 ms each, six
  per gsm8k document (lm-eval issue #1286, open). Here each template is compiled once.
- Every call gathers an environment report (`torch.utils.collect_env`: pip and git subprocesses, about
  0.6 s) and the git hash. Here once per process: neither changes between evaluations.
- Greedy generation keeps every row of a batch until all have stopped (lm-eval stops a batch once every
  row has met the same stop sequence): one row that writes "Question:" without EOS keeps the others
  generating, often to `max_gen_toks`. Here (`greedy_until`) a row leaves the batch at EOS or as soon as
  a stop sequence shows in its text as lm-eval decodes it; its answer is fixed then, since lm-eval cuts
  the text at the first stop sequence. Sampling, stop sequences that are special tokens other than EOS
  (lm-eval's decode drops them), thinking models and generation configs that add logits processors keep
  lm-eval's own generation.

`applied()` installs all three for the length of a `with` block (`evaluate.run_eval`, unless
`eval.fast_generation=false`); `drift()` names a target that an lm-eval or transformers version has renamed or
changed, and `run_eval` then uses stock lm-eval. tests/test_lmeval_fast.py checks that the answers are the same as
stock lm-eval's; bench/generation.py measures what they save.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from pipeline.generation.generator import greedy_until

# what `applied` replaces and `greedy_until` / `kvcache.BufferedLayer` build on: (module, attribute, its parameters
# as `inspect.signature` lists them, "*" / "**" for *args / **kwargs; None: any callable)
TARGETS = (
    ("lm_eval.models.huggingface", "HFLM._model_generate", ("self", "context", "max_length", "stop", "**")),
    ("lm_eval.models.huggingface", "HFLM.tok_decode", None),
    ("lm_eval.utils", "apply_template", ("template", "doc")),
    ("lm_eval.utils", "env.from_string", None),
    ("lm_eval.evaluator", "add_env_info", ("storage",)),
    ("lm_eval.evaluator", "get_git_commit_hash", ()),
    ("lm_eval.loggers.utils", "add_env_info", ("storage",)),
    ("lm_eval.loggers.utils", "get_git_commit_hash", ()),
    ("transformers", "DynamicLayer.lazy_initialization", ("self", "key_states", "value_states")),
    ("transformers", "DynamicLayer.update", ("self", "key_states", "value_states", "*", "**")),
    ("transformers", "DynamicLayer.get_seq_length", None),
    ("transformers", "DynamicCache.batch_select_indices", ("self", "indices")),
)


def _parameters(function: Any) -> tuple[str, ...]:
    import inspect

    marks = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return tuple(marks.get(p.kind, p.name) for p in inspect.signature(function).parameters.values())


def drift() -> str | None:
    """The first of `TARGETS` missing from the installed lm-eval / transformers or taking other parameters, as
    `module.attribute` (None: all there as expected). `DynamicCache` must also take `config` and hold `layers`."""
    import importlib

    for module, attribute, expected in TARGETS:
        target: Any = importlib.import_module(module)
        for name in attribute.split("."):
            target = getattr(target, name, None)
        if not callable(target) or (expected is not None and _parameters(target) != expected):
            return f"{module}.{attribute}"
    from transformers import DynamicCache, DynamicLayer

    if "config" not in _parameters(DynamicCache.__init__) or not hasattr(DynamicCache(), "layers") \
            or not hasattr(DynamicLayer(), "is_initialized"):
        return "transformers.DynamicCache(config=...).layers"
    return None


@functools.lru_cache(maxsize=256)
def _template(text: str) -> Any:
    from lm_eval.utils import env

    return env.from_string(text)


def render(template: str, doc: dict) -> str:
    """`lm_eval.utils.apply_template` with the compiled template kept."""
    return _template(template).render(**doc)


@functools.cache
def _environment() -> dict:
    from lm_eval.loggers.utils import add_env_info

    report: dict = {}
    add_env_info(report)
    return report


@functools.cache
def _git_hash() -> str | None:
    from lm_eval.loggers.utils import get_git_commit_hash

    return get_git_commit_hash()


# generation-config fields that add logits processors to greedy decoding
PROCESSORS = ("repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size",
              "encoder_no_repeat_ngram_size", "bad_words_ids", "min_length", "min_new_tokens",
              "forced_bos_token_id", "forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens",
              "sequence_bias", "exponential_decay_length_penalty", "guidance_scale", "watermarking_config")


def eos_ids(config: Any) -> list:
    """The EOS ids a generation config stops at (`eos_token_id`: one id, a list, or None)."""
    return config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]


def plain_greedy(lm: Any, stop: list[str], kwargs: dict) -> bool:
    """Whether lm-eval asks `lm` (an HFLM) for greedy decoding that `greedy_until` reproduces: greedy as lm-eval
    decides it, no other generation argument, the dynamic cache `generate` would use, no logits processor from
    the model's generation config, EOS ids known, every stop sequence but EOS kept by lm-eval's decode of its own
    tokens (a special token is dropped, so lm-eval's answers run past it), and padding dropped by that decode."""
    from transformers import GenerationConfig

    config, default, tok = lm.model.generation_config, GenerationConfig(), lm.tokenizer
    sample = kwargs.get("do_sample")
    greedy = sample is False or (sample is None and kwargs.get("temperature", 0.0) == 0)
    eos = eos_ids(config)
    ids = {s: tok.encode(s, add_special_tokens=False) for s in stop}
    dynamic = getattr(lm.model, "_supports_default_dynamic_cache", lambda: False)()  # generate's own cache
    return (greedy and set(kwargs) <= {"attention_mask", "do_sample", "temperature"} and lm.backend == "causal"
            and dynamic and config.cache_implementation in (None, "dynamic")
            and getattr(lm, "think_end_token", None) is None and None not in eos
            and lm.tok_decode([tok.pad_token_id]) == ""
            and all(s in lm.tok_decode(ids[s]) for s in stop if not (len(ids[s]) == 1 and ids[s][0] in eos))
            and all(getattr(config, key, None) == getattr(default, key, None) for key in PROCESSORS))


def stopped(lm: Any, ids: list[int], stop: list[str], window: int) -> bool:
    """Whether one of `stop` shows in the text lm-eval decodes from `ids`: looked for in the last `window`
    tokens first (cheap; a sequence it misses only lets the row run on, which cannot change its answer), then
    confirmed in the whole text."""
    return any(s in lm.tok_decode(ids[-window:]) for s in stop) and any(s in lm.tok_decode(ids) for s in stop)


@contextlib.contextmanager
def applied() -> Iterator[None]:
    """Within: lm-eval renders templates through `render`, reports the environment gathered once and generates
    greedily through `greedy_until` where `plain_greedy` says it may."""
    from lm_eval import evaluator, utils
    from lm_eval.models.huggingface import HFLM

    own = HFLM._model_generate

    def generate(lm: Any, context: Any, max_length: int, stop: list[str], **kwargs: Any) -> Any:
        if not plain_greedy(lm, stop, kwargs):
            return own(lm, context, max_length, stop, **kwargs)
        window = max((len(lm.tokenizer.encode(s, add_special_tokens=False)) for s in stop), default=0) + 2
        return greedy_until(lm.model, context, kwargs["attention_mask"], max_length,
                            set(eos_ids(lm.model.generation_config)), lm.tokenizer.pad_token_id,
                            lambda ids: stopped(lm, ids, stop, window), getattr(lm, "mixed_precision_dtype", None))

    patches = [(utils, "apply_template", render), (HFLM, "_model_generate", generate),
               (evaluator, "add_env_info", lambda storage: storage.update(_environment())),
               (evaluator, "get_git_commit_hash", _git_hash)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)

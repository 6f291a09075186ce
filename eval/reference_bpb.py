"""The continuous GSM8K-style metric: the reference solution's bits per byte under the prompt the stages are scored
with (lm-eval's `loglikelihood` of the answer after the question, chat template applied when the run applies it),
per problem. Lower is better; it moves with every token of the reference, where exact match at 1-2% holds a
handful of right answers. The reference is GSM8K's solution without its calculator annotations (`<<48/2=24>>`,
about 14% of its characters): the worked reasoning and the `#### N` answer, not the tool format. The tasks `*_bpb`
name `reference` as their target and `bits_per_byte` as their `process_results`."""

import math
import re

CALCULATOR = re.compile(r"<<[^>]*>>")


def reference(doc: dict) -> str:
    """The solution scored: `doc["answer"]` without GSM8K's calculator annotations."""
    return CALCULATOR.sub("", doc["answer"])


def bits_per_byte(doc: dict, results: list) -> dict:
    """`{"bits_per_byte": -log2 p(reference | prompt) / UTF-8 bytes of the reference}` of one problem."""
    loglikelihood, _ = results[0]
    return {"bits_per_byte": -loglikelihood / math.log(2) / max(1, len(reference(doc).encode("utf-8")))}

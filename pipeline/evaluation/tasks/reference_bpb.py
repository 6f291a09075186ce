"""The continuous GSM8K-style metric: the reference solution's bits per byte under the prompt the stages are scored
with (lm-eval's `loglikelihood` of the answer after the question, chat template applied when the run applies it),
per problem. Lower is better; it moves with every token of the reference, where exact match at 1-2% holds a
handful of right answers. The tasks `*_bpb` name `bits_per_byte` as their `process_results`."""

import math


def bits_per_byte(doc: dict, results: list) -> dict:
    """`{"bits_per_byte": -log2 p(answer | prompt) / UTF-8 bytes of the answer}` of one problem."""
    loglikelihood, _ = results[0]
    return {"bits_per_byte": -loglikelihood / math.log(2) / max(1, len(doc["answer"].encode("utf-8")))}

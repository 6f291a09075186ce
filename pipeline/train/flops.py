"""Model FLOPs and sizes as plain numbers (no torch): device peaks, FLOPs per token, parameter counts.

Shared by the training telemetry (measured MFU) and the plan (estimated GPU-hours).
"""

from __future__ import annotations

# Dense peak FLOP/s per device (vendor datasheets; no sparsity). Matched by substring of the name.
PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp32": 91.6e12},
    "L4": {"bf16": 121e12, "fp32": 30.3e12},
    "A10": {"bf16": 125e12, "fp32": 31.2e12},
    "RTX 4090": {"bf16": 165e12, "fp32": 82.6e12},
    "V100": {"bf16": None, "fp32": 15.7e12},
}


def peak_flops(device_name: str | None, precision: str) -> float | None:
    """The device's dense peak FLOP/s for `precision` (bf16 | fp32), or None when unknown."""
    for key, peaks in PEAK_FLOPS.items():
        if device_name and key in device_name:
            return peaks.get(precision)
    return None


def flops_per_token(params: float, layers: int, hidden: int, seq_len: float) -> float:
    """Training FLOPs per token (forward + backward): 6 x parameters + 12 x layers x hidden x seq_len."""
    return 6 * params + 12 * layers * hidden * seq_len


def param_count(config: dict) -> int:
    """Parameters of a dense Llama-style decoder (no biases) from its config fields, as in `config.json`."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    attention = hidden * head_dim * 2 * (heads + (config.get("num_key_value_heads") or heads))  # q, o; k, v
    layer = attention + 3 * hidden * config["intermediate_size"] + 2 * hidden  # + gate/up/down, two norms
    embeddings = config["vocab_size"] * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return embeddings + config["num_hidden_layers"] * layer + hidden  # + the final norm

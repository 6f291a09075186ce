"""The embedded tiny setup (`recipe=tiny`, `model.name_or_path: tiny`): everything built locally, no Hub.

- `data`: GSM8K-style synthetic splits (torch-free; mixtures read them as `generator: tiny`);
- `model`: a byte-level BPE tokenizer with a ChatML template and a tiny Llama, pretrained briefly on
  the synthetic corpus (so post-training starts from a model that has seen text).
"""

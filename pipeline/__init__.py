"""A staged post-training pipeline for small language models (SFT, mid-training, ...)."""

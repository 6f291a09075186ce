"""pipeline/redact.py: which keys name a secret, and their values hidden from configs, argv, text and logs."""

from __future__ import annotations

import logging
import pickle

import pytest
from omegaconf import OmegaConf

from pipeline import redact


@pytest.mark.parametrize("key", ["hub_token", "token", "HF_TOKEN", "sft.trainer.hub_token", "access_token", "apiKey",
                                 "api_key", "wandb_api_key", "client_secret", "password", "db_passwd", "private_key",
                                 "wandb_key", "hf_auth", "bearer", "ssh_key", "auth_bearer", "HF_AUTH"])
def test_keys_that_name_a_secret(key):
    assert redact.is_secret(key)


@pytest.mark.parametrize("key", ["eos_token", "pad_token", "max_new_tokens", "tokenizer", "tokens", "max_gen_toks",
                                 "average_tokens_across_devices", "include_num_input_tokens_seen", "key",
                                 "chat_template", "hub_model_id", "push_to_hub", "sort_key", "auth", "metric_key"])
def test_keys_that_do_not(key):
    assert not redact.is_secret(key)


def test_config_argv_and_text_are_redacted():
    cfg = {"lr": 1e-4, "trainer": {"hub_token": "hf_abcdef", "eos_token": "<|im_end|>"}, "hooks": [{"password": "pw"}],
           "token": None}
    assert redact.config(cfg) == {"lr": 1e-4, "trainer": {"hub_token": "<redacted>", "eos_token": "<|im_end|>"},
                                  "hooks": [{"password": "<redacted>"}], "token": None}
    plain = {"lr": 1e-4, "trainer": {"eos_token": "x"}, "mixture": "m"}
    assert redact.config(plain) == plain  # a config without secrets: the same value, so the same fingerprint
    assert redact.argv(["recipe=tiny", "sft.trainer.hub_token=hf_abcdef", "stages=[sft]"]) == [
        "recipe=tiny", "sft.trainer.hub_token=<redacted>", "stages=[sft]"]
    redact.remember(OmegaConf.create(cfg))
    assert redact.scrub("bad value hf_abcdef here") == "bad value <redacted> here"


def test_log_lines_are_scrubbed(tmp_path):
    redact.remember({"sft": {"trainer": {"hub_token": "hf_LOGGEDvalue"}}})
    handler = logging.FileHandler(tmp_path / "log", encoding="utf-8")
    handler.addFilter(redact.LogFilter())
    logger = logging.getLogger("test_redact")
    logger.addHandler(handler)
    try:
        logger.warning("token is %s", "hf_LOGGEDvalue")
        try:
            raise ValueError("refused hf_LOGGEDvalue")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
        handler.close()
    text = (tmp_path / "log").read_text()
    assert "hf_LOGGEDvalue" not in text and "token is <redacted>" in text and "refused <redacted>" in text


def test_a_secret_is_itself_in_memory_and_redacted_in_a_pickle():
    secret = redact.protect({"hub_token": "hf_mem", "seed": 1})["hub_token"]
    assert secret == "hf_mem" and f"Bearer {secret}" == "Bearer hf_mem"
    assert pickle.loads(pickle.dumps(secret)) == "<redacted>"

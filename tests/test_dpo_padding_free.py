"""`dpo.padding_free` is refused at config validation: TRL 1.16's DPOTrainer would turn it off silently."""

from __future__ import annotations

import pytest

from pipeline.config import load_config
from pipeline.errors import ConfigError


def test_dpo_padding_free_is_refused():
    """The key is an error naming itself, before anything loads."""
    with pytest.raises(ConfigError, match="dpo.padding_free"):
        load_config(["recipe=tiny", "dpo.padding_free=true"])


@pytest.mark.parametrize("recipe", ["smol", "smollm3"])
def test_shipped_recipes_pass_validation(recipe):
    """The GPU recipes no longer set it."""
    assert not load_config([f"recipe={recipe}"]).dpo.padding_free

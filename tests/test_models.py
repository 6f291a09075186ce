"""The one loader (`pipeline.train.models`): the recipe's `model.*` settings reach every model it loads, the
tokenizer gets a pad token and the chat template, the classifier kind, and no other `from_pretrained` in pipeline/.

The checkpoint is a micro Llama whose config names model code shipped in its folder (`auto_map`), as a Hub model
with custom code does, so `trust_remote_code` decides whether it loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pipeline.errors import ConfigError
from pipeline.settings import ModelConfig
from pipeline.train.models import engine_args, load_model, load_tokenizer
from pipeline.train.precision import inference_dtype

ROOT = Path(__file__).resolve().parents[1]
WORDS = [f"w{i}" for i in range(20)]
MODEL_CODE = """from transformers import (AutoModel, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification,
                          LlamaModel)


class MicroConfig(LlamaConfig):
    model_type = "micro"


class MicroModel(LlamaModel):
    config_class = MicroConfig


AutoModel.register(MicroConfig, MicroModel, exist_ok=True)  # the classifier builds its body through AutoModel


class MicroForCausalLM(LlamaForCausalLM):
    config_class = MicroConfig


class MicroForSequenceClassification(LlamaForSequenceClassification):
    config_class = MicroConfig
"""
AUTO_MAP = {"AutoConfig": "modeling_micro.MicroConfig", "AutoModelForCausalLM": "modeling_micro.MicroForCausalLM",
            "AutoModelForSequenceClassification": "modeling_micro.MicroForSequenceClassification"}


def _tokenizer(pad: bool) -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<eos>", unk_token="<unk>",
                                   **({"pad_token": "<pad>"} if pad else {}))


@pytest.fixture(scope="module")
def micro(tmp_path_factory) -> Path:
    """A micro checkpoint with custom model code and a tokenizer without pad token or chat template."""
    path = tmp_path_factory.mktemp("micro") / "model"
    _tokenizer(pad=False).save_pretrained(path)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(WORDS) + 3, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 eos_token_id=1)).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "micro", "auto_map": AUTO_MAP}))
    (path / "modeling_micro.py").write_text(MODEL_CODE)
    return path


def _cfg(path: Path, **kw) -> ModelConfig:
    return OmegaConf.structured(ModelConfig(name_or_path=str(path), **{"trust_remote_code": True, **kw}))


def test_settings_reach_the_model(micro):
    eager = load_model(micro, _cfg(micro, attn_implementation="eager", load_dtype="bf16"))
    assert type(eager).__name__ == "MicroForCausalLM"  # the checkpoint's own code ran
    assert eager.config._attn_implementation == "eager"
    assert {p.dtype for p in eager.parameters()} == {torch.bfloat16}
    plain = load_model(micro, _cfg(micro))
    assert plain.config._attn_implementation == "sdpa" and {p.dtype for p in plain.parameters()} == {torch.float32}
    assert load_model(micro, _cfg(micro), dtype=torch.bfloat16).dtype == torch.bfloat16


def test_custom_code_needs_trust_remote_code(micro):
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_model(micro, _cfg(micro, trust_remote_code=False))


def test_tokenizer_gets_a_pad_token_and_the_recipe_tokenizer_unless_saved(micro, tmp_path):
    tok = load_tokenizer(micro, _cfg(micro))
    assert tok.pad_token == tok.eos_token == "<eos>"
    _tokenizer(pad=True).save_pretrained(tmp_path / "tok")
    cfg = _cfg(micro, tokenizer=str(tmp_path / "tok"))
    assert load_tokenizer(micro, cfg).pad_token == "<pad>"  # model.tokenizer
    assert load_tokenizer(micro, cfg, saved=True).pad_token == "<eos>"  # the checkpoint's own
    with pytest.raises(ConfigError, match="no chat template"):
        load_tokenizer(micro, _cfg(micro), need_template=True)


def test_chat_template_fits_tokenizer_and_model_unless_saved(micro):
    cfg = _cfg(micro, chat_template="chatml")
    tok = load_tokenizer(micro, cfg, need_template=True)
    assert tok.eos_token == "<|im_end|>" and len(tok) == len(WORDS) + 5  # both markers added
    fitted = load_model(micro, cfg)
    assert fitted.get_input_embeddings().weight.shape[0] == 64  # resized to hold them, to a multiple of 64
    assert fitted.config.eos_token_id == fitted.generation_config.eos_token_id == tok.eos_token_id
    assert load_model(micro, cfg, saved=True).get_input_embeddings().weight.shape[0] == len(WORDS) + 3
    assert load_tokenizer(micro, cfg, saved=True).chat_template is None


def test_vllm_engines_get_the_model_settings(micro):
    """A vLLM engine is built with `model.trust_remote_code` and the inference dtype of `model.precision`, as a
    model loaded for generation is."""
    for precision in ("auto", "fp32", "bf16"):
        args = engine_args(_cfg(micro, precision=precision))
        assert args["dtype"] == str(inference_dtype(precision)).removeprefix("torch.") and args["trust_remote_code"]
    assert engine_args(_cfg(micro, trust_remote_code=False))["trust_remote_code"] is False


def test_classifier_kind(micro):
    cfg = _cfg(micro, attn_implementation="eager", chat_template="chatml")
    classifier = load_model(micro, cfg, "classifier")
    assert type(classifier).__name__ == "MicroForSequenceClassification"
    assert classifier.config.num_labels == 1 and classifier.config._attn_implementation == "eager"
    assert classifier.get_input_embeddings().weight.shape[0] == 64  # fitted like the policy it scores for
    classifier.config.pad_token_id = 0
    assert classifier(input_ids=torch.tensor([[3, 4, 5], [6, 7, 0]])).logits.shape == (2, 1)


def test_from_pretrained_only_in_the_loader():
    """Every model and tokenizer load in pipeline/ goes through models.py. The one other call reads a config
    (the model-path check, without torch for plan=true) and passes the recipe's trust_remote_code too."""
    calls = {}
    for file in sorted((ROOT / "pipeline").rglob("*.py")):
        for line in file.read_text(encoding="utf-8").splitlines():
            if "from_pretrained(" in line:
                calls.setdefault(file.relative_to(ROOT).as_posix(), []).append(line.strip())
    assert set(calls) == {"pipeline/train/models.py", "pipeline/chain/basemodel.py"}
    assert calls["pipeline/chain/basemodel.py"] == [
        "AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)"]

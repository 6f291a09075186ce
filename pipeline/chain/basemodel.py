"""The base model a run starts from: a Hub id, a local checkpoint, or a model the recipe's extension builds
(`model.name_or_path` naming the extension's section, pipeline/extension.py). Only this module tells them apart.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from pipeline import extension, keys
from pipeline.errors import ConfigError

log = logging.getLogger("pipeline")
HUB_TIMEOUT_S = 15  # how long the preflight waits for the Hub to say whether a model exists


def base_settings(cfg: DictConfig) -> dict | None:
    """The settings a built base model is made from (part of the base fingerprint); None for a loaded one."""
    return extension.of(cfg).base_settings(cfg) if extension.builds_base(cfg) else None


def check_model_path(cfg: DictConfig) -> None:
    """Refuse a local model path that does not exist or is not a Hugging Face checkpoint, and a Hub id that is
    malformed, not in the local cache when offline (HF_HUB_OFFLINE), or not on the Hub (asked when online)."""
    if extension.builds_base(cfg):
        return
    name = cfg.model.name_or_path
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.name_or_path {name} is not a checkpoint folder (no config.json)")
        from transformers import AutoConfig  # here, not at the top: plan=true imports this module without torch

        try:
            AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
        except (ValueError, OSError, KeyError) as err:  # malformed JSON, or no / an unknown model_type
            raise ConfigError(f"model.name_or_path {name}: its config.json cannot be read: {err}") from None
    elif name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise ConfigError(f"model.name_or_path {name} does not exist (and is not a Hub id like org/name)")
    else:
        check_hub_model(name)


def check_hub_model(name: str) -> None:
    """A Hub model id: well formed (huggingface_hub's rules); offline, in the local Hugging Face cache; online, a
    model repository with a config.json. A Hub that cannot be reached is logged and left to the model load."""
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    try:
        huggingface_hub.utils.validate_repo_id(name)
    except HFValidationError as err:
        raise ConfigError(f"model.name_or_path {name!r} is neither a local folder nor a valid Hub id: "
                          f"{str(err).splitlines()[0]}") from None
    if isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json"), str):
        return  # in the local cache (a path; otherwise None or a "known missing" marker): loads offline too
    if huggingface_hub.is_offline_mode():
        raise ConfigError(f"model.name_or_path {name} is not a local folder and not in the local Hugging Face cache, "
                          "and HF_HUB_OFFLINE is set: download it first (hf download " + name + "), point "
                          "model.name_or_path at a local copy, or go online")
    try:
        info = huggingface_hub.HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        return  # it exists; the load says whether this login may read it
    except RepositoryNotFoundError:
        raise ConfigError(f"model.name_or_path {name} is neither a local folder nor a model on the Hugging Face Hub "
                          "(check the spelling; a private model needs a login: hf auth login or HF_TOKEN)") from None
    except Exception as err:  # noqa: BLE001 - network errors come in many types: the load will tell
        log.warning("could not ask the Hub about model %s (%s); it is checked when it loads", name,
                    str(err).splitlines()[0] if str(err) else type(err).__name__)
        return
    files = {s.rfilename for s in info.siblings or []}
    if files and "config.json" not in files:
        raise ConfigError(f"model.name_or_path {name}: the Hub repository has no config.json (not a transformers "
                          "model)")


def local_config(cfg: DictConfig) -> Path | None:
    """The folder of the base model's config.json when it is on this machine (a local checkpoint, a built model
    already built, a Hub model in the local cache); None when it is not (yet)."""
    if extension.builds_base(cfg):
        folder = architecture(cfg)[0]
        return folder if (folder / "config.json").is_file() else None
    path = Path(cfg.model.name_or_path).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.exists() or cfg.model.name_or_path.count("/") > 1:
        return None
    import huggingface_hub

    try:
        cached = huggingface_hub.try_to_load_from_cache(cfg.model.name_or_path, "config.json")
    except ValueError:  # not a valid Hub id
        return None
    return Path(cached).parent if isinstance(cached, str) else None


# what a Hub model's snapshot leaves out: weights in formats the pipeline does not load
NOT_LOADED = ["*.onnx", "*.onnx_data", "onnx/*", "*.gguf", "*.h5", "*.msgpack", "*.ot", "*.tflite", "original/*",
              "consolidated*", "*.pth"]


def base_model(cfg: DictConfig) -> str | Path:
    """The base checkpoint to load: a local folder as it is; a Hub model's snapshot at the commit the run pinned
    `model.revision` to (`keys.resolved`), downloaded
    here once (so every load, scoring and engine of the run reads the same files, whatever the branch does
    meanwhile); a built model built first, collectively on every rank."""
    if extension.builds_base(cfg):
        return extension.of(cfg).build_base_model(cfg)
    name = cfg.model.name_or_path
    if Path(name).expanduser().exists():
        return name
    import huggingface_hub

    from pipeline.distributed import main_writes

    revision = keys.resolved(name, cfg.model.revision, "model")  # the commit the run pinned (chain/revisions.py)
    with main_writes() as main:  # the main process downloads first; the others find it in a shared cache, or
        if main:                 # download it into their node's own
            huggingface_hub.snapshot_download(name, revision=revision, ignore_patterns=NOT_LOADED)
    return huggingface_hub.snapshot_download(name, revision=revision, ignore_patterns=NOT_LOADED)


def architecture(cfg: DictConfig) -> tuple[Path, dict | None]:
    """Where the base checkpoint is or will be, and, for a built model, its shape from the settings. Reads no
    weights."""
    if extension.builds_base(cfg):
        return extension.of(cfg).architecture(cfg)
    return Path(cfg.model.name_or_path).expanduser(), None


def pending_build(cfg: DictConfig) -> Path | None:
    """Where the recipe's extension will build the base model, when it builds one that is not built yet."""
    if not extension.builds_base(cfg):
        return None
    path = architecture(cfg)[0]
    return None if path.is_dir() else path

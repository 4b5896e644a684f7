"""`lora_prefetch_dir`: adapters loaded into the cache at start-up, as TensorRT-LLM's backend
loads them. Each sub-folder is named by its task id (an integer) and holds the converter's
`model.lora_weights.npy` and `model.lora_config.npy` (`tools/lora_convert.py`); requests then
send the task id alone."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ensemble.errors import ConfigError, InputError
from inflight.lora.cache import LoraCache
from inflight.lora.nvidia import from_nvidia
from inflight.model.config import ModelConfig

logger = logging.getLogger(__name__)
WEIGHTS, CONFIG = "model.lora_weights.npy", "model.lora_config.npy"


def prefetch(cache: LoraCache, folder: str | Path, model_config: ModelConfig, max_rank: int) -> list[int]:
    """Caches every adapter under `folder`; returns their task ids. Raises ConfigError naming
    the folder that cannot be read (a server must not start half-configured)."""
    root = Path(folder)
    if not root.is_dir():
        raise ConfigError(f"lora_prefetch_dir {root} is not a folder")
    task_ids = []
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        if not sub.name.isdigit():
            raise ConfigError(f"lora_prefetch_dir holds {sub.name}: each folder is named by its integer task id")
        try:
            weights, config = np.load(sub / WEIGHTS), np.load(sub / CONFIG)
            cache.put(int(sub.name), from_nvidia(weights, config, model_config, max_rank=max_rank))
        except (OSError, ValueError, InputError) as exc:
            raise ConfigError(f"LoRA task folder {sub} ({WEIGHTS}, {CONFIG}): {exc}") from None
        task_ids.append(int(sub.name))
    logger.info("LoRA: %d adapters prefetched from %s (task ids %s)", len(task_ids), root, task_ids)
    return task_ids

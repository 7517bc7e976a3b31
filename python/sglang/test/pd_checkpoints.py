"""Another checkpoint of a random preset: the same config, shapes and tokenizer, weights from another seed
(`make_tiny_model`), as a fine-tune of the same architecture would be. A PD pair serving it on one side and
the preset on the other must be refused (`disaggregation/weights_fingerprint.py`)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path


def other_seed_checkpoint(preset: str, seed: int = 1) -> str:
    """The folder of `preset` (a key of `configs.presets.PRESETS`) made from `seed`, generated on first use
    beside the preset's own folder, whose name (and so this one's) carries the generator's digest."""
    from sglang.srt.configs.presets import PRESET_SEED, PRESETS, resolve_model_path
    from sglang.tools.make_tiny_model import make_tiny_model

    assert seed != PRESET_SEED, "the preset's own seed gives the preset"
    target = Path(f"{resolve_model_path(preset)}-seed{seed}")
    if (target / "model.safetensors").is_file():
        return str(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        make_tiny_model(PRESETS[preset], tmp, seed=seed)
        try:
            tmp.rename(target)
        except OSError:  # (another process made it first)
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)

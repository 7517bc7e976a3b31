"""Built-in tiny presets: `tiny-qwen3-next-demo` (the default model), `tiny-qwen3-next`,
`tiny-nemotron-h`, `tiny-qwen3.5`, `tiny-qwen3.5-moe`, `tiny-granite-4.0-h`, `tiny-falcon-h1`,
`tiny-bamba`, `tiny-lfm2` and `tiny-lfm2-moe`, the vision-language `tiny-qwen3.5-vl` and
`tiny-qwen3.5-moe-vl` (the published multimodal layout, with an image processor), and each of the random ones in block-FP8 as
`<name>-fp8` (`tiny-qwen3-next-fp8`, `tiny-nemotron-h-fp8`, ...: the published FP8 format).

Wherever a model path is accepted, a preset name resolves to a checkpoint folder. The demo model is
trained (`sglang.tools.train_tiny_model`) and ships with the package. The random presets are the
test fixtures: generated on first use into `$SGLANG_CACHE_DIR/presets/` (default
`~/.cache/sglang/presets/`), in a folder whose name carries a digest of the generator, its corpus and
the transformers version, so a change to any of them regenerates it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from sglang.srt.environ import envs

PRESETS = {
    "tiny-qwen3-next": "qwen3_next",
    "tiny-nemotron-h": "nemotron_h",
    "tiny-qwen3.5": "qwen3_5",
    "tiny-qwen3.5-moe": "qwen3_5_moe",
    "tiny-granite-4.0-h": "granitemoehybrid",
    "tiny-falcon-h1": "falcon_h1",
    "tiny-bamba": "bamba",
    "tiny-lfm2": "lfm2",
    "tiny-lfm2-moe": "lfm2_moe",
}
# The same presets in the published block-FP8 format (`sglang.tools.quantize_fp8`): hidden 64 and the
# like are smaller than a 128 block, so every scale covers a partial block.
FP8_PRESETS = {f"{name}-fp8": arch for name, arch in PRESETS.items()}
# Presets in NVIDIA ModelOpt's FP8 format, as the Nemotron FP8 releases (`sglang.tools.quantize_modelopt`).
MODELOPT_PRESETS = {"tiny-nemotron-h-fp8-modelopt": "nemotron_h"}
# Vision-language presets in the published multimodal layout (`sglang.tools.make_tiny_vl_model`).
VL_PRESETS = {"tiny-qwen3.5-vl": "qwen3_5", "tiny-qwen3.5-moe-vl": "qwen3_5_moe"}
# Trained checkpoints that ship with the package (name -> folder).
SHIPPED = {"tiny-qwen3-next-demo": Path(__file__).parents[2] / "tools" / "data" / "tiny-qwen3-next-demo"}
PRESET_SEED = 0


def cache_dir() -> Path:
    root = envs.SGLANG_CACHE_DIR.get() or os.path.join(Path.home(), ".cache", "sglang")
    return Path(root)


def _recipe_digest(quantized: bool = False, vision: bool = False, modelopt: bool = False) -> str:
    import transformers

    from sglang.srt.layers.quantization import fp8
    from sglang.srt.layers.quantization import modelopt as modelopt_format
    from sglang.tools import make_tiny_model, make_tiny_vl_model, quantize_fp8, quantize_modelopt

    h = hashlib.sha256()
    h.update(Path(make_tiny_model.__file__).read_bytes())
    if vision:
        h.update(Path(make_tiny_vl_model.__file__).read_bytes())
    if quantized:
        h.update(Path(quantize_fp8.__file__).read_bytes())
        h.update(Path(fp8.__file__).read_bytes())
    if modelopt:
        h.update(Path(quantize_modelopt.__file__).read_bytes())
        h.update(Path(modelopt_format.__file__).read_bytes())
    h.update(make_tiny_model.CORPUS.read_bytes())
    h.update(transformers.__version__.encode())
    h.update(str(PRESET_SEED).encode())
    return h.hexdigest()[:12]


def is_preset(model_path: str) -> bool:
    return (
        model_path in PRESETS
        or model_path in FP8_PRESETS
        or model_path in MODELOPT_PRESETS
        or model_path in VL_PRESETS
        or model_path in SHIPPED
    )


def resolve_model_path(model_path: str) -> str:
    """A preset name becomes its folder (shipped, or generated on first use); anything else is returned
    unchanged."""
    if model_path in SHIPPED:
        return str(SHIPPED[model_path])
    if not is_preset(model_path):
        return model_path
    quantized, modelopt = model_path in FP8_PRESETS, model_path in MODELOPT_PRESETS
    digest = _recipe_digest(quantized, model_path in VL_PRESETS, modelopt)
    target = cache_dir() / "presets" / f"{model_path}-{digest}"
    if (target / "model.safetensors").is_file():
        return str(target)
    from sglang.tools.make_tiny_model import make_tiny_model

    target.parent.mkdir(parents=True, exist_ok=True)
    # Generate into a private folder and rename it into place, so that concurrent first uses (a server
    # and a test, say) never see a half-written checkpoint.
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_path}-", dir=target.parent))
    try:
        if model_path in VL_PRESETS:
            from sglang.tools.make_tiny_vl_model import make_tiny_vl_model

            make_tiny_vl_model(VL_PRESETS[model_path], tmp, seed=PRESET_SEED)
        elif modelopt:
            make_tiny_model(MODELOPT_PRESETS[model_path], tmp, seed=PRESET_SEED, quantize="fp8-modelopt")
        else:
            arch = FP8_PRESETS[model_path] if quantized else PRESETS[model_path]
            make_tiny_model(arch, tmp, seed=PRESET_SEED, quantize="fp8-block" if quantized else None)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)

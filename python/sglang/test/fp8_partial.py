"""FP8 checkpoints that keep some modules unquantized, for tests of which modules load FP8
(`registry.fp8_dense_modules`): a copy of an FP8 checkpoint whose chosen modules hold their dequantized
weights, as an export that excluded them does."""

from __future__ import annotations

import json
import shutil
from fnmatch import fnmatchcase
from pathlib import Path

from safetensors.torch import save_file

from sglang.srt.layers.quantization import checkpoint_quant_config
from sglang.srt.layers.quantization.fp8 import FP8_DTYPE, fp8_checkpoint_stream
from sglang.srt.models.loader import iter_checkpoint


def keep_dense(
    path: str | Path, out: str | Path, patterns: list[str], listed: list[str] | None = None
) -> str:
    """Copy the FP8 checkpoint `path` (single file) to `out` with every module whose checkpoint name matches
    one of the shell `patterns` held dequantized (float32, its weight scale and input scale dropped; a KV
    cache scale stays) and `listed` (default: `patterns`) added to its config's list of unquantized modules
    (ModelOpt's `ignore`, block FP8's `modules_to_not_convert`). Returns `out`."""
    src, out = Path(path), Path(out)
    shutil.copytree(src, out, dirs_exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    quant = cfg["quantization_config"]
    fp8 = checkpoint_quant_config(quant)
    raw = dict(iter_checkpoint(src))
    dequantized = dict(fp8_checkpoint_stream(raw.items(), fp8))
    dropped = (".weight" + fp8.scale_suffix, ".input_scale")
    written = {}
    for name, tensor in raw.items():
        module = name.rpartition(".")[0]
        if not any(fnmatchcase(module, p) for p in patterns):
            written[name] = tensor
        elif tensor.dtype == FP8_DTYPE:
            written[name] = dequantized[name].contiguous()
        elif not name.endswith(dropped):
            written[name] = tensor
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    key = "ignore" if "ignore" in quant else "modules_to_not_convert"
    quant[key] = sorted({*quant.get(key, ()), *(patterns if listed is None else listed)})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return str(out)

"""NVIDIA ModelOpt FP8 checkpoints (the Nemotron FP8 releases: NVIDIA-Nemotron-Nano-9B-v2-FP8,
NVIDIA-Nemotron-3-Nano-30B-A3B-FP8, ...), upstream's `modelopt` / `modelopt_fp8` quantization.

The format: `quantization_config` with `quant_method: "modelopt"`, `quant_algo: "FP8"` (in config.json;
older exports put `{"quantization": {"quant_algo", "kv_cache_quant_algo", "exclude_modules"}}` in
`hf_quant_config.json` beside it, which `attach_hf_quant_config` reads the same way), the modules kept in
their own dtype in `ignore` (config.json) or `exclude_modules` (hf_quant_config.json), names or
shell-style patterns (`*mixer.conv1d*`). A quantized `X.weight` is float8_e4m3fn [out, in] with
`X.weight_scale`, one float32 for the whole tensor (shape [] or [1]), and `X.input_scale`, the static
activation scale calibrated at export; with `kv_cache_quant_algo: "FP8"` the attention's
`k_proj.k_scale` / `v_proj.v_scale` are the float8 KV cache's scales (`layers/attention/kv_scales.py`).

How it is served: a per-tensor scale is a block-scale grid whose blocks all hold the same value, so the
checkpoint is read as block FP8 (`Fp8Config` with method "modelopt": `fp8.fp8_checkpoint_stream` pairs
`X.weight` with `X.weight_scale` and gives the scale as its [ceil(out/128), ceil(in/128)] grid). Every
rule of block FP8 then holds unchanged: on CPU the weight is dequantized at load (weight * weight_scale);
on CUDA the FP8 linears and experts hold the checkpoint's bytes as published with that grid. Activations
are quantized per token and 128-column group at run time, as for block FP8, instead of with the static
`input_scale`: each group's scale fits its own largest value, so no activation saturates or loses the
range a calibrated whole-tensor scale gives it; the input scales are read past and nothing is logged.

Other ModelOpt algorithms (NVFP4, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO, MIXED_PRECISION, W4A8_AWQ, ...)
are refused in one sentence naming them; so is `--quantization modelopt` / `modelopt_fp8` on a checkpoint
ModelOpt did not quantize (upstream quantizes such a one only through NVIDIA's `nvidia-modelopt` library
and a calibration run, which this server does not carry; `--quantization fp8` quantizes at load here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8ConfigError

# The --quantization values that load a ModelOpt FP8 checkpoint (upstream's names).
MODELOPT_FLAGS = ("modelopt", "modelopt_fp8")
HF_QUANT_CONFIG = "hf_quant_config.json"


def is_modelopt(quant: dict[str, Any]) -> bool:
    """`quant_method: "modelopt"`, or `quant_library: "modelopt"` without a quant_method (config.json as
    ModelOpt's converter wrote it before it named quant_method, with `kv_cache_scheme: "FP8"`)."""
    return str(quant.get("quant_method") or quant.get("quant_library") or "").lower() == "modelopt"


def modelopt_fp8_config(quant: dict[str, Any]) -> Fp8Config:
    """The FP8 config of a ModelOpt `quantization_config`; Fp8ConfigError naming any other algorithm."""
    algo = str(quant.get("quant_algo") or "").upper()
    if algo != "FP8":
        raise Fp8ConfigError(
            f"its weights are quantized with NVIDIA ModelOpt's {algo or 'unnamed'!s} algorithm; this server "
            "serves ModelOpt's FP8 (quant_algo FP8, one scale per tensor) and block-wise FP8 checkpoints."
        )
    for kv in kv_cache_algorithms(quant):
        if kv != "FP8":
            raise Fp8ConfigError(
                f"its KV cache scales are for ModelOpt's {kv} KV cache; this server reads FP8 KV cache "
                "scales."
            )
    ignored = quant.get("ignore") or quant.get("exclude_modules") or ()
    if isinstance(ignored, str):
        ignored = (ignored,)  # (one name, not its characters)
    return Fp8Config(ignored_layers=tuple(ignored), method="modelopt")


def kv_cache_algorithms(quant: dict[str, Any]) -> list[str]:
    """The KV cache algorithms a ModelOpt config names, upper-cased: `kv_cache_quant_algo`
    (hf_quant_config.json's layout) and `kv_cache_scheme` (config.json's, which ModelOpt's converter writes as
    `{"dynamic": false, "num_bits": 8, "type": "float"}` for FP8 and as the bare algorithm otherwise: "FP8"
    in its older releases, "NVFP4", "INT8", ...); a scheme dict of another type or width is named by both
    (`INT8`, `FLOAT4`)."""
    found = []
    algo = quant.get("kv_cache_quant_algo")
    if algo is not None:
        found.append(str(algo).upper())
    scheme = quant.get("kv_cache_scheme")
    if isinstance(scheme, dict):
        kind, bits = str(scheme.get("type", "float")).lower(), scheme.get("num_bits", 8)
        found.append("FP8" if (kind, bits) == ("float", 8) else f"{kind}{bits}".upper())
    elif scheme is not None:
        found.append(str(scheme).upper())
    return found


def check_flag_on_checkpoint(flag: str | None, config: Fp8Config | None) -> None:
    """Fp8ConfigError where `--quantization` names another format than the checkpoint's, as upstream refuses
    the mismatch: `modelopt` / `modelopt_fp8` on a checkpoint ModelOpt did not quantize (`config`: the
    checkpoint's, None for an unquantized one), `fp8` on a ModelOpt one."""
    if flag == "fp8" and config is not None and config.method == "modelopt":
        raise Fp8ConfigError(
            "--quantization fp8 quantizes an unquantized checkpoint block-wise at load and this one is "
            "quantized with NVIDIA ModelOpt's FP8; serve it with --quantization modelopt or without the flag."
        )
    if flag not in MODELOPT_FLAGS or (config is not None and config.method == "modelopt"):
        return
    what = "unquantized" if config is None else f"quantized with {config.method!r}"
    raise Fp8ConfigError(
        f"--quantization {flag} serves checkpoints NVIDIA ModelOpt quantized to FP8 and this one is {what} "
        "(upstream quantizes with ModelOpt only through the nvidia-modelopt library; use --quantization fp8 "
        "to quantize an unquantized checkpoint at load, or no flag for a quantized one)."
    )


def hf_quant_config(path: str | Path) -> dict[str, Any] | None:
    """The `quantization_config` an export wrote only in hf_quant_config.json (ModelOpt's older exports),
    as upstream reads it, or None."""
    file = Path(path) / HF_QUANT_CONFIG
    body = json.loads(file.read_text()) if file.is_file() else None
    quant = body.get("quantization") if isinstance(body, dict) else None
    return {"quant_method": "modelopt", **quant} if isinstance(quant, dict) else None


def attach_hf_quant_config(hf_config: Any, path: str | Path) -> None:
    """Give `hf_config` the `hf_quant_config` of `path` where config.json has no quantization_config."""
    if not getattr(hf_config, "quantization_config", None):
        quant = hf_quant_config(path)
        if quant is not None:
            hf_config.quantization_config = quant

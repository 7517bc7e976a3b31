"""Which model class serves which HF architecture name."""

from __future__ import annotations

import importlib
import threading
from fnmatch import fnmatchcase
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from sglang.srt.layers.quantization import quant_config_of
from sglang.srt.layers.quantization.fp8 import (
    FP8_DTYPE,
    SCALE_SUFFIX,
    Fp8Layout,
    fp8_layout,
    swap_fp8_linears,
)
from sglang.srt.layers.quantization.fp8_experts import swap_fp8_experts
from sglang.srt.models.checkpoint_reader import read_checkpoint
from sglang.srt.models.loader import checkpoint_files

# architecture name -> (module, class); imported on first use.
_MODELS = {
    "Qwen3NextForCausalLM": ("sglang.srt.models.qwen3_next", "Qwen3NextForCausalLM"),
    "NemotronHForCausalLM": ("sglang.srt.models.nemotron_h", "NemotronHForCausalLM"),
    "BambaForCausalLM": ("sglang.srt.models.bamba", "BambaForCausalLM"),
    "Lfm2ForCausalLM": ("sglang.srt.models.lfm2", "Lfm2ForCausalLM"),
    "Lfm2MoeForCausalLM": ("sglang.srt.models.lfm2", "Lfm2ForCausalLM"),
    "FalconH1ForCausalLM": ("sglang.srt.models.falcon_h1", "FalconH1ForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("sglang.srt.models.granitemoehybrid", "GraniteMoeHybridForCausalLM"),
    "Qwen3_5ForCausalLM": ("sglang.srt.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("sglang.srt.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("sglang.srt.models.qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("sglang.srt.models.qwen3_5", "Qwen3_5ForConditionalGeneration"),
}


def get_model_class(hf_config: Any) -> type[nn.Module]:
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in _MODELS:
            module, cls = _MODELS[arch]
            return getattr(importlib.import_module(module), cls)
    raise ValueError(
        f"No model class for architectures {getattr(hf_config, 'architectures', None)!r}; "
        f"supported: {', '.join(sorted(_MODELS))}."
    )


def load_model(
    hf_config: Any,
    path: str,
    dtype: torch.dtype,
    device: str | torch.device,
    fp8: Fp8Layout | None = None,
    meta: nn.Module | None = None,
) -> nn.Module:
    """Build the model for `hf_config` in `dtype` on `device` and load the checkpoint at `path`; `meta`:
    that model already built on the meta device (`build_meta_model`, which the memory planner counted),
    used instead of building it again.

    The model is built on the meta device and each parameter is then allocated once, in its serving
    dtype on `device`, for the checkpoint to fill: no random initialisation and no float32 copy first
    (an 80B model in bfloat16 never needs twice its memory on the host)."""
    model = meta if meta is not None else build_meta_model(hf_config, device, fp8, path)
    materialize(model, dtype, torch.device(device))
    model.load_weights(read_checkpoint(path))  # read ahead by threads, in iter_checkpoint's order
    # Children first: a module's own step may read what its children's made (a decoder layer's fused
    # decode blocks read its norms' and experts' C++ choices).
    for module in reversed(list(model.modules())):
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    release_cached_blocks(torch.device(device))
    return model.eval().requires_grad_(False)


def release_cached_blocks(device: torch.device) -> None:
    """Give the device the blocks the load's own steps freed (stacks replacing the storages of the
    weights they hold: `stacked_linears.py`, the fused experts', regrouped rows): in torch's cache they
    count as used where the pools are sized from the free memory after the load, and a next layer's
    slightly larger stack cannot reuse them (~1.7 GB at the 80B's 36 GDN layers). Only on the thread
    that loads at start: a weight update's load runs on a thread of its own beside the forward, where
    the synchronisation would stall it and a graph capture may be underway."""
    if device.type == "cuda" and threading.current_thread() is threading.main_thread():
        torch.cuda.empty_cache()


def build_meta_model(
    hf_config: Any, device: str | torch.device, fp8: Fp8Layout | None = None, path: str | None = None
) -> nn.Module:
    """The model for `hf_config` on the meta device, laid out as it serves on `device`: an FP8
    checkpoint's layout is the device's (`fp8_layout`: FP8 linears on CUDA, FP8 experts where
    SGLANG_FP8_EXPERTS says; what stays dense loads dequantized), unless `fp8` says otherwise (tests:
    CUDA's on the CPU). Which modules hold FP8: `fp8_dense_modules` of the checkpoint at `path` (default:
    the folder the config was read from). The memory planner counts this model's parameters
    (`weight_bytes.py`)."""
    quant = quant_config_of(hf_config)
    layout = fp8_layout(quant, device) if fp8 is None or quant is None else fp8
    with torch.device("meta"):
        model = get_model_class(hf_config)(hf_config)
        if layout is not None:
            dense = fp8_dense_modules(model, quant, path or getattr(hf_config, "_name_or_path", None))
            if layout.linears:
                swap_fp8_linears(model, quant, model.fp8_dense_modules, dense)
            if layout.experts:
                swap_fp8_experts(model, quant, dense)
    model.quant_config = quant
    return model


def fp8_dense_modules(model: nn.Module, quant: Any, path: str | None) -> set[str]:
    """The modules (the model's names) an FP8 checkpoint holds in their own dtype, which therefore stay
    dense: each module a floating-point, non-FP8 checkpoint tensor of two or more dimensions loads into,
    through the model's name mapping (`checkpoint_tensors`: renames, a fused tensor's split pieces, each
    piece's fused parameter by `checkpoint_rows`). The file says it: the `ignore` / `modules_to_not_convert`
    lists (checkpoint names or shell patterns) say the same of a well-formed export, and are read only
    where `path` holds no weights (planning memory from a config alone: `_listed_as_unquantized`).
    `--quantization fp8` (nothing FP8 in the file): none; `quantizable_by_default` decides."""
    if not quant.is_checkpoint_fp8_serialized:
        return set()
    tensors = checkpoint_tensor_types(path) if path else None
    if tensors is None:
        return _listed_as_unquantized(model, quant)
    dense = set()
    for name, (dtype, shape) in tensors.items():
        if dtype not in _DENSE_DTYPES or len(shape) < 2 or name.startswith(model.skip_prefixes):
            continue
        if name.endswith(("_scale", "_scale_inv")):
            continue  # (scales: the FP8 tensors' own)
        for target, _ in model.checkpoint_tensors(name, torch.empty(shape, device="meta")):
            rows = model.checkpoint_rows(target)
            dense.add((rows[0] if rows else target).rpartition(".")[0])
    return dense


# safetensors' dtype names of the tensors a module keeps unquantized (F8_E4M3: quantized).
_DENSE_DTYPES = ("BF16", "F16", "F32", "F64")


def checkpoint_tensor_types(path: str) -> dict[str, tuple[str, list[int]]] | None:
    """{tensor name: (safetensors dtype, shape)} of the checkpoint in folder `path`, from its files'
    headers (no tensor is read), or None where the folder holds no safetensors."""
    try:
        files = checkpoint_files(path)
    except (ValueError, OSError):
        return None
    types = {}
    for file in files:
        if not file.is_file():
            return None
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                piece = f.get_slice(name)
                types[name] = (piece.get_dtype(), piece.get_shape())
    return types


def _listed_as_unquantized(model: nn.Module, quant: Any) -> set[str]:
    """Without the checkpoint's tensors: the modules its config lists as unquantized
    (`modules_to_not_convert`, ModelOpt's `ignore`) in the model's names, a plain name through
    `checkpoint_name`, a shell-style pattern matched against the model's names (an estimate where the
    model renames what the pattern names)."""
    names, patterns = set(), []
    for m in quant.ignored_layers:
        if any(c in m for c in "*?["):
            patterns.append(m)
        else:
            names.add(model.checkpoint_name(m + ".weight").removesuffix(".weight"))
    if patterns:
        names |= {n for n, _ in model.named_modules() if n and any(fnmatchcase(n, p) for p in patterns)}
    return names


def materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replace every meta parameter by an uninitialised one in `dtype` (float32 for the model's
    `fp32_param_suffixes`) on `device`, keeping tied parameters tied; buffers (computed at construction,
    on the host) are copied to `device` as they are."""
    made: dict[int, nn.Parameter] = {}
    for prefix, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in made:
                dt = served_dtype(model, f"{prefix}.{name}" if prefix else name, param, dtype)
                made[id(param)] = nn.Parameter(
                    torch.empty(param.shape, dtype=dt, device=device), requires_grad=False
                )
                if hasattr(param, "tp_shards"):  # this rank's part of the checkpoint's (`linear.py`)
                    made[id(param)].tp_shards = param.tp_shards
            module._parameters[name] = made[id(param)]
        for name, buf in list(module._buffers.items()):
            if buf is None:
                continue
            if buf.is_meta:
                raise ValueError(
                    f"Buffer {prefix}.{name} was built on the meta device; build it on the host."
                )
            module._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device=device).copy_(buf)


def served_dtype(model: nn.Module, name: str, param: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype parameter `name` is served in: `dtype`, float32 for the model's `fp32_param_suffixes`,
    its own for FP8 weights and their float32 block scales."""
    if param.dtype == FP8_DTYPE or name.endswith(SCALE_SUFFIX):
        return param.dtype
    keep_fp32 = tuple(getattr(model, "fp32_param_suffixes", ()))
    return torch.float32 if keep_fp32 and name.endswith(keep_fp32) else dtype

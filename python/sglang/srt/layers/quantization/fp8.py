"""Block-wise FP8 weights, as the published FP8 checkpoints store them (Qwen3-Next-80B-A3B-Instruct-FP8,
the Qwen3.5 FP8 releases; DeepSeek's format): each quantized `X.weight` is float8_e4m3fn [out, in] with
`X.weight_scale_inv`, one float32 per 128 x 128 block, [ceil(out / 128), ceil(in / 128)]; the real
weight is `weight * scale_inv` block by block. Activations are quantized per token and 128-column group
at run time ("dynamic"); there is no activation scale in the checkpoint.

Partial blocks (upstream's rule): a dimension that does not divide by the block has ceil(n / block)
scales, the last one covering the remaining n % block rows or columns. Upstream refuses a
tensor-parallel shard whose size does not divide by the block (its kernels index scales by whole
blocks); so does this server (`shard_fp8_like`: a rank's part of every piece must be whole blocks; the
weight and its scales then split together), except for one scale per tensor (ModelOpt's), whose rank
grid just holds that scale. An unsharded tensor of any size is fine.

Where the weights are computed with:
- CPU: every FP8 tensor is dequantized as it loads, into the model's own parameters in the serving
  dtype (`fp8_checkpoint_stream`), so the CPU's fused C++ blocks, the experts' op and every other path
  run unchanged. Dequantizing per forward instead (`Fp8BlockLinear`'s torch path) measured 4-6x slower
  than the dequantized linear at the tiny presets' shapes and 3-20x at 2048 x 2048 (1 and 64 tokens, one
  thread), and saves no memory while it runs; no C++ FP8 GEMM exists for these CPUs (no FP8 dot
  instructions), so one would dequantize too.
- CUDA: the quantizable `nn.Linear`s become `Fp8BlockLinear`s before loading (`swap_fp8_linears`),
  holding FP8 weights and their scales: the checkpoint's, copied as they are (`HybridCausalLM._fp8_pieces`
  says which pairs can be; the rest are dequantized and quantized again at load); their forward calls
  `fp8_kernel.w8a8_block_fp8_matmul` where that module imports, else dequantizes and multiplies. The
  routed experts stay FP8 as published (`fp8_experts.py`: w13 / w2 float8_e4m3fn with their block
  scales, run by `fused_moe_fp8_triton.py`); `SGLANG_FP8_EXPERTS` chooses their layout on any device
  (`fp8_layout`).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed import tensor_model_parallel_all_reduce
from sglang.srt.layers.linear import set_weight_shards, weight_shards

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"
# Module names the published FP8 checkpoints keep in their serving dtype (Qwen's modules_to_not_convert:
# embeddings, lm_head, norms, the Gated DeltaNet's small b/a projections and conv, the MoE router and
# the shared expert's sigmoid gate), and the like of the other architectures (Mamba2 and short convs,
# Nemotron-H's and Granite's routers). Matched against the module path's last parts.
_KEEP = re.compile(
    r"(^|\.)(lm_head|embed_tokens|embeddings?|[\w]*norm[\w]*|conv1d|conv|in_proj_ba|in_proj_a|in_proj_b"
    r"|shared_expert_gate|gate|router\.layer|router)$"
)


class Fp8Weight(NamedTuple):
    """A checkpoint's FP8 weight with its block scales, as a layer that stores FP8 loads it."""

    weight: torch.Tensor  # float8_e4m3fn [..., out, in]
    scale_inv: torch.Tensor  # float32 [..., ceil(out / b0), ceil(in / b1)]

    def scaled(self, factor: float | torch.Tensor | None) -> Fp8Weight:
        """The weight times `factor` (a model's folded multiplier): a number folds into every block's
        scale; a per-row tensor cannot (rows share a scale), ValueError."""
        if factor is None:
            return self
        if isinstance(factor, torch.Tensor) and factor.numel() != 1:
            raise ValueError("A per-row multiplier cannot fold into FP8 block scales.")
        return Fp8Weight(self.weight, self.scale_inv * float(factor))


@dataclass(frozen=True)
class Fp8Layout:
    """Which modules hold FP8 on a device: the quantizable linears (`Fp8BlockLinear`, CUDA) and the
    routed experts (`fp8_experts.py`)."""

    linears: bool
    experts: bool


def fp8_layout(config: Fp8Config | None, device: str | torch.device) -> Fp8Layout | None:
    """The FP8 layout of a model loaded with `config` on `device`, or None (no FP8 anywhere). Experts:
    `SGLANG_FP8_EXPERTS` auto = FP8 on CUDA, dequantized elsewhere (the CPU's C++ op takes float
    weights); fp8 = FP8 on any device (on CPU the experts run `fused_experts_fp8_torch`: tests);
    dequantize = dequantized everywhere. Linears: `SGLANG_FP8_LINEARS`, the same choices (fp8 on CPU:
    each forward dequantizes)."""
    from sglang.srt.environ import envs

    if config is None:
        return None
    cuda = torch.device(device).type == "cuda"
    chosen = []
    for var in (envs.SGLANG_FP8_LINEARS, envs.SGLANG_FP8_EXPERTS):
        choice = var.get().strip().lower()
        if choice not in ("auto", "fp8", "dequantize"):
            raise ValueError(f"{var.name} must be auto, fp8 or dequantize, got {choice!r}.")
        chosen.append(choice == "fp8" or (choice == "auto" and cuda))
    return Fp8Layout(linears=chosen[0], experts=chosen[1])


class Fp8ConfigError(ValueError):
    """A quantization_config this server cannot serve (one sentence naming the method)."""


@dataclass(frozen=True)
class Fp8Config:
    """The checkpoint's `quantization_config` of a block-wise FP8 checkpoint (upstream's `Fp8Config`)."""

    weight_block_size: tuple[int, int] = DEFAULT_BLOCK
    activation_scheme: str = "dynamic"
    fmt: str = "e4m3"
    # The checkpoint's modules kept unquantized (`modules_to_not_convert`, or upstream's
    # `ignored_layers`), as the checkpoint names them. Which modules load dense is what the checkpoint's
    # tensors are (`registry.fp8_dense_modules`); the list is read only without them.
    ignored_layers: tuple[str, ...] = ()
    # False: `--quantization fp8` on an unquantized checkpoint (quantized here, at load).
    is_checkpoint_fp8_serialized: bool = True
    # The checkpoint's format (`modelopt.py` makes the other): "fp8", block scales in `X.weight_scale_inv`;
    # "modelopt", one scale per tensor in `X.weight_scale`, each given as its block grid (`scale_grid`),
    # and static activation scales (`X.input_scale`) left out: activations are quantized per token here.
    method: str = "fp8"

    @classmethod
    def from_quantization_config(cls, config: Any) -> Fp8Config:
        get = (
            config.get
            if isinstance(config, dict)
            else (lambda key, default=None: getattr(config, key, default))
        )
        method = get("quant_method", None)
        if method != "fp8":
            raise Fp8ConfigError(
                f"its weights are quantized with {method!r}; this server serves block-wise FP8 checkpoints "
                "(quant_method fp8 with weight_block_size), NVIDIA ModelOpt's FP8 ones and unquantized ones."
            )
        fmt = get("fmt", "e4m3") or "e4m3"
        scheme = get("activation_scheme", "dynamic") or "dynamic"
        block = get("weight_block_size", None)
        if block is None:
            raise Fp8ConfigError(
                "its FP8 weights have one scale per tensor (no weight_block_size); this server serves "
                "block-wise FP8 (weight_block_size [128, 128]), not per-tensor FP8."
            )
        if fmt != "e4m3":
            raise Fp8ConfigError(f"its FP8 format is {fmt!r}; this server serves e4m3 FP8 weights.")
        if scheme != "dynamic":
            raise Fp8ConfigError(
                f"its FP8 activation_scheme is {scheme!r} (static activation scales); this server serves "
                "dynamic activation quantization only."
            )
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise Fp8ConfigError(f"its weight_block_size {block!r} is not two positive integers.")
        ignored = get("modules_to_not_convert", None) or get("ignored_layers", None) or ()
        return cls(tuple(block), scheme, fmt, (ignored,) if isinstance(ignored, str) else tuple(ignored))

    @classmethod
    def online(cls) -> Fp8Config:
        """`--quantization fp8` on an unquantized checkpoint."""
        return cls(is_checkpoint_fp8_serialized=False)

    def to_quantization_config(self) -> dict[str, Any]:
        """The config.json entry, as the published checkpoints write it."""
        return {
            "activation_scheme": self.activation_scheme,
            "fmt": self.fmt,
            "modules_to_not_convert": list(self.ignored_layers),
            "quant_method": "fp8",
            "weight_block_size": list(self.weight_block_size),
        }

    @property
    def scale_suffix(self) -> str:
        return "_scale" if self.method == "modelopt" else SCALE_SUFFIX

    def scale_grid(self, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The block scales of checkpoint `weight`: its own (block FP8), or its one per-tensor scale
        (ModelOpt: shape [] or [1]; one per expert, [E], for stacked experts) in every block of the grid.
        ValueError for a scale of another shape (per-channel scales are not this format)."""
        if self.method != "modelopt":
            return scale
        lead = weight.shape[:-2]
        if scale.numel() != math.prod(lead):
            raise ValueError(
                f"An FP8 weight of shape {tuple(weight.shape)} has a weight_scale of shape "
                f"{tuple(scale.shape)}; ModelOpt FP8 has one scale per tensor."
            )
        grid = tuple(math.ceil(n / b) for n, b in zip(weight.shape[-2:], self.weight_block_size, strict=True))
        return scale.float().reshape(*lead, 1, 1).expand(*lead, *grid).contiguous()


def quantizable_by_default(name: str, tensor: torch.Tensor) -> bool:
    """Whether a checkpoint tensor is one the published FP8 checkpoints quantize: a linear's weight (2-D,
    or 3-D stacked experts) outside the modules they keep (`_KEEP`)."""
    if not name.endswith(".weight") or tensor.dim() not in (2, 3) or not tensor.is_floating_point():
        return False
    return _KEEP.search(name.removesuffix(".weight")) is None


def quantize_block_fp8(
    weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv [..., ceil(out/b0), ceil(in/b1)]): each block scaled so
    its largest magnitude is 448 (an all-zero block gets scale 1 and stays zero). Leading dims (stacked
    experts) are quantized independently."""
    w, (rows, cols) = weight.float(), weight.shape[-2:]
    br, bc = block
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    padded = F.pad(w, (0, nc * bc - cols, 0, nr * br - rows))
    blocks = padded.reshape(*w.shape[:-2], nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.reshape(padded.shape)[..., :rows, :cols].to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()


def dequantize_block_fp8(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`weight * scale_inv` block by block, in `dtype` (the product is taken in float32). The last block
    of a dimension that does not divide by the block is partial; ValueError where the scales' shape is not
    [..., ceil(out/b0), ceil(in/b1)]."""
    rows, cols = weight.shape[-2:]
    br, bc = block
    want = (*weight.shape[:-2], math.ceil(rows / br), math.ceil(cols / bc))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"FP8 weight of shape {tuple(weight.shape)} has scales of shape {tuple(scale_inv.shape)}; "
            f"{list(block)} blocks need {want}."
        )
    scale = scale_inv.float().repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)
    return (weight.float() * scale[..., :rows, :cols]).to(dtype)


def fp8_checkpoint_stream(
    weights: Iterable[tuple[str, torch.Tensor]],
    config: Fp8Config,
    keep_fp8: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor | Fp8Weight]]:
    """The checkpoint's tensors with each FP8 `X.weight` and its `X.weight_scale_inv` given as one float32
    `X.weight` (dequantized), in whatever order they come; others unchanged. An online config
    (`--quantization fp8`) passes each quantizable tensor through the FP8 grid instead, so the values
    served are those an FP8 checkpoint of it would hold. ValueError where a weight and its scale do not
    pair up.

    `keep_fp8(name)`: which weights load as FP8 (the model's loader decides: every one where the linears
    are FP8, on CUDA; the FP8 experts' alone where only they are): a pair whose weight name it accepts is
    given as it is, as one `Fp8Weight` under the weight's name; online, such a tensor is given quantized
    the same way."""
    pending: dict[str, torch.Tensor] = {}  # a weight waiting for its scale, or a scale for its weight
    suffix = config.scale_suffix
    for name, tensor in weights:
        if config.method == "modelopt" and name.endswith(".input_scale"):
            continue  # (static activation scales: activations are quantized per token at run time)
        if name.endswith(".weight" + suffix):
            base = name.removesuffix(suffix)
        elif tensor.dtype == FP8_DTYPE:
            base = name
        else:
            if not config.is_checkpoint_fp8_serialized and quantizable_by_default(name, tensor):
                q, s = quantize_block_fp8(tensor, config.weight_block_size)
                if keep_fp8 is not None and keep_fp8(name):
                    yield name, Fp8Weight(q, s)
                    continue
                tensor = dequantize_block_fp8(q, s, config.weight_block_size)
            yield name, tensor
            continue
        other = pending.pop(base if name != base else base + suffix, None)
        if other is None:
            pending[name] = tensor
            continue
        weight, scale = (tensor, other) if name == base else (other, tensor)
        if weight.dtype != FP8_DTYPE:
            raise ValueError(f"Checkpoint tensor {base} is {weight.dtype}, yet it has a {base}{suffix}.")
        scale = config.scale_grid(weight, scale)
        if keep_fp8 is not None and keep_fp8(base):
            yield base, Fp8Weight(weight, scale)
            continue
        yield base, dequantize_block_fp8(weight, scale, config.weight_block_size)
    if pending:
        name = sorted(pending)[0]
        lacks = "scale" if not name.endswith(suffix) else "FP8 weight"
        raise ValueError(f"Checkpoint tensor {name} has no matching {lacks} ({len(pending)} unpaired).")


def row_block_of(fp8: Fp8Weight, rows: torch.Tensor, block: tuple[int, int]) -> Fp8Weight | None:
    """`rows` (a view of whole rows of `fp8.weight`, as a model's split of a fused checkpoint tensor
    gives: Granite's [gate | up]) with the scales of its blocks, or None where it does not start on a
    block row or end on one (or at the weight's end), or is not such a view (its blocks would need
    requantizing)."""
    w, b0 = fp8.weight, block[0]
    if rows is w:
        return fp8
    same = (
        w.dim() == 2
        and rows.dim() == 2
        and rows.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
        and rows.stride() == w.stride()
        and rows.shape[1] == w.shape[1]
    )
    if not same:
        return None
    start, off = divmod(rows.storage_offset() - w.storage_offset(), w.stride(0))
    stop = start + rows.shape[0]
    if off or start < 0 or stop > w.shape[0] or start % b0 or (stop % b0 and stop != w.shape[0]):
        return None
    return Fp8Weight(rows, fp8.scale_inv[start // b0 : math.ceil(stop / b0)])


class Fp8BlockLinear(nn.Module):
    """A linear layer of block-FP8 weights: `weight` float8_e4m3fn [out, in], `weight_scale_inv` float32
    [ceil(out/b0), ceil(in/b1)], an optional `bias` in the serving dtype. Forward: the block GEMM of
    `fp8_kernel` on CUDA where it imports (activations quantized per token and column group), else the
    dequantized weight times the input (torch)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        block: tuple[int, int] = DEFAULT_BLOCK,
    ):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, tuple(block)
        scales = (math.ceil(out_features / block[0]), math.ceil(in_features / block[1]))
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        self.weight_scale_inv = nn.Parameter(torch.ones(scales, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._kernel = None  # fp8_kernel.w8a8_block_fp8_matmul, looked up at load
        # Tensor parallel, where it replaces a row-parallel linear: the partial products' all-reduce.
        self.reduce_results = False
        # One scale for the checkpoint tensor (ModelOpt) and a rank's part that cuts its blocks: the
        # scale grid is this rank's own, every block the tensor's scale (`shard_fp8_like`).
        self.uniform_scale = False

    @classmethod
    def from_linear(cls, linear: nn.Linear, block: tuple[int, int] = DEFAULT_BLOCK) -> Fp8BlockLinear:
        """`linear` quantized block-wise (its weights must be real: not on the meta device)."""
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, block).to(
            linear.weight.device
        )
        out.load_dense(linear.weight.data)
        if linear.bias is not None:
            out.bias = nn.Parameter(linear.bias.data.clone(), requires_grad=False)
        return out

    def load_dense(self, weight: torch.Tensor) -> None:
        """Quantize the dense `weight` into this layer's FP8 weight and scales."""
        q, s = self.quantized(weight)
        self.weight.data.copy_(q)
        self.weight_scale_inv.data.copy_(s)

    def quantized(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"A weight of shape {tuple(weight.shape)} does not fit an FP8 linear of "
                f"{(self.out_features, self.in_features)}."
            )
        return quantize_block_fp8(weight, self.block)

    def process_weights_after_loading(self) -> None:
        self._kernel = fp8_block_kernel(self.weight.device)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_block_fp8(self.weight, self.weight_scale_inv, self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = block_fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self._kernel)
        if self.reduce_results:
            out = tensor_model_parallel_all_reduce(out)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={list(self.block)}"


def block_fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], kernel
) -> torch.Tensor:
    """x times the block-FP8 `weight` (with its `scale_inv`) transposed, in x's dtype: `kernel`
    (`fp8_block_kernel`'s, set where the weight is on CUDA, so x is too) where given, else the
    dequantized weight times x (torch)."""
    if kernel is not None:
        return kernel(x, weight, scale_inv, list(block), x.dtype)
    return F.linear(x, dequantize_block_fp8(weight, scale_inv, block, x.dtype))


def shard_fp8_like(fp8: Fp8BlockLinear, linear: nn.Linear, name: str, per_tensor: bool = False) -> None:
    """Give `fp8` the tensor-parallel split of the `linear` it replaces: its weight's, and its scales'
    the same in blocks, which needs every rank's part of every piece to be whole blocks (a scale covers
    one block of one rank). ValueError naming --tp-size where a part is not, unless the checkpoint has
    one scale per tensor (`per_tensor`, ModelOpt): then the rank's grid is its own, each block holding
    that scale (`Fp8BlockLinear.uniform_scale`; the loader fills it)."""
    shards = weight_shards(linear.weight)
    if not shards:
        return
    scale_shards = []
    for s in shards:
        block = fp8.block[s.dim]
        sizes = [*s.pieces[:-1], s.pieces[-1] + s.pad]
        if any(size // s.parts % block for size in sizes):
            if per_tensor:
                fp8.uniform_scale = True
                continue
            raise ValueError(
                f"{name}: each rank's part of its FP8 weight ({sizes[0] // s.parts} of {sizes[0]}) is not "
                f"a whole number of {block}-wide scale blocks at --tp-size {len(s.part_of_rank)}."
            )
        scale_shards.append(s.in_blocks(block))
    set_weight_shards(fp8.weight, *shards)
    if not fp8.uniform_scale:
        set_weight_shards(fp8.weight_scale_inv, *scale_shards)
    fp8.reduce_results = bool(getattr(linear, "reduce_results", False)) and any(s.dim == 1 for s in shards)


def fp8_block_kernel(device: torch.device):
    """The Triton block-FP8 GEMM (`fp8_kernel.w8a8_block_fp8_matmul`; with SGLANG_FP8_GEMM_BACKEND=cublas
    `fp8_scaled_mm.scaled_mm_linear`) on CUDA where it imports, else None (the torch path: dequantize,
    then matmul)."""
    if device.type != "cuda":
        return None
    try:
        from sglang.srt.layers.quantization.fp8_kernel import w8a8_block_fp8_matmul
    except ImportError as e:
        logger.warning("The block-FP8 GEMM is unavailable (%s); FP8 linears dequantize per forward.", e)
        return None
    from sglang.srt.layers.quantization import fp8_scaled_mm

    # SGLANG_FP8_GEMM_BACKEND=cublas: torch's block-wise _scaled_mm where it works here (probed once, at
    # load: never under a graph capture, and no per-call choice)
    if fp8_scaled_mm.chosen() and fp8_scaled_mm.available(device):
        return fp8_scaled_mm.scaled_mm_linear
    return w8a8_block_fp8_matmul


@dataclass
class SwapReport:
    swapped: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def under_any(name: str, modules: Iterable[str]) -> bool:
    """Whether module `name` is one of `modules` or under one of them (a checkpoint may keep a whole
    attention or MLP block unquantized by naming it)."""
    return any(name == m or name.startswith(m + ".") for m in modules)


def swap_fp8_linears(
    model: nn.Module, config: Fp8Config, dense_modules: Iterable[str] = (), skip: Iterable[str] = ()
) -> SwapReport:
    """Before loading: replace each `nn.Linear` of `model` that the FP8 checkpoint quantizes by an
    `Fp8BlockLinear` of the same shape (on the linear's device, meta included). Kept as they are: the
    modules `quantizable_by_default` keeps (lm_head, routers, gates, ...), the modules in or under `skip`
    (those the checkpoint holds unquantized, in our names: `registry.fp8_dense_modules`), and those whose
    name ends with one of `dense_modules` (a model's linears whose rows are regrouped or assembled after
    loading). The loader
    copies a checkpoint's FP8 weight and scales into an FP8 linear as they are, and quantizes a dense
    tensor that arrives for one."""
    report, skip, dense = SwapReport(), set(skip), tuple(dense_modules)
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        keep = (
            under_any(name, skip)
            or (dense and name.endswith(dense))
            or not quantizable_by_default(name + ".weight", module.weight)
        )
        if keep:
            report.kept.append(name)
            continue
        parent, _, attr = name.rpartition(".")
        with torch.device(module.weight.device):
            fp8 = Fp8BlockLinear(
                module.in_features, module.out_features, module.bias is not None, config.weight_block_size
            )
        shard_fp8_like(fp8, module, name, per_tensor=config.method == "modelopt")
        setattr(model.get_submodule(parent) if parent else model, attr, fp8)
        report.swapped.append(name)
    return report

"""The routed experts in bfloat16 / float16 on CUDA as fused Triton grouped GEMMs (decode batches by
default, `experts.FUSED_AUTO_MAX_TOKENS`; every batch with `SGLANG_GPU_MOE_BACKEND=triton_fused`): the
FP8 experts' kernel (`fused_moe_fp8_triton._moe_gemm_kernel`) with `FP8=False`. One layer's forward, a
fixed number of launches and no host read (a CUDA graph can capture it), against
`RoutedExperts.forward_device`'s gathered copy, two `torch._grouped_mm` and a separate activation:

1. the assignments sorted by expert (`sort_combine.sort_by_expert`; other EP ranks' assignments, id E,
   sort last, outside `offs`: no tile computes them), and the tiles of each GEMM's BLOCK_M per expert
   (`tile_map`: the grid is bounded without reading the counts);
2. the w13 GEMM, its rows gathered from x by token inside the kernel (no [T k, H] copy of x), each tile
   reading one expert's weights once; for gated silu experts the activation in its epilogue (each
   program computes a gate and the matching up tile and writes silu(gate) * up: w2's input [T k, I],
   rounded once to the activation dtype), otherwise the layer's activation after it;
3. the w2 GEMM over the same sorted rows;
4. `sort_combine.combine`: each token's top-k rows times their routing weights summed in float32 in pick
   order and rounded once. The weights are applied there and not in w2's epilogue: a token's rows lie in
   different experts' tiles, so summing them in the epilogue takes atomic adds, whose order (and float
   rounding) changes from run to run; the combine's one read of each row keeps the sum deterministic.

The weights need no other layout: w13 [E, 2I, H] and w2 [E, H, I] as loaded are K-contiguous rows, what
the kernel reads. Where the layer's shared expert has the routed experts' form and width (Qwen3-Next:
gated silu, 512 wide, with a sigmoid gate), `FusedExperts` appends it at load as expert E of a stack of
E + 1 and every token picks it once more, its weight the gate's sigmoid: the shared expert's GEMMs and
its gate's product run inside the same two launches and the same combine, where apart they take five more
launches per layer (most of a decode step's MoE time at batch 1, where the routed experts stream ~60 MB).
The parameters become views of the stack and their old storages are freed (on CUDA returned to the
device at once): one copy stays, but while a layer is stacked its routed experts are held twice, ~3.2 GB
for the 80B in bf16 at TP 1 (1 / TP of it per rank), on top of the weights the start's memory check
counts (it refuses weights over --mem-fraction-static of the device: on an H200 the default, ~0.91 with
8,192-token chunks, leaves ~13 GB free; a fraction near 1 with weights near it can run out here).
Tiles: `moe_configs.py` (JSON files per shape and GPU, a fallback elsewhere).
On CPU tensors the kernels run only under `TRITON_INTERPRET=1`, for tests; the torch twin is
`RoutedExperts.forward_device`."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.activation import relu2
from sglang.srt.layers.mlp import GatedMLP
from sglang.srt.layers.moe.fused_moe_fp8_triton import MoeGemmConfig, launch_moe_gemm
from sglang.srt.layers.moe.moe_configs import Table, device_name, pick_configs, tuned_table
from sglang.srt.layers.moe.sort_combine import combine, sort_by_expert


def moe_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    offs: torch.Tensor,
    rows: int,
    token_of: torch.Tensor | None,
    config: MoeGemmConfig,
    tile_end: torch.Tensor | None = None,
    silu_mul: bool = False,
    relu2: bool = False,
) -> torch.Tensor:
    """The 16-bit grouped GEMM over `rows` sorted rows: row r of expert e (offs[e-1] <= r < offs[e]) is
    a[token_of[r]] where `token_of` is given, else a[r]; weight [E, N, K] in a's dtype. Returns [rows, N]
    in a's dtype, or [rows, N / 2] = silu(gate) * up where `silu_mul` (weight's rows: gate then up), or
    relu(.)^2 of the product where `relu2`. Rows past offs[-1] belong to no expert and are left
    unwritten."""
    _, n, k = weight.shape
    if a.dtype != weight.dtype or a.shape[-1] != k or a.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError(
            f"moe_gemm takes a [.., {k}] row-major in the weight's dtype {weight.dtype} and contiguous "
            "weights; "
            f"got a {tuple(a.shape)} {a.dtype}."
        )
    if silu_mul:
        if n % 2:
            raise ValueError(f"silu_mul needs gate and up rows of equal count; the weight has {n} rows.")
        n //= 2
    out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    if rows == 0:
        return out
    launch_moe_gemm(a, weight, out, offs, token_of, config, tile_end, silu_mul=silu_mul, relu2=relu2)
    return out


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activate: Callable[[torch.Tensor], torch.Tensor],
    silu_and_mul: bool,
    table: Table | None = None,
    relu2: bool = False,
) -> torch.Tensor:
    """x [T, H] (bf16 / fp16, w13's and w2's dtype), routing `weights` and local expert `ids` [T, k] ->
    [T, H] in x's dtype: sum over k of weight * w2 @ activate(w13 @ x) (see the module docstring).
    `silu_and_mul`: `activate` is silu(gate) * up of w13's halves, computed in w13's epilogue; `relu2`:
    `activate` is relu(.)^2 (plain experts), computed there too. `table`: the tuned tiles of this shape
    (`moe_configs.tuned_table`), None for the fallback."""
    num_experts = w13.shape[0]
    rows = ids.numel()
    cfg13, cfg2 = pick_configs(table, ids.shape[0], rows, num_experts)
    heights = (cfg13.block_m,) if cfg2.block_m == cfg13.block_m else (cfg13.block_m, cfg2.block_m)
    sorted_ = sort_by_expert(ids, num_experts, use_triton=True, block_ms=heights)
    token_of, offs = sorted_.token_of, sorted_.offs
    tile_end13, tile_end2 = sorted_.tile_ends[0], sorted_.tile_ends[-1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    h = moe_gemm(x, w13, offs, rows, token_of, cfg13, tile_end13, silu_mul=silu_and_mul, relu2=relu2)
    if not (silu_and_mul or relu2):
        h = activate(h).contiguous()
    y = moe_gemm(h, w2, offs, rows, None, cfg2, tile_end2)
    return combine(y, sorted_, weights, x.dtype)


class FusedExperts:
    """The fused GEMMs' state for one `RoutedExperts` layer (its `fused_gemms`, set at load): the tuned
    tiles of its shape on its GPU ({} where the repository has none: the fallback), and, where its
    shared expert fuses, the stacks with the shared expert appended as expert E. Tiles are looked up by
    the experts the GEMMs run over, as `tune_fused_moe.py` names its files: E (`table`), or E + 1 for
    the stacks, which each token picks top-k + 1 of (`stack_table`)."""

    DTYPES = (torch.bfloat16, torch.float16)

    def __init__(self, experts: nn.Module, max_tokens: int | None = None):
        self.table = self._table(experts.w13.shape[0], experts.w2)
        self.max_tokens = max_tokens  # larger batches take the grouped_mm path (None: none do)
        self.silu_mul = experts.gated and experts.act is F.silu
        self.relu2 = not experts.gated and experts.act is relu2  # (Nemotron-H's plain experts)
        self.shared: tuple[nn.Module, nn.Module | None] | None = None  # (the MLP, its gate)
        self.stack: tuple[torch.Tensor, torch.Tensor] | None = None  # (w13, w2) of E + 1 experts
        self.stack_table: Table = {}  # the stacks' tiles (E + 1 experts)

    @staticmethod
    def _table(gemm_experts: int, w2: torch.Tensor) -> Table:
        _, hidden, inter = w2.shape
        return tuned_table(gemm_experts, inter, hidden, w2.dtype, device_name(w2.device)) or {}

    def serves(self, experts: nn.Module, x: torch.Tensor) -> bool:
        fits = self.max_tokens is None or x.shape[0] <= self.max_tokens
        return fits and x.dtype == experts.w13.dtype and x.dtype in self.DTYPES

    def fuse_shared(self, experts: nn.Module, mlp: nn.Module, gate: nn.Module | None) -> None:
        """Append `mlp` (and its [1, H] sigmoid `gate`, or None) as expert E where it has the routed
        experts' form (gated silu, no biases) and this rank's width, dtype and device; else leave it a
        torch MLP beside them. The stacks replace the parameters' storage (each parameter a view of its
        part, same shape and values, so weight updates in place reach the kernels)."""
        if self.shared is not None:
            if self.shared != (mlp, gate):
                raise ValueError("This layer's fused experts already run another shared expert.")
            return
        w13, w2 = experts.w13.data, experts.w2.data
        e, rows, _ = w13.shape
        inter = rows // 2
        linears = (mlp.gate_proj, mlp.up_proj, mlp.down_proj) if isinstance(mlp, GatedMLP) else ()
        fits = (
            self.silu_mul and mlp.act is F.silu and len(linears) == 3
            and all(lin.bias is None for lin in linears)
            and (gate is None or (getattr(gate, "bias", None) is None and gate.weight.dtype == w13.dtype))
            and linears[0].weight.shape == linears[1].weight.shape == (inter, w13.shape[2])
            and linears[2].weight.shape == w2.shape[1:]
            and all(lin.weight.dtype == w13.dtype and lin.weight.device == w13.device for lin in linears)
        )  # fmt: skip
        if not fits:
            return
        stack13 = torch.cat([w13, torch.cat([linears[0].weight.data, linears[1].weight.data])[None]])
        stack2 = torch.cat([w2, linears[2].weight.data[None]])
        experts.w13.data, experts.w2.data = stack13[:e], stack2[:e]
        linears[0].weight.data, linears[1].weight.data = stack13[e, :inter], stack13[e, inter:]
        linears[2].weight.data = stack2[e]
        self.stack, self.shared = (stack13, stack2), (mlp, gate)
        self.stack_table = self._table(e + 1, stack2)
        # The old storages are no longer referenced (every user holds a view of the stacks); on CUDA they
        # go back to the device now, not to torch's cache, where the pools' sizing (mem_get_info's free
        # bytes, after the load) would count them as used and the next layer's larger stack cannot
        # reuse them whole.
        # (Only on the thread that loads at start: a weight update loads on a thread of its own while the
        # forward runs, where the sync would stall it and a graph capture may be underway.)
        if w13.is_cuda and threading.current_thread() is threading.main_thread():
            del w13, w2
            torch.cuda.empty_cache()

    def forward(
        self,
        experts: nn.Module,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        shared_expert: nn.Module | None,
        shared_gate: nn.Module | None,
    ) -> torch.Tensor:
        """The layer's `forward` on its local `weights` / `ids` (other EP ranks' assignments: id E)."""
        if self.shared is None or self.shared != (shared_expert, shared_gate):
            return experts._add_shared(self.routed(experts, x, weights, ids), x, shared_expert, shared_gate)
        e = experts.num_experts
        if e != experts.global_num_experts:
            ids = torch.where(ids == e, e + 1, ids)  # other EP ranks' id, past the shared expert's
        t = x.shape[0]
        if shared_gate is None:
            share = torch.ones(t, 1, dtype=torch.float32, device=x.device)
        else:
            share = torch.sigmoid(shared_gate(x).float())
        ids = torch.cat([ids, ids.new_full((t, 1), e)], 1)
        weights = torch.cat([weights.float(), share], 1)
        return self.forward_picked(experts, x, weights, ids)

    def routed(self, experts: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts alone (the shared expert runs beside them)."""
        return fused_experts(
            x, experts.w13, experts.w2, weights, ids, experts._activate, self.silu_mul, self.table, self.relu2
        )

    def forward_picked(
        self, experts: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """The stacks' GEMMs on picks [T, k + 1] that already end with the shared expert's (id E, its
        gate's weight): `forward`'s last step, and `shared_routing.SharedRouting`'s, whose routing
        kernel writes that pick itself."""
        return fused_experts(
            x, *self.stack, weights, ids, experts._activate, self.silu_mul, self.stack_table, self.relu2
        )

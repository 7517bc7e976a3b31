"""Moving one request's KV and recurrent state from the prefill server's pools into the decode server's.

What moves: for every full-attention layer, K and V of the prompt's tokens (token slot t of a layer is
`bytes_per_token` bytes at `ptr + t * bytes_per_token`, so runs of consecutive slots on both sides
merge into one descriptor), and for every linear layer the conv and SSM rows of the running slot (one
slot of one layer is one contiguous block, `MambaPool.get_contiguous_buf_infos`). Page sizes may differ
between the two servers: descriptors are per token run, not per page.

The bytes move through Mooncake's transfer engine (`mooncake-transfer-engine-non-cuda`, TCP, with
P2PHANDSHAKE: no metadata service), as upstream SGLang does. A batch holds at most
`MAX_DESCRIPTORS_PER_BATCH` descriptors per peer: above 2,048 Mooncake's TCP transport rejects the
batch and, from ~2,100 on, keeps the link to that peer broken (reference/distributed.md, section 1.6);
and where two prefill ranks write into one decode rank at once (servers of other --tp-size sizes), two
batches of ~1,900 (a token's half row apiece) overflowed its queue under load ('TCP lane queue-full',
code -1, after MC_TCP_ADMISSION_TIMEOUT_MS): 1,024 per batch served in every run.
With `--disaggregation-transfer-backend nixl` they move through NIXL instead (`nixl_backend.py`, the
same `session_id` and `write`).
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
from dataclasses import asdict, dataclass, replace

from sglang.srt.disaggregation.channel import reachable_host
from sglang.srt.disaggregation.staging import Staging, staging_sizes, transfer_path
from sglang.srt.disaggregation.state_packer import BLOCK_FORMAT, StatePacker, kv_buffers
from sglang.srt.disaggregation.weights_fingerprint import with_weights
from sglang.srt.server_args import ServerArgsError
from sglang.srt.speculative.draft_layers import draft_kv_layer_ids

logger = logging.getLogger(__name__)

MAX_DESCRIPTORS_PER_BATCH = 1024

# (source address, destination address, bytes)
Descriptor = tuple[int, int, int]


class TransferError(RuntimeError):
    """A transfer did not complete; the request it carried ends with an error on both servers."""


@dataclass(frozen=True)
class PoolLayout:
    """Where a server's pools live, as a transfer engine addresses them. Sent by the decode server with
    every destination, so the prefill server needs no state per decode server."""

    kv_ptrs: list[int]  # K then V of each full-attention layer
    kv_nbytes: list[int]
    kv_bytes_per_token: int
    state_ptrs: list[int]  # conv of each linear layer, then SSM of each
    state_nbytes: list[int]
    state_slot_bytes: list[int]
    # The KV pool's dtype (`--kv-cache-dtype`): bfloat16 and float16, or the two float8s, have the same
    # bytes per token and different meanings.
    kv_dtype: str = ""
    # Of the KV layers, the MTP draft layer's (the last; EAGLE / NEXTN: `draft_layers.draft_kv_layer_ids`).
    draft_kv_layers: int = 0
    # The state pool's dtypes, "conv X, ssm Y" (SGLANG_MAMBA_CONV_DTYPE, default the --dtype; and
    # `--mamba-ssm-dtype`): a bfloat16 and a float16 state weigh alike.
    state_dtypes: str = ""
    # The weights that computed the KV and state (`--dtype`, `--quantization`): the decode server must
    # continue the prefill server's numerics, else it answers neither server's tokens.
    weights: str = ""
    # Their values (`weights_fingerprint.py`: another checkpoint of the same shapes, or a weight update
    # applied to one server only, differs here alone): the meta digest (the same on every rank), this TP
    # rank's share of the values (the server's fingerprint sums every rank's: `weights_total`, compared
    # by `weights_mismatch` at any --tp-size / --ep-size), and for the refusal where they came from.
    weights_digest: str = ""
    weights_share: int = 0
    weights_source: str = ""
    # The same sum over every element this rank holds, its copies of replicated ones included, and the
    # --ep-size: two servers of the same --tp-size and --ep-size hold the same elements rank by rank,
    # and compare these rank by rank too (`weights_mismatch`), so that a copy one rank alone got wrong
    # (one rank's payload of /update_weights_from_tensor) is seen, which the shares' total cannot see.
    weights_held: int = 0
    ep_size: int = 1
    # Which KV heads and state rows of the model this rank's pools hold (`shard_map.ShardLayout.to_dict`):
    # what lets a pair of other --tp-size sizes cut and join the shards (None: a rank that does not say).
    shards: dict | None = None
    # How this server packs a staged block (`state_packer.BLOCK_FORMAT`; "" from a build before it said).
    staged_blocks: str = ""

    @classmethod
    def of(cls, token_to_kv_pool, mamba_pool, draft_kv_layers: int = 0) -> PoolLayout:
        kv = kv_buffers(token_to_kv_pool)
        per_token = kv[0][0].nbytes if kv else 0
        states = mamba_pool.get_contiguous_buf_infos()
        return cls(
            kv_ptrs=[b.data_ptr() for b in kv],
            kv_nbytes=[b.nbytes for b in kv],
            kv_bytes_per_token=per_token,
            state_ptrs=[p for p, _, _ in states],
            state_nbytes=[n for _, n, _ in states],
            state_slot_bytes=[s for _, _, s in states],
            kv_dtype=str(token_to_kv_pool.dtype),
            draft_kv_layers=draft_kv_layers,
            state_dtypes=f"conv {mamba_pool.conv_state.dtype}, ssm {mamba_pool.ssm_state.dtype}",
            staged_blocks=BLOCK_FORMAT,
        )

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of every buffer, to register with the transfer engine."""
        return list(zip(self.kv_ptrs + self.state_ptrs, self.kv_nbytes + self.state_nbytes, strict=True))

    def sizes(self) -> dict[str, int]:
        """What one prompt position's KV (every layer's K and V) and one request's state (every linear
        layer's conv and SSM rows) weigh in a transfer."""
        return {
            "kv_bytes_per_token": self.kv_bytes_per_token * len(self.kv_ptrs),
            "state_bytes": sum(self.state_slot_bytes),
        }

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> PoolLayout:
        return cls(**d)

    def mismatch(self, other: PoolLayout, same_shards: bool = True) -> str | None:
        """Why a transfer between the two layouts cannot be right (different models or dtypes), or None.
        `self` is the prefill server's, `other` the decode server's (the decode client reads the reason).
        Without `same_shards` (servers of other --tp-size sizes, whose ranks hold other heads) the bytes
        of a token's KV and of a slot's state are not compared: `shard_map.layout_mismatch` checks them."""
        if self.draft_kv_layers != other.draft_kv_layers:
            return (
                "one server of the pair keeps the MTP draft layer's KV (--speculative-algorithm EAGLE / NEXTN) "
                "and the other does not: start both with the same --speculative-algorithm"
            )
        if self.weights != other.weights:
            return (
                f"the weights differ (the prefill server's {self.weights or 'none named'}, the decode server's "
                f"{other.weights or 'none named'}): start both with the same --dtype and --quantization"
            )
        # The dtype first: a float8 and a 16-bit KV differ in bytes per token too, and the flag is the cause.
        if self.kv_dtype != other.kv_dtype:
            here, there = self.kv_dtype or "none named", other.kv_dtype or "none named"
            return (
                f"the KV cache dtypes differ (the prefill server's {here}, the decode server's {there}: "
                "--kv-cache-dtype)"
            )
        if len(self.kv_ptrs) != len(other.kv_ptrs) or (
            same_shards and self.kv_bytes_per_token != other.kv_bytes_per_token
        ):
            return (
                f"the KV layouts differ ({len(self.kv_ptrs) // 2} layers of {self.kv_bytes_per_token} bytes per "
                f"token on the prefill server, {len(other.kv_ptrs) // 2} of {other.kv_bytes_per_token} on the "
                "decode server)"
            )
        if self.state_dtypes != other.state_dtypes:
            here, there = self.state_dtypes or "none named", other.state_dtypes or "none named"
            return (
                f"the recurrent-state dtypes differ (the prefill server's {here}, the decode server's {there}: "
                f"{_state_dtype_flags(self.state_dtypes, other.state_dtypes)})"
            )
        if len(self.state_ptrs) != len(other.state_ptrs) or (
            same_shards and self.state_slot_bytes != other.state_slot_bytes
        ):
            return (
                "the recurrent-state layouts differ (another model, or another --mamba-ssm-dtype or "
                "SGLANG_MAMBA_CONV_DTYPE)"
            )
        return None


def _state_dtype_flags(here: str, there: str) -> str:
    """What sets the state dtypes that differ between "conv X, ssm Y" and another such."""
    conv_here, _, ssm_here = here.partition(", ")
    conv_there, _, ssm_there = there.partition(", ")
    flags = []
    if conv_here != conv_there:
        flags.append("SGLANG_MAMBA_CONV_DTYPE for the conv state, whose default is the --dtype")
    if ssm_here != ssm_there:
        flags.append("--mamba-ssm-dtype (or SGLANG_MAMBA_SSM_DTYPE) for the SSM state")
    return " and ".join(flags) or "--mamba-ssm-dtype and SGLANG_MAMBA_CONV_DTYPE"


def token_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs (src start, dst start, length) where both slot lists go up by one together."""
    assert len(src) == len(dst)
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def transfer_descriptors(
    src: PoolLayout,
    dst: PoolLayout,
    src_tokens: list[int],
    dst_tokens: list[int],
    src_slot: int,
    dst_slot: int,
) -> list[Descriptor]:
    """Every copy one request needs: its tokens' K and V in every full-attention layer and its running
    slot's conv and SSM rows in every linear layer."""
    out: list[Descriptor] = []
    per_token = src.kv_bytes_per_token
    runs = token_runs(src_tokens, dst_tokens)
    for s_ptr, d_ptr in zip(src.kv_ptrs, dst.kv_ptrs, strict=True):
        out += [(s_ptr + s * per_token, d_ptr + d * per_token, n * per_token) for s, d, n in runs]
    for s_ptr, d_ptr, size in zip(src.state_ptrs, dst.state_ptrs, src.state_slot_bytes, strict=True):
        out.append((s_ptr + src_slot * size, d_ptr + dst_slot * size, size))
    return out


def clear_destination(layout: PoolLayout, tokens: list[int], slot: int) -> None:
    """Zero what a transfer into (`tokens`, `slot`) of this server's pools writes: the KV rows of those
    token slots in every full-attention layer and the running slot's conv and SSM rows. Reserved slots
    hold the previous tenant's KV and state; a request whose transfer never really came (a peer that
    answers "done" without writing) must decode from zeros, never from those. CPU pools only (PD runs
    on `--device cpu`), so the addresses are host memory."""
    per_token = layout.kv_bytes_per_token
    runs = token_runs(tokens, tokens)
    for ptr in layout.kv_ptrs:
        for start, _, n in runs:
            ctypes.memset(ptr + start * per_token, 0, n * per_token)
    for ptr, size in zip(layout.state_ptrs, layout.state_slot_bytes, strict=True):
        ctypes.memset(ptr + slot * size, 0, size)


def open_transfer_engine(sched, side: str) -> tuple[PoolLayout, MooncakeTransferEngine, Staging | None]:
    """The layout of a scheduler's pools, the transfer engine, and on the staged path the staging buffer
    it registers instead of the pools (`staging_sizes` for `side`, "prefill" or "decode"); the flags
    were checked at startup (`check_flag_support`). Logs which path is in use."""
    args = sched.server_args
    kv_pool, mamba_pool = sched.model_runner.token_to_kv_pool, sched.req_to_token_pool.mamba_pool
    from sglang.srt.disaggregation.shard_map import shard_layout  # (it imports this module)

    layout = PoolLayout.of(kv_pool, mamba_pool, len(draft_kv_layer_ids(args)))
    layout = replace(with_weights(layout, sched, args.model_path), shards=shard_layout(sched).to_dict())
    backend = args.disaggregation_transfer_backend
    path = transfer_path(args.device, backend)
    packer = StatePacker.of(kv_pool, mamba_pool, args.device)
    staging = None
    regions = layout.regions()
    if path == "staged":
        nbytes, chunk = staging_sizes(side, packer, sched.context_len, sched.req_to_token_pool.size)
        staging = Staging.create(packer, nbytes, chunk, args.tp_size)
        regions = [(staging.buffer.data_ptr(), staging.buffer.nbytes)]
    logger.info(
        "KV and state transfer path: %s.",
        {
            "host": "host memory pools, registered as they are",
            "gpu": "device pools registered with Mooncake's CUDA build",
            "staged": f"through a {staging.buffer.nbytes / 2**20:.1f} MiB host staging buffer in chunks of "
            f"at most {staging.chunk_bytes / 2**20:.1f} MiB "
            f"({'pinned, one copy per chunk on a copy stream' if packer.device.type == 'cuda' else 'CPU'})"
            if staging is not None
            else "",
        }[path],
    )
    host = reachable_host(args.host)
    if backend == "nixl":
        from sglang.srt.disaggregation.nixl_backend import NixlTransferEngine

        return layout, NixlTransferEngine(host, regions, progress=side == "decode"), staging
    return layout, MooncakeTransferEngine(host, args.disaggregation_ib_device, regions), staging


def listening_sockets() -> set[str]:
    """This process's listening TCP sockets as "address:port" (Linux; empty elsewhere)."""
    try:
        inodes = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        out = set()
        for table, v6 in (("/proc/self/net/tcp", False), ("/proc/self/net/tcp6", True)):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    cols = line.split()
                    if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                        continue
                    hex_addr, hex_port = cols[1].split(":")
                    raw = bytes.fromhex(hex_addr)
                    # /proc writes each 32-bit word in host (little-endian) order.
                    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                    addr = ipaddress.ip_address(raw)
                    out.add(f"[{addr}]:{int(hex_port, 16)}" if v6 else f"{addr}:{int(hex_port, 16)}")
        return out
    except OSError:
        return set()


class MooncakeTransferEngine:
    """One Mooncake engine per server: its pools registered once, writes to a peer by session id."""

    def __init__(self, hostname: str, ib_device: str | None, regions: list[tuple[int, int]]):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise ServerArgsError(
                "--disaggregation-transfer-backend mooncake needs the Mooncake transfer engine: "
                "pip install 'sglang[pd]' (mooncake-transfer-engine-non-cuda) and apt-get install "
                f"libibverbs1 ({e})."
            ) from None
        self.engine = TransferEngine()
        protocol = "rdma" if ib_device else "tcp"
        before = listening_sockets()
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, ib_device or "")
        if rc != 0:
            raise RuntimeError(f"Mooncake did not start on {hostname} over {protocol} (code {rc}).")
        # Mooncake (0.3.13) binds its handshake RPC port and its TCP data port to every interface, whatever
        # address it is given, and authenticates no peer: say where, so they can be firewalled.
        self.listening = sorted(listening_sockets() - before)
        wide = [a for a in self.listening if a.rsplit(":", 1)[0] in ("0.0.0.0", "[::]")]
        if wide:
            logger.warning(
                "Mooncake's transfer engine listens on %s (all interfaces, whatever --host says) and "
                "lets any peer that reaches it read and write the registered KV and state pools: keep "
                "these ports on an isolated network (docs/disaggregation.md).",
                ", ".join(wide),
            )
        self.session_id = f"{hostname}:{self.engine.get_rpc_port()}"
        regions = [(p, n) for p, n in regions if n > 0]
        if regions:
            rc = self.engine.batch_register_memory([p for p, _ in regions], [n for _, n in regions])
            if rc != 0:
                raise RuntimeError(
                    f"Mooncake could not register the pools ({len(regions)} buffers, code {rc})."
                )
        logger.info(
            "Mooncake transfer engine up: session %s, %d buffers registered.", self.session_id, len(regions)
        )

    def write(self, session_id: str, descriptors: list[Descriptor]) -> None:
        for i in range(0, len(descriptors), MAX_DESCRIPTORS_PER_BATCH):
            batch = descriptors[i : i + MAX_DESCRIPTORS_PER_BATCH]
            rc = self.engine.batch_transfer_sync_write(
                session_id, [s for s, _, _ in batch], [d for _, d, _ in batch], [n for _, _, n in batch]
            )
            if rc != 0:
                raise TransferError(
                    f"Mooncake write of {len(batch)} blocks to {session_id} failed (code {rc})."
                )

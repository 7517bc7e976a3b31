"""Train the demo model's MTP layer (`--speculative-algorithm NEXTN` drafts), the base model frozen.

    python -m sglang.tools.train_tiny_model --mtp-only --out python/sglang/tools/data/tiny-qwen3-next-demo

The layer is the published one (`srt/models/qwen3_next_mtp.py`): at position t it takes the embedding of
token t + 1 and the base model's final hidden state h_t, and the base's LM head on its output predicts
token t + 2. It is built from transformers' Qwen3-Next decoder layer (one full-attention layer with the
base's MoE shape), initialised from the base's last full-attention layer, and trained on the base's
training text with next-next-token cross-entropy; the base's weights never change (its tensors are
written back as they were read). Written as `mtp.*` tensors beside them, `num_nextn_predict_layers: 1` in
config.json and an `mtp` entry in training.json.
"""

from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path

import torch
from torch import nn

MTP_DEFAULTS = {"mtp_steps": 300, "mtp_batch_size": 8, "mtp_lr": 2e-3, "mtp_windows": 384}
# Shorter windows than the base's (256): the layer learns from one position back at most what a longer
# context adds little to, and each step costs half (a few minutes on 2 busy cores in all).
MTP_SEQ_LEN = 128


class TrainableMTP(nn.Module):
    """The MTP layer with the published parameter names (under `mtp.`)."""

    def __init__(self, base: nn.Module):
        super().__init__()
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

        config = copy.copy(base.config)
        config.layer_types = [*config.layer_types, "full_attention"]
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = Qwen3NextRMSNorm(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3NextRMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([Qwen3NextDecoderLayer(config, config.num_hidden_layers)])
        self.norm = Qwen3NextRMSNorm(hidden, eps=config.rms_norm_eps)
        with torch.no_grad():
            # Start from the base's last full-attention layer and its final norm; fc passes the hidden
            # state through with a little of the embedding, so training starts from "predict as the base".
            last = max(i for i, kind in enumerate(base.config.layer_types) if kind == "full_attention")
            self.layers[0].load_state_dict(base.model.layers[last].state_dict())
            self.norm.load_state_dict(base.model.norm.state_dict())
            self.fc.weight.zero_()
            self.fc.weight[:, hidden:] = torch.eye(hidden)
            self.fc.weight[:, :hidden] = 0.02 * torch.randn(hidden, hidden)

    def forward(self, base: nn.Module, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [B, S, vocab] at each position t from token t + 1 (`next_ids`) and h_t (`hidden`)."""
        embeds = base.model.embed_tokens(next_ids)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        positions = torch.arange(x.shape[1]).unsqueeze(0)
        rope = base.model.rotary_emb(x, positions)
        # (no mask: transformers' attention is causal where none is given)
        x = self.layers[0](x, position_embeddings=rope, attention_mask=None, position_ids=positions)
        return base.lm_head(self.norm(x))


def _windows(ids: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(ids) - length - 1, (n,), generator=gen)
    return torch.stack([ids[s : s + length] for s in starts.tolist()])


@torch.no_grad()
def _base_hidden(base: nn.Module, batch: torch.Tensor, seq_len: int, chunk: int = 16) -> torch.Tensor:
    """The base's final hidden states at the first seq_len positions of each window."""
    parts = [
        base.model(input_ids=batch[i : i + chunk, :seq_len]).last_hidden_state
        for i in range(0, len(batch), chunk)
    ]
    return torch.cat(parts)


def _mtp_loss(mtp: TrainableMTP, base: nn.Module, batch: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of token t + 2 at positions 0..S - 1 (`batch` holds S + 2 tokens, `hidden` S states)."""
    seq_len = hidden.shape[1]
    logits = mtp(base, batch[:, 1 : seq_len + 1], hidden)
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 2 : seq_len + 2].flatten())


def train_mtp(
    folder: Path,
    train_ids: torch.Tensor,
    held_ids: torch.Tensor,
    seq_len: int,
    steps: int,
    batch_size: int,
    lr: float,
    windows: int,
    seed: int,
) -> dict:
    """Train the MTP layer of the checkpoint in `folder` and write it there; returns the report entry.

    The frozen base's hidden states are computed once, for `windows` random training windows (the base's
    forward in transformers is most of the cost: ~0.4 s per window on 2 busy cores), and the layer trains
    on batches of them."""
    from safetensors.torch import load_file, save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    start = time.monotonic()
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)
    mtp = TrainableMTP(base)
    opt = torch.optim.AdamW(mtp.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            (s + 1) / warmup
            if s < warmup
            else 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))
        ),
    )
    gen = torch.Generator().manual_seed(seed)
    data = _windows(train_ids, windows, seq_len + 2, gen)
    hidden = _base_hidden(base, data, seq_len)
    loss_ema = None
    for _ in tqdm(range(steps), desc="training the MTP layer", unit="step"):
        pick = torch.randint(0, windows, (batch_size,), generator=gen)
        loss = _mtp_loss(mtp, base, data[pick], hidden[pick])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
    mtp.eval()
    with torch.no_grad():
        # Every held-out window (up to `windows` of them, evenly spread: a short test run evaluates few).
        n = (len(held_ids) - 2) // seq_len
        picked = sorted({i * n // min(n, windows) for i in range(min(n, windows))})
        held = [held_ids[i * seq_len : (i + 1) * seq_len + 2] for i in picked]
        held_batch = torch.stack(held)
        held_hidden = _base_hidden(base, held_batch, seq_len)
        held_loss = _mtp_loss(mtp, base, held_batch, held_hidden).item()

    path = folder / "model.safetensors"
    tensors = {k: v for k, v in load_file(path).items() if not k.startswith("mtp.")}
    tensors.update({f"mtp.{k}": v.detach().contiguous() for k, v in mtp.state_dict().items()})
    save_file(tensors, path, metadata={"format": "pt"})
    config_path = folder / "config.json"
    cfg = json.loads(config_path.read_text())
    cfg["num_nextn_predict_layers"] = 1
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return {
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "windows": windows,
        "parameters": sum(p.numel() for p in mtp.parameters()),
        "base_frozen": True,
        "final_train_loss_ema": round(loss_ema, 4),
        "held_out_loss_next_next_token": round(held_loss, 4),
        "minutes": round((time.monotonic() - start) / 60, 1),
    }

"""The MTP draft on the forward stream (`--speculative-algorithm EAGLE` / `NEXTN`): what runs beside the
target model's forwards. The scheduler side is `eagle_worker.py`.

After every target forward that commits tokens (a prefill chunk, a decode step, a verify), `MtpHook`
runs the MTP layer over the same positions, each with the token that follows it (the next prompt token,
or the token the forward sampled there), which writes the draft layer's KV at those positions (layer id
`num_hidden_layers` of the KV pool, in the request's own slots) and leaves, per request row, the MTP
output g at the last committed position (`DraftStash`: one hidden-size row per request row, all that is
kept between forwards). A verify's hook first applies rejection sampling to the drafted positions
(below), then finds on the device how many drafts each request accepted, so the MTP rows past them only
write KV slots the commit gives back.

`MtpDraftRunner.draft_steps` runs before a verify, for the drafting requests only: d_1 is taken from
q_1 = lm_head(g), then steps 2..k run the MTP layer at positions P, P + 1, ... (P: the request's newest
token), from (d_(j-1), g) of the step before, in the KV slots the verify has allocated for those
positions. How the drafts are taken (`Drafts.greedy`): a plan that fits a captured draft graph
(`mtp_graphs.py`, on a GPU), whatever its requests' sampling options, and an all-greedy plan take the
argmax at every step (greedy drafts); the eager loop of a plan with sampling requests (no graph fits: a
CPU server, a batch over the largest bucket) draws their drafts from q_j with the request's options, and
the distributions q_1..q_k then live from the draft steps to that verify's rejection sampling ([drafting
requests, k, vocab] float32, as the verify's own logits [positions, vocab]: activations, not a pool);
none is kept between verifies.

Rejection sampling (a sampling request's drafted positions, as upstream): draft d drawn from q is kept
with probability min(1, p(d) / q(d)), where p is the target's distribution with the request's options
(temperature, top-k, top-p, min-p: `truncated_probs`, the sampler's); else the position takes a token
drawn from norm(max(p - q, 0)), which is never d. Greedy drafts are the case q = one-hot(d), never built
(upstream EAGLE's target-only verification of topk-1 chains): d is kept with probability p(d), else the
token is drawn from p without d, renormalised; both rules leave each position's token distributed as p,
whatever drafted it. The position's token is then d exactly when it is accepted, so the scheduler's
commit (accept while the token equals the next draft, as NGRAM's) commits what rejection sampling
decides; the position after the last draft keeps the sampler's own draw from p. A request with a seed
draws its sampled drafts and its acceptance and resample uniforms from (seed, position), as the sampler
its tokens, so its tokens do not depend on the generator's state (what ran before it). Greedy requests
take the target's argmax at every position, as plain decoding does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sglang.srt.layers.logits_processor import scaled_log_softmax
from sglang.srt.layers.sampler import SampleOutput, inverse_cdf_sample, seeded_uniforms, truncated_probs
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode, SamplingBatchInfo
from sglang.srt.speculative.mtp_graphs import MtpDraftGraphs, MtpForwardGraphs
from sglang.srt.utils.host_tensors import host_int64

Agree = Callable[[torch.Tensor, ForwardBatch], torch.Tensor]


class MtpAttnBackend:
    """The batch backend the MTP layer sees: its own full-attention backend (own per-batch metadata) over
    the target's request table and KV pool."""

    def __init__(self, full_attn_backend: Any):
        self.full_attn_backend = full_attn_backend

    def forward(self, q, k, v, layer, fb: ForwardBatch) -> torch.Tensor:
        return self.full_attn_backend.forward(q, k, v, layer, fb)


def draft_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """The distribution a row samples from with its options (greedy rows: any; they take the argmax),
    normalised: rejection sampling compares p and q token by token, so a truncated row (which the
    sampler leaves unnormalised) is divided by what it kept."""
    temps = torch.where(info.temperatures > 0, info.temperatures, 1.0)
    if info.needs_truncation:
        kept = truncated_probs(logits, temps, info.top_ps, info.top_ks, info.min_ps, info.sort_width)
        return kept / kept.sum(dim=-1, keepdim=True)
    return torch.softmax(logits / temps[:, None], dim=-1)


# Salts of a seeded request's uniforms (`uniforms`), or'ed into the position the hash reads (positions stay
# below 2^29): each draw differs from the sampler's own at that position and from the others.
DRAFT_SALT, KEEP_SALT, RESAMPLE_SALT = 1 << 29, 2 << 29, 3 << 29


def uniforms(
    generator: torch.Generator, info: SamplingBatchInfo, positions: torch.Tensor, salt: int
) -> torch.Tensor:
    """A uniform per row: a seeded request's from (seed, position | salt), the sampler's hash; the others'
    from `generator` (the draft runner's; one draw per row, seeded rows included)."""
    fresh = torch.rand(positions.shape[0], generator=generator, device=positions.device)
    if info.has_seed is None:
        return fresh
    return torch.where(info.has_seed, seeded_uniforms(info.seed_bits, positions | salt), fresh)


@dataclass
class Drafts:
    """What `draft_steps` gives a verify: each planned request's k drafts (host lists) and how they were
    taken. `greedy`: every chain is the MTP layer's argmax at each step (a draft graph served the plan, or
    every request is greedy), and the verify's rejection sampling takes q = one-hot(d); else `probs`
    holds the distributions the sampling requests' drafts were drawn from, [bs, k, vocab] on the device."""

    chains: list[list[int]]
    probs: torch.Tensor | None
    greedy: bool

    def __post_init__(self):
        if self.greedy != (self.probs is None):
            raise ValueError("sampled drafts come with their distributions, greedy drafts without")


@dataclass
class DraftStash:
    """Per request row (`req_pool_idx`): the MTP output g at its last committed position, which the
    first draft and its distribution come from (`draft_steps`)."""

    hidden: torch.Tensor  # [rows, hidden]


class MtpDraftRunner:
    def __init__(self, model_runner: Any):
        self.runner = model_runner
        target = model_runner.model
        args = model_runner.server_args
        self.attn = MtpAttnBackend(model_runner._full_attn_backend())
        rows = model_runner.req_to_token_pool.req_to_token.shape[0]
        device, hidden = target.lm_head.weight.device, target.config.hidden_size
        self.stash = DraftStash(torch.zeros(rows, hidden, dtype=target.lm_head.weight.dtype, device=device))
        self.generator = torch.Generator(device=device).manual_seed(args.random_seed + 1)
        # All-greedy draft loops, and the MTP layer after a target forward that replayed a graph, replayed
        # from CUDA graphs beside the target's (`mtp_graphs.py`).
        self.graphs: MtpDraftGraphs | None = None
        self.forward_graphs: MtpForwardGraphs | None = None
        self.loops = 0  # draft loops run (`graphs.replays` of them by a graph)
        graph_runner = getattr(model_runner, "graph_runner", None)
        if graph_runner is not None:
            self.use_graphs(graph_runner)

    # The MTP layer (loaded with the target: `draft_layers.load_draft_layers`) and the target's embedding
    # and lm_head as the runner serves them now (/update_weights_from_disk swaps them together).
    @property
    def mtp(self) -> torch.nn.Module:
        return self.runner.draft_model

    @property
    def embed(self) -> torch.nn.Module:
        return self.runner.model.model.embed_tokens

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.runner.model.lm_head

    def use_graphs(self, graph_runner: Any) -> None:
        """Capture the draft loop's graphs at `graph_runner`'s sizes up to the verify rows, and the MTP
        layer's after each of its graphs (its `use_graphs`), captured again and released with its own."""
        started = time.monotonic()
        steps = self.runner.server_args.speculative_num_steps
        sizes = [bs for bs in graph_runner.bs_list if bs <= self.runner.mamba_pool.verify_shape[0]]
        if sizes:
            self.graphs = MtpDraftGraphs(self, sizes, steps, graph_runner.use_graphs)
            graph_runner.add_companion(self.graphs)
        self.forward_graphs = MtpForwardGraphs(self, graph_runner)
        graph_runner.add_companion(self.forward_graphs)
        times = getattr(self.runner, "startup_times", {})
        if "cuda_graph" in times:  # (the start's capture time: the target's graphs and these)
            times["cuda_graph"] += time.monotonic() - started

    # ---- the MTP layer ----------------------------------------------------------------------------

    def _run(self, fb: ForwardBatch, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layer over `fb`'s positions (its own attention metadata), `tokens` the next tokens."""
        target_backend, fb.attn_backend = fb.attn_backend, self.attn
        try:
            self.attn.full_attn_backend.init_forward_metadata(fb)
            return self.mtp(self.embed(tokens), fb.positions, hidden.to(self.stash.hidden.dtype), fb)
        finally:
            fb.attn_backend = target_backend

    def _run_after(self, fb: ForwardBatch, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """`_run` after a target forward: from its CUDA graph where the target's graph served `fb`."""
        graphs = self.forward_graphs
        if graphs is not None and graphs.can_run(fb):
            return graphs.replay(fb, tokens)
        return self._run(fb, tokens, hidden)

    def _logits(self, g: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits on every rank: under tensor parallelism the vocab-parallel head
        gathers the ranks' blocks (`ParallelLMHead`), so every rank drafts the same tokens."""
        return self.lm_head(g).float()

    def _greedy(self, g: torch.Tensor) -> torch.Tensor:
        return self._logits(g).max(dim=-1).indices

    def _sample(
        self, logits: torch.Tensor, info: SamplingBatchInfo, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(draft ids for the tokens at `positions`, their distributions or None where every row is
        greedy)."""
        greedy = logits.max(dim=-1).indices
        if info.is_all_greedy:
            return greedy, None
        probs = draft_probs(logits, info)
        u = uniforms(self.generator, info, positions, DRAFT_SALT)
        return torch.where(info.temperatures > 0, inverse_cdf_sample(probs, u), greedy), probs

    def _stash(self, rows: torch.Tensor, g: torch.Tensor) -> None:
        self.stash.hidden[rows] = g

    # ---- before a verify: the k drafts ------------------------------------------------------------

    def draft_steps(self, plan: DraftPlan) -> Drafts:
        """Each planned request's k drafts. Runs on the forward stream; a plan that fits a captured size
        replays its graph (`mtp_graphs.py`: greedy drafts, whatever the requests' sampling options), else
        the loop runs eagerly (sampled drafts where some request samples)."""
        runner, stash = self.runner, self.stash
        self.loops += 1
        with torch.inference_mode():
            if self.graphs is not None and self.graphs.can_run(plan):
                return Drafts(self.graphs.replay(plan), None, greedy=True)
            device = stash.hidden.device
            rows = host_int64(plan.rows).to(device)
            # Uploaded once for the k steps (each step's batch leaves an info on the device as it is).
            info = plan.sampling_info.map_tensors(lambda t: t.to(device, non_blocking=True))
            index = host_int64(plan.prefix_lens).to(device) + 1  # d_1's position (d_j's: + j - 1)
            g = stash.hidden[rows]
            tokens, first_probs = self._sample(self._logits(g), info, index)
            drafts = [tokens]
            probs = None if first_probs is None else [first_probs]
            for j in range(plan.steps - 1):
                fb = ForwardBatch.create(
                    ForwardMode.DECODE,
                    input_ids=[0] * len(plan.rows),
                    req_pool_indices=plan.rows,
                    seq_lens=[p + j + 1 for p in plan.prefix_lens],
                    out_cache_loc=[slots[j] for slots in plan.slots],
                    mamba_pool_indices=[0] * len(plan.rows),
                    req_to_token_writes=plan.writes if j == 0 else (),
                    sampling_info=info,
                )
                fb.to_device(runner.device)
                fb.input_ids = tokens
                runner._rewrite_req_to_token(fb)
                runner.write_new_token_slots(fb)
                g = self._run(fb, tokens, g)
                tokens, step_probs = self._sample(self._logits(g), info, index + (j + 1))
                drafts.append(tokens)
                if probs is not None:
                    probs.append(step_probs)
            host = torch.stack(drafts, dim=1).tolist()
            if probs is None:
                return Drafts(host, None, greedy=True)
            return Drafts(host, torch.stack(probs, dim=1), greedy=False)


@dataclass
class DraftPlan:
    """The draft steps of a verify, per drafting request: its row, KV length P (its newest token's
    position), the verify's KV slots of positions P.., and the request table rewrites the verify makes."""

    rows: list[int]
    prefix_lens: list[int]
    slots: list[list[int]]
    writes: list[tuple[int, int, Any]]
    sampling_info: SamplingBatchInfo
    steps: int


@dataclass
class MtpHook:
    """`ForwardBatch.spec` of a target forward: after sampling (`ModelRunner.forward_batch_generation`),
    rejection sampling for a verify's drafted positions, the TP ranks' agreement on the tokens, and the
    MTP layer over the forward's positions.

    `next_ids`: per token of the batch the token after it where the host knows it (prompt), -1 where it is
    the request's sampled token (extend; a decode and a verify use their own sampled tokens). A verify
    carries its widths, each request's drafts count and how the drafts were taken (`Drafts`)."""

    runner: MtpDraftRunner
    next_ids: list[int] | None = None
    completes: list[bool] | None = None  # extend: the rows whose request's last position ran
    widths: list[int] | None = None  # verify: positions per request
    num_drafts: list[int] | None = None  # verify: drafts per request (0 or k)
    drafts: Drafts | None = None  # verify: how its drafts were taken (`Drafts.greedy`, else `.probs`)

    def after_sampling(
        self, fb: ForwardBatch, hidden: torch.Tensor, logits: torch.Tensor, sample: SampleOutput, agree: Agree
    ) -> SampleOutput:
        """`agree`: the TP ranks' agreement on the tokens (`model_runner.agree_on_tokens`), applied to the
        tokens as sampled (a verify's after its rejection sampling) and before anything reads them: the
        MTP layer, the accepted counts and the stash rows are then the same on every rank."""
        mode = fb.forward_mode
        if mode.is_target_verify():
            return self._verify(fb, hidden, logits, sample, agree)
        ids = sample.next_token_ids = agree(sample.next_token_ids, fb)
        if mode.is_decode():
            self.runner._stash(fb.req_pool_indices, self.runner._run_after(fb, ids, hidden))
            return sample
        # An extend: the next tokens, the request's sampled one after its last position.
        known = host_int64(self.next_ids).to(ids.device)
        owner = torch.repeat_interleave(torch.arange(fb.batch_size, device=ids.device), fb.extend_seq_lens)
        g = self.runner._run(fb, torch.where(known >= 0, known, ids[owner]), hidden)
        done = [i for i, c in enumerate(self.completes) if c]
        if done:
            at = host_int64(done).to(ids.device)
            self.runner._stash(fb.req_pool_indices[at], g[fb.extend_last_loc[at]])
        return sample

    def _verify(
        self, fb: ForwardBatch, hidden: torch.Tensor, logits: torch.Tensor, sample: SampleOutput, agree: Agree
    ) -> SampleOutput:
        device = logits.device
        info = fb.sampling_info  # (one row per position)
        starts = [0]
        for w in self.widths[:-1]:
            starts.append(starts[-1] + w)
        drafted = [i for i, n in enumerate(self.num_drafts) if n]
        k = max(self.num_drafts, default=0)
        ids = sample.next_token_ids
        if drafted and not info.is_all_greedy:
            ids = self._reject(fb, logits, ids, [starts[i] for i in drafted], k)
            sample.next_token_ids = ids
            if sample.next_token_logprobs is not None:
                lp = scaled_log_softmax(logits.float(), info.temperatures)
                sample.next_token_logprobs = lp.gather(1, ids[:, None])[:, 0]
        ids = sample.next_token_ids = agree(ids, fb)
        # Drafts accepted per request: leading positions whose token is the next input (a draft).
        accepted = torch.zeros(len(self.widths), dtype=torch.int64, device=device)
        if drafted:
            grid = host_int64([starts[i] + t for i in drafted for t in range(k)]).to(device).view(-1, k)
            match = (ids[grid] == fb.input_ids[grid + 1]).long()
            accepted[host_int64(drafted).to(device)] = match.cumprod(dim=1).sum(dim=1)
        g = self.runner._run_after(fb, ids, hidden)
        last = host_int64(starts).to(device) + accepted
        self.runner._stash(fb.req_pool_indices, g[last])
        return sample

    @staticmethod
    def _one_hot_rule(
        p: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rejection sampling's (keep, residual) for greedy drafts, q = one-hot(d): d kept with probability
        p(d) (never where p(d) = 0), else drawn from max(p - q, 0) = p without d (unnormalised: the
        inverse-CDF draw scales by the total); p(d) = 1 leaves nothing to draw from, and d is then kept."""
        keep = u < p.gather(1, drafts[:, None])[:, 0]
        return keep, p.scatter(1, drafts[:, None], 0.0)

    def _reject(self, fb: ForwardBatch, logits: torch.Tensor, ids: torch.Tensor, starts: list[int], k: int):
        """The drafted positions' tokens under rejection sampling (module docstring)."""
        device = logits.device
        rows = host_int64([s + t for s in starts for t in range(k)]).to(device)
        info = fb.sampling_info.map_tensors(lambda t: t.index_select(0, rows))
        p = draft_probs(logits.float()[rows], info)
        drafts = fb.input_ids[rows + 1]
        index = fb.positions[rows] + 1  # (the drafted token's position, as the sampler's)
        u = uniforms(self.runner.generator, info, index, KEEP_SALT)
        if self.drafts is None:
            raise RuntimeError("a verify of drafted positions needs how they were drafted (MtpHook.drafts)")
        if self.drafts.greedy:
            keep, residual = self._one_hot_rule(p, drafts, u)
        else:
            q = self.drafts.probs.reshape(len(rows), -1)
            keep = u * q.gather(1, drafts[:, None])[:, 0] <= p.gather(1, drafts[:, None])[:, 0]
            residual = (p - q).clamp_(min=0)
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, p, residual)
        resampled = inverse_cdf_sample(residual, uniforms(self.runner.generator, info, index, RESAMPLE_SALT))
        chosen = torch.where(keep, drafts, resampled)
        sampling = info.temperatures > 0
        out = ids.clone()
        out[rows] = torch.where(sampling, chosen, ids[rows])
        return out

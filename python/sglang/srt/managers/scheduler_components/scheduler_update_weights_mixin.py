"""The scheduler's weight and memory operations, a part of the `Scheduler` class kept in its own file
(upstream's `scheduler_update_weights_mixin.py`): /update_weights_from_disk's swap, the in-place writes
of /update_weights_from_tensor and /update_weights_from_distributed, and /release_memory_occupation and
/resume_memory_occupation. Each runs between two steps, after the batches in flight; requests that
hold KV and state computed by the current weights refuse what would strand them. It does not import
`scheduler.py`."""

from __future__ import annotations

import logging

from sglang.srt.managers.io_struct import (
    DestroyWeightsUpdateGroupReqInput,
    DestroyWeightsUpdateGroupReqOutput,
    GetWeightsByNameReqInput,
    GetWeightsByNameReqOutput,
    InitWeightsUpdateGroupReqInput,
    InitWeightsUpdateGroupReqOutput,
    ReleaseMemoryOccupationReqInput,
    ReleaseMemoryOccupationReqOutput,
    ResumeMemoryOccupationReqInput,
    ResumeMemoryOccupationReqOutput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromDistributedReqOutput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsFromTensorReqOutput,
)
from sglang.srt.managers.scheduler_components.weight_update import RankVote, named_tensors_of, payload_of_rank
from sglang.srt.model_executor.memory_occupation import KV_CACHE, WEIGHTS
from sglang.srt.model_executor.memory_occupation import TAGS as MEMORY_TAGS

logger = logging.getLogger(__name__)

MEMORY_RELEASED = "The weights were not updated: memory is released (/resume_memory_occupation first)."


class SchedulerUpdateWeightsMixin:
    def process_weights_message(self, obj: object) -> bool:
        """Start or answer a weight or memory call; False where `obj` is none."""
        if isinstance(obj, UpdateWeightFromDiskReqInput):
            # (while memory is released a second model would load into what the trainer holds)
            released = self.model_runner.memory_occupation.released
            refused = MEMORY_RELEASED if released else self.weight_update.start(obj)
            if refused is not None:
                self.send_to_tokenizer(UpdateWeightFromDiskReqOutput(False, refused))
        elif isinstance(obj, UpdateWeightsFromTensorReqInput):
            self.update_weights_from_tensor(obj)
        elif isinstance(obj, InitWeightsUpdateGroupReqInput):
            tp_rank = self.tp.rank.tp_rank if self.tp is not None else 0  # (upstream: rank_offset + tp_rank)
            sizes = self.server_args.tp_size, self.server_args.dp_size
            refused = self.weights_groups.start_init(obj, tp_rank, *sizes)
            if refused is not None:
                self.send_to_tokenizer(InitWeightsUpdateGroupReqOutput(False, refused))
        elif isinstance(obj, UpdateWeightsFromDistributedReqInput):
            refused = self.weights_groups.start_receive(obj)
            if refused is not None:
                self.send_to_tokenizer(UpdateWeightsFromDistributedReqOutput(False, refused))
        elif isinstance(obj, DestroyWeightsUpdateGroupReqInput):
            refused = self.weights_groups.destroy(obj.group_name)
            message = refused or f"Left the weight-update group {obj.group_name!r}."
            self.send_to_tokenizer(DestroyWeightsUpdateGroupReqOutput(refused is None, message))
        elif isinstance(obj, GetWeightsByNameReqInput):
            self.get_weights_by_name(obj)
        elif isinstance(obj, ReleaseMemoryOccupationReqInput):
            self.release_memory_occupation(obj)
        elif isinstance(obj, ResumeMemoryOccupationReqInput):
            self.resume_memory_occupation(obj)
        else:
            return False
        return True

    def finish_weight_update(self) -> None:
        """Swap in the model a /update_weights_from_disk loaded (`WeightUpdate`), once it has, between
        two steps; then empty the prefix cache, whose KV and states the old weights computed (unless
        the request said flush_cache false). Requests that hold such state (paused in place, or still
        running) make a flushing update fail, with the old weights kept: they would go on from it."""
        done = self.weight_update.poll()
        if done is None:
            return
        req, model, error = done
        self._drain()  # (on every rank before the vote, its load failed or not)
        if model is not None and self.model_runner.memory_occupation.released:
            # (released while it loaded: the new model's graphs would be captured on freed pools)
            error = MEMORY_RELEASED
        elif model is not None:
            error = self._weights_held(req.flush_cache)
        error = self._agree(error or None)  # (a rank whose load failed: every rank keeps the old model)
        if error:
            self.send_to_tokenizer(UpdateWeightFromDiskReqOutput(False, error))
            return
        self.model_runner.swap_model(model)
        self._weights_changed(req.weight_version, req.model_path)
        if req.flush_cache:
            self._empty_tree()
        paused = len(self.waiting_queue) + len(self.running) if self.generation_pause.paused else 0
        logger.info("Serving the weights of %s.", req.model_path)
        message = "Succeeded to update model weights."
        self.send_to_tokenizer(UpdateWeightFromDiskReqOutput(True, message, paused))

    def update_weights_from_tensor(self, req: UpdateWeightsFromTensorReqInput) -> None:
        """/update_weights_from_tensor: this rank's payload's tensors (`payload_of_rank`,
        `named_tensors_of`), written in place on every rank or on none (`RankVote`)."""
        vote = RankVote(self._agree)
        self._drain()  # (on every rank before the vote, a rank whose payload fails too)
        try:
            rank, size = (self.tp.rank.tp_rank, self.tp.rank.tp_size) if self.tp is not None else (0, 1)
            payload = payload_of_rank(req.serialized_named_tensors, rank, size, self.dp_rank, req.trusted)
            named = named_tensors_of(payload, req.trusted, req.load_format)
        except Exception as e:  # noqa: BLE001 - any malformed payload is the client's, told to it
            message = vote.outcome(_not_updated(e))
            self.send_to_tokenizer(UpdateWeightsFromTensorReqOutput(False, message))
            return
        success, message = self.write_weights(named, req.load_format, req.flush_cache, vote, req.weight_version)
        self.send_to_tokenizer(UpdateWeightsFromTensorReqOutput(success, message))

    def finish_weights_group_op(self) -> None:
        """Reply to a weight-update group operation (`WeightsUpdateGroups`) once it has ended: a group
        joined, or weights received, which are then written in place between two steps."""
        done = self.weights_groups.poll(None if self.tp is None else self.tp.all_true)
        if done is None:
            return
        req, named, error = done
        self._drain()  # (on every rank before the vote, a rank whose join or receive failed too)
        if isinstance(req, InitWeightsUpdateGroupReqInput):
            error = self._agree(error or None)  # (under TP: every rank joined, or none stays in the group)
            if error and req.group_name in self.weights_groups.groups:
                self.weights_groups.destroy(req.group_name)
            message = f"The weight-update group was not joined: {error}." if error else "Succeeded to join."
            self.send_to_tokenizer(InitWeightsUpdateGroupReqOutput(not error, message))
            return
        if error:  # (this rank's vote: the others vote in `write_weights`)
            success, message = False, RankVote(self._agree).outcome(_not_updated(error))
        else:
            vote = RankVote(self._agree)
            success, message = self.write_weights(named, None, req.flush_cache, vote, req.weight_version)
        self.send_to_tokenizer(UpdateWeightsFromDistributedReqOutput(success, message))

    def write_weights(
        self, named: list, load_format: str | None, flush_cache: bool, vote: RankVote, version: str | None = None
    ) -> tuple[bool, str]:
        """Write (name, tensor) pairs into the weights in place (`ModelRunner.update_weights_from_tensor`:
        all or none, on every rank or none: `vote`) between two steps, then empty the prefix cache (as
        `finish_weight_update`, whose refusals it shares): (success, message)."""
        error = self._weights_held(flush_cache)
        if error is not None:
            return False, vote.outcome(error)
        try:
            ignored = self.model_runner.update_weights_from_tensor(named, load_format, vote.before_copy)
        except Exception as e:  # noqa: BLE001 - a tensor that does not fit, however it fails
            # Past the vote (every rank voted to copy) the copies may have begun: every rank reaches this or
            # the success below, and the weights are fingerprinted again on all (a collective under TP).
            copied = vote.cast and not vote.result
            message = vote.outcome(_not_updated(e))
            if copied:
                self._weights_changed(None)
            return False, message
        error = vote.outcome(None)  # (votes here where the write copied nothing: every rank votes once)
        if error is not None:
            return False, error
        self._weights_changed(version)
        if flush_cache:
            self._empty_tree()
        message = f"Succeeded to update {len(named) - len(ignored)} weight tensor(s) in place."
        if ignored:
            shown = ", ".join(ignored[:5]) + (" ..." if len(ignored) > 5 else "")
            message += f" The model has no parameter for {len(ignored)} of them, ignored: {shown}."
            logger.warning("A weight update ignored %d tensor(s) with no parameter: %s", len(ignored), shown)
        return True, message

    def _weights_changed(self, weight_version: str | None, model_path: str | None = None) -> None:
        """The prefix cache's disk tier (if any) stops serving entries of the old weights; a PD server
        fingerprints the new ones, which its pair checks with every transfer (named by the update's
        weight_version and, from disk, model_path)."""
        self.tree_cache.weights_changed()
        if weight_version is not None:
            self.server_args.weight_version = weight_version
        if self.disagg is not None:  # (in full after a load from disk; else the tensors written only)
            self.disagg.weights_changed(model_path, full=model_path is not None)

    def release_memory_occupation(self, req: ReleaseMemoryOccupationReqInput) -> None:
        """Free the memory of `req.tags` (`MemoryOccupation`), with no request running or waiting (as
        upstream asserts); the prefix cache is emptied with the pools, and new requests wait until
        everything is resumed (the tokenizer manager holds them; one that slipped through waits here).
        Without --enable-memory-saver the memory stays, as upstream's does without it."""
        tags = req.tags or list(MEMORY_TAGS)  # (upstream's clients send None for all)
        error = None
        if self._holding_requests(waiting=True):
            n = len(self.running) + len(self.waiting_queue) + (self.chunked_req is not None)
            error = f"Nothing was released: {n} request(s) are running or waiting (abort them first)."
        elif KV_CACHE in tags and self.disagg is not None:
            error = "Nothing was released: with --disaggregation-mode the transfer engine holds the KV cache."
        memory = self.model_runner.memory_occupation
        if error is None and KV_CACHE in tags:
            self._empty_tree()
        if error is None and not self.server_args.enable_memory_saver:
            message = "Nothing was released: start the server with --enable-memory-saver."
        elif error is None:
            before = set(memory.released)
            try:
                memory.release(tags)
                message = f"Released the memory of {', '.join(tags)}."
            except Exception as e:  # noqa: BLE001 - no host memory for the copy, say
                now = ", ".join(sorted(memory.released)) or "nothing"
                error = f"Releasing stopped: {str(e).strip() or type(e).__name__} (released now: {now})."
            error = self._agree(error)
            if error is not None and memory.released - before:
                # (another rank failed: this one takes back what it released, so all ranks run alike)
                memory.resume(sorted(memory.released - before))
        logger.info(error or message)
        reply = ReleaseMemoryOccupationReqOutput(error is None, error or message, sorted(memory.released))
        self.send_to_tokenizer(reply)

    def resume_memory_occupation(self, req: ResumeMemoryOccupationReqInput) -> None:
        memory, tags = self.model_runner.memory_occupation, req.tags or list(MEMORY_TAGS)
        before = set(memory.released)
        error = None
        try:
            memory.resume(tags)
        except Exception as e:  # noqa: BLE001 - out of memory (the trainer still holds it): still released
            error = f"Not resumed: {str(e).strip() or type(e).__name__}"
        error = self._agree(error)
        if error is not None and before - memory.released:
            memory.release(sorted(before - memory.released))  # (another rank failed: released on all)
        if error is None and WEIGHTS in before - memory.released and self.disagg is not None:
            self.disagg.weights_changed(full=True)  # (their values: the host copy's, or none yet)
        left = sorted(memory.released)
        message = f"Resumed {', '.join(tags)}" + (f"; {', '.join(left)} still released." if left else ".")
        success, message = error is None, error or message
        logger.info(message)
        self.send_to_tokenizer(ResumeMemoryOccupationReqOutput(success, message, sorted(memory.released)))

    def get_weights_by_name(self, req: GetWeightsByNameReqInput) -> None:
        """Under TP the parameter is gathered from every rank (a collective on the model's group), so
        the batches in flight finish first: their forwards' collectives must not interleave with it."""
        self._drain()
        try:
            values = self.model_runner.get_weights_by_name(req.name, req.truncate_size)
            reply = GetWeightsByNameReqOutput(values)
        except Exception as e:  # noqa: BLE001 - a name it lacks, too many values, no memory: told
            reply = GetWeightsByNameReqOutput(None, str(e).strip() or type(e).__name__)
        self.send_to_tokenizer(reply)

    def _drain(self) -> None:
        """Process every batch in flight. Each weight operation does so first on every rank, before any
        vote: a rank that voted with a batch still in flight (its own step failed early) would keep the
        requests that batch finished running, build another next batch than the others, and their
        model collectives would then differ (review finding 2 of issue 54)."""
        while self.in_flight:
            self.process_oldest()

    def _agree(self, error: str | None) -> str | None:
        """Every rank's outcome of a call that may fail on some ranks only (`TpBroadcast.agree_outcome`)."""
        return error if self.tp is None else self.tp.agree_outcome(error)

    def _weights_held(self, flush_cache: bool) -> str | None:
        """Why the weights may not change now, or None: first the batches in flight finish (they read the
        weights); then requests that hold KV and state the current weights computed (running, or paused
        in place) refuse a flushing update, which would leave them going on from it."""
        held = self._holding_requests(waiting=False)  # (first the batches in flight: they read the weights)
        if WEIGHTS in self.model_runner.memory_occupation.released:
            return "The weights were not updated: their memory is released (resume the weights first)."
        if flush_cache and held:
            n = len(self.running) + (self.chunked_req is not None)
            return (
                f"The weights were not updated: {n or 'PD'} request(s) hold KV and state the current "
                "weights computed (pause with mode retract or abort first, or send flush_cache false)."
            )
        return None

    def _holding_requests(self, waiting: bool) -> bool:
        """Whether requests hold KV and state (running, a chunked prefill, a PD transfer; with `waiting`,
        queued ones too), once the batches in flight have finished."""
        self._drain()
        pd_busy = self.disagg is not None and self.disagg.busy()
        queued = waiting and bool(self.waiting_queue)
        return bool(self.running or self.chunked_req is not None or pd_busy or queued)


def _not_updated(why: object) -> str:
    return f"The weights were not updated: {str(why).strip().rstrip('.')}."

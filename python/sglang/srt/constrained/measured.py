"""Which requests' finish checks depend on facts of one tensor-parallel rank alone, so that each rank
measures them and the ranks agree before deciding (`managers/finish_checker.py`'s module docstring).
Here, apart from the finish checker, so that the decode rows (`scheduler_components/decode_rows.py`)
read the same rule without importing the checker."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang.srt.constrained.stop_strings import stops_charged

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


def is_measured(req: Req) -> bool:
    """Whether `req`'s finish check depends on facts of this rank alone, so it is measured, then agreed
    (the module's docstring): it has a grammar, stop regexes, a custom logit processor or a stop list
    that is charged (`stops_charged`). Read from what every rank holds alike (a processor's failure is
    this rank's own: it is what is agreed). The one owner of the rule: `check_finished`, `precheck`'s
    row filter and `DecodeRows.measured_rows` read it here."""
    sp = req.sampling_params
    return (
        req.grammar is not None
        or req.custom_logit_processor is not None
        or bool(sp.stop_regex)
        or (bool(sp.stop) and stops_charged(sp.stop))
    )

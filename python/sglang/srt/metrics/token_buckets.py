"""Upstream's bucket rules of the token histograms (`--prompt-tokens-buckets`,
`--generation-tokens-buckets`): `default` (upstream's bounds, 100 to 1,100,000 tokens); `tse MIDDLE BASE
COUNT`, two-sided exponential bounds around MIDDLE (MIDDLE +- BASE**i for i = 1 .. ceil(COUNT / 2), none
below 0, and MIDDLE: `tse 1000 2 8` gives 984, 992, 996, 998, 1000, 1002, 1004, 1008, 1016); `custom B1
B2 ...` the bounds given, sorted, each once (upstream's rules)."""

from __future__ import annotations

import math

MAX_TSE_COUNT = 1000  # (a histogram of more bounds than this costs every scrape)
# Upstream's default bounds for both histograms (tokens).
DEFAULT_TOKEN_BUCKETS = (
    100, 300, 500, 700, 1000, 1500, 2000, 3000, 4000, 5000, 6000, 7000, 8000, 9000, 10000, 12500, 15000,
    17500, 20000, 22500, 25000, 27500, 30000, 35000, 40000, 60000, 80000, 100000, 200000, 300000, 400000,
    600000, 800000, 1000000, 1100000,
)  # fmt: skip


def token_buckets(rule: list[str] | None, flag: str) -> tuple[float, ...]:
    """The bounds `rule` names (None: the default); a ValueError naming `flag` for a rule that is not one."""
    if not rule or rule == ["default"]:
        return tuple(float(b) for b in DEFAULT_TOKEN_BUCKETS)
    kind, args = rule[0], rule[1:]
    try:
        values = [float(a) for a in args]
    except ValueError:
        raise ValueError(f"{flag} {kind}: its values must be numbers, got {' '.join(args)}.") from None
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{flag} {kind}: its values must be finite, got {' '.join(args)}.")
    if kind == "tse":
        if (
            len(values) != 3
            or values[1] <= 1
            or not 1 <= values[2] <= MAX_TSE_COUNT
            or values[2] != int(values[2])
        ):
            raise ValueError(
                f"{flag} tse takes MIDDLE BASE COUNT (BASE above 1, COUNT an integer from 1 to {MAX_TSE_COUNT})."
            )
        middle, base, count = values[0], values[1], int(values[2])
        bounds = {middle}
        for i in range(1, math.ceil(count / 2) + 1):  # (upstream's: ceil(COUNT / 2) each side, none below 0)
            try:
                distance = base**i
            except OverflowError:
                raise ValueError(f"{flag} tse {' '.join(args)}: BASE ** {i} is too large.") from None
            bounds |= {middle + distance, max(0.0, middle - distance)}
        if not all(math.isfinite(b) for b in bounds):
            raise ValueError(f"{flag} tse {' '.join(args)}: its bounds are too large.")
        return tuple(sorted(bounds))
    if kind == "custom":
        if not values:
            raise ValueError(f"{flag} custom takes one bound or more.")
        return tuple(sorted(set(values)))  # (upstream's: sorted, each once)
    raise ValueError(f"{flag} takes default, tse MIDDLE BASE COUNT or custom B1 B2 ..., got {rule[0]!r}.")

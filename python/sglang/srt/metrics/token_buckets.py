"""Upstream's bucket rules of the token histograms (`--prompt-tokens-buckets`,
`--generation-tokens-buckets`): `default` (upstream's bounds, 100 to 1,100,000 tokens); `tse MIDDLE BASE
COUNT`, two-sided exponential bounds around MIDDLE (MIDDLE +- BASE**i for i = 1 .. COUNT // 2, and MIDDLE:
`tse 1000 2 8` gives 984, 992, 996, 998, 1000, 1002, 1004, 1008, 1016); `custom B1 B2 ...` the bounds given."""

from __future__ import annotations

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
    if kind == "tse":
        if len(values) != 3 or values[1] <= 1 or values[2] < 2 or values[2] != int(values[2]):
            raise ValueError(
                f"{flag} tse takes MIDDLE BASE COUNT (BASE above 1, COUNT an integer of 2 or more)."
            )
        middle, base, count = values[0], values[1], int(values[2])
        offsets = [base**i for i in range(1, count // 2 + 1)]
        bounds = sorted({middle, *(middle - d for d in offsets), *(middle + d for d in offsets)})
        if bounds[0] < 0:
            raise ValueError(
                f"{flag} tse {' '.join(args)}: its lowest bound {bounds[0]:g} is below 0 tokens."
            )
        return tuple(bounds)
    if kind == "custom":
        if not values or any(v < 0 for v in values) or sorted(set(values)) != values:
            raise ValueError(f"{flag} custom takes bounds of 0 or more in ascending order, each once.")
        return tuple(values)
    raise ValueError(f"{flag} takes default, tse MIDDLE BASE COUNT or custom B1 B2 ..., got {rule[0]!r}.")

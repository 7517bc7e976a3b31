"""Chat-answer parsers the server options name (`--reasoning-parser`), at upstream's module paths."""

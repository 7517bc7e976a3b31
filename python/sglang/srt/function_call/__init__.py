"""`--tool-call-parser`'s parsers, at upstream's module path."""

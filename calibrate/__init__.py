"""Corpus readers and replay that count which experts a user's traffic routes to."""

"""Compaction: a persistent summary up to a real message id, and the context built from it."""

SERVICE_NAME = "compaction"

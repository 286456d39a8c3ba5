"""Handoff-read: the read-only HandoffRead tool over a merged session's sealed package."""

SERVICE_NAME = "handoff-read"

"""Transcript: sessions, messages, attachments, execution claims and the session events outbox."""

SERVICE_NAME = "transcript"

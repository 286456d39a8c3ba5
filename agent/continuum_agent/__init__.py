"""The reference agent runtime: a user's turn as a client of transcript and compaction only."""

SERVICE_NAME = "agent"

"""Merge: several idle sessions handed to a new one through a sealed package and a structured handoff."""

SERVICE_NAME = "merge"

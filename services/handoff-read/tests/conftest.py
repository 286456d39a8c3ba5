"""Handoff-read tests read real merge packages and talk to real transcript and merge servers."""

"""Envelope classes generated from proto/ by `make proto` (committed: every install path has them)."""

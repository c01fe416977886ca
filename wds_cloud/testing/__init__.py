"""Test helpers for plugin authors: the shared backend conformance suite (:mod:`.conformance`)."""

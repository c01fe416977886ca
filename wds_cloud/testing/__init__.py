"""Test helpers for plugin authors: the shared backend conformance suite (:mod:`.conformance`) and a
network-emulating proxy (:mod:`.faults`: first-byte latency, per-connection pacing, resets, stalls,
truncated bodies, error answers) to put in front of any store."""

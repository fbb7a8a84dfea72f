"""Retraining: the drafter registry and its champion (registry), the challenger-vs-champion verdict
(verdict) and the demo's growing prompt source (demo_source). Incremental reuse of earlier datagen
and dump work is what those two stages exchange: drafter.contracts.reuse."""

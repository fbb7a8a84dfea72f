"""Retraining: the drafter registry and its champion (registry), the challenger-vs-champion verdict
(verdict), incremental reuse of earlier datagen and dump work (reuse), and the demo's growing
prompt source (demo_source)."""

"""Server supervision: preflight, launch in its own process group, readiness gate, stall watchdog,
run ownership and verified teardown (launcher, gate, session, check, ownership, host). It knows no
engine (it asks the engine object drafter.engine_registry makes) and imports no torch; the engines
themselves live in drafter.engines."""

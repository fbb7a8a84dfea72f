"""What two or more stages exchange, beside them rather than inside one of them.

A contract module holds a format or a rule that one stage writes and another reads, or that two
stages must compute alike: shards (the dump's hidden-state shard format, read by training) and
fp8 (its optional fp8 storage), accept (what training predicts an export's accept length to be,
checked by the export judge), prompts (the held-out prompt builder of the export judge and the
bench), reuse (the reuse index that datagen and dump write and look up), conversations (the one
conversation shape every prompt source is normalised to) and sharegpt (ShareGPT read into it, for
prepare and the demo's growing source).

A contract module imports nothing from any stage package (drafter/prepare, datagen, capture,
training, export, bench, retrain) nor from the orchestration layer (drafter/stages, drafter/cli):
the stage packages stand side by side on top of it (tests/core/test_import_graph.py).
"""

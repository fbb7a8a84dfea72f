"""Training the EAGLE-3 drafter (library only: no Prefect, no CLI).

The stage calls `drafter.training.trainer.train_drafter`; the pieces are usable on their own:
vocab (draft vocabulary, d2t/t2d), data (streaming dump reader + packing), teacher (restricted
target head, full-vocab argmax in chunks, position mask), ttt (the unroll: fast path and dense
reference), metrics, optim, checkpoint (atomic, exact resume), distributed (DDP / FSDP2, torchrun).
"""

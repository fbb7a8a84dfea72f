"""Expected training failures. Mismatches and bad checkpoints never heal on retry."""
from __future__ import annotations

from drafter.errors import EXIT_TERMINATED, DrafterError


class TrainingError(DrafterError):
    retryable = False


class TrainingInterrupted(TrainingError):
    """SIGTERM (e.g. Prefect cancellation): a checkpoint was written, a re-run resumes from it.
    An interruption, not a failure: the CLI exits 143 like any SIGTERM (docs/operations.md, Exit codes)."""

    exit_code = EXIT_TERMINATED


class DumpIncompatible(TrainingError):
    """The dump was captured with other layer ids / convention / hidden size / target."""


class DrafterIncompatible(TrainingError):
    """`train.init_from` names a drafter that does not fit the target (shapes, vocab, layer ids)."""


class CheckpointError(TrainingError):
    """A training checkpoint that cannot be resumed from (missing key, other run, corrupt)."""


class TargetWeightsError(TrainingError):
    """The target directory lacks the embedding / lm_head tensors the trainer needs."""

"""A gate's verdict text (drafter.stages.verdicts, named by the gate's row of the stage table): which
errors are the gate's refusal and which are failures, and what the markdown says either way."""
import pytest

from drafter.bench import BenchError
from drafter.export.judge import JudgedTooLow
from drafter.export.sglang import ExportCheckFailed
from drafter.retrain.registry import RegistryError
from drafter.stage_result import StageResult
from drafter.stages import TABLE
from drafter.stages.verdicts import bench_verdict, champion_verdict, export_verdict
from drafter.store import StoreError


@pytest.mark.parametrize("stage, error, refused", [
    ("export", JudgedTooLow("export judged too low: offline accept length 1.000 < export.min_accept_length 1.2"), True),
    ("export", ExportCheckFailed("SGLang export (read back):\n  fc.weight: shape differs"), True),
    ("export", StoreError("connection reset"), False),  # storage trouble is a failure, not a verdict
    ("bench", BenchError("the baseline server failed (config): bad flag"), True),
    ("bench", BenchError("the baseline server failed (crashed): exit 1", retryable=True), False),
    ("champion", RegistryError("no committed export abc"), True),
    ("champion", ValueError("a bug"), False),
    ("train", ValueError("a bug"), False),  # not a gate
])
def test_which_errors_are_a_gates_refusal(stage, error, refused):
    assert TABLE[stage].refuses(error) is refused


def test_a_refusal_names_the_error_and_lists_each_problem():
    md = export_verdict(None, ExportCheckFailed("refusing to export train/abc:\n  aux layer ids: [1]\n  vocab: 9"))
    assert md == "## export: refused (ExportCheckFailed)\n\n- refusing to export train/abc:\n- aux layer ids: [1]\n- vocab: 9\n"


def result(stage, meta, summary=(), table=()):
    return StageResult(stage=stage, status="done", uri=f"file:///s/{stage}/f", fingerprint="f", meta=meta,
                       summary=tuple(summary), table=tuple(table))


def test_verdicts_of_gates_that_passed():
    judge = {"verdict": {"passed": True, "min_accept_length": 1.2, "min_accept_ratio": 0.5, "ratio_to_prediction": 0.68,
                         "problems": []}}
    md = export_verdict(result("export", {"judge": judge}, ["offline accept length 1.499 at 3/1/4"],
                               [{"metric": "offline accept length", "value": "1.499"}]))
    assert md.splitlines() == ["## export: passed", "",
                               "- met export.min_accept_length 1.2 and export.min_accept_ratio 0.5 (ratio to "
                               "training's prediction 0.68)", "- offline accept length 1.499 at 3/1/4", "",
                               "| metric | value |", "|---|---|", "| offline accept length | 1.499 |"]
    md = champion_verdict(result("champion", {"verdict": "rejected"}, ["rejected: 1.40 vs 1.52 | not better"],
                                 [{"figure": "verdict", "champion": "kept", "challenger": "rejected"}]))
    assert md.startswith("## champion: rejected\n\n- rejected: 1.40 vs 1.52 | not better\n")
    assert "| verdict | kept | rejected |" in md
    md = bench_verdict(result("bench", {"recommendation": {"1": {"text": "keep the baseline"}}},
                              ["EAGLE3 2/1/3 @ batch 1: 0.71x", "batch 1: keep the baseline", "report: file:///r.md"]))
    assert md.splitlines()[:5] == ["## bench: recommendation", "", "- **batch 1: keep the baseline**",
                                   "- EAGLE3 2/1/3 @ batch 1: 0.71x", "- report: file:///r.md"]
    answered = StageResult(**{**result("bench", {"recommendation": {}}).__dict__, "headline": "not faster on vllm"})
    assert bench_verdict(answered).splitlines()[2] == "- **not faster on vllm**"  # the answer leads

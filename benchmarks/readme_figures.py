"""The demo run's report figures (docs/demo-run.md), taken from a real run: the bench stage's plot
and table and the train stage's curves of a profile's committed outputs (after `make demo`), copied
into docs/.

    .venv/bin/python benchmarks/readme_figures.py --config profiles/demo.yaml --out docs/demo

Writes bench-plot.png (the bench report's own plot), bench-table.png (its headline table, drawn
from report.json), train-curves.png and figures.json (which outputs they came from). Refuses, with
the stage to run, when the profile's bench or train output is not committed yet.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter.config import load_config  # noqa: E402
from drafter.formats import TRAIN_CURVES  # noqa: E402
from drafter.stage_output import StageOutput  # noqa: E402
from drafter.stages import TABLE  # noqa: E402
from drafter.store import open_store  # noqa: E402

# The bench report's headline columns that the reference engine fills (it does not stream: no TTFT / ITL).
COLUMNS = ("config", "batch", "speedup [CI]", "verdict", "accept length", "break-even accept", "output tok/s",
           "rounds")  # the report's reading order: the answer first


def table_png(rows: list[dict], title: str) -> bytes:
    """The bench's headline rows as a picture (matplotlib table, no display)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    fig, ax = plt.subplots(figsize=(1.4 * len(cols), 0.3 + 0.3 * (len(rows) + 1)))
    ax.axis("off")
    t = ax.table(cellText=cells, colLabels=cols, loc="upper center", cellLoc="left")
    t.auto_set_font_size(False)
    t.set_fontsize(9)
    t.auto_set_column_width(list(range(len(cols))))
    ax.set_title(title, fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=Path("profiles/demo.yaml"))
    ap.add_argument("--out", type=Path, default=Path("docs/demo"))
    args = ap.parse_args()
    cfg = load_config(args.config)
    store = open_store(cfg.storage)
    fps = TABLE.fingerprints(cfg)
    outputs = {}
    for stage in ("bench", "train"):
        out = StageOutput(store, stage, fps[stage])
        if not out.is_complete():
            print(f"no committed {stage} output for {args.config} (fingerprint {fps[stage]}): "
                  f"run `make demo` (or `drafter {stage} --config {args.config}`) first", file=sys.stderr)
            return 2
        outputs[stage] = out
    args.out.mkdir(parents=True, exist_ok=True)
    bench = outputs["bench"]
    report = json.loads(bench.read_shard("report.json"))
    (args.out / "bench-plot.png").write_bytes(bench.read_shard("report.png"))
    (args.out / "bench-table.png").write_bytes(table_png(report["table"], f"bench {bench.fingerprint}"))
    (args.out / "train-curves.png").write_bytes(outputs["train"].read_shard(TRAIN_CURVES))
    (args.out / "figures.json").write_text(json.dumps(
        {"config": str(args.config), "bench": bench.uri, "train": outputs["train"].uri,
         "table": report["table"]}, indent=1, default=str) + "\n")
    print(f"wrote {args.out}/bench-plot.png, bench-table.png, train-curves.png, figures.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

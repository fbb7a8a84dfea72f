"""What training predicts an export's accept length to be, from a row of its metrics log
(drafter.training.metrics defines the figures), and what the export judge checks its offline
measurement against."""
from __future__ import annotations


def predicted_accept(row: dict, num_steps: int) -> dict:
    """The prediction at `num_steps` draft steps from a metrics row: the served walk's figures
    when the row has them (held-out rows), else 1 + sum of accept_rate. Steps past the trained TTT
    depth are not extrapolated: `positions_used` says how many were available."""
    if row.get("served_accept_length"):
        s = min(num_steps, len(row["served_accept_length"]))
        return {"accept_length": row["served_accept_length"][s - 1], "per_position": row["served_per_position"][s - 1],
                "positions_used": s, "source": "served walk"}
    rates = [float(r) for r in row["accept_rate"][:num_steps]]
    return {"accept_length": 1.0 + sum(rates), "per_position": rates, "positions_used": len(rates),
            "source": "accept_rate"}

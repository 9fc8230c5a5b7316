"""Every shipped CPU recipe's memory forecast, as the code computes it now, against the peak its latest run through
``bench/shipped_recipes.py`` measured: within 20% (a forecast that holds for the whole run, not for calibration
alone). A change to the forecast or to a recipe that moves the two apart fails here; a recipe never run through
the bench fails too, until it has been."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import shipped_recipes  # noqa: E402

TOLERANCE = 0.2


def latest_measurements() -> dict[str, dict]:
    """Each recipe's row from the most recently updated host section that ran it to the end (exit 0 or a failed
    gate: its peak was measured; a run refused before work measured nothing)."""
    hosts = json.loads(shipped_recipes.RESULTS.read_text())
    latest = {}
    for key, host in sorted(hosts.items(), key=lambda item: item[1]["when"]):
        for name, row in host["recipes"].items():
            if row.get("exit_code") in (0, 1) and row.get("measured_peak_mb"):
                latest[name] = row | {"host": key, "when": host["when"]}
    return latest


def test_every_shipped_cpu_recipe_has_a_measured_peak():
    shipped = {path.stem for path in (REPO / "recipes").glob("*.yaml")}
    assert set(shipped_recipes.CPU_RECIPES) <= shipped
    unmeasured = sorted(set(shipped_recipes.CPU_RECIPES) - set(latest_measurements()))
    assert not unmeasured, f"never through bench/shipped_recipes.py: {unmeasured}"


@pytest.mark.parametrize("name", shipped_recipes.CPU_RECIPES)
def test_a_shipped_recipe_s_forecast_is_within_20_percent_of_its_measured_peak(name, smollm2_dir):
    from lmpress.memory_plan import forecast_checkpoint
    from lmpress.recipe import load_recipe

    measured = latest_measurements().get(name)
    if measured is None:
        pytest.skip(f"{name} was never through bench/shipped_recipes.py (the test above fails for it)")
    recipe = load_recipe(str(REPO / "recipes" / f"{name}.yaml"), [])
    forecast_mb = forecast_checkpoint(recipe).ram_bytes / 2**20
    ratio = forecast_mb / measured["measured_peak_mb"]
    assert 1 - TOLERANCE <= ratio <= 1 + TOLERANCE, (
        f"{name}: forecast {forecast_mb:.0f} MiB against {measured['measured_peak_mb']:.0f} measured "
        f"({measured['host']}, {measured['when']}): {ratio:.2f}"
    )

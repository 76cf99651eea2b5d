"""The quality gate: the Great Expectations suite in expectations.json, run over per-record statistics."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from training.data.config import DataConfig
from training.data.shardset import DataError

SUITE_PATH = Path(__file__).with_name("expectations.json")
EXAMPLE_KEYS = 3


class QualityError(DataError):
    """The suite failed; `report` is the full GX validation result (JSON-ready dict)."""

    def __init__(self, message: str, report: dict[str, Any]) -> None:
        super().__init__(message)
        self.report = report


def load_suite_json() -> dict[str, Any]:
    return json.loads(SUITE_PATH.read_text(encoding="utf-8"))


def suite_parameters(cfg: DataConfig) -> dict[str, float]:
    """The $PARAMETER values the suite refers to, from the data config."""
    return {
        "min_record_bytes": cfg.min_record_bytes,
        "max_record_bytes": cfg.max_record_bytes,
        "val_fraction_min": max(0.0, cfg.val_fraction - cfg.split_tolerance),
        "val_fraction_max": min(1.0, cfg.val_fraction + cfg.split_tolerance),
    }


def run_suite(rows: list[dict[str, Any]], cfg: DataConfig) -> dict[str, Any]:
    """Validate the per-record rows; return the GX result as a JSON-ready dict (with 'success')."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import great_expectations as gx
    import pandas as pd
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch_def = (
        context.data_sources.add_pandas("shardline")
        .add_dataframe_asset("records")
        .add_batch_definition_whole_dataframe("all")
    )
    spec = load_suite_json()
    suite = gx.ExpectationSuite(name=spec["name"], expectations=spec["expectations"], meta=spec.get("meta", {}))
    batch = batch_def.get_batch(batch_parameters={"dataframe": pd.DataFrame(rows)})
    result = batch.validate(
        suite,
        result_format={"result_format": "COMPLETE", "unexpected_index_column_names": ["key"],
                       "partial_unexpected_count": EXAMPLE_KEYS},
        expectation_parameters=suite_parameters(cfg),
    )
    # to_json_dict leaves numpy scalars in places; a round trip through json with str() fallback cleans them.
    return json.loads(json.dumps(result.to_json_dict(), default=_plain))


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def failures(report: dict[str, Any]) -> list[str]:
    """One line per failing expectation: what, how many records, a few example keys or the observed value."""
    lines = []
    for res in report.get("results", []):
        if res.get("success"):
            continue
        conf = res.get("expectation_config", {})
        kwargs = conf.get("kwargs", {})
        column = kwargs.get("column") or f"{kwargs.get('column_A')},{kwargs.get('column_B')}"
        check = (conf.get("meta") or {}).get("check", "")
        out = res.get("result", {})
        if "unexpected_count" in out:
            keys = []
            for item in out.get("unexpected_index_list") or []:
                if isinstance(item, dict) and item.get("key") not in keys:
                    keys.append(item.get("key"))
            detail = f"{out['unexpected_count']} of {out.get('element_count')} records, e.g. keys {keys[:EXAMPLE_KEYS]}"
        elif "observed_value" in out:
            detail = f"observed {out['observed_value']!r}, expected {kwargs.get('min_value')}..{kwargs.get('max_value')}"
        else:
            detail = f"exception: {res.get('exception_info', {}).get('exception_message', 'unknown')}"
        lines.append(f"{conf.get('type')}({column}) [{check}]: {detail}")
    return lines


def check(rows: list[dict[str, Any]], cfg: DataConfig) -> dict[str, Any]:
    """Run the suite; return the report when it passes, else raise QualityError listing each failure."""
    report = run_suite(rows, cfg)
    if report.get("success"):
        return report
    lines = failures(report)
    total = len(report.get("results", []))
    head = f"data quality gate failed ({SUITE_PATH.name}): {len(lines)} of {total} expectations"
    raise QualityError("\n".join([head, *(f"  {line}" for line in lines)]), report)

"""The quality gate: the Great Expectations suite in expectations.json, run over per-record statistics that
arrive chunk by chunk, in memory bounded by a batch (QualityGate)."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Iterable
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


AGGREGATES = ("expect_column_values_to_be_unique", "expect_column_mean_to_be_between")
ROW_WISE = ("expect_column_values_to_", "expect_column_pair_values_", "expect_multicolumn_")
EXAMPLES = 20  # unexpected values and index entries kept per expectation, whatever the corpus size
SUMMED = ("element_count", "unexpected_count", "missing_count")
LISTED = ("partial_unexpected_list", "partial_unexpected_index_list", "unexpected_list", "unexpected_index_list")
BATCH_LOCAL = ("unexpected_index_query", "partial_unexpected_counts")  # meaningless once batches are summed


class QualityGate:
    """The suite over a stream of per-record rows, in memory bounded by the batch size, not the corpus.

    Row-wise expectations (one verdict per record: values between / in set, pair equal) run in GX on batches of at
    most data.gate_batch_records rows, and their results are summed. The two that look at a whole column are exact
    aggregates over every record instead of one frame of all of them: uniqueness through a SQLite table on disk
    (GROUP BY sorts externally), the column mean through a running sum. The report keeps GX's result layout, one
    result per expectation in the suite's order, plus meta.shardline (records, batches).
    """

    def __init__(self, cfg: DataConfig, workdir: Path) -> None:
        import sqlite3

        spec = load_suite_json()
        self.name, self.specs, self.params = spec["name"], spec["expectations"], suite_parameters(cfg)
        self.row_wise = [i for i, e in enumerate(self.specs) if e["type"] not in AGGREGATES]
        for i in self.row_wise:
            if not self.specs[i]["type"].startswith(ROW_WISE):
                raise ValueError(
                    f"{SUITE_PATH.name}: {self.specs[i]['type']} is neither row-wise nor one of "
                    f"{AGGREGATES}, so it cannot be checked batch by batch"
                )
        self._gx: tuple[Any, Any] | None = None  # (batch definition, suite)
        # Importing GX and making its context take ~2-3 s: done on a thread from here on, while the listing is
        # planned and the first chunks are written (the workers are other processes), not when the first batch
        # of rows is waiting for it. The first batch joins the thread.
        self._gx_error: BaseException | None = None
        self._gx_thread = threading.Thread(target=self._prepare_gx, name="shardline-gx-import", daemon=True)
        self._gx_thread.start()
        self._db = sqlite3.connect(workdir / "gate.sqlite")
        for pragma in ("journal_mode=OFF", "synchronous=OFF", "temp_store=FILE", "cache_size=-8192"):
            self._db.execute(f"PRAGMA {pragma}")
        for i, e in enumerate(self.specs):
            if e["type"] == AGGREGATES[0]:
                self._db.execute(f"CREATE TABLE u{i} (v TEXT)")  # rowid keeps arrival (corpus) order
        self._sums = {i: [0.0, 0] for i, e in enumerate(self.specs) if e["type"] == AGGREGATES[1]}
        self._merged: dict[int, dict[str, Any]] = {}
        self._pending: list[dict[str, Any]] = []
        self.batch_records, self.records, self.batches = cfg.gate_batch_records, 0, 0

    def _prepare_gx(self) -> None:
        try:
            self._make_gx()
        except BaseException as e:  # noqa: BLE001 - re-raised by the first batch, on the stage's own thread
            self._gx_error = e

    def _validator(self) -> tuple[Any, Any]:
        """GX's batch definition and the row-wise suite, once the import thread has made them."""
        self._gx_thread.join()
        if self._gx_error is not None:
            raise self._gx_error
        return self._make_gx()

    def _make_gx(self) -> tuple[Any, Any]:
        if self._gx is None:
            os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
            import great_expectations as gx
            from great_expectations.data_context.types.base import ProgressBarsConfig

            context = gx.get_context(mode="ephemeral")
            context.variables.progress_bars = ProgressBarsConfig(globally=False)
            batches = (
                context.data_sources.add_pandas("shardline")
                .add_dataframe_asset("records")
                .add_batch_definition_whole_dataframe("batch")
            )
            self._gx = (
                batches,
                gx.ExpectationSuite(name=self.name, expectations=[self.specs[i] for i in self.row_wise]),
            )
        return self._gx

    def add(self, rows: Iterable[dict[str, Any]]) -> None:
        """Take rows in corpus order; a full batch is validated at once and dropped."""
        for row in rows:
            self._pending.append(row)
            if len(self._pending) >= self.batch_records:
                self._flush()

    def _flush(self) -> None:
        import pandas as pd

        rows, self._pending = self._pending, []
        if not rows:
            return
        self.records += len(rows)
        self.batches += 1
        frame = pd.DataFrame(rows)
        batches, suite = self._validator()
        result = batches.get_batch(batch_parameters={"dataframe": frame}).validate(
            suite,
            result_format={
                "result_format": "COMPLETE",
                "unexpected_index_column_names": ["key"],
                "partial_unexpected_count": EXAMPLE_KEYS,
            },
            expectation_parameters=self.params,
        )
        # to_json_dict leaves numpy scalars in places; a round trip through json with str() fallback cleans them.
        report = json.loads(json.dumps(result.to_json_dict(), default=_plain))
        for index, res in zip(self.row_wise, report["results"], strict=True):
            self._merge(index, res)
        for i in self._sums:
            column = frame[self.specs[i]["kwargs"]["column"]].dropna()
            self._sums[i][0] += float(column.sum())
            self._sums[i][1] += int(column.count())
        for i, e in enumerate(self.specs):
            if e["type"] == AGGREGATES[0]:
                values = ((str(v),) for v in frame[e["kwargs"]["column"]])
                self._db.executemany(f"INSERT INTO u{i} (v) VALUES (?)", values)

    def _merge(self, index: int, res: dict[str, Any]) -> None:
        out = res.get("result", {})
        kept = self._merged.setdefault(
            index, {**res, "result": {k: v for k, v in out.items() if k not in (*SUMMED, *LISTED, *BATCH_LOCAL)}}
        )
        kept["success"] = bool(kept["success"] and res.get("success"))
        if (res.get("exception_info") or {}).get("raised_exception"):
            kept["exception_info"] = res["exception_info"]
        merged = kept["result"]
        for key in SUMMED:
            if key in out:
                merged[key] = merged.get(key, 0) + out[key]
        for key in LISTED:
            if key in out:
                have = merged.setdefault(key, [])
                have += (out[key] or [])[: EXAMPLES - len(have)]
        total, missing = merged.get("element_count", 0), merged.get("missing_count", 0)
        if "unexpected_count" in merged:
            unexpected = merged["unexpected_count"]
            merged["unexpected_percent"] = merged["unexpected_percent_nonmissing"] = _pct(unexpected, total - missing)
            merged["unexpected_percent_total"] = _pct(unexpected, total)
            merged["missing_percent"] = _pct(missing, total)

    def _resolved(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {
            k: self.params[v["$PARAMETER"]] if isinstance(v, dict) and "$PARAMETER" in v else v
            for k, v in kwargs.items()
        }

    def _unique(self, index: int, spec: dict[str, Any]) -> dict[str, Any]:
        column, duplicates = spec["kwargs"]["column"], 0
        examples: list[Any] = []
        query = f"SELECT v, COUNT(*) FROM u{index} GROUP BY v HAVING COUNT(*) > 1 ORDER BY MIN(rowid)"
        for value, count in self._db.execute(query):
            duplicates += count
            if len(examples) < EXAMPLES:
                examples.append(value)
        result = {
            "element_count": self.records,
            "unexpected_count": duplicates,
            "unexpected_percent": _pct(duplicates, self.records),
            "partial_unexpected_list": examples,
            "unexpected_index_list": [{column: v} for v in examples],
            "evaluated": "exact, all records",
        }
        return self._aggregate(spec, duplicates == 0, result)

    def _mean(self, index: int, spec: dict[str, Any]) -> dict[str, Any]:
        total, count = self._sums[index]
        kwargs = self._resolved(spec["kwargs"])
        observed = total / count if count else None
        ok = (
            observed is not None
            and (kwargs.get("min_value") is None or observed >= kwargs["min_value"])
            and (kwargs.get("max_value") is None or observed <= kwargs["max_value"])
        )
        return self._aggregate(
            spec, ok, {"observed_value": observed, "element_count": count, "evaluated": "exact, all records"}
        )

    def _aggregate(self, spec: dict[str, Any], ok: bool, result: dict[str, Any]) -> dict[str, Any]:
        config = {"type": spec["type"], "kwargs": self._resolved(spec["kwargs"]), "meta": spec.get("meta", {})}
        return {
            "success": ok,
            "expectation_config": config,
            "result": result,
            "meta": {},
            "exception_info": {"raised_exception": False, "exception_traceback": None, "exception_message": None},
        }

    def close(self) -> None:
        """Release the on-disk key table (finish does; a build that stops early must too)."""
        self._db.close()

    def finish(self) -> dict[str, Any]:
        """The report when every expectation passed; QualityError listing each failure otherwise."""
        try:
            self._flush()
            results = []
            for i, spec in enumerate(self.specs):
                if spec["type"] == AGGREGATES[0]:
                    results.append(self._unique(i, spec))
                elif spec["type"] == AGGREGATES[1]:
                    results.append(self._mean(i, spec))
                else:
                    results.append(self._merged.get(i) or self._aggregate(spec, True, {"element_count": 0}))
        finally:
            self.close()
        passed = sum(1 for r in results if r["success"])
        import great_expectations as gx

        report = {
            "success": passed == len(results),
            "results": results,
            "suite_name": self.name,
            "statistics": {
                "evaluated_expectations": len(results),
                "successful_expectations": passed,
                "unsuccessful_expectations": len(results) - passed,
                "success_percent": _pct(passed, len(results)),
            },
            "meta": {
                "great_expectations_version": gx.__version__,
                "shardline": {"records": self.records, "batches": self.batches, "batch_records": self.batch_records},
            },
        }
        if report["success"]:
            return report
        lines = failures(report)
        # the first line is what a one-line report (the CLI, a failed task's state) shows: it names the first failure
        more = f" (and {len(lines) - 1} more below)" if len(lines) > 1 else ""
        head = (
            f"data quality gate failed ({SUITE_PATH.name}): {len(lines)} of {len(results)} expectations: "
            f"{lines[0] if lines else 'unknown'}{more}"
        )
        raise QualityError("\n".join([head, *(f"  {line}" for line in lines)]), report)


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def _pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole else 0.0


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
            detail = (
                f"observed {out['observed_value']!r}, expected {kwargs.get('min_value')}..{kwargs.get('max_value')}"
            )
        else:
            detail = f"exception: {res.get('exception_info', {}).get('exception_message', 'unknown')}"
        lines.append(f"{conf.get('type')}({column}) [{check}]: {detail}")
    return lines


def check(rows: Iterable[dict[str, Any]], cfg: DataConfig) -> dict[str, Any]:
    """Run the suite over `rows` through a QualityGate; the report when it passes, else QualityError."""
    with tempfile.TemporaryDirectory(prefix="shardline-gate-") as tmp:
        gate = QualityGate(cfg, Path(tmp))
        gate.add(rows)
        return gate.finish()

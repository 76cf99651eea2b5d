"""The GX suite in training/data/expectations.json over hand-made per-record rows: every expectation can fail."""

from __future__ import annotations

import json

import pytest

from training.data.config import DataConfig
from training.data.quality import SUITE_PATH, QualityError, check


def _row(key, split="train", n=100, utf8=True, manifest=2, tar=2):
    return {
        "key": key,
        "split": split,
        "is_val": int(split == "val"),
        "n_bytes": n,
        "utf8_valid": utf8,
        "shard": f"{split}/x.tar",
        "shard_manifest_count": manifest,
        "shard_tar_count": tar,
    }


def test_suite_is_the_repo_json():
    suite = json.loads(SUITE_PATH.read_text())
    assert len(suite["expectations"]) == 6


def test_good_rows_pass_and_the_report_is_json():
    rows = [_row(f"k{i}", "val" if i % 10 == 0 else "train") for i in range(50)]
    report = check(rows, DataConfig(val_fraction=0.1, split_tolerance=0.05))
    assert report["success"] is True and len(report["results"]) == 6
    json.dumps(report)


def test_every_expectation_reports_its_count_and_example_keys():
    rows = [_row(f"k{i}") for i in range(20)]
    rows[0] = _row("empty-one", n=0)
    rows[1] = _row("huge-one", n=10**9)
    rows[2] = _row("latin-one", utf8=False)
    rows[3] = _row("k10")  # duplicate of rows[10]
    rows[4] = _row("bad-shard", manifest=3, tar=2)
    with pytest.raises(QualityError) as err:
        check(rows, DataConfig(val_fraction=0.5, split_tolerance=0.1, max_record_bytes=4096))
    lines = str(err.value).splitlines()
    # the first line, all a one-line report shows, names the first failure; every one follows on its own line
    assert lines[0] == (
        "data quality gate failed (expectations.json): 6 of 6 expectations: expect_column_values_to_be_between"
        "(n_bytes) [records non-empty]: 1 of 20 records, e.g. keys ['empty-one'] (and 5 more below)"
    )
    assert len(lines) == 7
    expected = {
        "expect_column_values_to_be_between(n_bytes) [records non-empty]": "1 of 20 records, e.g. keys ['empty-one']",
        "expect_column_values_to_be_between(n_bytes) [record length": (
            "2 of 20 records, e.g. keys ['empty-one', 'huge-one']"
        ),
        "expect_column_values_to_be_in_set(utf8_valid)": "1 of 20 records, e.g. keys ['latin-one']",
        "expect_column_values_to_be_unique(key)": "2 of 20 records, e.g. keys ['k10']",
        "expect_column_mean_to_be_between(is_val)": "observed 0.0, expected 0.4..0.6",
        "expect_column_pair_values_to_be_equal(shard_manifest_count,shard_tar_count)": "e.g. keys ['bad-shard']",
    }
    for head, detail in expected.items():
        line = next(line for line in lines if head in line)
        assert detail in line, line


def test_min_record_bytes_cannot_go_below_the_suite_minimum():
    """The suite fails any empty record whatever data.min_record_bytes says; 0 would keep one and fail the stage."""
    from pydantic import ValidationError

    suite = json.loads(SUITE_PATH.read_text())
    non_empty = next(e for e in suite["expectations"] if e["meta"]["check"] == "records non-empty")
    assert non_empty["kwargs"]["min_value"] == 1
    with pytest.raises(ValidationError, match="min_record_bytes\n  Input should be greater than or equal to 1"):
        DataConfig(min_record_bytes=0)
    assert DataConfig(min_record_bytes=1).min_record_bytes == 1

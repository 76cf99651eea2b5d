"""Pure parts of the stack: backend URLs keep passwords out, the [stack] table, dataset sources, the dependency
check, the on-new-data trigger's match, and stopping only the process that was recorded."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from flows.cli.notify import dataset_resource, resolve_source
from flows.config import ConfigError, load_config, load_stack_config
from flows.stack.code_env import unmet_requirements
from flows.stack.postgres import parse_backend
from flows.stack.procs import Proc, StackError, _start_ticks, is_ours, stop

REPO = Path(__file__).resolve().parents[2]


def test_backend_url_password_goes_to_env_only():
    b = parse_backend("postgresql://ml:s3cret@db.internal:6543/shardline")
    assert (b.user, b.host, b.port, b.name) == ("ml", "db.internal", 6543, "shardline")
    assert b.databases == {"mlflow": "shardline_mlflow", "prefect": "shardline_prefect"}
    assert b.url("asyncpg", "shardline_prefect") == "postgresql+asyncpg://ml@db.internal:6543/shardline_prefect"
    assert "s3cret" not in b.display and b.env() == {"PGPASSWORD": "s3cret"}


@pytest.mark.parametrize("text", ["mysql://u:s3cret@h/db", "postgresql://h:5432/db", "postgresql://u:s3cret@h:5432/"])
def test_bad_backend_is_one_line_without_the_password(text):
    with pytest.raises(StackError) as err:
        parse_backend(text)
    assert "s3cret" not in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith("stack.backend: expected postgresql://USER@HOST:PORT/NAME")


def test_stack_table_sits_beside_the_pipeline_sections(tmp_path):
    cfg = tmp_path / "ops.toml"
    cfg.write_text("[stack]\nprefect_port = 4300\n[train]\nsteps = 7\n")
    stack, pipeline = load_stack_config(cfg, ["stack.mlflow_port=5100"])
    assert (stack.prefect_port, stack.mlflow_port, pipeline.train.steps) == (4300, 5100, 7)
    assert load_config(cfg).train.steps == 7  # `shardline run` takes the same file
    cfg.write_text("[stack]\nprefect_prot = 4300\n")
    with pytest.raises(ConfigError, match=r"unknown key 'stack.prefect_prot'"):
        load_config(cfg)


@pytest.mark.parametrize("host", ["::1", "[::1]", "::", "fe80::1%eth0", "", "bad_host", "127.0.0.1:4200"])
def test_a_stack_host_that_is_no_ipv4_address_or_host_name_is_refused_naming_the_field(host):
    """An IPv6 literal was accepted, then `up` failed deep inside with a bare InvalidURL."""
    with pytest.raises(ConfigError) as err:
        load_stack_config(None, [f"stack.host={host!r}"])
    message = str(err.value)
    assert "stack.host: not an IPv4 address or a host name" in message and repr(host) in message
    assert "\n" not in message


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "localhost", "db-1.example.internal"])
def test_a_stack_host_that_is_an_ipv4_address_or_host_name_is_kept(host):
    assert load_stack_config(None, [f"stack.host={host!r}"])[0].host == host


def test_up_refuses_an_ipv6_host_in_one_line(tmp_path, monkeypatch, capsys):
    from flows.cli.root import main

    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path))
    assert main(["up", "--host", "::1"]) == 2
    err = capsys.readouterr().err
    assert "stack.host: not an IPv4 address or a host name" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "stack.json").exists()


def test_dataset_source_is_absolute_existing_or_remote(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    assert resolve_source("corpus") == str(tmp_path / "corpus")
    assert resolve_source("s3://bucket/new") == "s3://bucket/new"
    with pytest.raises(ValueError, match="empty"):
        resolve_source("  ")
    with pytest.raises(ValueError, match="missing: no such file"):
        resolve_source("missing")
    # the event, and the run it starts, would carry a credential in the SOURCE: refused, and not repeated
    with pytest.raises(ValueError, match=r"'s3://AKIAFAKE:\*\*\*@bucket/x' carries a password in the URI") as err:
        resolve_source("s3://AKIAFAKE:secret@bucket/x")
    assert "secret" not in str(err.value)


def test_on_new_data_trigger_needs_a_source_label():
    from prefect.events.schemas.events import Resource, ResourceSpecification

    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    trigger = next(d for d in spec["deployments"] if d["name"] == "on-new-data")["triggers"][0]
    match = ResourceSpecification(trigger["match"])
    assert match.matches(Resource(dataset_resource("/data/corpus-2")))
    assert not match.matches(Resource({"prefect.resource.id": "shardline.dataset.abc"}))
    assert "stdlib" not in trigger["parameters"]["config"]


def test_dependency_check_names_what_the_worker_lacks(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\ndependencies = ["pydantic>=2", "pydantic<1", "no-such-package-shardline>=1"]\n'
    )
    unmet = unmet_requirements(tmp_path / "pyproject.toml")
    assert [u.split(" (")[0] for u in unmet] == ["pydantic<1", "no-such-package-shardline>=1"]
    assert unmet_requirements(REPO / "pyproject.toml") == []


def test_stop_leaves_a_process_whose_start_time_differs():
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        real = Proc(pid=sleeper.pid, start_ticks=_start_ticks(sleeper.pid))
        recycled = real.model_copy(update={"start_ticks": real.start_ticks - 1})
        assert not is_ours(recycled) and stop(recycled) is False
        assert sleeper.poll() is None
        assert stop(real) is True
        assert not is_ours(real) and not Path(f"/proc/{sleeper.pid}").exists()  # stopped and reaped
    finally:
        sleeper.kill()

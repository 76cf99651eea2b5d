"""What `shardline up`'s backend and `shardline notify-dataset` print never holds the password they were given, and
a backend's `?password=` is the one the servers log in with."""

from __future__ import annotations

import pytest

from flows.cli.notify import resolve_source
from flows.cli.root import main
from flows.stack.postgres import parse_backend
from flows.stack.procs import StackError

SECRET = "S3CR3T"


def test_a_missing_local_source_is_named_without_its_password(capsys):
    with pytest.raises(ValueError, match="no such file") as caught:
        resolve_source(f"https://u:{SECRET}@host/x")
    assert SECRET not in str(caught.value) and "u:***@host/x" in str(caught.value)
    assert main(["notify-dataset", f"https://u:{SECRET}@host/x"]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and SECRET not in err


def test_a_backend_password_in_the_query_is_the_one_used_and_never_shown():
    backend = parse_backend(f"postgresql://u@db:5433/x?password={SECRET}")
    assert backend.password == SECRET and backend.env() == {"PGPASSWORD": SECRET}
    assert (backend.user, backend.host, backend.port, backend.name) == ("u", "db", 5433, "x")
    assert SECRET not in backend.display and SECRET not in backend.url("asyncpg", "x_prefect")
    # the password before the '@' wins over the query's
    assert parse_backend(f"postgresql://u:first@db/x?password={SECRET}").password == "first"
    assert parse_backend("postgresql://u@db/x").env() == {}


@pytest.mark.parametrize(
    "text",
    [
        f"postgresql://u@db:5432?password={SECRET}",  # no database name
        f"mysql://u@db/x?password={SECRET}",
        f"postgresql://u:{SECRET}@db:5432",
    ],
)
def test_a_mistyped_backend_is_refused_without_its_password(text):
    with pytest.raises(StackError, match="expected postgresql://") as caught:
        parse_backend(text)
    assert SECRET not in str(caught.value) and "***" in str(caught.value)


@pytest.mark.parametrize("port", ["abc", "99999999", "0"])
def test_a_backend_port_that_is_no_port_is_a_stack_error_without_its_password(port):
    with pytest.raises(StackError, match="stack.backend: the port is not a number in 1-65535") as caught:
        parse_backend(f"postgresql://u:{SECRET}@db:{port}/x")
    assert SECRET not in str(caught.value)


TAIL = "T41L"


@pytest.mark.parametrize(
    "text",
    [
        f"postgresql://u:{SECRET}@{TAIL}@db:5432/x",
        f"postgresql://u:{SECRET}@{TAIL}@db/x?sslmode=require",
        f"mysql://u:{SECRET}@{TAIL}@db/x",  # refused for the '@' before the scheme is looked at, which shows the URL
    ],
)
def test_a_password_with_an_unescaped_at_is_refused_without_any_of_it(text):
    """The password ended at its first '@' and the rest of it was taken for the host, shown everywhere."""
    with pytest.raises(StackError) as caught:
        parse_backend(text)
    message = str(caught.value)
    assert message.startswith("stack.backend: ") and "escape @ in the password as %40" in message
    assert SECRET not in message and TAIL not in message and "\n" not in message


def test_a_password_with_an_escaped_at_is_the_one_used():
    backend = parse_backend(f"postgresql://u:{SECRET}%40{TAIL}@db:5432/x")
    assert backend.password == f"{SECRET}@{TAIL}" and backend.host == "db"
    assert SECRET not in backend.display and TAIL not in backend.display


def test_up_refuses_a_password_with_an_unescaped_at_without_printing_any_of_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path))
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:1/api")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:2")
    assert main(["up", "--backend", f"postgresql://u:{SECRET}@{TAIL}@db.invalid:5432/x"]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("shardline: stack.backend: ") and "escape @ in the password as %40" in err
    assert len(err.strip().splitlines()) == 1  # refused before anything starts: no note about what is recorded
    assert SECRET not in out + err and TAIL not in out + err
    assert not (tmp_path / "stack.json").exists()


def test_up_refuses_a_mistyped_backend_without_printing_its_password(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path))
    # `up` points this process at the stack's servers first; restored after the test
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:1/api")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:2")
    assert main(["up", "--backend", f"postgresql://u@db:5432?password={SECRET}"]) == 1  # refused before any start
    err = capsys.readouterr().err
    assert "expected postgresql://" in err and SECRET not in err
    assert not (tmp_path / "stack.json").exists()

"""Credentials are masked wherever a URI-like value can travel; configs refuse them; expected failures log one line."""

from __future__ import annotations

import logging

import pytest

from flows import log_hygiene
from flows.config import ConfigError, load_config
from infra.redact import find_credential, redact
from infra.tracking import flat_params, resolve_tracking_uri


@pytest.mark.parametrize(
    ("raw", "masked"),
    [
        ("https://bob:hunter2@mlflow.example.com:5000/api", "https://bob:***@mlflow.example.com:5000/api"),
        ("ray://alice:s3cret@head:10001", "ray://alice:***@head:10001"),
        ("https://ghp_token123@github.com/o/r", "https://***@github.com/o/r"),
        (
            "https://a.blob.core.windows.net/c/b?sv=2021-08-06&sig=AbC%2Bd&se=2030",
            "https://a.blob.core.windows.net/c/b?sv=2021-08-06&sig=***&se=2030",
        ),
        (
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIAX&X-Amz-Signature=beef&v=1",
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&v=1",
        ),
        (
            "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=Zm9vYmFy==;EndpointSuffix=core.windows.net",
            "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=***;EndpointSuffix=core.windows.net",
        ),
        (
            "BlobEndpoint=https://a/;SharedAccessSignature=sv=1&sig=xyz",
            "BlobEndpoint=https://a/;SharedAccessSignature=***",
        ),
        ("error talking to https://u:pw@h/x: 401", "error talking to https://u:***@h/x: 401"),
        # a password holding '/', '#', '?' or '@' is still all of it (SQLAlchemy and libpq read these URIs so)
        ("postgresql://mlflow:pa/ss@db:5432/mlflow", "postgresql://mlflow:***@db:5432/mlflow"),
        ("postgresql://mlflow:pa#ss@db/mlflow", "postgresql://mlflow:***@db/mlflow"),
        ("postgresql://mlflow:pa?ss@db/mlflow", "postgresql://mlflow:***@db/mlflow"),
        ("postgresql://mlflow:p@ss@db/mlflow", "postgresql://mlflow:***@db/mlflow"),
        ("redis://:hunter2@cache:6379/0", "redis://***@cache:6379/0"),
    ],
)
def test_redact_masks_every_kind_of_credential(raw, masked):
    assert redact(raw) == masked
    assert find_credential(raw) is not None


def test_text_with_environment_style_secrets_and_bearer_tokens_is_masked():
    line = (
        "env AWS_SECRET_ACCESS_KEY=abc123 PREFECT_API_KEY=pnu_x SHARDLINE_HOME=/tmp/h; Authorization: Bearer eyJhb.x.y"
    )
    assert (
        redact(line)
        == "env AWS_SECRET_ACCESS_KEY=*** PREFECT_API_KEY=*** SHARDLINE_HOME=/tmp/h; Authorization: Bearer ***"
    )
    assert redact("https://h/p?api-key=zz&sas=qq&x=1") == "https://h/p?api-key=***&sas=***&x=1"
    assert redact("Authorization: Basic dXNlcjpwYXNz") == "Authorization: Basic ***"  # base64 of user:pass
    assert redact("PREFECT_API_AUTH_STRING=admin:pw X_SECRET='q' Y_TOKEN=\"t\"") == (
        "PREFECT_API_AUTH_STRING=*** X_SECRET='***' Y_TOKEN=\"***\""
    )
    assert redact("train.steps=50, Basic settings") == "train.steps=50, Basic settings"


GHP = "ghp_" + "1a2B3c4D5e6F7g8H9i0J1k2L3m4N5o6P7q8R"  # the shapes of real tokens, made up
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ1MSJ9.SflKxwRJSMeKKF2QT4fw"


@pytest.mark.parametrize(
    ("raw", "masked"),
    [
        # urllib3's words for every failed request: the path and its signed query, no scheme or host
        (
            "HTTPSConnectionPool(host='acct.blob.core.windows.net', port=443): Max retries exceeded with url: "
            "/c/b.parquet?sv=2021-08-06&sig=s9y%2BQ5Z (Caused by ReadTimeoutError)",
            "HTTPSConnectionPool(host='acct.blob.core.windows.net', port=443): Max retries exceeded with url: "
            "/c/b.parquet?sv=2021-08-06&sig=*** (Caused by ReadTimeoutError)",
        ),
        (
            '"GET /k?X-Amz-Date=2024&amp;X-Amz-Signature=beef HTTP/1.1" 403',
            '"GET /k?X-Amz-Date=***&amp;X-Amz-Signature=*** HTTP/1.1" 403',
        ),
        # secret keys as code, JSON, reprs and libpq DSNs write them
        ("aws_secret_access_key=wJalrXUtnFEMI/K7MDENG", "aws_secret_access_key=***"),
        (
            '{"aws_access_key_id": "AKIDX", "aws_secret_access_key": "wJalr/K7"}',
            '{"aws_access_key_id": "AKIDX", "aws_secret_access_key": "***"}',
        ),
        ("{'client_secret': 'q~8Q', 'tenant_id': 't'}", "{'client_secret': '***', 'tenant_id': 't'}"),
        ("host=db user=mlflow password='p w' dbname=x", "host=db user=mlflow password='***' dbname=x"),
        ("MYSQL_PWD=hunter2 DB_PASS=hunter3", "MYSQL_PWD=*** DB_PASS=***"),
        # tokens of a known shape, wherever they stand; a bearer token in lower case (HTTP/2 headers)
        (f"cloning with token {GHP} failed", "cloning with token *** failed"),
        ("hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345 rejected", "*** rejected"),
        ("access key AKIAIOSFODNN7EXAMPLE is not valid", "access key *** is not valid"),
        (f"authorization: bearer {JWT}", "authorization: bearer ***"),
        (f"token {JWT} expired", "token *** expired"),
    ],
    ids=["urllib3", "amp", "snake", "json", "repr", "dsn", "env-pwd", "ghp", "hf", "akia", "bearer", "jwt"],
)
def test_secrets_in_log_and_error_text_are_masked(raw, masked):
    assert redact(raw) == masked


@pytest.mark.parametrize(
    ("raw", "masked"),
    [
        ("secret_key=wJalrXUtnFEMI/K7MDENG", "secret_key=***"),
        ("aws_secret_key=wJalrXUtnFEMI/K7MDENG", "aws_secret_key=***"),
        ("access_key=wJalrXUtnFEMI/K7MDENG", "access_key=***"),
        ("{'secret_key': 'wJalr/K7', 'access_key_id': 'AKIDX'}", "{'secret_key': '***', 'access_key_id': 'AKIDX'}"),
        ('{"private-token": "glx-abc"}', '{"private-token": "***"}'),
        ("https://minio.local/b?secret_key=s3&access_key=a1", "https://minio.local/b?secret_key=***&access_key=***"),
        (
            "https://gitlab.local/api?private-token=abc&per_page=5",
            "https://gitlab.local/api?private-token=***&per_page=5",
        ),
    ],
    ids=["secret_key", "aws_secret_key", "access_key", "repr", "json-private-token", "minio-query", "gitlab-query"],
)
def test_object_store_and_gitlab_key_names_are_masked(raw, masked):
    assert redact(raw) == masked
    if "://" in raw:
        assert find_credential(raw) is not None  # a config value holding one is refused


@pytest.mark.parametrize(
    "clean",
    [
        "access_key_id=AKIDX aws_access_key_id=AKIDX",  # an access key's id names it, it is no secret
        "https://minio.local/b?access_key_id=AKIDX",
        "access_keys=3 secret_key_id=k1 private_tokens=0",
    ],
)
def test_key_ids_and_longer_names_are_unchanged(clean):
    assert redact(clean) == clean and find_credential(clean) is None


@pytest.mark.parametrize(
    ("raw", "masked"),
    [
        ("[default]\naws_secret_access_key = wJalrXUtnFEMI/K7MDENG", "[default]\naws_secret_access_key = ***"),
        ("AccountKey = abc+/=", "AccountKey = ***"),
        ("passphrase=hunter2x", "passphrase=***"),
        ("GET /v1\nx-api-key: abcd1234efgh\nAccept: */*", "GET /v1\nx-api-key: ***\nAccept: */*"),
        ("  X-Amz-Security-Token: FQoGZXIvYXdzE", "  X-Amz-Security-Token: ***"),
        ("psql --password hunter2 -h db", "psql --password *** -h db"),
        ("tool --api-key=abc123 --verbose", "tool --api-key=*** --verbose"),
        ("x --no-password --verbose --token-file /run/t", "x --no-password --verbose --token-file /run/t"),
        ("Driver={ODBC};Server=db;PWD={a;b};Database=x", "Driver={ODBC};Server=db;PWD=***;Database=x"),
        (
            "Credential=AKIDEXAMPLE/x, SignedHeaders=host, Signature=5d672d79c1",
            "Credential=AKIDEXAMPLE/x, SignedHeaders=host, Signature=***",
        ),
        ("if password == other:", "if password == other:"),  # code comparing, not assigning
        ("Password: must be set", "Password: must be set"),  # prose: no header of a secret
        ("db:\n  password: hunter2\n  host: db", "db:\n  password: ***\n  host: db"),
        ('  - api_key: "a b"  # prod\nuser: x', '  - api_key: "***"  # prod\nuser: x'),
        ("aws_secret_access_key: wJalr/K7", "aws_secret_access_key: ***"),
        ("api_key_env: OPENAI_API_KEY\neos_token: </s>", "api_key_env: OPENAI_API_KEY\neos_token: </s>"),
        ("db:\r\n  password: hunter2\r\n", "db:\r\n  password: ***\r\n"),
        ("password: p#ss'x", "password: ***"),  # a '#' starts a comment only after a space
        ("password: \"ab\\\"cd\"\n'secret': 'it''s'", "password: \"***\"\n'secret': '***'"),
        ('password: null\napi_key: ~\ntoken_secret: ""', 'password: null\napi_key: ~\ntoken_secret: ""'),
        (
            "db:\n  password: |\n    hunter2\n\n    line2\n  host: db",
            "db:\n  password: |\n    ***\n\n    ***\n  host: db",
        ),
        (
            "- private_key: >-  # pem\r\n    MIIEv\r\n    QDx\r\nuser: x\r\n  password: |\n",
            "- private_key: >-  # pem\r\n    ***\r\n    ***\r\nuser: x\r\n  password: |\n",
        ),
        (
            "notes: |\n  password is required\nsecret: |2+\n  s3cr3t",
            "notes: |\n  password is required\nsecret: |2+\n  ***",
        ),
        ("x-api-key: |\n  sk-live-abcdef123\nnext: 1", "x-api-key: ***\n  ***\nnext: 1"),  # a header's name too
        (
            "db_password: !!str |\n  hunter2\npassword: &a >-\n  hunter3",
            "db_password: !!str |\n  ***\npassword: &a >-\n  ***",
        ),
    ],
    ids=[
        "ini-spaces",
        "conn-spaces",
        "passphrase",
        "header",
        "amz-header",
        "option",
        "option-equals",
        "option-flags",
        "odbc-braces",
        "aws4-authorization",
        "comparison",
        "prose",
        "yaml",
        "yaml-list-quoted-comment",
        "yaml-aws",
        "yaml-names-only",
        "yaml-crlf",
        "yaml-hash-and-quote-inside",
        "yaml-escaped-and-quoted-key",
        "yaml-none-set",
        "yaml-block",
        "yaml-folded-block-crlf-in-a-list",
        "yaml-block-indicators-and-a-plain-block",
        "yaml-block-of-a-header-name",
        "yaml-block-tagged-and-anchored",
    ],
)
def test_ini_assignments_options_odbc_braces_and_secret_header_lines_are_masked(raw, masked):
    assert redact(raw) == masked


def test_a_malformed_uri_is_still_judged_and_text_masked_twice_keeps_its_quotes():
    # urlsplit raises on a bracketed host left open: the check must answer, not raise
    assert find_credential("http://[::1:5000") is None
    assert find_credential("s3://[bucket/x?sig=abc") == "query key 'sig'"
    once = redact("data.source='s3://bucket/c?X-Amz-Signature=abc' holds a signed URL")
    assert once == "data.source='s3://bucket/c?X-Amz-Signature=***' holds a signed URL" and redact(once) == once
    assert redact("GET /c/b?sv=1&sig=ab'cd") == "GET /c/b?sv=1&sig=***"  # a quote inside a value is masked with it


def test_a_token_as_the_user_of_a_url_is_a_token_and_an_azure_container_is_not_a_credential():
    assert find_credential(f"https://{GHP}@github.com/o/r.git") == "a token in the URI"
    assert find_credential("ssh://git@github.com/o/r.git") == "a user/token in the URI"  # a user deploy_all allows
    for container in ("abfss://corpus@acct.dfs.core.windows.net/raw", "wasbs://mlflow@acct.blob.core.windows.net/a"):
        assert redact(container) == container and find_credential(container) is None
    assert find_credential("abfss://corpus:hunter2@acct.dfs.core.windows.net/raw") == "a password in the URI"


@pytest.mark.parametrize(
    "clean",
    [
        "max_tokens=512 pad_token='<pad>' eos_token: </s> tokens_per_s=3400.5",
        "Password: must be set through PGPASSWORD",
        "Basic authentication failed",
        "Basic authentication. bearer authentication.",  # a sentence's full stop is no token's
        "TESTS_PASSED=3 FOO_PASSTHROUGH=1",
        "api_key_env=OPENAI_API_KEY secret_block=shardline-s3 {'api_key_env': 'X'}",
        "hf_model.py hf_config ghp_short",
        "private_key_path: /etc/ssl/k.pem\nprivate_key_file=k.pem",  # where a key is, not the key
        "a -> b: |x| > 2",
    ],
)
def test_words_that_name_secrets_without_holding_one_are_unchanged(clean):
    assert redact(clean) == clean


@pytest.mark.parametrize(
    "clean",
    [
        "s3://bucket/prefix",
        "http://127.0.0.1:5000",
        "az://container/p",
        "ray://head:10001",
        "models:/shardline-gpt@champion",
        "sqlite:////tmp/x/mlflow.db",
        "plain text",
        "https://mlflow.example:5000/p?mail=a@b",  # a port, then an '@' in the query: no userinfo
        "s3://bucket/key@v2",
        "http://[::1]:8080/x?mail=a@b.com",  # an IPv6 host, then an '@' in the query
    ],
)
def test_values_without_credentials_are_unchanged(clean):
    assert redact(clean) == clean and find_credential(clean) is None


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ('registry.tracking_uri="https://bob:hunter2@mlflow.example.com"', "registry.tracking_uri"),
        ('cluster.address="ray://bob:hunter2@head:10001"', "cluster.address"),
        ('train.storage_path="https://acct.blob.core.windows.net/c?sig=hunter2"', "train.storage_path"),
    ],
)
def test_config_refuses_credentials_without_repeating_them(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert field in str(err.value) and "hunter2" not in str(err.value)


def test_config_type_errors_do_not_echo_credentials():
    with pytest.raises(ConfigError) as err:
        load_config(None, ['train.steps="https://u:hunter2@h"'])
    assert "train.steps" in str(err.value) and "hunter2" not in str(err.value)


def test_mlflow_params_are_redacted():
    from infra.config import ClusterConfig

    cfg = ClusterConfig.model_construct(mode="remote", address="ray://u:hunter2@head:10001")
    assert flat_params("cluster", cfg)["cluster.address"] == "ray://u:***@head:10001"


def test_tracking_password_from_the_environment_moves_into_mlflow_variables(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://bob:hunter%402@127.0.0.1:5000")
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    assert resolve_tracking_uri() == "http://127.0.0.1:5000"
    import os

    assert (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]) == ("bob", "hunter@2")
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5000"


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def task_logger():
    logger = logging.getLogger("prefect.task_runs")
    capture = _Capture()
    logger.addHandler(capture)
    log_hygiene.install()
    yield logger, capture
    logger.removeHandler(capture)


def test_expected_failure_is_logged_without_traceback_and_unexpected_keeps_it(task_logger):
    from training.checkpoint import CheckpointError

    logger, capture = task_logger
    for exc in (CheckpointError("/ck/__0_0.distcp: sha256 does not match"), KeyError("a bug")):
        try:
            raise exc
        except Exception as e:  # noqa: BLE001 - both kinds, as Prefect's task runner logs them
            logger.error("Task run failed with exception: %r", e, exc_info=True)
    expected, unexpected = capture.lines
    assert expected == "Task run failed with exception: CheckpointError('/ck/__0_0.distcp: sha256 does not match')"
    assert "Traceback (most recent call last)" in unexpected and "KeyError: 'a bug'" in unexpected


def test_log_messages_are_redacted_on_every_handler(task_logger):
    logger, capture = task_logger
    logger.warning("cannot reach %s", "https://bob:hunter2@mlflow.example.com")
    assert capture.lines == ["cannot reach https://bob:***@mlflow.example.com"]


def test_a_git_url_with_a_token_is_refused_before_anything_is_deployed():
    """Prefect stores each deployment's pull step (the repository URL) and shows it in its UI."""
    from flows.stack.deploy import deploy_all
    from flows.stack.procs import StackError

    with pytest.raises(StackError, match=r"x-access-token:\*\*\*@github.com/o/r.git carries a password") as err:
        deploy_all("http://127.0.0.1:9/api", repository="https://x-access-token:ghs_hunter2@github.com/o/r.git")
    assert "hunter2" not in str(err.value)
    with pytest.raises(StackError, match="carries a token in the URI") as err:
        deploy_all("http://127.0.0.1:9/api", repository=f"https://{GHP}@github.com/o/r.git")
    assert GHP not in str(err.value)

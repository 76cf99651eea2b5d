"""The PostgreSQL part: one server given by `stack.backend`, two databases on it (MLflow's and Prefect's).

shardline does not run the server; it checks that it answers and creates the databases when missing. A password
in the URL is moved to PGPASSWORD for the child processes (libpq and asyncpg both read it), so it never appears
in a command line, the state file, a log or the status output.
"""

from __future__ import annotations

from pydantic import BaseModel

from flows.stack.procs import StackError
from infra.redact import redact


class Backend(BaseModel):
    """A parsed `postgresql://USER[:PASSWORD]@HOST:PORT/NAME`; `password` never leaves this process but via env."""

    user: str
    host: str
    port: int
    name: str
    password: str = ""

    def url(self, driver: str, database: str) -> str:
        """SQLAlchemy URL without the password, e.g. driver='psycopg2' or 'asyncpg'."""
        return f"postgresql+{driver}://{self.user}@{self.host}:{self.port}/{database}"

    @property
    def display(self) -> str:
        return f"postgresql://{self.user}@{self.host}:{self.port}/{self.name}"

    @property
    def databases(self) -> dict[str, str]:
        return {"mlflow": f"{self.name}_mlflow", "prefect": f"{self.name}_prefect"}

    def env(self) -> dict[str, str]:
        """Variables the servers need to log in."""
        return {"PGPASSWORD": self.password} if self.password else {}


class BackendError(StackError):
    """`stack.backend` is not a URL the stack can use; raised before anything starts."""


def parse_backend(text: str) -> Backend:
    """Parse `stack.backend`.

    Raises:
        BackendError: not a postgresql:// URL with user, host and database name, or a password with an unescaped '@'
            (the message hides the password).
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(text)
    except ArgumentError:
        raise BackendError("stack.backend: expected postgresql://USER@HOST:PORT/NAME") from None
    except ValueError:  # `host:abc`: SQLAlchemy's int() of the port
        raise BackendError("stack.backend: the port is not a number in 1-65535") from None
    if "@" in (url.host or ""):
        # `user:pa@ss@host`: the password ends at its first '@' and the rest of it is taken for the host, which the
        # state file, `status` and libpq's "could not translate host name" show; the message quotes none of it
        raise BackendError("stack.backend: the password holds an '@'; escape @ in the password as %40") from None
    # hide_password covers user:password@ only; a `?password=` (libpq's own spelling) is masked by redact
    shown = redact(url.render_as_string(hide_password=True))
    if url.get_backend_name() != "postgresql" or not url.username or not url.host or not url.database:
        raise BackendError(f"stack.backend: expected postgresql://USER@HOST:PORT/NAME, got {shown!r}")
    port = 5432 if url.port is None else url.port
    if not 0 < port < 65536:
        raise BackendError(f"stack.backend: the port is not a number in 1-65535, got {shown!r}")
    query_password = url.query.get("password", "")
    if not isinstance(query_password, str):  # `?password=a&password=b`: SQLAlchemy keeps both
        query_password = query_password[-1]
    return Backend(
        user=url.username,
        host=url.host,
        port=port,
        name=url.database,
        password=url.password or query_password,
    )


def ensure_databases(backend: Backend, timeout_s: float = 10.0) -> list[str]:
    """Create MLflow's and Prefect's databases when missing; return the ones created.

    Raises:
        StackError: the server does not answer or refuses the login (host, port and user named; no password).
    """
    import psycopg2
    from psycopg2 import sql

    try:
        conn = psycopg2.connect(
            host=backend.host,
            port=backend.port,
            user=backend.user,
            dbname="postgres",
            password=backend.password or None,
            connect_timeout=int(timeout_s),
        )
    except psycopg2.OperationalError as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise StackError(f"postgres: cannot log in to {backend.display} as {backend.user!r}: {first}") from None
    created = []
    try:
        conn.autocommit = True  # CREATE DATABASE cannot run inside a transaction
        with conn.cursor() as cur:
            for db in backend.databases.values():
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (db,))
                if cur.fetchone() is None:
                    try:
                        cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
                        created.append(db)
                    except psycopg2.errors.DuplicateDatabase:  # created by a concurrent `up`
                        pass
    finally:
        conn.close()
    return created

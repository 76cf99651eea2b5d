"""PipelineConfig: the six stage configs in one model; the TOML file, the flow parameter and the UI form."""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from deployments.config import CanaryConfig, RegistryConfig, ServeConfig
from deployments.gateway_control import EndpointConflict, check_endpoint_free
from flows.stack.config import StackConfig
from infra.config import ClusterConfig
from infra.paths import shardline_home
from infra.redact import redact
from infra.remote import RemoteConfigError, check_remote_config
from training.chat_template import ChatFormat
from training.config import (
    DEFAULT_FACTORY,
    GPT_MODULE,
    TokenizerConfig,
    TrainConfig,
    ValidationConfig,
    check_global_batch,
)
from training.data.config import DataConfig


class ConfigError(ValueError):
    """A user mistake in a config file or override; its message is one line per problem."""


class PipelineConfig(BaseModel):
    """Everything one pipeline run needs, one section per stage."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN bound never fails a check

    data: DataConfig = Field(default_factory=DataConfig, description="shard_dataset: corpus, split, shards.")
    tokenizer: TokenizerConfig = Field(
        default_factory=TokenizerConfig,
        description="shard_dataset: bytes (the default), or token ids of a tokenizer.json or a BPE trained in "
        "the run; training, validation and serving then use that tokenizer's ids.",
    )
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="provision_cluster: which Ray.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="train_fsdp: model and optimisation.")
    validation: ValidationConfig = Field(
        default_factory=ValidationConfig, description="validate_checkpoint: the quality gate."
    )
    registry: RegistryConfig = Field(default_factory=RegistryConfig, description="promote_model: MLflow registry.")
    canary: CanaryConfig = Field(default_factory=CanaryConfig, description="canary_deploy: ramp and gates.")
    serve: ServeConfig = Field(default_factory=ServeConfig, description="The live endpoint the canary releases into.")

    @model_validator(mode="after")
    def _train_fits_the_data(self) -> PipelineConfig:
        """What training would refuse only after the data stage published its shards, refused at load instead: a
        global batch the workers cannot make, the built-in GPT's heads not dividing its width, and an embedding
        smaller than the ids the tokenizer gives (bytes: 256; a BPE trained in the run: tokenizer.vocab_size, the
        size asked, although a small corpus may train fewer: a config that fits only then breaks as the corpus grows;
        a tokenizer file is read, and checked, as a pipeline run starts: check_tokenizer_fits)."""
        t = self.train
        check_global_batch(t, t.workers)
        if (t.model_factory == DEFAULT_FACTORY or t.lightning_module == GPT_MODULE) and t.d_model % t.n_head:
            raise ValueError(f"train.d_model={t.d_model} is not divisible by train.n_head={t.n_head}")
        ids = {"bytes": 256, "train": self.tokenizer.vocab_size}.get(self.tokenizer.kind)
        if ids is None:
            return self
        source = f"tokenizer.kind={self.tokenizer.kind!r} gives {ids} ids"
        rows, setting = self.embedding_limit()
        if rows and rows < ids:
            fix = (
                f"set it to 0 or at least {ids}"
                if setting == "train.vocab_size"
                else f"the embedding needs {ids} rows or more"
            )
            raise ValueError(f"{setting}={rows}: {source}; {fix}")
        return self

    def embedding_limit(self) -> tuple[int, str]:
        """How many ids the configured model embeds, and the setting that says so; (0, "") when training sizes it to
        the data (train.vocab_size = 0) or it is known only once the model is loaded (a config.json path)."""
        t = self.train
        if isinstance(t.hf_config, dict) and t.hf_config:
            from training.hf_model import embedding_rows

            return embedding_rows(t.hf_config), "train.hf_config vocab_size"
        if t.hf_config or not t.vocab_size:
            return 0, ""
        return t.vocab_size, "train.vocab_size"


def _parse_value(text: str) -> Any:
    """Read an override value as TOML (numbers, booleans, arrays, quoted strings), else as a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    except RecursionError:
        raise ConfigError(f"--set value {redact(text)[:60]!r}...: nested too deeply") from None


def _wants_text(parts: list[str]) -> bool:
    """Whether the PipelineConfig field at the dotted path `parts` (through nested models) is a `str` (or
    `str | None`): a value of it that reads as a TOML number, date, boolean or array is meant as that text."""
    import types
    import typing

    def members(annotation: Any) -> tuple[Any, ...]:  # X | Y -> (X, Y); X -> (X,)
        union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        return typing.get_args(annotation) if union else (annotation,)

    model: Any = PipelineConfig
    annotation: Any = None
    for part in parts:
        if model is None or part not in model.model_fields:
            return False  # an unknown key: validation names it
        annotation = model.model_fields[part].annotation
        nested = [a for a in members(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        model = nested[0] if len(nested) == 1 else None
    return set(members(annotation)) in ({str}, {str, type(None)})


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one `section.key=value` override to a raw config dict, in place.

    The value is read as TOML, but for a string setting it stays the text given when TOML would read it as
    something else (`registry.model_name=2024`, a date, `true`).
    """
    shown = redact(assignment)  # a mistyped key's value may be a URI with a password in it
    if "=" not in assignment:
        raise ConfigError(f"--set {shown!r}: expected section.key=value")
    dotted, value = assignment.split("=", 1)
    parts = [p for p in dotted.strip().split(".") if p]
    if len(parts) < 2:
        raise ConfigError(f"--set {shown!r}: expected section.key=value, e.g. train.steps=50")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {shown!r}: {part!r} is not a section")
    text = value.strip()
    parsed = _parse_value(text)
    node[parts[-1]] = text if not isinstance(parsed, str) and _wants_text(parts) else parsed


_NEVER_SHOWN = re.compile(r"(?i)(token|secret|password)")


def describe_errors(err: ValidationError, origin: str) -> str:
    """One line per problem, naming the dotted key and the value, e.g. `demo.toml: train.stepz: unknown key`.

    Values are shown with any credential in them masked.
    """
    from infra.redact import clip, redact

    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if not key:  # a check across sections: its message names the keys (the input is the whole config)
            lines.append(f"{origin}: {str(e['msg']).removeprefix('Value error, ')}")
        elif e["type"] == "extra_forbidden":
            lines.append(f"{origin}: unknown key '{key}'")
        else:
            got = clip(repr(e.get("input")), 120)  # a long inline table or string, shortened
            if _NEVER_SHOWN.search(key):  # a token pasted where a variable's name goes: whatever it is, unshown
                got = "'***'"
            lines.append(f"{origin}: {key}: {str(e['msg']).removeprefix('Value error, ')} (got {got})")
    return redact("\n".join(lines))


_WHERE_INSTEAD = {
    "registry.tracking_uri": "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or a password in "
    "$MLFLOW_TRACKING_URI)",
    "cluster.address": "the cluster's own authentication (Ray token auth: RAY_AUTH_TOKEN in the environment)",
}


def check_no_credentials(config: PipelineConfig | dict[str, Any], origin: str = "config", prefix: str = "") -> None:
    """ConfigError when any config value holds a credential (a password in a URI, a signed query, an account key,
    a token of a known shape).

    The config is the Prefect flow parameter (stored in Prefect's database) and is logged to MLflow, so
    credentials come from the environment or Prefect Secret blocks only. The message masks the credential.
    `config` may also be a plain mapping (the `[stack]` table's values), its keys named under `prefix`.
    """
    from infra.redact import find_credential, redact

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(f"{prefix}[{i}]", v)
        elif isinstance(value, str):
            what = find_credential(value)
            if what:
                instead = _WHERE_INSTEAD.get(prefix, "the environment or a Prefect Secret block (see README)")
                raise ConfigError(
                    f"{origin}: {prefix}={redact(value)!r} holds {what}; configs are stored by Prefect and logged "
                    f"to MLflow, so give credentials through {instead}"
                )

    walk(prefix, config if isinstance(config, dict) else config.model_dump())


def read_raw(path: str | Path | None, overrides: list[str] | None) -> tuple[dict[str, Any], str]:
    """The TOML file with overrides applied, unvalidated, and a name for it in messages."""
    raw: dict[str, Any] = {}
    origin = "config"
    if path is not None:
        origin = shown = redact(str(path))  # a mistyped --config may be a URI with a password in it
        try:
            if Path(path).exists() and not Path(path).is_file() and not Path(path).is_dir():
                raise ConfigError(f"{shown}: not a regular file (a FIFO or a device would never end)")
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{shown}: no such config file") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{shown}: not valid TOML: {redact(e)}") from None
        except RecursionError:
            raise ConfigError(f"{shown}: not TOML this reads: nested too deeply") from None
        except OSError as e:  # a directory, a file it may not read
            raise ConfigError(f"{shown}: cannot read the config: {e.strerror or type(e).__name__}") from None
    for assignment in overrides or []:
        apply_override(raw, assignment)
    if overrides:
        origin = f"{origin} (with --set)"
    return raw, origin


class _StackTable(BaseModel):
    stack: StackConfig = Field(default_factory=StackConfig)


def load_stack_config(
    path: str | Path | None = None, overrides: list[str] | None = None, probe_endpoint: bool = False
) -> tuple[StackConfig, PipelineConfig]:
    """The `[stack]` table of a config file (settings of `shardline up`) and the pipeline sections beside it.
    `probe_endpoint`: also ask whoever listens on serve.port whether shardline can serve there (check_serving),
    for the commands that serve (`run`, `serve`, `up`, `notify-dataset`); the others (`down`, `serve --stop`,
    `shard`, `canary`, ...) must work whatever holds that port.

    Raises:
        ConfigError: as for load_config, with keys of the stack table named `stack.KEY`.
    """
    raw, origin = read_raw(path, overrides)
    try:
        stack = _StackTable.model_validate({"stack": raw.pop("stack", {})}).stack
        config = PipelineConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(describe_errors(e, origin)) from None
    # the stack's settings reach `mlflow server`'s command line and `shardline status`; its backend is a database
    # URI whose password comes from PGPASSWORD, and a bare user there is a database user, not a credential
    check_no_credentials(stack.model_dump(exclude={"backend"}), origin, prefix="stack")
    check_no_credentials(config, origin)
    check_remote_storage(config, origin)
    check_serving(config, origin, probe=probe_endpoint)
    return stack, config


def chat_template_of(
    config: PipelineConfig,
    origin: str = "config",
    warn: Callable[[str], None] | None = None,
    discover: bool = True,
) -> ChatFormat:
    """The chat format the run's model version will carry (training.chat_template.ChatFormat): the template of
    `tokenizer.chat_template`, or the one beside a `tokenizer.path`, read and parsed before anything trains, with
    the special tokens the tokenizer names (`_special_tokens_of`, also when there is no template); false when
    there is no template.

    A template named in `tokenizer.chat_template` must be usable; one merely found beside `tokenizer.path` that is
    not (unreadable, or a tag Jinja does not know) is left out with one warning line, so a tokenizer directory that
    trained before still trains.

    Args:
        warn: where that warning goes (the run's logger); None drops it.
        discover: look beside `tokenizer.path` (release-from-shards turns it off when the set's ids come from
            another tokenizer than the config's).

    Raises:
        ConfigError: one line naming the file, when a named one cannot be read or is not a chat template.
    """
    from training import chat_template

    tok = config.tokenizer
    template = ""
    if tok.chat_template:
        try:
            template = chat_template.read(tok.chat_template)
        except ValueError as e:
            raise ConfigError(f"{origin}: tokenizer.chat_template: {e}") from None
    elif tok.kind == "file" and discover:
        try:
            template = chat_template.discover(tok.path)
        except ValueError as e:
            if warn is not None:
                warn(f"tokenizer.path: the chat template beside it is not used: {e}")
    # the tokens even without a template: serve.chat_template, set for such a version, renders with them
    return ChatFormat.of(template, _special_tokens_of(config, discover, warn))


def _special_tokens_of(config: PipelineConfig, discover: bool, warn: Callable[[str], None] | None) -> dict[str, str]:
    """The bos_token and eos_token a chat template sees, as transformers 5 gives them: from the
    `tokenizer_config.json` named as the template, else the one beside `tokenizer.path`; a
    `special_tokens_map.json` beside that file (an older tokenizer directory keeps them there) overrides those,
    unless the tokenizer_config.json has an `added_tokens_decoder` (then transformers does not read it).
    Validation keeps those the tokenizer has as special tokens, and names an eos_token nobody named as the
    flavor's tokenizer names it (training.servable). A file there that cannot be read is one warning line, and
    its tokens are not used."""
    from training import chat_template

    tok = config.tokenizer
    config_uri = ""
    if tok.chat_template.endswith(".json"):
        config_uri = tok.chat_template
    elif tok.kind == "file" and discover:
        config_uri = chat_template.beside(tok.path)
    # from the config's own directory, as transformers loads one directory
    map_uri = chat_template.beside(config_uri, "special_tokens_map.json") if config_uri else ""

    def read(uri: str) -> tuple[dict[str, str], bool]:
        try:
            return chat_template.special_tokens(uri)
        except ValueError as e:
            if warn is not None:
                warn(f"tokenizer: the special tokens of the chat template are not used: {e}")
            return {}, False

    tokens, has_decoder = read(config_uri) if config_uri else ({}, False)
    if map_uri and not has_decoder:
        tokens |= read(map_uri)[0]  # transformers merges the map over the config's own
    return {key: token for key, token in tokens.items() if token}  # one named as none is none


def check_tokenizer_fits(config: PipelineConfig, origin: str = "config") -> None:
    """ConfigError when a tokenizer.path file has more ids than the configured model embeds: read before the corpus
    is (the data stage would tokenize and publish all of it, and training refuse only then). A trained BPE's size
    and the bytes' 256 are checked at load (PipelineConfig); a model sized from the data fits whatever it gets.

    Raises:
        ConfigError: one line naming both sizes; or the file cannot be read (tokenizer.TokenizerError's line).
    """
    rows, setting = config.embedding_limit()
    if config.tokenizer.kind != "file" or not rows:
        return
    from training import tokenizer as tk

    try:
        tk.check_fits(tk.load(config.tokenizer.path), rows, f"{setting}={rows}")
    except tk.TokenizerError as e:
        raise ConfigError(f"{origin}: {e}") from None


def check_serving(config: PipelineConfig, origin: str = "config", probe: bool = True) -> None:
    """ConfigError when the canary is on but the live endpoint it ramps on is off, or (`probe`: an HTTP request to
    serve.port) when the endpoint's address cannot host shardline's gateway (a route prefix or port held by
    something shardline did not start): found before anything trains, so nothing is registered for a model that
    could not be served."""
    if config.canary.enabled and not config.serve.enabled:
        raise ConfigError(
            f"{origin}: canary.enabled = true needs serve.enabled = true (the canary ramps on the live "
            "endpoint); set canary.enabled = false to end runs at the registry"
        )
    if config.serve.enabled and probe:
        try:
            check_endpoint_free(config.serve)
        except EndpointConflict as e:
            raise ConfigError(f"{origin}: {e}") from None


def check_remote_storage(config: PipelineConfig, origin: str = "config", tracking_uri: str = "") -> None:
    """ConfigError when a remote cluster's nodes could not reach the run's checkpoints, shards or MLflow store, or
    cannot run its data engine or canary (infra.remote.check_remote_config on the pipeline's settings).

    `tracking_uri` is the resolved one (the flow knows it); else registry.tracking_uri, else $MLFLOW_TRACKING_URI.
    """
    home = shardline_home()
    tracking = tracking_uri or config.registry.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    settings = {
        "train.storage_path": (config.train.storage_path, str(home / "checkpoints")),
        "data.output": (config.data.output, str(home / "shards")),
        "registry.tracking_uri": (tracking, f"sqlite:///{home / 'mlflow.db'}"),
    }
    try:
        check_remote_config(
            config.cluster, settings, data_engine=config.data.engine, canary_enabled=config.canary.enabled
        )
    except RemoteConfigError as e:  # it quotes the settings, $MLFLOW_TRACKING_URI's password among them
        raise ConfigError(f"{origin}: {redact(e)}") from None


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, probe_endpoint: bool = False
) -> PipelineConfig:
    """Build a PipelineConfig from an optional TOML file and `section.key=value` overrides.

    A `[stack]` table is `shardline up`'s; it is checked and set aside, so one file can serve both commands.
    `probe_endpoint`: as for load_stack_config (the flow probes at its start whatever the caller chose).

    Raises:
        ConfigError: the file is missing or not TOML, or a key is unknown or a value invalid.
    """
    return load_stack_config(path, overrides, probe_endpoint)[1]

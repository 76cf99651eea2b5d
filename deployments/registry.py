"""The MLflow model registry side of a rollout: register a version, read aliases, decide and apply alias moves."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from infra.names import (  # noqa: F401 - re-exported: the registry's names, defined with every cross-process name
    CHALLENGER,
    CHAMPION,
    TAG_CANARY_COMMAND,
    TAG_CANARY_DECISION,
    TAG_CANARY_ID,
    TAG_CANARY_REASON,
    TAG_CANARY_STATE,
    TAG_REJECTED,
    TAG_SERVE_ERROR,
    TAG_SERVED_BY,
)

_MAX_TAG_VALUE = 5000  # MLflow caps model version tag values (8000 in recent servers); stay well below


class RegistryError(RuntimeError):
    """The registry is not in the state a decision was taken on, or a version is missing."""


class AliasChanged(RegistryError):
    """Compare-and-set refused: an alias moved between the decision and its application."""


class ChampionUnloadable(RegistryError):
    """The champion's logged model was read but does not load as served (its factory, config or files changed
    since it was logged); loading it again would fail the same way, so a stage does not retry it."""


class PromotionResult(BaseModel):
    """What promote_model hands to the canary stage."""

    model_name: str
    version: str
    # "rejected": the version (reused by a rerun: same checkpoint) was rejected by an earlier canary; no alias moved
    decision: Literal["first-champion", "challenger", "rejected"]
    champion_version: str | None  # the champion before this run
    challenger_version: str
    reason: str = ""  # why: the PromotionDecision's reason, or why a rejected version got no alias


class PromotionDecision(BaseModel):
    """Which aliases a newly registered version gets, computed from the aliases as read (compare, then act)."""

    model_name: str
    candidate: str  # the new version
    baseline: str | None  # the champion when the decision was taken
    verdict: Literal["first-champion", "challenger"]
    reason: str

    def result(self) -> PromotionResult:
        return PromotionResult(
            model_name=self.model_name,
            version=self.candidate,
            decision=self.verdict,
            champion_version=self.baseline,
            challenger_version=self.candidate,
            reason=self.reason,
        )


def client_for(tracking_uri: str) -> Any:
    """An MlflowClient whose tracking and registry are both `tracking_uri`."""
    from infra.paths import quiet_telemetry

    quiet_telemetry()
    import mlflow

    return mlflow.MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def model_id_of(model_uri: str) -> str | None:
    """The logged-model id of a `models:/<model_id>` URI (MLflow 3), else None."""
    prefix = "models:/"
    if not model_uri.startswith(prefix):
        return None
    rest = model_uri[len(prefix) :].strip("/")
    return rest if rest and "/" not in rest and "@" not in rest else None


def ensure_registered_model(client: Any, name: str) -> None:
    """Create the registered model `name` unless it exists."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
            raise


def register_version(client: Any, name: str, model_uri: str, run_id: str, tags: dict[str, str] | None = None) -> str:
    """Register `model_uri` as a new version of `name` whose run is `run_id` (the training run); return it.

    Idempotent: a version of `name` with the same source and run id, or made from the same checkpoint (its
    `shardline.checkpoint_uri` tag: a rerun after a crash validates and logs the reused checkpoint again), is
    reused. A version whose source is `model_uri` (a retried promote) gets its tags (re)applied. A version matched
    by its checkpoint only keeps its lineage tags: its source stays the first run's logged model, and tags naming
    this run's model, validation run and flow run would describe a model it was not registered from; the rerun is
    recorded under TAG_REVALIDATED_BY instead. A version the canary rejected (TAG_REJECTED) gets neither: its tags
    keep describing the run that was judged. A version of the same checkpoint whose model carries something else (a
    changed chat template: infra.names.VERSION_CONTENT_TAGS) is not that model: a new version is registered, so
    no version's tags describe a model other than its source.
    """
    import mlflow

    # the SQL registry resolves a models:/<model_id> source through the *global* tracking URI
    if model_id_of(model_uri) and mlflow.get_tracking_uri() != client.tracking_uri:
        mlflow.set_tracking_uri(client.tracking_uri)
    ensure_registered_model(client, name)
    tags = {k: str(v)[:_MAX_TAG_VALUE] for k, v in (tags or {}).items() if v not in (None, "")}
    from infra.names import TAG_CHECKPOINT_URI, TAG_REVALIDATED_BY, VERSION_CONTENT_TAGS

    checkpoint = tags.get(TAG_CHECKPOINT_URI)
    for mv in client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
        have = mv.tags or {}
        same = checkpoint and have.get(TAG_CHECKPOINT_URI) == checkpoint
        if mv.source == model_uri or (same and all(have.get(k, "") == tags.get(k, "") for k in VERSION_CONTENT_TAGS)):
            if have.get(TAG_REJECTED):  # a rerun reused a rejected version: its lineage stays what was judged
                return str(mv.version)
            if mv.source == model_uri:
                for key, value in tags.items():
                    client.set_model_version_tag(name, mv.version, key, value)
            else:  # the same checkpoint, another logged model: its lineage stays its source's
                client.set_model_version_tag(name, mv.version, TAG_REVALIDATED_BY, _revalidation(model_uri, tags))
            return str(mv.version)
    mv = client.create_model_version(name, source=model_uri, run_id=run_id, tags=tags, model_id=model_id_of(model_uri))
    return str(mv.version)


def _revalidation(model_uri: str, tags: dict[str, str]) -> str:
    """What a rerun that reused a version by its checkpoint produced (TAG_REVALIDATED_BY's value, JSON): its own
    flow run, validation run and logged model, kept apart from the version's lineage tags."""
    import json

    from infra.names import TAG_FLOW_RUN_ID, TAG_VALIDATION_RUN_ID

    rerun = {
        "prefect_flow_run_id": tags.get(TAG_FLOW_RUN_ID, ""),
        "validation_run_id": tags.get(TAG_VALIDATION_RUN_ID, ""),
        "model_uri": model_uri,
    }
    return json.dumps(rerun, sort_keys=True)[:_MAX_TAG_VALUE]


def version_tags(
    *,
    dataset_digest: str,
    flow_run_id: str,
    train_run_id: str,
    checkpoint_uri: str,
    validation_run_id: str,
    model_uri: str,
    data_run_id: str = "",
    manifest_uri: str = "",
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    """The lineage tags of a model version: what it was made from, under infra.names' tag names."""
    from infra import names as n
    from infra import tracking as t

    tags = {
        n.TAG_DATASET_DIGEST: dataset_digest,
        n.TAG_FLOW_RUN_ID: flow_run_id,
        n.TAG_TRAIN_RUN_ID: train_run_id,
        n.TAG_CHECKPOINT_URI: checkpoint_uri,
        n.TAG_VALIDATION_RUN_ID: validation_run_id,
        n.TAG_MODEL_URI: model_uri,
        n.TAG_DATA_RUN_ID: data_run_id,
        n.TAG_MANIFEST_URI: manifest_uri,
        **t.git_tags(),
        **(extra or {}),
    }
    return {k: str(v) for k, v in tags.items() if v not in (None, "")}


def read_aliases(client: Any, name: str) -> dict[str, str]:
    """alias -> version of registered model `name`; {} when the model does not exist yet."""
    from mlflow.exceptions import MlflowException

    try:
        model = client.get_registered_model(name)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return {}
        raise
    return {alias: str(version) for alias, version in (model.aliases or {}).items()}


def decide_promotion(name: str, candidate: str, aliases: dict[str, str]) -> PromotionDecision:
    """A new version becomes `challenger`; when no other version is `champion`, it becomes champion directly."""
    champion = aliases.get(CHAMPION)
    if champion is None:
        return PromotionDecision(
            model_name=name,
            candidate=candidate,
            baseline=None,
            verdict="first-champion",
            reason=f"{name} has no '{CHAMPION}' alias; validated version {candidate} becomes champion",
        )
    if champion == candidate:  # a retried promote_model after the first attempt applied its decision
        return PromotionDecision(
            model_name=name,
            candidate=candidate,
            baseline=champion,
            verdict="first-champion",
            reason=f"version {candidate} is already '{CHAMPION}' of {name}",
        )
    return PromotionDecision(
        model_name=name,
        candidate=candidate,
        baseline=champion,
        verdict="challenger",
        reason=f"version {candidate} challenges champion version {champion}; the canary decides",
    )


def move_alias(client: Any, name: str, alias: str, expected: str | None, version: str) -> None:
    """Point `alias` at `version`, but only if it still points at `expected` (None: unset).

    MLflow has no atomic compare-and-set; re-reading just before the write narrows the race to the two calls.

    Raises:
        AliasChanged: the alias moved since the decision was taken.
    """
    current = read_aliases(client, name).get(alias)
    if current == version:
        return
    if current != expected:
        raise AliasChanged(
            f"{name}: alias '{alias}' is at version {current}, the decision expected {expected}; "
            f"refusing to move it to {version}"
        )
    client.set_registered_model_alias(name, alias, version)


def apply_promotion(client: Any, decision: PromotionDecision) -> PromotionResult:
    """Apply a PromotionDecision: `challenger` -> candidate; `champion` -> candidate when first-champion."""
    name, candidate = decision.model_name, decision.candidate
    if decision.verdict == "first-champion":
        move_alias(client, name, CHAMPION, decision.baseline, candidate)
    else:  # the champion must still be the baseline the canary will compare against
        current = read_aliases(client, name).get(CHAMPION)
        if current != decision.baseline:
            raise AliasChanged(
                f"{name}: alias '{CHAMPION}' is at version {current}, the decision expected {decision.baseline}"
            )
    client.set_registered_model_alias(name, CHALLENGER, candidate)
    return decision.result()


def tag_rejected(client: Any, name: str, version: str, reason: str) -> None:
    """Mark `version` as rejected by the canary, with the reason."""
    client.set_model_version_tag(name, version, TAG_REJECTED, (reason or "rejected")[:_MAX_TAG_VALUE])
    client.set_model_version_tag(name, version, TAG_CANARY_DECISION, "rejected")


def version_source(client: Any, name: str, version: str) -> str:
    """The source URI of a model version (the logged model it was registered from)."""
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version(name, version).source)
    except MlflowException as e:
        raise RegistryError(f"{name}: version {version} not found in the registry: {e.message}") from None


def seq_len_of(model_uri: str) -> int:
    """The context length recorded in a logged model's metadata ("seq_len")."""
    import mlflow

    metadata = mlflow.models.get_model_info(model_uri).metadata or {}
    if "seq_len" not in metadata:
        raise RegistryError(f"{model_uri}: logged model has no 'seq_len' in its metadata")
    return int(metadata["seq_len"])


def champion_model(tracking_uri: str, name: str) -> tuple[str, Any] | None:
    """(version, loaded model) of `name`'s champion as it is served (training.servable: a transformers model from
    its flavor's safetensors, the pt2 program or the eager model); None when there is no champion."""
    import mlflow

    from infra.redact import first_line
    from training.servable import load_served_model

    aliases = read_aliases(client_for(tracking_uri), name)
    version = aliases.get(CHAMPION)
    if version is None:
        return None
    mlflow.set_registry_uri(tracking_uri)
    try:
        return version, load_served_model(f"models:/{name}/{version}")
    except Exception as e:  # noqa: BLE001 - e.g. an eager champion whose factory or TrainConfig changed since
        if store_unavailable(e):  # the tracking server or the artifact store did not answer: worth a retry
            raise RegistryError(f"{name} champion v{version}: its store did not answer: {first_line(e)}") from None
        raise ChampionUnloadable(
            f"{name} champion v{version} does not load as served: {first_line(e)}; point alias '{CHAMPION}' at a "
            "version that loads, or delete the alias, to judge new versions again"
        ) from None


_UNANSWERED = ("API request to", "The following failures occurred while downloading")


def store_unavailable(err: BaseException) -> bool:
    """True when `err` (or what it was raised from) says a server did not answer or failed on its side: what
    infra.storage_retry.is_transient retries (a refused or timed-out connection, S3 or Azure 5xx and throttling),
    requests' connection errors and timeouts, and MLflow's 5xx answers, "API request to ... failed" after its own
    retries and a failed download of listed files. A missing file, a model that does not build or a refused request
    is not."""
    import requests
    from mlflow.exceptions import MlflowException, RestException

    from infra.storage_retry import is_transient

    seen: BaseException | None = err
    for _ in range(5):
        if seen is None:
            return False
        if is_transient(seen) or isinstance(seen, (requests.ConnectionError, requests.Timeout)):
            return True
        if isinstance(seen, MlflowException) and seen.get_http_status_code() >= 500:
            # the server's own 5xx, no answer at all (MLflow's rest_utils words both), or a listed file whose
            # download failed (ArtifactRepository.download_artifacts collects its threads' errors, their causes
            # dropped; a missing file there is a 404)
            if isinstance(seen, RestException) or seen.message.startswith(_UNANSWERED):
                return True
        seen = seen.__cause__ or seen.__context__
    return False


def mark_serving(client: Any, name: str, gateway: str, error: str = "") -> None:
    """Record on the registered model that `gateway` serves (or should serve) its champion, and the last error
    serving it ("" clears it): `shardline serve` reconciles every such model, `shardline status` reports them."""
    client.set_registered_model_tag(name, TAG_SERVED_BY, gateway)
    if error:
        client.set_registered_model_tag(name, TAG_SERVE_ERROR, error[:500])
    elif TAG_SERVE_ERROR in (client.get_registered_model(name).tags or {}):
        client.delete_registered_model_tag(name, TAG_SERVE_ERROR)


def unmark_serving(client: Any, name: str) -> bool:
    """Forget that a gateway serves the model (its served-by tag and last serving error): `shardline serve --stop`
    removed its application, and a model still marked would be served again by the next `shardline serve` of any
    other model (serving.reconcile_others). False when there was no mark (or no such model)."""
    from mlflow.exceptions import MlflowException

    try:
        tags = client.get_registered_model(name).tags or {}
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise
    for tag in (TAG_SERVED_BY, TAG_SERVE_ERROR):
        if tag in tags:
            client.delete_registered_model_tag(name, tag)
    return TAG_SERVED_BY in tags


def served_champions(client: Any, gateway: str | None = None) -> dict[str, dict[str, str]]:
    """Models marked as served (by `gateway`, or by any) that have a champion: name -> {"champion", "error"}."""
    out = {}
    for model in client.search_registered_models(
        filter_string=f"tags.`{TAG_SERVED_BY}` " + (f"= '{gateway}'" if gateway else "LIKE '%'")
    ):
        champion = (getattr(model, "aliases", None) or {}).get(CHAMPION)
        if champion is not None:
            out[model.name] = {"champion": str(champion), "error": (model.tags or {}).get(TAG_SERVE_ERROR, "")}
    return out


def clear_challenger(client: Any, name: str, version: str) -> bool:
    """Remove the `challenger` alias if it points at `version` (decided: champion now, or not to be); True if it did."""
    if read_aliases(client, name).get(CHALLENGER) != version:
        return False
    client.delete_registered_model_alias(name, CHALLENGER)
    return True


def version_description(tags: dict[str, str], run_id: str, outcome: str) -> str:
    """A model version's description: what it was trained on (dataset digest, manifest, train and validation runs,
    from its lineage tags) and `outcome`, how it was decided (verdict, reason, numbers)."""
    from infra import names as n

    made = [f"dataset {tags[n.TAG_DATASET_DIGEST]}" if tags.get(n.TAG_DATASET_DIGEST) else "dataset unknown"]
    for label, key in (
        ("manifest", n.TAG_MANIFEST_URI),
        ("validation run", n.TAG_VALIDATION_RUN_ID),
        ("commit", n.TAG_GIT_COMMIT),
    ):
        if tags.get(key):
            made.append(f"{label} {tags[key]}")
    train = tags.get(n.TAG_TRAIN_RUN_ID) or run_id or "unknown"
    return f"Trained on {', '.join(made)} by train run {train}.\n{outcome}"[:_MAX_TAG_VALUE]


def describe_version(client: Any, name: str, version: str, outcome: str) -> str:
    """Set the model version's description (version_description); returns it."""
    mv = client.get_model_version(name, version)
    text = version_description(dict(mv.tags or {}), mv.run_id or "", outcome)
    client.update_model_version(name, version, description=text)
    return text

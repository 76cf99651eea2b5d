"""Names that cross process boundaries, in one bottom-floor module (Ray Train v2's `_internal/constants.py` shape).

MLflow tags that drive resume, re-attach, lineage and serving are written by one process and read by another (a
rerun, a `shardline serve`, a stack status, a remote job's follower): a typo in one copy would silently break
recovery. Every module imports them from here; the modules that used to define them re-export them unchanged.
"""

from __future__ import annotations

# ----- the MLflow run tree and lineage: every stage tags what it produced with the ids of what it consumed
TAG_STAGE = "shardline.stage"
TAG_FLOW_RUN_ID = "shardline.prefect_flow_run_id"
TAG_PARENT = "mlflow.parentRunId"  # MLflow's own name for the parent of a nested run
TAG_DATASET_DIGEST = "shardline.dataset_digest"
TAG_MANIFEST_URI = "shardline.manifest_uri"
TAG_TOKENIZER_SHA256 = "shardline.tokenizer_sha256"  # training.tokenizer.fingerprint of the tokenizer.json used
TAG_CHAT_TEMPLATE_SHA256 = "shardline.chat_template_sha256"  # training.chat_template.fingerprint of the version's
# the special tokens a chat template (the version's own, or serve.chat_template) renders with for this version, as
# JSON ({"bos_token", "eos_token"}, those there are; training.servable.served_chat); also without a template
TAG_CHAT_TOKENS = "shardline.chat_tokens"
# what a version's logged model carries besides its checkpoint's weights: a version registered from the same
# checkpoint is reused (deployments.registry.register_version) only when it agrees on each of these ("" = absent)
VERSION_CONTENT_TAGS = (TAG_TOKENIZER_SHA256, TAG_CHAT_TEMPLATE_SHA256, TAG_CHAT_TOKENS)
TAG_TOKENIZER_TRAINED_ON = "shardline.tokenizer_trained_on"  # the text set whose training split a BPE learned
TAG_DATA_RUN_ID = "shardline.data_run_id"
TAG_TRAIN_RUN_ID = "shardline.train_run_id"
TAG_CHECKPOINT_URI = "shardline.checkpoint_uri"
TAG_VALIDATION_RUN_ID = "shardline.validation_run_id"
TAG_MODEL_URI = "shardline.model_uri"
TAG_MODEL_VERSION = "shardline.model_version"
TAG_GIT_COMMIT = "shardline.git_commit"
# on a version a rerun reused by its checkpoint (deployments.registry.register_version): that rerun's flow run,
# validation run and logged model, as JSON; the version's lineage tags keep naming the model it was registered from
TAG_REVALIDATED_BY = "shardline.revalidated_by"
TAG_CLUSTER_ADDRESS = "shardline.ray_address"
TAG_NETWORK = "shardline.network"

# ----- run ownership: which process a RUNNING parent run belongs to, and who ended it when it died
TAG_OWNER = "shardline.owner"
TAG_ENDED_BY = "shardline.ended_by"

# ----- training resume and re-attach
TAG_TRAIN_REQUEST = "shardline.train_request"  # dataset + config, init_from as written (e.g. "champion")
TAG_TRAIN_KEY = "shardline.train_key"  # ... with init_from resolved: names the Ray Train run
TAG_INIT_CHECKPOINT = "shardline.init_from_checkpoint"
TAG_INIT_VERSION = "shardline.init_from_version"
TAG_REUSED_FROM = "shardline.reused_train_run_id"
TAG_RESUMED_FROM_STEP = "shardline.resumed_from_step"
TAG_TRAIN_NODE_IDS = "shardline.train_node_ids"
TAG_RAY_JOB_ID = "shardline.ray_job_id"
TAG_JOB_TRAIN_RUN_ID = "shardline.ray_job_train_run_id"  # the MLflow run a remote job's rank 0 logs its metrics to

# ----- the registry: aliases, and tags on versions and registered models
CHAMPION = "champion"  # the alias that says what serves: the endpoint's desired state
CHALLENGER = "challenger"  # the alias of the version in canary (gone once it is decided)
TAG_REJECTED = "rejected"  # value: the reason the canary gave
TAG_CANARY_DECISION = "shardline.canary_decision"
TAG_CANARY_REASON = "shardline.canary_reason"
# a running canary, on the challenger version (deployments/canary_control.py): the driver's state (JSON, renewed
# with the lease) and the last operator command (JSON); on the canary stage's MLflow run: the canary's id
TAG_CANARY_STATE = "shardline.canary_state"
TAG_CANARY_COMMAND = "shardline.canary_command"
TAG_CANARY_ID = "shardline.canary_id"
# on the registered model: the gateway (app name) that serves its champion, and why serving it last failed
TAG_SERVED_BY = "shardline.served_by"
TAG_SERVE_ERROR = "shardline.serve_error"

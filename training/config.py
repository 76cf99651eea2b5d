"""Configuration of training and of checkpoint validation."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

DEFAULT_FACTORY = "training.model:build_gpt"
LIGHTNING_FACTORY = "training.lightning_loop:lightning_model"  # a Lightning run's model: the module's `.model`
GPT_MODULE = "training.lightning_example:ByteGPTModule"  # the shipped LightningModule: the built-in GPT inside


class TrainConfig(BaseModel):
    """Model size, optimisation, parallelism and checkpointing of the training stage."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN bound never fails a check

    workers: int = Field(2, ge=1, description="Ray Train workers (= data-parallel ranks).")
    steps: int = Field(300, ge=1, description="Optimizer steps; the run ends at exactly this step, resumes included.")
    checkpoint_every: int = Field(
        100, ge=1, description="Save a DCP checkpoint every this many steps (and at the end)."
    )
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints Ray Train keeps (the latest N).")
    checkpoint_threads: int = Field(
        8, ge=1, description="Files (and writer threads) per rank per checkpoint: parallel writes and checksums."
    )
    max_failures: int = Field(2, ge=1, description="Worker-group restarts Ray Train allows before failing the stage.")
    seed: int = Field(1337, description="Seed of initialisation and data order.")

    # model
    model_factory: str = Field(
        DEFAULT_FACTORY,
        description="Import path 'module:function' that takes this TrainConfig and returns an nn.Module.",
    )
    loop: Literal["builtin", "lightning"] = Field(
        "builtin",
        description="builtin: shardline's FSDP2/DDP loop over train.model_factory's model. lightning: the "
        "LightningModule train.lightning_module names, under Ray Train's Lightning integration (RayDDPStrategy, "
        "or Lightning's FSDP2 strategy with train.parallelism='fsdp'); its `model` attribute is what is validated "
        "and served (training/lightning_loop.py).",
    )
    lightning_module: str = Field(
        "",
        description="Import path 'module:Class' of a lightning.pytorch.LightningModule taking this TrainConfig "
        "(train.loop='lightning'), e.g. 'training.lightning_example:ByteGPTModule'.",
    )
    batch_format: str = Field(
        "training.data.loader:byte_blocks",
        description="Import path 'module:function' that turns a stream of records into (input, target) batches.",
    )
    seq_len: int = Field(128, ge=8, description="Context length in bytes.")
    n_layer: int = Field(4, ge=1, description="Transformer blocks.")
    n_head: int = Field(4, ge=1, description="Attention heads.")
    d_model: int = Field(128, ge=8, description="Model width.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability.")
    vocab_size: int = Field(
        0,
        ge=0,
        description="Token ids the built-in GPT embeds. 0 takes the shard set's: 256 bytes, or its tokenizer's "
        "vocabulary. A larger value pads the embedding. A transformers model's is hf_config's vocab_size.",
    )
    hf_config: dict[str, Any] | str = Field(
        default_factory=dict,
        description="A Hugging Face transformers causal LM to train instead of the built-in GPT: its config inline "
        "(a table with model_type, e.g. 'llama') or a config.json path (local, s3://, az://), read at config load "
        "and kept inline. Built with AutoModelForCausalLM.from_config; nothing is fetched from a hub. Byte tokens: "
        "vocab_size >= 256. n_layer, n_head, d_model and dropout do not apply (the config sizes the model).",
    )

    # optimisation
    micro_batch: int = Field(8, ge=1, description="Sequences per rank per forward pass.")
    grad_accum: int = Field(1, ge=1, description="Micro batches accumulated per optimizer step.")
    global_batch: int = Field(
        0,
        ge=0,
        description="Sequences per optimizer step over all ranks; 0 derives it. Checked against "
        "micro_batch x grad_accum x workers.",
    )
    lr: float = Field(3e-3, gt=0, description="Peak learning rate (AdamW).")
    min_lr: float = Field(3e-4, ge=0, description="Learning rate at the end of the cosine decay.")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global grad norm to this (0 disables).")

    # parallelism and precision
    parallelism: Literal["fsdp", "ddp"] = Field("fsdp", description="FSDP2 fully_shard, or DDP for comparison.")
    powersgd_rank: int = Field(0, ge=0, description="DDP only: PowerSGD gradient compression rank (0 = off).")
    reshard_after_forward: bool = Field(True, description="FSDP2: free gathered parameters after forward.")
    activation_checkpointing: bool = Field(False, description="Recompute block activations in backward.")
    cpu_offload: bool = Field(False, description="FSDP2: keep sharded parameters on CPU (GPU runs).")
    mixed_precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto: bf16 compute with fp32 reduction on GPU, fp32 on CPU."
    )
    use_gpu: bool = Field(False, description="One GPU per worker, NCCL backend.")
    threads_per_worker: int = Field(1, ge=1, description="torch intra-op threads per CPU worker.")
    placement_timeout_s: float = Field(
        0.0,
        ge=0,
        description="Seconds each start of the worker group (the first and every restart) may wait for "
        "the cluster to place all workers, e.g. while an autoscaler adds nodes; then the stage fails at once, naming "
        "the demand. 0: wait as long as the stage runs (Ray Train retries the start every 60 s without a limit).",
    )
    resources_per_worker: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict,
        description="Ray resources each training worker asks for; empty: {'GPU': 1} with use_gpu, else {'CPU': 1}. "
        "Name a resource only some node types advertise (e.g. {'CPU': 1, 'trainer': 1}) to keep training off the "
        "head; on an autoscaling cluster this demand is what makes the autoscaler add such nodes.",
    )
    peak_tflops: float = Field(
        0.0, ge=0, description="Peak dense TFLOP/s of one device, for the MFU estimate (0: 989 on GPU, 0.1 on CPU)."
    )

    log_every: int = Field(10, ge=1, description="Rank 0 logs metrics to MLflow every this many steps.")
    storage_path: str = Field(
        "",
        description="Ray Train storage for checkpoints: local path, s3://..., az://..., or empty for "
        "$SHARDLINE_HOME/checkpoints.",
    )
    init_from: str = Field(
        "",
        description="Start from existing model weights (continued training): '' (from scratch), 'champion' (the "
        "registered model's champion; from scratch while there is none), 'models:/name/version', "
        "'models:/name@alias', or a checkpoint URI. Only the model weights are loaded; optimizer and schedule "
        "start fresh.",
    )

    hf_weights: str = Field(
        "",
        description="A transformers model's save_pretrained directory (config.json and model.safetensors; local, "
        "s3://, az://) whose weights a run starts from: continued training or fine-tuning. Its config.json is the "
        "model's config unless hf_config is given. train.init_from, when it finds a checkpoint, and resume win.",
    )

    @field_validator("hf_config")
    @classmethod
    def _resolve_hf_config(cls, value: dict[str, Any] | str, info: ValidationInfo) -> dict[str, Any] | str:
        if not value:
            return value
        from training.hf_model import resolve_hf_config

        return resolve_hf_config(value, int(info.data.get("seq_len", 0)))

    @field_validator("hf_weights")
    @classmethod
    def _check_hf_weights(cls, value: str) -> str:
        if value:
            from training.hf_model import weight_files

            weight_files(value)
        return value

    @model_validator(mode="after")
    def _hf_factory(self) -> TrainConfig:
        if self.hf_weights and not self.hf_config:
            from infra.storage import join
            from training.hf_model import resolve_hf_config

            try:
                self.hf_config = resolve_hf_config(join(self.hf_weights.rstrip("/"), "config.json"), self.seq_len)
            except ValueError as e:
                raise ValueError(f"train.hf_weights: {e}") from None
        if self.hf_config:
            from training.hf_model import HF_FACTORY

            if self.model_factory not in (DEFAULT_FACTORY, HF_FACTORY):
                raise ValueError(
                    f"train.hf_config and train.model_factory={self.model_factory!r} both name the model; set one"
                )
            self.model_factory = HF_FACTORY
        if self.loop == "lightning" or self.lightning_module:
            self._lightning_factory()
        return self

    @model_validator(mode="after")
    def _settings_work_together(self) -> TrainConfig:
        """What the workers would refuse, or silently ignore, only once training started, refused at load (after the
        Lightning checks above, whose message says what a Lightning run does instead)."""
        if self.min_lr > self.lr:
            raise ValueError(
                f"train.min_lr={self.min_lr:g} > train.lr={self.lr:g}: the cosine decay would raise the rate past its "
                "peak; set train.min_lr at most train.lr"
            )
        if self.use_gpu and self.resources_per_worker and self.resources_per_worker.get("GPU", 0) <= 0:
            # training.trainer.worker_resources would refuse it only in train_fsdp, after the data stage
            raise ValueError(
                f"train.resources_per_worker={dict(self.resources_per_worker)}: train.use_gpu needs a GPU per worker, "
                "e.g. 'GPU': 1"
            )
        if self.cpu_offload and self.parallelism != "fsdp":
            raise ValueError("train.cpu_offload is FSDP2's; with train.parallelism='ddp' set it false")
        if self.cpu_offload and not self.use_gpu:
            raise ValueError("train.cpu_offload=true needs train.use_gpu=true (parameters already live on CPU)")
        if self.powersgd_rank and self.parallelism != "ddp":
            raise ValueError(
                f"train.powersgd_rank={self.powersgd_rank} compresses DDP's gradients; set train.parallelism='ddp' "
                "or train.powersgd_rank=0"
            )
        if self.powersgd_rank and self.workers < 2:  # it compresses what ranks exchange
            raise ValueError(f"train.powersgd_rank={self.powersgd_rank} needs at least 2 train.workers, got 1")
        return self

    def _lightning_factory(self) -> None:
        if self.loop != "lightning":
            raise ValueError(f"train.lightning_module={self.lightning_module!r} needs train.loop='lightning'")
        if not self.lightning_module:
            raise ValueError("train.loop='lightning' needs train.lightning_module ('module:Class')")
        if self.hf_config:
            raise ValueError("train.hf_config and train.lightning_module both name the model; set one")
        if self.model_factory not in (DEFAULT_FACTORY, LIGHTNING_FACTORY):
            raise ValueError(
                f"train.lightning_module and train.model_factory={self.model_factory!r} both name the model; set one"
            )
        cls = lightning_class(self.lightning_module)
        if self.parallelism == "fsdp" and not _shards_itself(cls):
            raise ValueError(
                f"train.parallelism='fsdp' with train.lightning_module={self.lightning_module!r}: the module must "
                "shard its model in configure_model() (call training.lightning_loop.shard_model(self, cfg) there), "
                "or set train.parallelism='ddp'"
            )
        if self.activation_checkpointing or self.powersgd_rank or self.cpu_offload:
            raise ValueError(
                "train.activation_checkpointing, train.powersgd_rank and train.cpu_offload are the built-in loop's; "
                "with train.loop='lightning' the module decides (set them false, 0 and false)"
            )
        self.model_factory = LIGHTNING_FACTORY


def check_global_batch(cfg: TrainConfig, world_size: int) -> int:
    """Sequences per optimizer step; raises ValueError when train.global_batch disagrees with the product. One check
    for both places that make it: the config at load (world = train.workers) and training on the world it got."""
    derived = cfg.micro_batch * cfg.grad_accum * world_size
    if cfg.global_batch and cfg.global_batch != derived:
        raise ValueError(
            f"train.global_batch={cfg.global_batch} != micro_batch {cfg.micro_batch} x grad_accum {cfg.grad_accum} x "
            f"workers {world_size} = {derived}; set it to {derived} or 0"
        )
    return derived


class ValidationConfig(BaseModel):
    """The gate a checkpoint must pass before it is registered."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN bound never fails a check

    max_bits_per_byte: float = Field(
        6.0, gt=0, description="Fail the stage when validation bits per byte is above this (uniform bytes = 8)."
    )
    max_texts: int = Field(
        0,
        ge=0,
        description="Held-out texts evaluated: 0 = the whole validation split; N = a systematic sample "
        "of about N spread over every validation shard (its size is logged).",
    )
    batch_size: int = Field(8, ge=1, description="Windows per evaluation batch.")
    max_regression_vs_champion: float | None = Field(
        0.25,
        ge=0,
        description="Fail when held-out bits/byte exceeds the current champion's on the same data by "
        "more than this (None = no relative gate); checked before any traffic is risked.",
    )


def load_object(spec: str, field: str) -> Any:
    """Resolve an import path 'module:function' named by a config field (e.g. train.model_factory).

    Raises:
        ValueError: naming the field and value, when the path is malformed or does not import.
    """
    import importlib

    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{field}={spec!r}: expected 'module:function'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{field}={spec!r}: cannot import ({e})") from None


def lightning_class(spec: str) -> type:
    """The LightningModule class `train.lightning_module` names.

    Raises:
        ValueError: the path does not import, or names something that is not a LightningModule subclass.
    """
    import lightning.pytorch as pl

    cls = load_object(spec, "train.lightning_module")
    if not (isinstance(cls, type) and issubclass(cls, pl.LightningModule)):
        raise ValueError(f"train.lightning_module={spec!r}: {cls!r} is not a lightning.pytorch.LightningModule class")
    return cls


def _shards_itself(cls: type) -> bool:
    """Whether a LightningModule class overrides `configure_model`, where FSDP2 modules shard their model."""
    import lightning.pytorch as pl

    return getattr(cls, "configure_model", None) is not pl.LightningModule.configure_model


class TokenizerConfig(BaseModel):
    """Which tokenizer turns text into the model's token ids."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN bound never fails a check

    kind: Literal["bytes", "file", "train"] = Field(
        "bytes",
        description="bytes: one token per UTF-8 byte (256 ids, the built-in GPT's). file: the tokenizer.json at "
        "tokenizer.path. train: a byte-level BPE of tokenizer.vocab_size trained on the training split, cached by "
        "the shard set's digest and these settings.",
    )
    path: str = Field("", description="kind='file': a tokenizer.json as a local path, s3:// or az:// URI.")
    vocab_size: int = Field(
        4096, ge=257, le=1 << 20, description="kind='train': the BPE's vocabulary (256 bytes, merges, 1 special)."
    )
    min_frequency: int = Field(2, ge=1, description="kind='train': a pair seen fewer times is never merged.")
    chat_template: str = Field(
        "",
        description="The tokenizer's chat template, which the registered version carries and the endpoint's "
        "/v1/chat/completions renders with: a Jinja file (chat_template.jinja) or a tokenizer_config.json (its "
        "chat_template), as a local path, s3:// or az:// URI. '' = with kind='file', the one beside tokenizer.path "
        "as a Hugging Face tokenizer directory holds it (chat_template.jinja, else tokenizer_config.json's), if any.",
    )

    @model_validator(mode="after")
    def _path_fits_kind(self) -> TokenizerConfig:
        if self.kind == "file" and not self.path:
            raise ValueError("tokenizer.kind='file' needs tokenizer.path (a tokenizer.json)")
        if self.kind != "file" and self.path:
            raise ValueError(f"tokenizer.path={self.path!r} is read only with tokenizer.kind='file'")
        return self

"""The DAG: the Prefect flow, its typed parameters (PipelineConfig) and the `shardline` command."""

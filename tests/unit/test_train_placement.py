"""Where training workers run: the resources each asks Ray for, and the placement recorded in lineage."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from training.config import TrainConfig
from training.placement import TAG_TRAIN_NODE_IDS, gather_nodes, placement_lineage
from training.trainer import worker_resources


def test_worker_resources_default_to_one_cpu_or_one_gpu():
    assert worker_resources(TrainConfig()) == {"CPU": 1.0}
    assert worker_resources(TrainConfig(use_gpu=True)) == {"GPU": 1.0}


def test_worker_resources_take_a_custom_resource_as_given():
    cfg = TrainConfig(resources_per_worker={"CPU": 2, "trainer": 1})
    assert worker_resources(cfg) == {"CPU": 2.0, "trainer": 1.0}


@pytest.mark.parametrize(
    "resources, message",
    [
        ({"CPU": -1}, "amounts must not be negative"),
        ({"CPU": 4}, "train.use_gpu needs a GPU per worker"),
    ],
)
def test_worker_resources_refuse_a_demand_that_cannot_be_meant(resources, message):
    # model_copy skips validation, as a config changed in code would; the config itself refuses a negative amount
    with pytest.raises(ValueError, match=message) as err:
        worker_resources(TrainConfig(use_gpu=True).model_copy(update={"resources_per_worker": resources}))
    assert "train.resources_per_worker=" in str(err.value)


def test_a_negative_or_nan_resource_is_refused_with_the_config():
    from pydantic import ValidationError

    for amount, message in ((-1, "greater than or equal to 0"), (float("nan"), "finite number")):
        with pytest.raises(ValidationError, match=message):
            TrainConfig(resources_per_worker={"GPU": amount})


def test_placement_lineage_lists_distinct_nodes_in_rank_order_and_counts_them():
    tags, metrics = placement_lineage(["node-b", "node-b", "node-a", "node-b"])
    assert tags == {TAG_TRAIN_NODE_IDS: "node-b,node-a"}
    assert metrics == {"train_nodes": 2.0, "train_ranks": 4.0}


def test_placement_lineage_of_a_huge_cluster_stays_a_readable_tag_with_the_exact_count():
    nodes = [f"{i:056x}" for i in range(500)]
    tags, metrics = placement_lineage(nodes)
    listed = tags[TAG_TRAIN_NODE_IDS]
    assert len(listed) <= 5000
    assert listed.startswith(nodes[0] + ",") and listed.endswith(",... (500 nodes in all)")
    assert metrics["train_nodes"] == 500.0


def test_gather_nodes_outside_ray_names_this_host():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert gather_nodes(torch.device("cpu")) == [socket.gethostname()]
    finally:
        dist.destroy_process_group()


def test_where_workers_run_does_not_change_which_training_a_rerun_continues():
    from training.resume import request_key

    here, there = TrainConfig(), TrainConfig(resources_per_worker={"CPU": 1, "trainer": 1})
    assert request_key(here, "d" * 32) == request_key(there, "d" * 32)


def test_use_gpu_without_a_gpu_per_worker_is_refused_with_the_config_not_after_the_data_stage():
    """The Prefect form took it, and train_fsdp refused it only after sharding and provisioning (hours)."""
    from pydantic import ValidationError

    from flows.config import PipelineConfig

    with pytest.raises(ValidationError, match=r"train.use_gpu needs a GPU per worker"):
        PipelineConfig.model_validate({"train": {"use_gpu": True, "resources_per_worker": {"CPU": 4}}})
    assert TrainConfig(use_gpu=True, resources_per_worker={"CPU": 4, "GPU": 1}).use_gpu

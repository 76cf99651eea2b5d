"""DCP checkpoints: round trip into a plain model, exact resume of the optimizer, and what verification catches."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from training import checkpoint as ck
from training.config import TrainConfig
from training.loop import build_optimizer
from training.model import build_gpt
from training.parallelize import parallelize

CFG = TrainConfig(workers=1, seq_len=16, n_layer=2, n_head=2, d_model=16, lr=1e-2, warmup_steps=0, dropout=0.1)
CPU = torch.device("cpu")


@pytest.fixture()
def pg():
    """A real one-rank gloo process group (FSDP2 and DCP need one)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _fsdp():
    torch.manual_seed(0)
    model = parallelize(build_gpt(CFG), CFG, CPU, 1)
    return model, build_optimizer(model, CFG, CPU)


def _steps(model, opt, n: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(n):
        x = torch.randint(0, 256, (4, 17), generator=g)
        loss = F.cross_entropy(model(x[:, :-1]).view(-1, 256), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full(model) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }


@pytest.fixture()
def saved(pg, tmp_path):
    model, opt = _fsdp()
    _steps(model, opt, 3, seed=1)
    ck.save_checkpoint(tmp_path / "ck", model, opt, step=3, data_position=3, rank=0, world_size=1)
    return tmp_path / "ck", model, opt


def test_save_then_load_unsharded_equals_trained_params(saved):
    directory, model, _ = saved
    plain = build_gpt(CFG)
    info = ck.load_unsharded(plain, directory)
    assert (info.step, info.world_size) == (3, 1)
    trained = _full(model)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, trained[name]), name


def test_state_holds_tensors_only(saved):
    directory, _, _ = saved
    md = ck.read_metadata(directory)
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    assert not [k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    assert {"train.step", "rank0.rng_cpu", "rank0.data_position"} <= set(md.state_dict_metadata)


def test_the_load_planner_refuses_a_pickled_entry_even_after_the_check(saved, tmp_path):
    """A bytes entry would be unpickled by DCP; one swapped in after _no_pickled_leaves looked is refused too."""
    import io
    import pickle

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    marker = tmp_path / "unpickled"
    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex("evil"), [0], MetadataIndex("evil"), [0], [0])
    payload = io.BytesIO(pickle.dumps(marker))
    with pytest.raises(ck.CheckpointError, match="evil; refusing it"):
        ck.checked_load_planner(saved[0]).load_bytes(item, payload)
    assert payload.tell() == 0


def test_resume_continues_exactly(saved):
    directory, model, opt = saved
    rng = torch.get_rng_state()
    expected = _steps(model, opt, 3, seed=2)  # the uninterrupted continuation (dropout uses the RNG)
    torch.set_rng_state(rng)
    torch.manual_seed(123)  # clobber: the checkpoint must restore the RNG
    model2, opt2 = _fsdp()
    step, position = ck.load_checkpoint(directory, model2, opt2, rank=0, world_size=1)
    assert (step, position) == (3, 3)
    assert _steps(model2, opt2, 3, seed=2) == expected
    after, after2 = _full(model), _full(model2)
    assert all(torch.equal(after[k], after2[k]) for k in after)


def test_verify_reports_step_and_files(saved):
    info = ck.verify_checkpoint(saved[0])
    assert info.step == 3 and info.world_size == 1
    assert info.files == 2  # __0_0.distcp + .metadata
    assert info.total_bytes == sum(os.path.getsize(saved[0] / n) for n in (".metadata", "__0_0.distcp"))


def test_verify_catches_missing_file(saved):
    (saved[0] / "__0_0.distcp").unlink()
    with pytest.raises(ck.CheckpointError, match=r"__0_0.distcp: missing"):
        ck.verify_checkpoint(saved[0])


def test_verify_catches_truncated_file(saved):
    path = saved[0] / "__0_0.distcp"
    size = path.stat().st_size
    os.truncate(path, size - 100)
    with pytest.raises(ck.CheckpointError, match=rf"__0_0.distcp: {size - 100} bytes, manifest says {size}"):
        ck.verify_checkpoint(saved[0])
    with pytest.raises(ck.CheckpointError):
        ck.load_unsharded(build_gpt(CFG), saved[0])


def test_verify_catches_flipped_byte(saved):
    path = saved[0] / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError, match="xxh3_128 does not match"):
        ck.verify_checkpoint(saved[0])


def test_partial_checkpoint_without_manifest_is_not_complete(saved):
    (saved[0] / ck.manifest_name(0)).unlink()
    with pytest.raises(ck.CheckpointError, match="no manifest"):
        ck.verify_checkpoint(saved[0])
    assert ck.latest_complete([str(saved[0])]) is None


def test_missing_rank_manifest_is_partial(saved):
    body = json.loads((saved[0] / ck.manifest_name(0)).read_text())
    body["world_size"] = 2
    (saved[0] / ck.manifest_name(0)).write_text(json.dumps(body))
    with pytest.raises(ck.CheckpointError, match=r"no manifest from rank\(s\) \[1\] of 2"):
        ck.verify_checkpoint(saved[0])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: b.pop("rank"), "rank must be a whole number, got None"),
        (lambda b: b.update(world_size="x"), "world_size must be a whole number, got 'x'"),
        (lambda b: b.update(files=[]), "files must map each file to its bytes and checksum"),
        (lambda b: b["files"].update({".metadata": None}), "files must map each file to its bytes and checksum"),
        (lambda b: b.update(tensors=[1]), "tensors must map each chunk to its checksum record"),
    ],
    ids=["no-rank", "world-size-text", "files-a-list", "file-record-null", "tensors-a-list"],
)
def test_a_manifest_of_the_wrong_shape_is_a_checkpoint_error_and_resume_falls_back_past_it(
    saved, tmp_path, damage, message
):
    """It raised KeyError or TypeError, and a damaged newest checkpoint stopped resume instead of being skipped."""
    import shutil

    newer = tmp_path / "newer"
    shutil.copytree(saved[0], newer)
    manifest = newer / ck.manifest_name(0)
    body = json.loads(manifest.read_text())
    body["step"] = 9
    damage(body)
    manifest.write_text(json.dumps(body))
    with pytest.raises(ck.CheckpointError) as err:
        ck.verify_checkpoint(newer)
    assert str(err.value) == f"{manifest}: {message}"
    assert ck.latest_complete([str(saved[0]), str(newer)]) == (3, str(saved[0]))


def test_a_metadata_file_of_another_type_is_a_checkpoint_error(saved):
    directory = saved[0]
    (directory / ".metadata").write_bytes(pickle.dumps(7))  # allowed by the unpickler, but no DCP Metadata
    _rehash_file(directory, ".metadata")
    with pytest.raises(ck.CheckpointError, match=r"\.metadata: holds a int, not DCP's Metadata$"):
        ck.verify_checkpoint(directory)


def test_metadata_naming_an_absent_file_is_caught(saved, tmp_path):
    # Rank 0's manifest names .metadata; a .metadata pointing at a file nobody listed must still be caught.
    directory = saved[0]
    md = ck.read_metadata(directory)
    info = next(iter(md.storage_data.values()))
    info.relative_path = "__7_0.distcp"
    (directory / ".metadata").write_bytes(pickle.dumps(md))
    body = json.loads((directory / ck.manifest_name(0)).read_text())
    body["files"][".metadata"] = ck.file_record(directory / ".metadata")
    (directory / ck.manifest_name(0)).write_text(json.dumps(body))
    with pytest.raises(ck.CheckpointError, match=r"__7_0.distcp: missing \(named by .metadata"):
        ck.verify_checkpoint(directory)


def test_metadata_unpickler_refuses_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        ck.read_metadata(tmp_path)


def test_non_finite_weights_are_refused(pg, tmp_path):
    model, opt = _fsdp()
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    ck.save_checkpoint(tmp_path / "nan", model, opt, step=1, data_position=1, rank=0, world_size=1)
    with pytest.raises(ck.CheckpointError, match="non-finite values in"):
        ck.load_unsharded(build_gpt(CFG), tmp_path / "nan")


def test_load_into_a_different_model_names_the_keys(saved):
    other = build_gpt(CFG.model_copy(update={"n_layer": 3}))
    with pytest.raises(ck.CheckpointError, match=r"model keys differ: missing \['blocks.2"):
        ck.load_unsharded(other, saved[0])


# ------------------------------------------------------------------------------------- integrity (issue 9)


def _chunk(directory, fqn: str):
    """(file path, offset, length) of the stored chunk of `fqn` (world size 1: one chunk)."""
    md = ck.read_metadata(directory)
    index, info = next((i, s) for i, s in md.storage_data.items() if i.fqn == fqn)
    return directory / str(info.relative_path), info.offset, info.length, index


def _rehash_file(directory, name: str) -> None:
    """Make the manifest's digest of `name` match the file again, as a corruption before hashing would."""
    body = json.loads((directory / ck.manifest_name(0)).read_text())
    body["files"][name] = ck.file_record(directory / name)
    (directory / ck.manifest_name(0)).write_text(json.dumps(body))


def _overwrite_floats(path, tensor: torch.Tensor, value: float, count: int = 4) -> None:
    """Overwrite `count` float32 values of `tensor`'s stored bytes (found inside its torch.save record)."""
    data = bytearray(path.read_bytes())
    at = data.find(tensor.contiguous().numpy().tobytes())
    assert at > 0, "the tensor's bytes are not stored verbatim"
    data[at : at + 4 * count] = torch.full((count,), value, dtype=torch.float32).numpy().tobytes()
    path.write_bytes(bytes(data))


def test_manifest_records_file_hashes_taken_while_writing(saved):
    directory = saved[0]
    body = json.loads((directory / ck.manifest_name(0)).read_text())
    for name, rec in body["files"].items():
        assert rec == {"bytes": (directory / name).stat().st_size, "xxh3_128": ck.file_digest(directory / name)}, name
    assert set(body["files"]) == {".metadata", "__0_0.distcp"}


def test_manifest_records_a_checksum_of_every_saved_tensor(saved):
    directory, model, _ = saved
    body = json.loads((directory / ck.manifest_name(0)).read_text())
    stored = {i.fqn for i in ck.read_metadata(directory).storage_data}
    assert {k.split("@")[0] for k in body["tensors"]} == stored
    weight = _full(model)["wte.weight"]
    rec = body["tensors"]["model.wte.weight@0,0"]
    assert rec["sizes"] == list(weight.shape) and rec["xxh3_64"] == ck.tensor_checksum(weight)


def _as_format_2(directory) -> None:
    """Rewrite rank 0's manifest as format /2 wrote it: sha256 per file, CRC32 per tensor chunk."""
    import hashlib
    import zlib

    import torch.distributed.checkpoint as dcp

    body = json.loads((directory / ck.manifest_name(0)).read_text())
    body["format"] = "shardline-dcp-manifest/2"
    body["files"] = {
        name: {
            "bytes": (directory / name).stat().st_size,
            "sha256": hashlib.sha256((directory / name).read_bytes()).hexdigest(),
        }
        for name in body["files"]
    }
    state = {"model": {k: v.detach().clone() for k, v in build_gpt(CFG).state_dict().items()}}
    dcp.load(state, storage_reader=ck.safe_reader(directory), no_dist=True)
    for key, rec in body["tensors"].items():
        fqn = key.split("@")[0]
        if fqn.startswith("model."):
            del rec["xxh3_64"]
            rec["crc32"] = zlib.crc32(
                state["model"][fqn[len("model.") :]].contiguous().view(-1).view(torch.uint8).numpy()
            )
    body["tensors"] = {k: v for k, v in body["tensors"].items() if "crc32" in v}
    (directory / ck.manifest_name(0)).write_text(json.dumps(body))


def test_checkpoints_of_the_sha256_crc32_format_still_verify_and_load(saved):
    # Checkpoints written before the XXH3 manifests (format /2) must stay resumable and servable.
    directory, model, _ = saved
    _as_format_2(directory)
    assert ck.verify_checkpoint(directory).step == 3
    plain = build_gpt(CFG)
    ck.load_unsharded(plain, directory)
    assert torch.equal(plain.state_dict()["wte.weight"], _full(model)["wte.weight"])
    # and their checksums are still checked: a flipped byte fails the sha256, damage before hashing the CRC32
    path, _, _, _ = _chunk(directory, "model.wte.weight")
    _overwrite_floats(path, _full(model)["wte.weight"], 0.125)
    with pytest.raises(ck.CheckpointError, match="sha256 does not match"):
        ck.verify_checkpoint(directory)
    body = json.loads((directory / ck.manifest_name(0)).read_text())
    import hashlib

    body["files"][path.name]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (directory / ck.manifest_name(0)).write_text(json.dumps(body))
    with pytest.raises(ck.CheckpointError, match=r"tensor model.wte.weight .*crc32 mismatch"):
        ck.load_unsharded(build_gpt(CFG), directory)


def test_corruption_between_memory_and_disk_is_caught_by_tensor_checksum(saved):
    # The bytes are damaged before they were hashed: the file's digest matches, the tensor does not.
    directory, model, _ = saved
    path, _, _, _ = _chunk(directory, "model.wte.weight")
    _overwrite_floats(path, _full(model)["wte.weight"], 0.125)
    _rehash_file(directory, path.name)
    ck.verify_checkpoint(directory)  # the files are as the manifest says
    with pytest.raises(ck.CheckpointError, match=r"__0_0.distcp: tensor model.wte.weight .*xxh3_64 mismatch"):
        ck.load_unsharded(build_gpt(CFG), directory)


def test_nan_weights_under_a_manifest_that_matches_them_are_refused(saved):
    directory, model, _ = saved
    path, _, _, _ = _chunk(directory, "model.wte.weight")
    _overwrite_floats(path, _full(model)["wte.weight"], float("nan"))
    _rehash_file(directory, path.name)
    # make the tensor checksum match the NaN bytes too: the whole manifest vouches for the damage
    import torch.distributed.checkpoint as dcp

    body = json.loads((directory / ck.manifest_name(0)).read_text())
    plain = build_gpt(CFG)

    state = {"model": {k: v.detach().clone() for k, v in plain.state_dict().items()}}
    dcp.load(state, storage_reader=ck.safe_reader(directory), no_dist=True)
    body["tensors"]["model.wte.weight@0,0"]["xxh3_64"] = ck.tensor_checksum(state["model"]["wte.weight"])
    (directory / ck.manifest_name(0)).write_text(json.dumps(body))
    with pytest.raises(ck.CheckpointError, match=r"non-finite values in \['wte.weight'\]"):
        ck.load_unsharded(build_gpt(CFG), directory)


def test_file_named_by_metadata_but_by_no_manifest_is_refused(saved):
    directory = saved[0]
    body = json.loads((directory / ck.manifest_name(0)).read_text())
    del body["files"]["__0_0.distcp"]
    (directory / ck.manifest_name(0)).write_text(json.dumps(body))
    with pytest.raises(ck.CheckpointError, match=r"__0_0.distcp: in no manifest .*named by .metadata"):
        ck.verify_checkpoint(directory)


def test_checkpoint_of_another_width_names_the_tensor_and_both_shapes(saved):
    other = build_gpt(CFG.model_copy(update={"d_model": 32}))
    with pytest.raises(
        ck.CheckpointError,
        match=r"tensor model.wte.weight has shape \[256, 16\] in the "
        r"checkpoint but \[256, 32\] in the model",
    ):
        ck.load_unsharded(other, saved[0])


def test_resume_into_another_width_is_a_checkpoint_error_not_a_base_exception(saved):
    wide = CFG.model_copy(update={"d_model": 32})
    model = parallelize(build_gpt(wide), wide, CPU, 1)
    try:
        ck.load_checkpoint(saved[0], model, build_optimizer(model, wide, CPU), rank=0, world_size=1)
    except Exception as e:  # noqa: BLE001 - the point: it is an Exception, so every handler on the way sees it
        assert isinstance(e, ck.CheckpointError) and "shape [256, 16] in the checkpoint but [256, 32]" in str(e)
    else:
        pytest.fail("a checkpoint of another width loaded")


@pytest.mark.parametrize("n_layer", [1, 3])
def test_a_checkpoint_of_another_depth_is_refused_before_workers_start_and_on_resume(saved, n_layer):
    """check_shapes compared only the keys the model has: a deeper checkpoint resumed into a shallower model with its
    extra blocks ignored, and the check before any worker starts let both depths through."""
    from training.resume import InitSource, check_init_checkpoint

    other = CFG.model_copy(update={"n_layer": n_layer})
    init = InitSource(checkpoint_uri=str(saved[0]), label="a checkpoint of 2 blocks")
    with pytest.raises(ck.CheckpointError, match=r": model keys differ: missing \[.*\], unexpected \[.*\]$") as err:
        check_init_checkpoint(init, other)
    block = "'blocks.2." if n_layer == 3 else "unexpected ['blocks.1."
    assert block in str(err.value)
    model = parallelize(build_gpt(other), other, CPU, 1)
    with pytest.raises(ck.CheckpointError, match="model keys differ"):
        ck.load_checkpoint(saved[0], model, build_optimizer(model, other, CPU), rank=0, world_size=1)

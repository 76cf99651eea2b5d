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
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


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
    with pytest.raises(ck.CheckpointError, match="sha256 does not match"):
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


def test_metadata_naming_an_absent_file_is_caught(saved, tmp_path):
    # Rank 0's manifest names .metadata; a .metadata pointing at a file nobody listed must still be caught.
    directory = saved[0]
    md = ck.read_metadata(directory)
    info = next(iter(md.storage_data.values()))
    info.relative_path = "__7_0.distcp"
    (directory / ".metadata").write_bytes(pickle.dumps(md))
    body = json.loads((directory / ck.manifest_name(0)).read_text())
    body["files"][".metadata"] = {"bytes": (directory / ".metadata").stat().st_size,
                                  "sha256": ck._sha256(directory / ".metadata")}
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

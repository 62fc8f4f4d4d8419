"""The streaming safetensors writer: what safetensors' own reader reads back, for every dtype
a checkpoint holds, 0-d and empty tensors, and tensors larger than one block."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from flashnorm.checkpoint import shards  # noqa: E402
from flashnorm.errors import FlashNormError  # noqa: E402


def test_round_trip_through_safetensors(tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "BLOCK_BYTES", 4096)  # several blocks per tensor
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w.bf16": torch.randn(300, 17, generator=g).to(torch.bfloat16),
        "w.f16": torch.randn(5, 3, 2, generator=g).to(torch.float16),
        "w.f32": torch.randn(1000, generator=g),
        "ids": torch.randint(-5, 5, (7, 3), generator=g),
        "mask": torch.rand(9, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }
    planned = [shards.Planned(n, t.dtype, tuple(t.shape), lambda a, b, t=t: t if t.ndim == 0 else t[a:b])
               for n, t in tensors.items()]
    written = shards.write_shard(tmp_path / "x.safetensors", planned)
    assert written == sum(t.numel() * t.element_size() for t in tensors.values())
    back = safetensors_torch.load_file(tmp_path / "x.safetensors")
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert len(shards.read_header(tmp_path / "x.safetensors")) == len(tensors) + 1  # + __metadata__

    (tmp_path / "model.safetensors").write_bytes((tmp_path / "x.safetensors").read_bytes())  # our reader too
    source = shards.SafetensorsSource(tmp_path)
    assert [i.name for i in source.shards["model.safetensors"]] == list(tensors)
    assert torch.equal(source.rows("w.bf16", 10, 20), tensors["w.bf16"][10:20])
    assert torch.equal(source.read("scalar"), tensors["scalar"])
    source.close()


def test_writer_refuses_a_wrong_block_and_an_existing_file(tmp_path):
    wrong = [shards.Planned("w", torch.float32, (4,), lambda a, b: torch.zeros(b - a, dtype=torch.float16))]
    with pytest.raises(AssertionError, match="produced torch.float16"):
        shards.write_shard(tmp_path / "a.safetensors", wrong)
    (tmp_path / "b.safetensors").write_bytes(b"")
    ok = [shards.Planned("w", torch.float32, (4,), lambda a, b: torch.zeros(b - a))]
    with pytest.raises(FileExistsError):
        shards.write_shard(tmp_path / "b.safetensors", ok)


def test_index_naming_a_missing_shard(tmp_path):
    (tmp_path / shards.INDEX_NAME).write_text('{"weight_map": {"w": "model-00001-of-00002.safetensors"}}')
    with pytest.raises(FlashNormError, match="listed in the index but does not exist"):
        shards.SafetensorsSource(tmp_path)
    (tmp_path / shards.INDEX_NAME).write_text('{"weights": {}}')
    with pytest.raises(FlashNormError, match="is not a safetensors index"):
        shards.SafetensorsSource(tmp_path)

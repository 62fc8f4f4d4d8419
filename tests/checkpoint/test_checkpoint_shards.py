"""The streaming safetensors writer: what safetensors' own reader reads back, for every dtype
a checkpoint holds, 0-d and empty tensors, and tensors larger than one block; the reader: every
header field checked, each shard read through the descriptor opened first, a change refused."""

from __future__ import annotations

import json
import os
import struct

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


def _shard(path, header: dict, data: bytes = b"\0" * 8) -> None:
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


@pytest.mark.parametrize("entry, why", [
    ({"dtype": "F32", "shape": [-2, -1], "data_offsets": [0, 8]}, "non-negative integers"),
    ({"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}, "non-negative integers"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 9]}, "data_offsets two"),
    ({"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}, "two lists"),
    ({"shape": [2], "data_offsets": [0, 8]}, "dtype"),
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "do not fit its shape"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "do not fit its shape"),
    ({"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}, "dtype Q4 is not supported"),
])
def test_every_field_of_a_header_entry_is_checked(tmp_path, entry, why):
    _shard(tmp_path / "model.safetensors", {"w": entry})
    with pytest.raises(FlashNormError) as excinfo:
        shards.SafetensorsSource(tmp_path)
    assert "\n" not in str(excinfo.value) and why in str(excinfo.value), str(excinfo.value)


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    for name in ("a.safetensors", "b.safetensors"):
        _shard(tmp_path / name, {"w": entry, "v": entry})
    (tmp_path / shards.INDEX_NAME).write_text(json.dumps({"weight_map": {"w": "a.safetensors", "v": "b.safetensors"}}))
    with pytest.raises(FlashNormError, match="also stored in a.safetensors"):
        shards.SafetensorsSource(tmp_path)


def test_a_shard_replaced_while_it_is_read_is_refused(tmp_path):
    """Every shard is opened once: reads keep going to the file opened, and the replacement
    (or any other file of the folder changing) is refused before anything is committed."""
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    _shard(tmp_path / "model.safetensors", {"w": entry}, struct.pack("<2f", 1.0, 2.0))
    (tmp_path / "config.json").write_text("{}")
    source = shards.SafetensorsSource(tmp_path)
    source.check_unchanged()
    _shard(tmp_path / "new.safetensors", {"w": entry}, struct.pack("<2f", 5.0, 6.0))
    os.replace(tmp_path / "new.safetensors", tmp_path / "model.safetensors")
    assert source.read("w").tolist() == [1.0, 2.0]  # the file opened, not the one now at its name
    with pytest.raises(FlashNormError, match="model.safetensors changed while flashnorm was reading it"):
        source.check_unchanged()
    source.close()

    source = shards.SafetensorsSource(tmp_path)
    (tmp_path / "config.json").write_text('{"changed": true}')
    with pytest.raises(FlashNormError, match="config.json changed while flashnorm was reading it"):
        source.check_unchanged()
    source.close()

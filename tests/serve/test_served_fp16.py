"""The fp16 SmolLM2-135M, folded (`flashnorm export --dtype fp16`, then `flashnorm optimize`:
fold, cancel), in a `flashnorm triton --triton-backend python` repository served by the real
`tritonserver` bundled in nvidia-pytriton (FLASHNORM_PYTRITON_VENV), on loopback.

- The config declares the types the ONNX file declares (int64 ids, fp16 logits) and is the
  config the server loaded.
- Its logits on real text, over HTTP and gRPC, match ONNX Runtime's run of the same file.
- Under load (8 clients, 4 over HTTP and 4 over gRPC, × 20 requests, 10 of each client's
  malformed, interleaved) every good request gets the right logits and every malformed one a
  400-class error naming the problem, never an answer and never ONNX Runtime's internals. Wrong
  data types and ranks are refused by Triton against config.pbtxt; ids outside the vocabulary,
  empty sequences, mask values other than 0 and 1 and lengths that disagree by the generated
  model.py, before ONNX Runtime runs.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import time

import numpy as np
import onnx
import pytest

pytest.importorskip("tritonclient.http", reason="needs tritonclient[http,grpc]")
pytest.importorskip("tritonclient.grpc", reason="needs tritonclient[http,grpc]")

import onnxruntime as ort  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.grpc import model_config_pb2  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from flashnorm import cli, files  # noqa: E402
from flashnorm.serve.bundled_server import BundledTritonServer  # noqa: E402
from flashnorm.serve.config import parse_model_config  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "smollm2_fp16"
VOCAB = 49152
MAX_BATCH = 4
THREADS = 2  # ONNX Runtime intra-op threads, the same in the server and in the reference
TEXTS = (
    "Gravity is the force by which a planet or other body draws objects toward its center.",
    "The force of gravity keeps all of the planets in orbit around the sun.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "A library lends books, music and films to the people of its town.",
    "The train to the coast leaves every morning at seven.",
    "Bees carry pollen from flower to flower.",
)
CLIENTS, REQUESTS_PER_CLIENT, MALFORMED_PER_CLIENT = 8, 20, 10
# The load test's good requests: the texts' first 4 or 6 tokens. fp16 runs slowly on ONNX
# Runtime's CPU kernels (0.2 s for 4 tokens, 0.4 s for 18 on two shared cores, 2026-12-01),
# and two lengths let the dynamic batcher join concurrent requests.
LOAD_LENGTHS = (4, 6)
MALFORMED = ("negative id", "id >= vocabulary", "float ids", "int32 ids", "short mask", "mask value 2",
             "rank 3 ids", "positions of another shape", "no tokens")


@pytest.fixture(scope="module")
def fp16_folded(smollm2_fp16_onnx):
    from models import cache

    path, report = cache.optimized(smollm2_fp16_onnx)
    assert report["summary"]["fold.folded"] == 60  # 61 norm sites; the final one feeds the tied head
    return path


@pytest.fixture(scope="module")
def served(pytriton_venv, fp16_folded, tmp_path_factory):
    """The repository written by `flashnorm triton` and the server on it, stopped afterwards."""
    repo = tmp_path_factory.mktemp("triton") / "repo"
    # A queue delay long enough that concurrent requests of one length meet in the batcher.
    assert cli.main([
        "triton", "--onnx", str(fp16_folded), "--triton-backend", "python", "-o", str(repo), "--name", MODEL,
        "--outputs", "logits", "--max-batch-size", str(MAX_BATCH), "--max-queue-delay-us", "20000",
        "--threads", str(THREADS), "-q",
    ]) == 0
    server = BundledTritonServer(pytriton_venv, repo, ready_timeout=300)
    try:
        yield repo, server.start()
    finally:
        server.stop()
        server.cleanup()
        shutil.rmtree(repo.parent, ignore_errors=True)  # a copy of the model


@pytest.fixture(scope="module")
def reference(fp16_folded):
    """ONNX Runtime on the same file, with the server's thread count, one request at a time."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    session = ort.InferenceSession(str(fp16_folded), options, providers=["CPUExecutionProvider"])
    return lambda feeds: session.run(["logits"], feeds)[0]


@pytest.fixture(scope="module")
def text_feeds(smollm2_tokenizer) -> list[dict[str, np.ndarray]]:
    feeds = []
    for text in TEXTS:
        ids = smollm2_tokenizer(text, return_tensors="np")["input_ids"].astype(np.int64)
        feeds.append({"input_ids": ids, "attention_mask": np.ones_like(ids),
                      "position_ids": np.arange(ids.shape[1], dtype=np.int64)[None]})
    return feeds


def _grpc_client(url: str) -> grpcclient.InferenceServerClient:
    # No proxy for loopback; tritonclient's message limits restated (channel arguments replace them).
    return grpcclient.InferenceServerClient(url, channel_args=[
        ("grpc.enable_http_proxy", 0),
        ("grpc.max_send_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
    ])


_TRITON_TYPES = {np.dtype(np.int64): "INT64", np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32"}


def _input(module, name: str, value: np.ndarray):
    tensor = module.InferInput(name, list(value.shape), _TRITON_TYPES[value.dtype])
    tensor.set_data_from_numpy(value)
    return tensor


def _infer(module, client, feeds: dict[str, np.ndarray], timeout_s: float) -> np.ndarray:
    inputs = [_input(module, name, value) for name, value in feeds.items()]
    if module is httpclient:
        outputs = [httpclient.InferRequestedOutput("logits", binary_data=True)]
        result = client.infer(MODEL, inputs, outputs=outputs, timeout=int(timeout_s * 1e6))
    else:
        result = client.infer(MODEL, inputs, outputs=[grpcclient.InferRequestedOutput("logits")],
                              client_timeout=timeout_s)
    return result.as_numpy("logits")


def assert_logits_match(served: np.ndarray, expected: np.ndarray) -> None:
    """Same file, same ONNX Runtime (1.32.0 in both environments), same thread count. Alone, a
    request's logits came back bit-identical (2026-12-01); in a batch the dynamic batcher
    formed (one larger GEMM, other accumulation orders) some differed by one fp16 unit in the
    last place, 0.0156 on logits up to 34. Allowed: 4 units in the last place at the largest
    logit's magnitude; the served top-1 token's reference logit within that of the maximum
    (a near tie in fp16 may pick the other token, which is not an error)."""
    assert served.dtype == np.float16 and served.shape == expected.shape
    assert np.isfinite(served).all()
    expected = expected.astype(np.float32)
    tolerance = 4 * 2.0 ** (np.floor(np.log2(np.abs(expected).max())) - 10)
    difference = float(np.abs(served.astype(np.float32) - expected).max())
    assert difference <= tolerance, (difference, tolerance)
    chosen = np.take_along_axis(expected, served.argmax(-1)[..., None], -1)[..., 0]
    assert (chosen >= expected.max(-1) - tolerance).all()


def test_config_declares_the_model_types_and_is_what_the_server_loaded(served, fp16_folded):
    repo, server = served
    model = onnx.load(str(fp16_folded), load_external_data=False)
    declared = {value.name: value.type.tensor_type.elem_type for value in [*model.graph.input, *model.graph.output]}
    assert declared["logits"] == onnx.TensorProto.FLOAT16 and declared["input_ids"] == onnx.TensorProto.INT64
    written = parse_model_config((repo / MODEL / "config.pbtxt").read_text())
    expected = {"input_ids": model_config_pb2.TYPE_INT64, "attention_mask": model_config_pb2.TYPE_INT64,
                "position_ids": model_config_pb2.TYPE_INT64, "logits": model_config_pb2.TYPE_FP16}
    assert {t.name: t.data_type for t in [*written.input, *written.output]} == expected
    client = _grpc_client(server.grpc_url)
    try:
        loaded = client.get_model_config(MODEL).config
    finally:
        client.close()
    assert {t.name: t.data_type for t in [*loaded.input, *loaded.output]} == expected
    assert [list(t.dims) for t in loaded.output] == [[-1, VOCAB]] and loaded.max_batch_size == MAX_BATCH


def test_logits_on_real_text_match_onnxruntime_over_http_and_grpc(served, reference, text_feeds):
    _, server = served
    http = httpclient.InferenceServerClient(server.http_url)
    grpc = _grpc_client(server.grpc_url)
    try:
        for feeds in text_feeds[:3]:
            expected = reference(feeds)
            assert expected.dtype == np.float16 and expected.astype(np.float32).std() > 0.1  # a real model's logits
            assert_logits_match(_infer(httpclient, http, feeds, 60), expected)
            assert_logits_match(_infer(grpcclient, grpc, feeds, 60), expected)
    finally:
        http.close()
        grpc.close()


def _malformed(kind: str, feeds: dict[str, np.ndarray], rng) -> tuple[dict[str, np.ndarray], str]:
    """A broken copy of `feeds` and the text its error must contain."""
    ids = feeds["input_ids"]
    position = (0, int(rng.integers(0, ids.shape[1])))
    if kind == "negative id":
        broken = ids.copy()
        broken[position] = -int(rng.integers(1, VOCAB + 1))
        return dict(feeds, input_ids=broken), "outside the vocabulary"
    if kind == "id >= vocabulary":
        broken = ids.copy()
        broken[position] = VOCAB + int(rng.integers(0, 10 * VOCAB))
        return dict(feeds, input_ids=broken), "outside the vocabulary"
    if kind == "float ids":
        return dict(feeds, input_ids=ids.astype(np.float32)), "'input_ids' data-type is 'FP32', but model"
    if kind == "int32 ids":
        return dict(feeds, input_ids=ids.astype(np.int32)), "'input_ids' data-type is 'INT32', but model"
    if kind == "short mask":
        return dict(feeds, attention_mask=feeds["attention_mask"][:, 1:]), "attention_mask must be"
    if kind == "mask value 2":
        broken = feeds["attention_mask"].copy()
        broken[position] = 2
        return dict(feeds, attention_mask=broken), "attention_mask: value 2 is not 0 or 1"
    if kind == "rank 3 ids":
        return dict(feeds, input_ids=ids[..., None]), "unexpected shape for input 'input_ids'"
    if kind == "positions of another shape":
        return dict(feeds, position_ids=feeds["position_ids"][:, :-1]), "position_ids must have"
    if kind == "no tokens":
        return {name: value[:, :0] for name, value in feeds.items()}, "at least one token"
    raise AssertionError(kind)


def _status_is_400_class(error: InferenceServerException) -> bool:
    status = str(error.status())
    return status.startswith("4") or status == "StatusCode.INVALID_ARGUMENT"


def test_malformed_requests_under_load_are_all_refused(served, reference, text_feeds, rng):
    _, server = served
    load_feeds = [{name: value[:, :length] for name, value in feeds.items()}
                  for feeds in text_feeds for length in LOAD_LENGTHS]
    expected = [reference(feeds) for feeds in load_feeds]
    # Every client sends REQUESTS_PER_CLIENT requests, MALFORMED_PER_CLIENT of them malformed:
    # every kind, then random kinds; which feeds, and in what order, is random each run.
    plans = []
    for _ in range(CLIENTS):
        kinds = list(MALFORMED) + [MALFORMED[int(i)] for i in
                                   rng.integers(0, len(MALFORMED), MALFORMED_PER_CLIENT - len(MALFORMED))]
        plan = [("good", int(rng.integers(0, len(load_feeds)))) for _ in range(REQUESTS_PER_CLIENT - len(kinds))]
        plan += [(kind, int(rng.integers(0, len(load_feeds)))) for kind in kinds]
        plans.append([plan[i] for i in rng.permutation(len(plan))])

    def run_client(index: int, seed: int) -> list[tuple[str, int, object]]:
        module = httpclient if index % 2 == 0 else grpcclient
        local_rng = np.random.default_rng(seed)
        client = (httpclient.InferenceServerClient(server.http_url, network_timeout=60)
                  if module is httpclient else _grpc_client(server.grpc_url))
        outcomes = []
        try:
            for kind, text in plans[index]:
                feeds = load_feeds[text]
                if kind != "good":
                    feeds, _ = _malformed(kind, feeds, local_rng)
                try:
                    outcomes.append((kind, text, _infer(module, client, feeds, 60)))
                except InferenceServerException as error:
                    outcomes.append((kind, text, error))
        finally:
            client.close()
        return outcomes

    statistics = grpcclient.InferenceServerClient(server.grpc_url, channel_args=[("grpc.enable_http_proxy", 0)])
    before = statistics.get_inference_statistics(MODEL, as_json=True)["model_stats"][0]
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(run_client, index, int(rng.integers(2**31))) for index in range(CLIENTS)]
        results = [future.result(timeout=120) for future in futures]
    seconds = time.monotonic() - started
    after = statistics.get_inference_statistics(MODEL, as_json=True)["model_stats"][0]
    statistics.close()
    good = refused = 0
    for index, outcomes in enumerate(results):
        assert len(outcomes) == REQUESTS_PER_CLIENT
        for kind, text, outcome in outcomes:
            if kind == "good":
                assert not isinstance(outcome, Exception), (index, text, outcome)
                assert_logits_match(outcome, expected[text])
                good += 1
                continue
            assert isinstance(outcome, InferenceServerException), (index, kind, "was answered")
            message = outcome.message()
            _, needle = _malformed(kind, load_feeds[text], np.random.default_rng(0))
            assert _status_is_400_class(outcome), (kind, outcome.status(), message)
            assert needle in message and "\n" not in message.strip(), (kind, message)
            assert "onnxruntime" not in message.lower() and "ONNX Runtime" not in message, (kind, message)
            refused += 1
    executions = int(after.get("execution_count", 0)) - int(before.get("execution_count", 0))
    print(f"{CLIENTS} clients × {REQUESTS_PER_CLIENT} requests: {good} answered, {refused} refused in "
          f"{seconds:.1f} s; {executions} model executions (execution_count)")
    assert (good, refused) == (CLIENTS * (REQUESTS_PER_CLIENT - MALFORMED_PER_CLIENT), CLIENTS * MALFORMED_PER_CLIENT)
    assert server.process.poll() is None and server.is_ready()


def test_tensorrt_repository_checks_requests_before_the_engine(pytriton_venv, fp16_folded, tmp_path, text_feeds,
                                                              reference, rng):
    """`flashnorm triton --triton-backend tensorrt --check-requests`: the ensemble and its checking
    model, served for real. The bundled server has no TensorRT backend, so NAME_engine (a
    tensorrt_plan written from random bytes) is swapped for a Python-backend model serving the
    ONNX file the engine would be built from, under the same name and signature; the ensemble
    and NAME_checks are served as written. Triton's statistics show that refused requests
    never reach NAME_engine."""
    engine, plugin = tmp_path / "smollm2.plan", tmp_path / "libflashnorm_plugin.so"
    engine.write_bytes(rng.bytes(256))
    plugin.write_bytes(rng.bytes(256))
    longest = int(rng.integers(8, 17))
    profile = f"1x1,2x8,{MAX_BATCH}x{longest}"
    repo, stand_in = tmp_path / "repo", tmp_path / "stand-in"
    assert cli.main([
        "triton", "--engine", str(engine), "--plugin", str(plugin), "--onnx", str(fp16_folded), "-o", str(repo),
        "--name", "smol", "--max-batch-size", str(MAX_BATCH), "--check-requests",
        "--shapes", *(f"{name}:{profile}" for name in ("input_ids", "attention_mask", "position_ids")), "-q",
    ]) == 0
    assert sorted(p.name for p in repo.iterdir()) == sorted([files.MARKER, "README.md", "smol", "smol_checks",
                                                             "smol_engine"])
    assert parse_model_config((repo / "smol_engine/config.pbtxt").read_text()).platform == "tensorrt_plan"
    assert cli.main(["triton", "--onnx", str(fp16_folded), "--triton-backend", "python", "-o", str(stand_in),
                     "--name", "smol_engine", "--max-batch-size", str(MAX_BATCH), "--threads", str(THREADS), "-q"]) == 0
    written = parse_model_config((repo / "smol_engine/config.pbtxt").read_text())
    replacement = parse_model_config((stand_in / "smol_engine/config.pbtxt").read_text())
    assert [(t.name, t.data_type, list(t.dims)) for t in written.input] == [
        (t.name, t.data_type, list(t.dims)) for t in replacement.input]
    assert [(t.name, t.data_type, list(t.dims)) for t in written.output] == [
        (t.name, t.data_type, list(t.dims)) for t in replacement.output]
    shutil.rmtree(repo / "smol_engine")
    shutil.move(stand_in / "smol_engine", repo / "smol_engine")

    good = {name: value[:, :longest] for name, value in text_feeds[0].items()}
    too_long = {name: np.concatenate([value, value], axis=1)[:, :longest + 1] for name, value in text_feeds[0].items()}
    too_long["position_ids"] = np.arange(longest + 1)[None]
    refusals = [(_malformed(kind, good, rng)) for kind in ("negative id", "id >= vocabulary", "short mask",
                                                              "mask value 2", "positions of another shape")]
    refusals.append((too_long, f"input_ids has shape [1, {longest + 1}], outside the engine's profile"))
    with BundledTritonServer(pytriton_venv, repo, ready_timeout=300) as server:
        client = _grpc_client(server.grpc_url)
        try:
            def requests_seen(model: str) -> int:
                """Requests `model` has executed, answered or refused (Triton counts a Python-backend
                error response as a success of the model's execution)."""
                stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]["inference_stats"]
                return sum(int(stats.get(key, {}).get("count", 0)) for key in ("success", "fail"))

            def settled_counts(expected: tuple[int, int]) -> tuple[int, int]:
                """(smol_checks, smol_engine) request counts once they reach `expected`, or as they
                stand after 10 s. Triton records a composing model's statistics when its request is
                released, which can be after the ensemble has answered the client: a CI run read 5
                of 6 refusals right after the sixth came back."""
                deadline = time.monotonic() + 10.0
                while True:
                    counts = (requests_seen("smol_checks"), requests_seen("smol_engine"))
                    if counts == expected or time.monotonic() > deadline:
                        return counts
                    time.sleep(0.1)

            for feeds, needle in refusals:
                with pytest.raises(InferenceServerException) as refused:
                    client.infer("smol", [_input(grpcclient, name, value) for name, value in feeds.items()])
                assert _status_is_400_class(refused.value) and needle in refused.value.message(), refused.value
            assert settled_counts((len(refusals), 0)) == (len(refusals), 0)
            served = client.infer("smol", [_input(grpcclient, name, value) for name, value in good.items()])
            assert_logits_match(served.as_numpy("logits"), reference(good))
            assert settled_counts((len(refusals) + 1, 1)) == (len(refusals) + 1, 1)
        finally:
            client.close()

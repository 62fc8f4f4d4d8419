"""Triton Python-backend model: serves the ONNX file in this version folder with ONNX Runtime,
or (role "check") only checks requests in front of a TensorRT model in an ensemble.

Written by `flashnorm triton`; it depends on nothing from FlashNorm, only on numpy (and, to
serve, onnxruntime) in the Python that runs Triton's Python-backend stub. The config's
parameters: `role` ("serve", the default, or "check"); to serve, the file (`onnx_file`), the
providers (`providers`, comma-separated) and ONNX Runtime's thread count
(`intra_op_num_threads`, 0 = its default); to check, `vocabulary` and `input_ranges` (JSON,
input name → [minimum shape, maximum shape], the engine's optimization profile).

Token models (an `input_ids` input: language models and text encoders) have every request
checked before the model runs: token ids integers in [0, vocabulary) (`vocabulary`: the logits'
width, else the config's parameter, the embedding table's rows), attention_mask and position_ids
of the shapes input_ids and the past keys/values imply, attention_mask values 0 or 1, positions
not negative. Every float input (an encoder's pixel_values or input_features) must be finite;
with `input_ranges`, every shape inside its range. A request that fails gets an INVALID_ARG error
(HTTP 400) naming what is wrong: ONNX Gather wraps a negative id around to the end of the
vocabulary, a wrong answer rather than an error, and other mistakes would reach the client as
ONNX Runtime's internals. The checking role answers a good request with its inputs unchanged,
as outputs named `checked_<input>`, for the ensemble to hand to the engine.

With batching on (max_batch_size > 0), requests that Triton's dynamic batcher hands over
together are concatenated along the batch dimension when their other dimensions agree and run
as one ONNX Runtime call; if that call fails, each request is retried alone so that one bad
request gets an error response and the others still get their results.
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

CHECKED_PREFIX = "checked_"


def _parameter(config, key, default):
    entry = config.get("parameters", {}).get(key)
    return entry["string_value"] if entry and entry.get("string_value") else default


def request_error(feed, vocabulary):
    """Why `feed` (input name → array) cannot run on a token model, or None; a feed without
    input_ids is not checked."""
    ids = feed.get("input_ids")
    if ids is None:
        return None
    if not np.issubdtype(ids.dtype, np.integer):
        return f"input_ids must be integers, got {ids.dtype}"
    if ids.ndim != 2 or ids.shape[1] < 1:
        return f"input_ids must be [batch, sequence] with at least one token, got shape {list(ids.shape)}"
    outside = ids < 0
    if vocabulary is not None:
        outside |= ids >= vocabulary
    if np.any(outside):
        upper = vocabulary if vocabulary is not None else "vocabulary size"
        return f"input_ids: token id {int(ids[outside].flat[0])} is outside the vocabulary [0, {upper})"
    batch, sequence = ids.shape
    past = sorted(name for name in feed if name.startswith("past_key_values."))
    past_length = 0
    for name in past:
        value = feed[name]
        if value.ndim != 4 or value.shape[0] != batch:
            return f"{name} must be [batch={batch}, heads, past, head_dim], got shape {list(value.shape)}"
        if name != past[0] and value.shape[2] != feed[past[0]].shape[2]:
            return f"{name} holds {value.shape[2]} past tokens, {past[0]} {feed[past[0]].shape[2]}"
        past_length = value.shape[2]
    mask = feed.get("attention_mask")
    if mask is not None and list(mask.shape) != [batch, past_length + sequence]:
        return (f"attention_mask must be [batch, past + sequence] = [{batch}, {past_length + sequence}], "
                f"got shape {list(mask.shape)}")
    if mask is not None and mask.size and not np.isin(mask, (0, 1)).all():
        # Transformers turns the mask into an additive bias, (1 - mask) * lowest: any other
        # value shifts scores silently instead of masking.
        return f"attention_mask: value {mask[~np.isin(mask, (0, 1))].flat[0]} is not 0 or 1"
    positions = feed.get("position_ids")
    if positions is not None:
        if list(positions.shape) != [batch, sequence]:
            return f"position_ids must have input_ids' shape {[batch, sequence]}, got {list(positions.shape)}"
        if positions.size and positions.min() < 0:
            return f"position_ids: negative position {int(positions.min())}"
    return None


def value_error(feed):
    """Why a float input of `feed` cannot run (a NaN or infinity), or None: an encoder's
    pixel_values or input_features, or a past key/value."""
    for name, value in feed.items():
        if np.issubdtype(value.dtype, np.floating) and value.size and not np.isfinite(value).all():
            bad = value[~np.isfinite(value)].flat[0]
            return f"{name}: non-finite value {bad} (pixels and features must be finite)"
    return None


def range_error(feed, ranges):
    """Why a shape in `feed` lies outside its [minimum, maximum] in `ranges`, or None."""
    for name, (minimum, maximum) in ranges.items():
        shape = list(feed[name].shape)
        if len(shape) != len(minimum) or not all(low <= d <= high for low, d, high in zip(minimum, shape, maximum)):
            return f"{name} has shape {shape}, outside the engine's profile {minimum}..{maximum}"
    return None


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.input_names = [tensor["name"] for tensor in config["input"]]
        self.checking = _parameter(config, "role", "serve") == "check"
        if self.checking:
            vocabulary = int(_parameter(config, "vocabulary", "0"))
            self.vocabulary = vocabulary if vocabulary > 0 else None
            self.ranges = json.loads(_parameter(config, "input_ranges", "{}"))
            return
        import onnxruntime  # only to serve: the checking role runs where onnxruntime is absent

        self.ranges = {}
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        onnx_path = os.path.join(version_dir, _parameter(config, "onnx_file", "model.onnx"))
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = int(_parameter(config, "intra_op_num_threads", "0"))
        providers = _parameter(config, "providers", "CPUExecutionProvider").split(",")
        self.session = onnxruntime.InferenceSession(onnx_path, options, providers=providers)
        self.output_names = [tensor["name"] for tensor in config["output"]]
        self.output_dtypes = {
            tensor["name"]: pb_utils.triton_string_to_numpy(tensor["data_type"]) for tensor in config["output"]
        }
        self.batched = int(config.get("max_batch_size", 0)) > 0
        logits = next((o for o in self.session.get_outputs() if o.name == "logits"), None)
        last = logits.shape[-1] if logits is not None and logits.shape else None
        # An encoder has no logits: the embedding table's size comes from the config.
        vocabulary = last if isinstance(last, int) and last > 0 else int(_parameter(config, "vocabulary", "0"))
        self.vocabulary = vocabulary if vocabulary > 0 else None

    def _invalid(self, feed):
        """Why a token model's request cannot run (one line), or None."""
        return request_error(feed, self.vocabulary) or value_error(feed) or range_error(feed, self.ranges)

    def _refuse(self, message):
        code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
        error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
        return pb_utils.InferenceResponse(error=error)

    def _run(self, feeds):
        results = self.session.run(self.output_names, feeds)
        return {name: np.ascontiguousarray(value, dtype=self.output_dtypes[name])
                for name, value in zip(self.output_names, results)}

    def _response(self, outputs):
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, value) for name, value in outputs.items()]
        )

    def _run_alone(self, feeds):
        try:
            return self._response(self._run(feeds))
        except Exception as exc:  # ONNX Runtime reports bad inputs as exceptions of its own types
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"ONNX Runtime: {exc}"))

    def execute(self, requests):
        feeds = [
            {name: pb_utils.get_input_tensor_by_name(request, name).as_numpy() for name in self.input_names}
            for request in requests
        ]
        responses = [None] * len(requests)
        groups = {}
        for index, feed in enumerate(feeds):
            error = self._invalid(feed)
            if error is not None:
                responses[index] = self._refuse(error)
            elif self.checking:
                responses[index] = self._response({CHECKED_PREFIX + name: value for name, value in feed.items()})
            elif self.batched:
                key = tuple((name, feed[name].shape[1:], feed[name].dtype.str) for name in self.input_names)
                groups.setdefault(key, []).append(index)
            else:
                responses[index] = self._run_alone(feed)
        for members in groups.values():
            if len(members) == 1:
                responses[members[0]] = self._run_alone(feeds[members[0]])
                continue
            joined = {name: np.concatenate([feeds[i][name] for i in members]) for name in self.input_names}
            try:
                outputs = self._run(joined)
            except Exception:  # find the bad request(s): run each alone
                for i in members:
                    responses[i] = self._run_alone(feeds[i])
                continue
            offsets = np.cumsum([feeds[i][self.input_names[0]].shape[0] for i in members])[:-1]
            pieces = {name: np.split(value, offsets) for name, value in outputs.items()}
            for position, i in enumerate(members):
                responses[i] = self._response({name: pieces[name][position] for name in self.output_names})
        return responses

    def finalize(self):
        self.session = None

"""Triton Python-backend model: serves the ONNX file in this version folder with ONNX Runtime.

Written by `flashnorm triton --backend python`; it depends on nothing from FlashNorm, only on
numpy and onnxruntime in the Python that runs Triton's Python-backend stub. The config's
parameters choose the file (`onnx_file`), the providers (`providers`, comma-separated) and
ONNX Runtime's thread count (`intra_op_num_threads`, 0 = its default).

With batching on (max_batch_size > 0), requests that Triton's dynamic batcher hands over
together are concatenated along the batch dimension when their other dimensions agree and run
as one ONNX Runtime call; if that call fails, each request is retried alone so that one bad
request gets an error response and the others still get their results.
"""

import json
import os

import numpy as np
import onnxruntime
import triton_python_backend_utils as pb_utils


def _parameter(config, key, default):
    entry = config.get("parameters", {}).get(key)
    return entry["string_value"] if entry and entry.get("string_value") else default


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        onnx_path = os.path.join(version_dir, _parameter(config, "onnx_file", "model.onnx"))
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = int(_parameter(config, "intra_op_num_threads", "0"))
        providers = _parameter(config, "providers", "CPUExecutionProvider").split(",")
        self.session = onnxruntime.InferenceSession(onnx_path, options, providers=providers)
        self.input_names = [tensor["name"] for tensor in config["input"]]
        self.output_names = [tensor["name"] for tensor in config["output"]]
        self.output_dtypes = {
            tensor["name"]: pb_utils.triton_string_to_numpy(tensor["data_type"]) for tensor in config["output"]
        }
        self.batched = int(config.get("max_batch_size", 0)) > 0

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
            if self.batched:
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

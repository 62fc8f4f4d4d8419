# Sourced by .ci/run. The tests in tests/serve start the real `tritonserver` bundled in
# nvidia-pytriton; PyTriton pins numpy 1.26 and its own protobuf, so it gets a venv of its own,
# named by FLASHNORM_PYTRITON_VENV. onnxruntime goes there too: Triton's Python-backend stub
# runs the generated model.py with that venv's Python (see flashnorm/serve/bundled_server.py).
FLASHNORM_PYTRITON_VENV="${FLASHNORM_PYTRITON_VENV:-$PWD/.venv-pytriton}"
export FLASHNORM_PYTRITON_VENV
if [ ! -x "$FLASHNORM_PYTRITON_VENV/bin/python" ]; then
    python3 -m venv "$FLASHNORM_PYTRITON_VENV"
fi
"$FLASHNORM_PYTRITON_VENV/bin/python" -m pip install -q --upgrade pip
"$FLASHNORM_PYTRITON_VENV/bin/python" -m pip install -q nvidia-pytriton==0.7.0 onnxruntime==1.32.0
# The stub links libpython3.X.so: the venv's base Python must be a shared build.
"$FLASHNORM_PYTRITON_VENV/bin/python" -c 'import sysconfig, sys; sys.exit(0 if sysconfig.get_config_var("Py_ENABLE_SHARED") else "the Python behind FLASHNORM_PYTRITON_VENV has no shared libpython; the Triton Python-backend stub needs one")'

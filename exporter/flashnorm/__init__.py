"""FlashNorm: make the RMSNorm in front of every transformer projection cost nothing.

The pipeline, one direction:
    export → modelio.load → match → passes (fold, cancel, defer) → modelio.save → validate → engine → serve
Heavy dependencies (torch, transformers, tensorrt, tritonclient) are imported lazily by the
modules that need them, so `import flashnorm` needs only onnx, onnx-graphsurgeon and numpy.
"""

__version__ = "0.1.0"

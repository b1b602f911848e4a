"""The exporters' shared names: the artifact formats and the weight formats each exporter writes (one home,
read by export/artifacts.py, export/executorch_export.py and export/onnx_export.py)."""

FORMATS = ("onnx", "pte")
ONNX_WEIGHTS = ("fp32", "int4", "int4-e4")  # export.onnx_export
PTE_WEIGHTS = ("fp32", "8da4w", "8da4w-e8", "8da4w-asym-e8h8")  # export.executorch_export
ASYM_WEIGHTS = "8da4w-asym-e8h8"  # the .pte's asymmetric int4 format (export.executorch_export.AsymInt4Linear)

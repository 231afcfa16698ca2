"""The graph layer: ONNX models loaded as found in the wild (`model_file`, `core`), their shapes (`shape_inference`,
`input_shapes`), a graph's copy and node order (`copy_and_sort`), its identity (`fingerprint`) and its size (`flops`).
Everything above edits graphs through `rlflow.graph.core.Graph`; nothing here imports the layers above."""

"""The TASO-style cost model: a graph's latency as the sum of its onnxruntime fusion groups (`groups`), each timed in
isolation (`group_timing`) and cached in a table per machine kind (`model`), with a size estimate where a search has
no time to measure (`size_estimate`, `fallback`) and for GPUs this machine lacks (`gpu_estimate`); `check` and
`audit` compare it with reality (`rlflow costmodel`)."""

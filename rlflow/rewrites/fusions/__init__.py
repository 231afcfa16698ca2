"""Fusions: rules that replace a subgraph with one operator (standard, or onnxruntime's contrib), and their inverses.

Norms (`layernorm`, `rmsnorm`), activations (`activations`: the GELU formulas), linear layers (`linear`: Gemm,
FusedConv/FusedGemm/FusedMatMul), embeddings (`embedding`), each contrib fusion undone (`unfuse`); attention has a
package of its own (`attention`).
"""

"""Substitutions: rules that rewrite standard operators into standard operators.

`cleanup` (operators that compute nothing), `layout` (transposes, reshapes, concatenations and splits that cancel or
move), the algebra (`products`: MatMul associativity, factored sums of products; `elementwise`: elementwise operators
through Concat, Split and layout operators), folding (`fold`, with `constant_eval` evaluating one node through
onnxruntime for `constant-fold`), and merging (`merge`, `merge_batch`, and `unmerge`, their inverses).
"""

"""The world model: graph encoder (V), and the parts that learn how rewrites change a graph and its runtime.

Submodules import torch; this package itself imports nothing heavy, so `import rlflow.worldmodel` stays cheap.
"""

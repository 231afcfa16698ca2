"""The rule registry: every rule and its group, one line each, in action-id order.

A rule's position in `RULES` is its action id: the environment's action space and a trained agent's outputs are
indexed by it, and `REGISTRY_VERSION` (a hash of the names in this order) is recorded in every checkpoint.  So the
table only grows at the end: a new rule is appended, whatever its topic, and moving, removing or renaming a line
would retire the shipped agents (`rlflow/checkpoints/`), which `tests/rewrites/test_registry.py` guards.  An agent
trained before rules were appended still acts, on the rules it knows (`rlflow.search.agent.known_rules`).

The group says what kind of rewrite a rule is (`base.GROUP_NAMES`); `GROUPS` lists the rules of each, and the
searches and `rlflow costmodel check --rules` go by it.  The group follows what a rule does, not the module it lives
in: the cleanup rules fold (nothing is computed), and a rule that undoes a merge or a fusion is an inverse.
"""
from __future__ import annotations

from rlflow.rewrites import half, precision
from rlflow.rewrites.base import GROUP_NAMES, Rule, registry_version
from rlflow.rewrites.fusions import activations, embedding, layernorm, linear, rmsnorm, unfuse
from rlflow.rewrites.fusions.attention import decoder, encoder, gqa_absorb, gqa_causal, nan_guard, packed_qkv, rotary
from rlflow.rewrites.substitutions import cleanup, elementwise, fold, layout, merge, merge_batch, products, unmerge

RULES: tuple[Rule, ...] = (
    # module.Rule(group=...)                                        # action id, name
    layout.TransposeTranspose(group="layout"),                      #  0 transpose-transpose
    fold.ConvBatchNorm(group="fold"),                               #  1 conv-bn-fold
    cleanup.IdentityElim(group="fold"),                             #  2 identity-elim
    cleanup.DropoutElim(group="fold"),                              #  3 dropout-elim
    cleanup.MulOneElim(group="fold"),                               #  4 mul-one-elim
    cleanup.AddZeroElim(group="fold"),                              #  5 add-zero-elim
    cleanup.SubZeroElim(group="fold"),                              #  6 sub-zero-elim
    cleanup.DivOneElim(group="fold"),                               #  7 div-one-elim
    cleanup.CastNoopElim(group="fold"),                             #  8 cast-noop-elim
    cleanup.CastRoundtripElim(group="fold"),                        #  9 cast-roundtrip-elim
    cleanup.TransposeNoopElim(group="fold"),                        # 10 transpose-noop-elim
    cleanup.ReshapeNoopElim(group="fold"),                          # 11 reshape-noop-elim
    cleanup.PadZeroElim(group="fold"),                              # 12 pad-zero-elim
    cleanup.SliceNoopElim(group="fold"),                            # 13 slice-noop-elim
    cleanup.ConcatSingleElim(group="fold"),                         # 14 concat-single-elim
    cleanup.SplitSingleElim(group="fold"),                          # 15 split-single-elim
    cleanup.ExpandNoopElim(group="fold"),                           # 16 expand-noop-elim
    cleanup.IdempotentUnaryElim(group="fold"),                      # 17 idempotent-unary-elim
    cleanup.DuplicateNodeElim(group="fold"),                        # 18 duplicate-node-elim
    layout.ReshapeChain(group="layout"),                            # 19 reshape-chain
    layout.SqueezeUnsqueezeCancel(group="layout"),                  # 20 squeeze-unsqueeze-cancel
    layout.ConcatSplitCancel(group="layout"),                       # 21 concat-split-cancel
    layout.SplitConcatCancel(group="layout"),                       # 22 split-concat-cancel
    layout.ConcatFlatten(group="layout"),                           # 23 concat-flatten
    layout.TransposeUnarySink(group="layout"),                      # 24 transpose-unary-sink
    layout.TransposeBinarySink(group="layout"),                     # 25 transpose-binary-sink
    layout.Conv1x1NhwcMatmul(group="layout"),                       # 26 conv1x1-nhwc-matmul
    products.MatMulAssoc(group="algebra"),                          # 27 matmul-assoc
    products.MatMulConstChainFold(group="algebra"),                 # 28 matmul-const-chain-fold
    products.MatMulFactorLhs(group="algebra"),                      # 29 matmul-factor-lhs
    products.MatMulFactorRhs(group="algebra"),                      # 30 matmul-factor-rhs
    products.MulFactor(group="algebra"),                            # 31 mul-factor
    products.TransposeMatMul(group="algebra"),                      # 32 transpose-matmul
    products.MatMulTransposeFactor(group="algebra"),                # 33 matmul-transpose-factor
    elementwise.ConcatUnaryCommute(group="algebra"),                # 34 concat-unary-commute
    elementwise.ConcatBinaryCommute(group="algebra"),               # 35 concat-binary-commute
    elementwise.SplitUnaryHoist(group="algebra"),                   # 36 split-unary-hoist
    elementwise.SplitBinaryHoist(group="algebra"),                  # 37 split-binary-hoist
    elementwise.ScalarMulHoist(group="algebra"),                    # 38 scalar-mul-hoist
    elementwise.ScalarMulThroughLayout(group="algebra"),            # 39 scalar-mul-through-layout
    elementwise.MulAddDistribute(group="algebra"),                  # 40 mul-add-distribute
    fold.ConvMulFold(group="fold"),                                 # 41 conv-mul-fold
    fold.ConvAddFold(group="fold"),                                 # 42 conv-add-fold
    fold.MatMulBatchNorm(group="fold"),                             # 43 matmul-bn-fold
    fold.MatMulScaleFold(group="fold"),                             # 44 matmul-scale-fold
    fold.GemmBiasFold(group="fold"),                                # 45 gemm-bias-fold
    fold.AddConstChainFold(group="fold"),                           # 46 add-const-chain-fold
    fold.MulConstChainFold(group="fold"),                           # 47 mul-const-chain-fold
    fold.ConstantFold(group="fold"),                                # 48 constant-fold
    merge.MatMulMergeSiblings(group="merge"),                       # 49 matmul-merge-siblings
    merge.GemmMergeSiblings(group="merge"),                         # 50 gemm-merge-siblings
    merge.ConvMergeSiblings(group="merge"),                         # 51 conv-merge-siblings
    merge.ConvEnlargeKernel(group="merge"),                         # 52 conv-enlarge-kernel
    merge.ConvConcatToGroup(group="merge"),                         # 53 conv-concat-to-group
    merge.GroupConvMergeGroups(group="merge"),                      # 54 group-conv-merge-groups
    merge.ConvAddMerge(group="merge"),                              # 55 conv-add-merge
    merge.MatMulAddMerge(group="merge"),                            # 56 matmul-add-merge
    merge_batch.MatMulBatchSharedWeight(group="merge"),             # 57 matmul-batch-shared-weight
    merge_batch.ConvBatchSharedWeight(group="merge"),               # 58 conv-batch-shared-weight
    linear.MatMulAddToGemm(group="fusion"),                         # 59 matmul-add-to-gemm
    linear.GemmToMatMulAdd(group="inverse"),                        # 60 gemm-to-matmul-add
    layernorm.LayerNormFusion(group="fusion"),                      # 61 layernorm-fusion
    layernorm.SkipLayerNormFusion(group="fusion"),                  # 62 skip-layernorm-fusion
    activations.GeluFusion(group="fusion"),                         # 63 gelu-fusion
    activations.FastGeluFusion(group="fusion"),                     # 64 fast-gelu-fusion
    linear.ConvActivationFusion(group="fusion"),                    # 65 conv-activation-fusion
    linear.GemmActivationFusion(group="fusion"),                    # 66 gemm-activation-fusion
    linear.MatMulTransposeFusion(group="fusion"),                   # 67 matmul-transpose-fusion
    layout.TransposeIntoGemm(group="layout"),                       # 68 transpose-into-gemm
    layout.MatMulTransposeToGemm(group="layout"),                   # 69 matmul-transpose-to-gemm
    layout.MatMul3dToGemm(group="layout"),                          # 70 matmul3d-add-to-gemm
    activations.BiasGeluFusion(group="fusion"),                     # 71 bias-gelu-fusion
    activations.BiasFastGeluFusion(group="fusion"),                 # 72 bias-fast-gelu-fusion
    encoder.AttentionFusion(group="fusion"),                        # 73 attention-fusion
    unmerge.MatMulSplitUnmerge(group="inverse"),                    # 74 matmul-split-unmerge
    unmerge.GemmSplitUnmerge(group="inverse"),                      # 75 gemm-split-unmerge
    unmerge.ConvSplitUnmerge(group="inverse"),                      # 76 conv-split-unmerge
    unmerge.GemmReshapeToMatMul(group="inverse"),                   # 77 gemm-reshape-to-matmul
    unfuse.FusedConvUnfuse(group="inverse"),                        # 78 fused-conv-unfuse
    unfuse.FusedGemmUnfuse(group="inverse"),                        # 79 fused-gemm-unfuse
    unfuse.FusedMatMulUnfuse(group="inverse"),                      # 80 fused-matmul-unfuse
    unfuse.GeluUnfuse(group="inverse"),                             # 81 gelu-unfuse
    unfuse.FastGeluUnfuse(group="inverse"),                         # 82 fast-gelu-unfuse
    unfuse.BiasGeluUnfuse(group="inverse"),                         # 83 bias-gelu-unfuse
    unfuse.SkipLayerNormUnfuse(group="inverse"),                    # 84 skip-layernorm-unfuse
    unfuse.AttentionUnfuse(group="inverse"),                        # 85 attention-unfuse
    packed_qkv.AttentionPackQkv(group="fusion"),                    # 86 attention-pack-qkv
    embedding.EmbedLayerNormFusion(group="fusion"),                 # 87 embed-layernorm-fusion
    rmsnorm.RMSNormFusion(group="fusion"),                          # 88 rmsnorm-fusion
    rmsnorm.SkipRMSNormFusion(group="fusion"),                      # 89 skip-rmsnorm-fusion
    rmsnorm.RMSNormStandardFusion(group="fusion"),                  # 90 rmsnorm-standard-fusion
    unfuse.RMSNormUnfuse(group="inverse"),                          # 91 rmsnorm-unfuse
    unfuse.SkipRMSNormUnfuse(group="inverse"),                      # 92 skip-rmsnorm-unfuse
    rotary.RotaryFusion(group="fusion"),                            # 93 rotary-fusion
    rotary.RotaryStandardFusion(group="fusion"),                    # 94 rotary-standard-fusion
    unfuse.RotaryUnfuse(group="inverse"),                           # 95 rotary-unfuse
    decoder.DecoderAttentionFusion(group="fusion"),                 # 96 decoder-attention-fusion
    decoder.GroupQueryAttentionFusion(group="fusion"),              # 97 group-query-attention-fusion
    decoder.AttentionStandardFusion(group="fusion"),                # 98 attention-standard-fusion
    gqa_absorb.GroupQueryAttentionRotary(group="fusion"),           # 99 group-query-attention-rotary
    gqa_absorb.GroupQueryAttentionPackQkv(group="fusion"),          # 100 group-query-attention-pack-qkv
    gqa_causal.GroupQueryAttentionCausal(group="fusion"),           # 101 group-query-attention-causal
    linear.TiedHeadFusion(group="fusion"),                          # 102 tied-head-fusion
    fold.ShapeDimFold(group="fold"),                                # 103 shape-dim-fold
    cleanup.ConcatEmptyElim(group="fold"),                          # 104 concat-empty-elim
    nan_guard.AttentionNanGuardElim(group="fusion"),                # 105 attention-nan-guard-elim
    layernorm.ResidualBiasReorder(group="layout"),                  # 106 residual-bias-reorder
    activations.QuickGeluFusion(group="fusion"),                    # 107 quick-gelu-fusion
    unfuse.QuickGeluUnfuse(group="inverse"),                        # 108 quick-gelu-unfuse
)
"""Every rule, in action-id order.  Append only."""

REGISTRY_VERSION = registry_version(RULES)
"""A hash of the rule names in order: a checkpoint records it, and one trained on another registry is refused unless
this one extends it."""

PRECISION_RULES: tuple[precision.PrecisionRule, ...] = (
    precision.MatMulInt4Block32(group="precision"),               #  0 matmul-int4-block32
    precision.MatMulInt4Block128(group="precision"),              #  1 matmul-int4-block128
    precision.MatMulInt8Block32(group="precision"),               #  2 matmul-int8-block32
    precision.MatMulDynamicInt8(group="precision"),               #  3 matmul-dynamic-int8
    half.NodeFloat16(group="precision"),                          #  4 node-fp16
    half.NodeBfloat16(group="precision"),                         #  5 node-bf16
)
"""The reduced-precision rules, append only like `RULES` but a table of their own: they change what a model computes,
so no default search sees them (`rlflow optimize --precision` offers them), and the exact rules' action ids, and the
agents trained on them, are untouched by them."""


def _check(rules: tuple[Rule, ...]) -> None:
    names = [r.name for r in rules]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise TypeError(f"duplicate rule names in RULES: {duplicates}")
    ungrouped = [r.name for r in rules if r.group not in GROUP_NAMES]
    if ungrouped:
        raise TypeError(f"rules without a group in RULES: {ungrouped}")


GROUPS: dict[str, tuple[Rule, ...]] = {group: tuple(r for r in RULES + PRECISION_RULES if r.group == group)
                                       for group in GROUP_NAMES}
"""The rules of each group (`base.GROUP_NAMES`), in action-id order; every rule is in exactly one."""

_check(RULES + PRECISION_RULES)

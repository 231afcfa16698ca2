"""Attention fusions: an encoder's attention (`encoder`), a decoder's with its KV cache (`decoder`), the grouped-query
operator taking in more (`gqa_absorb`: the rotary embedding and the packed projections; `gqa_causal`: the causal
mask; `nan_guard`: the exporters' NaN guard dropped), the rotary embedding (`rotary`) and packed QKV (`packed_qkv`).
"""

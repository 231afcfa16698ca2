"""The architectures of the zoo's deployment section (`rlflow.zoo.deploy` exports them).

Kept apart from the export code because a build's definition hash (`rlflow.zoo.definition_hash`) covers that code's
source, and each entry's own architecture through its recipe (configuration, shapes, outputs, input ranges,
transformer settings), but not this table: adding an architecture leaves the others' builds up to date (with the
table in the hashed module, one more model made all 28 stale, and the dynamo exporter's files differ from build to
build).
"""

from __future__ import annotations

from dataclasses import dataclass

BERT_VOCAB, ROBERTA_VOCAB, GPT2_VOCAB = 30522, 50265, 50257


@dataclass(frozen=True)
class Architecture:
    """One exported graph: a transformers model class and its configuration, deployed at one or more shapes.

    Attributes:
        key: name stem (``bert-l2-h128``).
        model: transformers model class name (``BertModel``), or ``WhisperEncoder``.
        config: keyword arguments of the model's configuration class.
        kind: ``text`` (input_ids, attention_mask), ``image`` (pixel_values), ``audio`` (input_features),
            ``prefill`` (text with the KV cache as output) or ``decode`` (one token, the KV cache in and out).
        shapes: name suffix (``s16``) -> deployed shape of every input.
        outputs: graph output names (the KV cache's are added for prefill and decode).
        transformer: what onnxruntime's transformers optimizer needs: model_type, num_heads, hidden_size.
        description: one line for listings.
    """

    key: str
    model: str
    config: dict
    kind: str
    shapes: dict
    outputs: tuple
    transformer: dict
    description: str

    @property
    def vocab(self) -> int:
        return self.config.get("vocab_size", 0)


def _text(seqs=(16, 128)) -> dict:
    return {f"s{s}": {"input_ids": (1, s), "attention_mask": (1, s)} for s in seqs}


def _bert(layers: int, hidden: int, heads: int, **extra) -> dict:
    return dict(vocab_size=BERT_VOCAB, num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                intermediate_size=4 * hidden, **extra)


def _deit(size: str, hidden: int, heads: int) -> Architecture:
    """DeiT-`size` (a ViT L12 classifier at 224x224, facebook/deit-`size`-patch16-224's config), batch 1."""
    config = dict(hidden_size=hidden, num_hidden_layers=12, num_attention_heads=heads, intermediate_size=4 * hidden,
                  image_size=224, patch_size=16, num_labels=1000)
    return Architecture(f"deit-{size}", "ViTForImageClassification", config, "image",
                        {"b1": {"pixel_values": (1, 3, 224, 224)}}, ("logits",),
                        {"model_type": "vit", "num_heads": heads, "hidden_size": hidden},
                        f"DeiT-{size} (facebook/deit-{size}-patch16-224: a ViT L12/H{hidden} classifier), 224x224")


_GPT2 = dict(vocab_size=GPT2_VOCAB, n_layer=12, n_embd=768, n_head=12, n_positions=1024)
_GPT2_TF = {"model_type": "gpt2", "num_heads": 12, "hidden_size": 768}
_KV = {f"past_key_values.{i}.{kv}": (1, 12, 128, 64) for i in range(12) for kv in ("key", "value")}

ARCHITECTURES = (
    Architecture("bert-l2-h128", "BertModel", _bert(2, 128, 2), "text", _text(),
                 ("last_hidden_state", "pooler_output"), {"model_type": "bert", "num_heads": 2, "hidden_size": 128},
                 "BERT L2/H128 (google/bert_uncased_L-2_H-128_A-2 config)"),
    Architecture("bert-l4-h256", "BertModel", _bert(4, 256, 4), "text", _text(),
                 ("last_hidden_state", "pooler_output"), {"model_type": "bert", "num_heads": 4, "hidden_size": 256},
                 "BERT L4/H256 (google/bert_uncased_L-4_H-256_A-4 config)"),
    Architecture("minilm-l12-h384", "BertModel", _bert(12, 384, 12), "text", _text(),
                 ("last_hidden_state", "pooler_output"), {"model_type": "bert", "num_heads": 12, "hidden_size": 384},
                 "MiniLM-L12-H384 (BertModel, microsoft/MiniLM-L12-H384-uncased config)"),
    Architecture("distilbert-base", "DistilBertModel", dict(vocab_size=BERT_VOCAB), "text", _text(),
                 ("last_hidden_state",), {"model_type": "bert", "num_heads": 12, "hidden_size": 768},
                 "DistilBERT-base (distilbert-base-uncased config)"),
    Architecture("roberta-base", "RobertaModel",
                 dict(vocab_size=ROBERTA_VOCAB, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1,
                      bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5), "text", _text(),
                 ("last_hidden_state", "pooler_output"), {"model_type": "bert", "num_heads": 12, "hidden_size": 768},
                 "RoBERTa-base (roberta-base config)"),
    _deit("small", 384, 6),
    # the agents' training set's small-hidden model: attention fusion is worth 7-9% of its estimated time, as on
    # the held-out BERT L2/H128 (8-10%), where DeiT-small, DistilBERT and Whisper-tiny show 0.5-5%
    _deit("tiny", 192, 3),
    Architecture("gpt2-prefill", "GPT2LMHeadModel", _GPT2, "prefill", _text((32,)), ("logits",), _GPT2_TF,
                 "GPT-2 small prefill (logits and the KV cache)"),
    Architecture("gpt2-decode", "GPT2LMHeadModel", _GPT2, "decode",
                 {"kv128": {"input_ids": (1, 1), "attention_mask": (1, 129), **_KV}}, ("logits",), _GPT2_TF,
                 "GPT-2 small decode step (one token, KV cache of 128 in, 129 out)"),
    # onnxruntime's optimizer has no whisper type; "bart" (its encoder-decoder type), "bert" and "clip" fuse the same
    # here (8 SkipLayerNormalization, 4 BiasGelu; no Attention with either exporter's SDPA decomposition)
    Architecture("whisper-tiny-encoder", "WhisperEncoder",
                 dict(d_model=384, encoder_layers=4, encoder_attention_heads=6, encoder_ffn_dim=1536,
                      decoder_layers=4, decoder_attention_heads=6, decoder_ffn_dim=1536, num_mel_bins=80,
                      max_source_positions=1500, vocab_size=51865), "audio",
                 {"b1": {"input_features": (1, 80, 3000)}}, ("last_hidden_state",),
                 {"model_type": "bart", "num_heads": 6, "hidden_size": 384}, "Whisper-tiny encoder, 30 s of audio"),
    # three families no agent trains on, held out whole (issue #49): ELECTRA's factorised embedding, ALBERT's shared
    # layers, MPNet's relative position bias
    Architecture("electra-small", "ElectraModel",
                 _bert(12, 256, 4, embedding_size=128), "text", _text(),
                 ("last_hidden_state",), {"model_type": "bert", "num_heads": 4, "hidden_size": 256},
                 "ELECTRA-small discriminator (google/electra-small-discriminator config)"),
    Architecture("albert-base", "AlbertModel",
                 dict(vocab_size=30000, embedding_size=128, hidden_size=768, num_hidden_layers=12,
                      num_attention_heads=12, intermediate_size=3072), "text", _text(),
                 ("last_hidden_state", "pooler_output"), {"model_type": "bert", "num_heads": 12, "hidden_size": 768},
                 "ALBERT-base v2 (albert-base-v2 config: one layer's weights shared by all 12)"),
    Architecture("mpnet-base", "MPNetModel",
                 dict(vocab_size=30527, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      intermediate_size=3072, max_position_embeddings=514, relative_attention_num_buckets=32,
                      pad_token_id=1), "text", _text(),
                 ("last_hidden_state", "pooler_output"), {"model_type": "bert", "num_heads": 12, "hidden_size": 768},
                 "MPNet-base (microsoft/mpnet-base config; sentence-transformers' all-mpnet-base-v2)"),
)

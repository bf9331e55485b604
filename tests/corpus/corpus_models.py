"""The real-model corpus: Hugging Face models built from a config with random weights (no download).

Each entry builds a model and its example inputs at one of two sizes: `"tiny"` (the corpus tests,
the table, the CPU benchmarks: seconds per model on 2 cores) and `"real"` (the published
configuration, e.g. ResNet-50 at batch 64 or BERT-base at sequence 512, for the GPU benchmarks).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import transformers
from transformers.models.whisper.modeling_whisper import WhisperEncoder


class LastHiddenState(torch.nn.Module):
    """A Hugging Face model called for its `last_hidden_state` alone (one tensor out: the whole model is one
    graph, as the training-memory issue measures it)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).last_hidden_state


class BreakBefore(torch.nn.Module):
    """A layer whose call breaks the graph first (as a print or a data-dependent branch in user code would): a model
    with it runs one step as several graphs."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return self.inner(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    kind: str  # vision / text / audio
    build: Callable[[str], torch.nn.Module]  # size -> model
    inputs: Callable[[str, int], tuple]  # (size, batch) -> example inputs


def _image(resolution: dict[str, int]):
    return lambda size, batch: (torch.randn(batch, 3, resolution[size], resolution[size]),)


def _tokens(length: dict[str, int], vocab: int = 100):
    return lambda size, batch: (torch.randint(0, vocab, (batch, length[size])),)


TINY_IMAGE, REAL_IMAGE = 32, 224
IMAGE = _image({"tiny": TINY_IMAGE, "real": REAL_IMAGE})
TEXT = _tokens({"tiny": 16, "real": 512})

def _hf(model_class, config_class, tiny: dict, real: dict | None = None):
    """A builder: `model_class(config_class(**tiny))`, or the library's defaults (or `real`) at size "real"."""
    return lambda size: model_class(config_class(**(tiny if size == "tiny" else real or {})))


_TINY_TEXT = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  max_position_embeddings=64)
_TINY_VIT = dict(image_size=TINY_IMAGE, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64)
T = transformers

CORPUS: tuple[Entry, ...] = (
    Entry("ResNet", "vision", _hf(T.ResNetModel, T.ResNetConfig,
                                  dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1])), IMAGE),
    Entry("MobileNetV2", "vision", _hf(T.MobileNetV2Model, T.MobileNetV2Config,
                                       dict(image_size=TINY_IMAGE, depth_multiplier=0.25)), IMAGE),
    Entry("EfficientNet", "vision", _hf(T.EfficientNetModel, T.EfficientNetConfig,
                                        dict(image_size=TINY_IMAGE, width_coefficient=0.25, depth_coefficient=0.25,
                                             hidden_dim=320),
                                        dict(image_size=REAL_IMAGE)), IMAGE),
    Entry("ConvNeXt", "vision", _hf(T.ConvNextModel, T.ConvNextConfig,
                                    dict(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2)), IMAGE),
    Entry("Swin", "vision", _hf(T.SwinModel, T.SwinConfig,
                                dict(image_size=TINY_IMAGE, patch_size=4, embed_dim=8, depths=[1, 1],
                                     num_heads=[1, 2], window_size=4)), IMAGE),
    Entry("ViT", "vision", _hf(T.ViTModel, T.ViTConfig, _TINY_VIT), IMAGE),
    Entry("DeiT", "vision", _hf(T.DeiTModel, T.DeiTConfig, _TINY_VIT), IMAGE),
    Entry("Segformer", "vision", _hf(T.SegformerModel, T.SegformerConfig,
                                     dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
                                          num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2],
                                          mlp_ratios=[2, 2])), IMAGE),
    Entry("MobileViT", "vision", _hf(T.MobileViTModel, T.MobileViTConfig,
                                     dict(image_size=TINY_IMAGE, hidden_sizes=[16, 24, 32],
                                          neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64])), IMAGE),
    Entry("BERT", "text", _hf(T.BertModel, T.BertConfig, _TINY_TEXT), TEXT),
    Entry("RoBERTa", "text", _hf(T.RobertaModel, T.RobertaConfig, _TINY_TEXT), TEXT),
    Entry("DistilBERT", "text", _hf(T.DistilBertModel, T.DistilBertConfig,
                                    dict(vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                         max_position_embeddings=64)), TEXT),
    Entry("GPT-2", "text", _hf(T.GPT2Model, T.GPT2Config,
                               dict(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0,
                                    eos_token_id=0)), TEXT),
    Entry("T5-encoder", "text", _hf(T.T5EncoderModel, T.T5Config,
                                    dict(vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2)),
          TEXT),
    Entry("Llama", "text", _hf(T.LlamaModel, T.LlamaConfig,  # rotary positions, RMSNorm, grouped-query attention
                               dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64),
                               dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,  # TinyLlama-1.1B
                                    num_attention_heads=32, num_key_value_heads=4)), TEXT),
    Entry("BLOOM", "text", _hf(T.BloomModel, T.BloomConfig,  # ALiBi; in training its GELU is a custom autograd.Function
                               dict(vocab_size=100, hidden_size=32, n_layer=2, n_head=2)), TEXT),
    Entry("BART", "text", _hf(T.BartModel, T.BartConfig,  # encoder-decoder; decoder inputs shifted from the inputs
                              dict(vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1,
                                   encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                   decoder_ffn_dim=64, max_position_embeddings=64)), TEXT),
    Entry("Whisper-encoder", "audio", _hf(WhisperEncoder, T.WhisperConfig,
                                          dict(num_mel_bins=16, d_model=32, encoder_layers=2,
                                               encoder_attention_heads=2, encoder_ffn_dim=64,
                                               max_source_positions=32)),
          lambda size, batch: (torch.randn(batch, 16, 64) if size == "tiny" else torch.randn(batch, 80, 3000),)),
    # in training: SpecAugment masks drawn from NumPy's global generator, LayerDrop from torch's
    Entry("Wav2Vec2", "audio", _hf(T.Wav2Vec2Model, T.Wav2Vec2Config,
                                   dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                                        conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                        num_conv_pos_embedding_groups=4)),
          lambda size, batch: (torch.randn(batch, 800 if size == "tiny" else 16000),)),
    # its attention's softmax and its dropouts are custom autograd Functions (XSoftmax, XDropout: torch's RNG)
    Entry("SEW-D", "audio", _hf(T.SEWDModel, T.SEWDConfig,
                                dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                                     num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, squeeze_factor=1)),
          lambda size, batch: (torch.randn(batch, 800 if size == "tiny" else 16000),)),
)

BY_NAME = {e.name: e for e in CORPUS}


def build(name: str, size: str = "tiny", batch: int = 2, training: bool = False, dtype=torch.float64,
          seed: int = 0) -> tuple[torch.nn.Module, tuple]:
    """The model `name` in train or eval mode, in `dtype`, with its example inputs (same seed, same weights)."""
    entry = BY_NAME[name]
    torch.manual_seed(seed)
    model = entry.build(size).to(dtype).train(training)
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in entry.inputs(size, batch))
    return model, inputs

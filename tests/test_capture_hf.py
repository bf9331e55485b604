"""Capture targets: Hugging Face models built from small configs with the library's defaults, called as users call them.

Each must come back from TorchDynamo as one graph with no graph break and every parameter an input of
it, in inference and in training, computing eager's outputs, gradients and buffers; results must
survive torch.save / torch.load; reports name sites by module path.
"""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import transformers

import fxopt
from equivalence import assert_same_step, assert_state_unchanged, state_snapshot
from fxopt.capture import capture
from fxopt.capture.naming import model_path, module_path

IMAGE = (torch.randn(2, 3, 32, 32),)
TOKENS = (torch.randint(0, 100, (2, 8)),)
SMALL_TEXT = dict(vocab_size=100)


def hf_resnet():
    return transformers.ResNetModel(transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1]))


def hf_mobilenet_v2():
    return transformers.MobileNetV2Model(transformers.MobileNetV2Config(image_size=32, depth_multiplier=0.25))


def hf_convnext():
    return transformers.ConvNextModel(transformers.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2))


def hf_vit():
    return transformers.ViTModel(transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                                        num_attention_heads=2, intermediate_size=128))


def hf_swin():
    """Swin's forward assigns `shift_size` / `window_size` on every call: Dynamo replays the writes."""
    return transformers.SwinModel(transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                                                          num_heads=[2, 2], window_size=4))


def hf_bert():
    return transformers.BertModel(transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                                          intermediate_size=128, max_position_embeddings=32, **SMALL_TEXT))


def hf_gpt2():
    return transformers.GPT2Model(transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=32,
                                                          **SMALL_TEXT))


HEAVY = pytest.mark.slow  # 5-20 s each on 2 cores: CI's second step (`make test-slow`)
TARGETS = [
    pytest.param(hf_resnet, IMAGE, id="resnet"),
    pytest.param(hf_mobilenet_v2, IMAGE, id="mobilenet_v2", marks=HEAVY),
    pytest.param(hf_convnext, IMAGE, id="convnext", marks=HEAVY),
    pytest.param(hf_vit, IMAGE, id="vit", marks=HEAVY),
    pytest.param(hf_bert, TOKENS, id="bert"),
    pytest.param(hf_gpt2, TOKENS, id="gpt2", marks=HEAVY),
    pytest.param(hf_swin, IMAGE, id="swin", marks=HEAVY),
]


def randomize_bn(model: torch.nn.Module) -> torch.nn.Module:
    """Non-trivial running statistics, so a wrong fold shows in the outputs."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    return model


def check_shares_parameters(model, optimized):
    """The same Parameter and buffer objects and the same state_dict keys, loadable both ways."""
    assert [id(p) for p in optimized.parameters()] == [id(p) for p in model.parameters()]
    theirs, ours = model.state_dict(keep_vars=True), optimized.state_dict(keep_vars=True)
    assert list(ours) == list(theirs)
    assert all(ours[k] is theirs[k] for k in theirs)
    optimized.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    model.load_state_dict({k: v.clone() for k, v in optimized.state_dict().items()})


def graph_parameters(gm: fx.GraphModule) -> set[str]:
    """Qualified names of the parameters the graph reads (inputs of the graph, named as the model names them)."""
    return {n.meta["state_name"] for n in gm.graph.find_nodes(op="placeholder") if "state_name" in n.meta}


@pytest.mark.parametrize("mode", ["inference", "training"])
@pytest.mark.parametrize("make_model, inputs", TARGETS)
def test_one_graph_every_parameter_equal_to_eager(make_model, inputs, mode):
    """One graph, no graph break, 100% of the parameters in it; outputs (and in training gradients and buffers) equal
    eager."""
    torch.manual_seed(0)
    model = make_model().train(mode == "training")
    (graph,) = capture(model, inputs).graphs  # before any pass
    assert graph_parameters(graph.gm) >= {name for name, _ in model.named_parameters()}
    optimized = fxopt.optimize(model, inputs, mode=mode)
    (report,) = optimized.fxopt_reports
    assert report.graph_breaks == [] and not report.not_optimized
    assert_same_step(model, optimized, inputs, training=mode == "training")


def test_grouped_query_attention_gradients_are_eager_bits():
    """HF Llama (4 query heads sharing 2 key/value heads) in training: float32 outputs and gradients equal eager's bit
    for bit."""
    torch.manual_seed(0)
    model = transformers.LlamaModel(transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        max_position_embeddings=64, **SMALL_TEXT)).train()
    tokens = torch.randint(0, 100, (2, 64))  # at 16 tokens the per-head copies happened to give the same bits
    optimized = fxopt.optimize(model, (tokens,), mode="training")
    assert_same_step(model, optimized, (tokens,), training=True, rtol=0, atol=0)


def test_model_output_type_comes_back():
    """Users index a ModelOutput by attribute and position: the result returns the same type."""
    model = hf_resnet().eval()
    x = IMAGE[0]
    expected, got = model(x), fxopt.optimize(model, x)(x)
    assert type(got) is type(expected)
    torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state)
    torch.testing.assert_close(got[1], expected[1])


def test_sites_are_named_by_module_path():
    """BERT's query projection is `encoder.layer.1.attention.self.query`, as the model names it."""
    model = hf_bert().eval()
    optimized = fxopt.optimize(model, TOKENS, passes=[])
    paths = {module_path(n) for n in optimized.graph_module.graph.nodes if n.op == "call_function"}
    assert {"encoder.layer.1.attention.self.query", "encoder.layer.0.output.LayerNorm", "pooler.dense"} <= paths


@pytest.mark.parametrize("source, path", [
    ("L['self']._modules['head']._parameters['bias']", "head.bias"),
    ("L['self'].encoder.layer[3]", "encoder.layer.3"),
    # Swin's blocks are read past Module.__getattr__ once its forward has written attributes on them
    ("L['self']._modules['layers']._modules['1'].__dict__['_modules']['norm']._parameters['weight']", "layers.1.norm.weight"),
    ("encoder.layer.0", "encoder.layer.0"),
])
def test_dynamo_sources_become_model_paths(source, path):
    """Every form of source Dynamo writes for a module or parameter names it by its path in the model."""
    assert model_path(source) == path


def test_other_sequence_length_and_batch():
    """BERT compiled at (2, 8): batch 3 and length 12 compute eager's outputs, each new size making its
    dimension dynamic (one compile each), and a third size compiles nothing more."""
    torch.manual_seed(0)
    model = hf_bert().eval()
    optimized = fxopt.optimize(model, TOKENS)
    for shape, graphs in (((3, 8), 2), ((2, 12), 3), ((5, 7), 3)):
        ids = torch.randint(0, 100, shape)
        with torch.no_grad():
            got = optimized(ids).last_hidden_state
            torch.testing.assert_close(got, model(ids).last_hidden_state)
        assert len(optimized.fxopt_reports) == graphs, shape


@pytest.mark.parametrize("mode, budget", [("inference", None), ("training", None),
                                          pytest.param("training", 0.5, marks=HEAVY)])
@pytest.mark.parametrize("make_model, inputs", [(hf_bert, TOKENS), (hf_resnet, IMAGE)], ids=["bert", "resnet"])
@pytest.mark.usefixtures("budget_may_be_unmet")
def test_save_and_load_real_models(make_model, inputs, mode, budget, tmp_path):
    """torch.save / torch.load(weights_only=False) of a result gives a model computing the same step."""
    torch.manual_seed(0)
    model = make_model().train(mode == "training")
    options = {} if budget is None else {"memory_budget": budget}
    optimized = fxopt.optimize(model, inputs, mode=mode, **options)
    torch.save(optimized, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert_same_step(optimized, loaded, inputs, training=mode == "training")
    assert_same_step(model, loaded, inputs, training=mode == "training")


@pytest.mark.parametrize("make_model, min_folds", [(hf_resnet, 8), pytest.param(hf_mobilenet_v2, 20, marks=HEAVY)],
                         ids=["resnet", "mobilenet_v2"])
def test_hugging_face_cnns_are_folded(make_model, min_folds):
    """Every Conv+BN pair of HF ResNet / MobileNetV2 (shape checks, `int()` of sizes, TF padding) is folded in the one graph."""
    torch.manual_seed(0)
    model = randomize_bn(make_model()).eval()
    optimized = fxopt.optimize(model, IMAGE, passes=["fold_conv_bn"])
    assert optimized.fxopt_report["fold_conv_bn"].stats["folded"] >= min_folds
    assert_same_step(model, optimized, IMAGE, training=False)


def test_hugging_face_resnet_fine_tuning_with_frozen_batch_norm_folds_on_the_fly():
    """Training with eval-mode BNs (fine-tuning) folds every pair in the graph; gradients and buffers still match."""
    torch.manual_seed(0)
    model = randomize_bn(hf_resnet()).train()
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.eval()
    optimized = fxopt.optimize(model, IMAGE, passes=["fold_conv_bn"])
    assert optimized.fxopt_report.mode == "training"
    assert optimized.fxopt_report["fold_conv_bn"].stats["folded"] == 8
    assert_same_step(model, optimized, IMAGE, training=True)


@pytest.mark.parametrize("make_model, inputs", [(hf_resnet, IMAGE), (hf_bert, TOKENS)], ids=["resnet", "bert"])
def test_training_result_shares_parameters_and_state_dict_keys(make_model, inputs):
    """Training mode: the same Parameter and buffer objects and the same state_dict keys, loadable both ways."""
    torch.manual_seed(0)
    model = make_model().train()
    check_shares_parameters(model, fxopt.optimize(model, inputs, mode="training", passes=["fold_conv_bn"]))


@pytest.mark.parametrize("make_model, inputs", [pytest.param(hf_mobilenet_v2, IMAGE, marks=HEAVY), (hf_bert, TOKENS)],
                         ids=["mobilenet_v2", "bert"])
def test_inference_never_modifies_the_callers_model(make_model, inputs):
    """Optimizing and running the result leaves the caller's state and its inputs as they were."""
    torch.manual_seed(0)
    model = randomize_bn(make_model()).eval()
    snapshot = state_snapshot(model)
    inputs_before = [x.clone() for x in inputs]
    fxopt.optimize(model, inputs, mode="inference")(*inputs)
    assert_state_unchanged(model, snapshot)
    assert all(torch.equal(a, b) for a, b in zip(inputs_before, inputs))

"""Training memory on real models: fxopt's checkpoint_activations beside what users already have.

Per model (Hugging Face, built from configs with random weights, wrapped to return
`last_hidden_state`, loss = mean of its square; the library's default attention (SDPA) and dropout; issue #12's
sizes: BERT, GPT-2 and ViT 6 layers 384 wide, BERT and GPT-2 sequence 128 batch 8, ViT, ResNet-50 and MobileNetV2
batch 4, ConvNeXt-T batch 2; issue #39's: Llama 4 layers 256 wide (8 query heads sharing 2 key/value heads, no
dropout in its default config) and BART 3+3 layers 256 wide (dropout 0.1, attention dropout 0), sequence 128 batch 8;
`convnext`, not in the default list, is a smaller ConvNeXt: depths 2-2-2-2, widths 48-384, batch 2),
one training step per variant:

  eager            the model as it is
  fxopt 0.5        fxopt.optimize(..., memory_budget=0.5)
  fxopt @HF        fxopt.optimize(..., memory_budget=<bytes HF's checkpointing peaks at>)
  HF GC            the library's checkpointing of every layer: model.activation_checkpointing_enable()
                   (gradient_checkpointing_enable() before transformers 5.x), where the model supports it
  HF GC/2          the same on every second layer (every_n_layers=2), where transformers offers it
  ckpt/block       torch.utils.checkpoint (non-reentrant) around each block of the model
  compile 0.5      torch.compile(backend="aot_eager") with activation_memory_budget=0.5 (--compile)

Peak = the allocator's live bytes during one step (`fxopt.measure.measure_allocator_peak`, after a
warm-up step; parameter gradients exist before it), as a ratio of eager's. Step time: interleaved rounds
(every variant once per round) of the calling thread's CPU time (`time.thread_time()`, with
`torch.set_num_threads(1)`, so this machine's other processes do not inflate it); each round's
step over the same round's eager step (after a round that warms up), the median of those ratios, and in
brackets their lowest and highest (a machine whose speed drifts moves a round's steps together, so a ratio
within a round cancels what a ratio of two medians taken over all rounds does not; the brackets show what
noise is left). "fastest step": the variant's fastest step over eager's fastest, a second estimate that noise
moves less: on a shared virtual machine other tenants only ever add time, even to the thread's CPU clock (25 identical
eager ViT steps: 654 ms fastest, 724 ms median, 1,058 ms slowest). With glibc's default malloc the clock
also counts the page faults of memory the heap gave back to the OS and takes again (HF MobileNetV2,
batch 4: ~50,000 minor faults per eager step, a third of its time, and fewer under checkpointing,
whose peak is lower); --steady-heap keeps freed memory in the heap (mallopt: no mmap for large blocks,
no trimming), as jemalloc or tcmalloc would, so the ratio compares compute alone. optimize() = wall time of fxopt.optimize (load on
the machine inflates it); in steps = its thread CPU time over eager's median step, the same clock, so
the cost of planning in training steps (issue #12: at most ~10). Peaks are deterministic.

    python benchmarks/checkpoint_vs_peers.py [--models bert,gpt2] [--rounds 3] [--compile] [--steady-heap]
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import os
import statistics
import sys
import time
import warnings

import torch
from tabulate import tabulate
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "corpus"))

import fxopt  # noqa: E402
from corpus_models import LastHiddenState  # noqa: E402
from fxopt import _torch_private  # noqa: E402
from fxopt.measure import measure_allocator_peak  # noqa: E402


def _models():
    import transformers as hf

    tokens = torch.randint(0, 1000, (8, 128))
    images = torch.randn(4, 3, 224, 224)
    return {
        "bert": (lambda: hf.BertModel(hf.BertConfig(num_hidden_layers=6, hidden_size=384, num_attention_heads=6,
                                                    intermediate_size=1536)),
                 tokens, "encoder.layer"),
        "gpt2": (lambda: hf.GPT2Model(hf.GPT2Config(n_layer=6, n_embd=384, n_head=6)), tokens, "h"),
        "vit": (lambda: hf.ViTModel(hf.ViTConfig(num_hidden_layers=6, hidden_size=384, num_attention_heads=6,
                                                 intermediate_size=1536)),
                images, "layers"),
        "llama": (lambda: hf.LlamaModel(hf.LlamaConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=8,
                                                       num_key_value_heads=2, intermediate_size=688)),
                  tokens, "layers"),
        "bart": (lambda: hf.BartModel(hf.BartConfig(encoder_layers=3, decoder_layers=3, d_model=256,
                                                    encoder_attention_heads=4, decoder_attention_heads=4,
                                                    encoder_ffn_dim=1024, decoder_ffn_dim=1024)),
                 tokens, "encoder.layers"),
        "convnext": (lambda: hf.ConvNextModel(hf.ConvNextConfig(depths=[2, 2, 2, 2], hidden_sizes=[48, 96, 192, 384])),
                     images[:2], "encoder.stages"),
        "convnext_t": (lambda: hf.ConvNextModel(hf.ConvNextConfig()), images[:2], "encoder.stages"),
        "resnet50": (lambda: hf.ResNetModel(hf.ResNetConfig()), images, "encoder.stages"),
        "mobilenet_v2": (lambda: hf.MobileNetV2Model(hf.MobileNetV2Config()), images, "layer"),
    }


def _loss_step(forward, x):
    out = forward(x)
    return (out.float() ** 2).mean()


def _hf_checkpointing(base: torch.nn.Module, every_n_layers: int) -> torch.nn.Module:
    """A copy with the library's own checkpointing (non-reentrant) on every `every_n_layers`-th layer; transformers
    without `activation_checkpointing_enable` checkpoint every layer (gradient_checkpointing_enable)."""
    model = copy.deepcopy(base)
    if hasattr(model.model, "activation_checkpointing_enable"):
        model.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                                    every_n_layers=every_n_layers)
    else:
        model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _checkpoint_each_block(model: torch.nn.Module, blocks_path: str) -> torch.nn.Module:
    """A copy whose every block (children of `blocks_path`) runs under non-reentrant torch.utils.checkpoint."""
    model = copy.deepcopy(model)
    for block in model.get_submodule(f"model.{blocks_path}").children():
        block.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(block.forward)
    return model


def _peak(forward, module, x) -> int:
    return measure_allocator_peak(module, (x,), forward=lambda x: _loss_step(forward, x) * 1.0)


def _timed(forward, module, x) -> float:
    start = time.thread_time()  # this thread's CPU time: with one torch thread, all of the step's work
    _loss_step(forward, x).backward()
    module.zero_grad(set_to_none=True)
    return time.thread_time() - start


def run_model(name, factory, x, blocks_path, rounds, with_compile):
    torch.manual_seed(0)
    base = LastHiddenState(factory()).train()
    variants, optimize_s, optimize_cpu_s = {"eager": (base, base)}, {}, {}
    if getattr(base.model, "supports_gradient_checkpointing", False):
        hf_every = _hf_checkpointing(base, every_n_layers=1)
        variants["HF GC"] = (hf_every, hf_every)
        if hasattr(base.model, "activation_checkpointing_enable"):
            hf_half = _hf_checkpointing(base, every_n_layers=2)
            variants["HF GC/2"] = (hf_half, hf_half)
    per_block = _checkpoint_each_block(base, blocks_path)
    variants["ckpt/block"] = (per_block, per_block)
    peaks = {k: _peak(f, m, x) for k, (f, m) in variants.items()}
    budgets = {"fxopt 0.5": 0.5}
    if "HF GC" in peaks:
        budgets["fxopt @HF"] = f"{int(peaks['HF GC'])}B"
    for label, budget in budgets.items():
        start, start_cpu = time.perf_counter(), time.thread_time()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = fxopt.optimize(base, (x,), mode="training", memory_budget=budget)
        optimize_s[label], optimize_cpu_s[label] = time.perf_counter() - start, time.thread_time() - start_cpu
        missed = [str(w.message) for w in caught if "NOT met" in str(w.message)]
        if missed:
            print(f"  {name} {label}: {missed[0]}")
        variants[label] = (opt, opt)
        peaks[label] = _peak(opt, opt, x)
    if with_compile:
        with _torch_private.activation_memory_budget(0.5):
            compiled = torch.compile(base, backend="aot_eager")
            peaks["compile 0.5"] = _peak(compiled, base, x)
            variants["compile 0.5"] = (compiled, base)
    times = {k: [] for k in variants}
    for r in range(rounds + 1):  # the first round warms up (eager's step right after optimize() ran slower)
        for k, (f, m) in variants.items():
            t = _timed(f, m, x)
            if r:
                times[k].append(t)
    eager_t, eager_p = statistics.median(times["eager"]), peaks["eager"]
    return [[name, k, f"{peaks[k] / eager_p:.2f}x", f"{peaks[k] / 1e6:.1f}", _step_ratio(times[k], times["eager"]),
             f"{min(times[k]) / min(times['eager']):.2f}x"]
            + ([f"{optimize_s[k]:.1f}", f"{optimize_cpu_s[k] / eager_t:.1f}"] if k in optimize_s else [])
            for k in variants]


def _step_ratio(times: list[float], eager_times: list[float]) -> str:
    """The median over rounds of a variant's step over eager's in the same round, with the lowest and highest."""
    ratios = [t / e for t, e in zip(times, eager_times)]
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]"


def _steady_heap() -> None:
    """Make glibc's malloc keep what is freed: large blocks from the heap instead of mmap, and the heap's top
    never given back, so that steady-state steps take no page faults."""
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    if not (libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 30)):
        raise SystemExit("--steady-heap: glibc's mallopt refused the settings")


HEADERS = ["model", "variant", "peak", "peak MB", "step time", "fastest step", "optimize() s", "in steps"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, "bert,gpt2,vit,convnext_t,resnet50,mobilenet_v2", rounds=3)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    models = prepare(args)
    print_tables(args.models.split(","), lambda name: run_model(name, *models[name], args.rounds, args.compile), HEADERS)


def add_common_arguments(parser: argparse.ArgumentParser, models: str, rounds: int) -> None:
    """--models, --rounds and --steady-heap, with these defaults (the training benchmarks share them)."""
    parser.add_argument("--models", default=models)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steady-heap", action="store_true", help="no page faults from malloc (module docstring)")


def prepare(args: argparse.Namespace) -> dict:
    """The heap as --steady-heap asks, one torch thread (the clock's premise), and the models by name."""
    if args.steady_heap:
        _steady_heap()
    torch.set_num_threads(1)
    return _models()


def print_tables(names: list[str], rows_of, headers: list[str]) -> None:
    """Each model's table as soon as `rows_of(name)` has measured it, then all of them in one."""
    rows = []
    for name in names:
        model_rows = rows_of(name)
        print(tabulate(model_rows, headers=headers), flush=True)
        rows += model_rows
    print()
    print(tabulate(rows, headers=headers))


if __name__ == "__main__":
    main()

"""Training memory on the corpus (tests/corpus): fxopt's memory budget against the library's own
checkpointing (Hugging Face `gradient_checkpointing_enable()`), `torch.utils.checkpoint` with a
selective policy, and Inductor's `activation_memory_budget`, side by side in one process.

    python benchmarks/corpus_training_memory.py --models ResNet,BERT --size tiny --batch 2
    python benchmarks/corpus_training_memory.py --device cuda --dtype bfloat16 --size real --models BERT --batch 8

Per variant: the peak bytes of activations and temporaries during one forward + backward
(`torch.cuda.max_memory_allocated` on CUDA; the allocator's events on CPU, which also see inside
compiled code), as a ratio of eager's, and the median step time (CUDA events on CUDA; variants
called round-robin). The budget is a fraction of the un-checkpointed peak for fxopt and Inductor alike.
"""
from __future__ import annotations

import copy
import functools
import os
import sys

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests", "corpus")]
import corpus_cli  # noqa: E402
import device as dev  # noqa: E402
from corpus_inference import FirstTensor  # noqa: E402
from corpus_models import build  # noqa: E402

import fxopt  # noqa: E402
from fxopt import _torch_private  # noqa: E402

KEEP = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
        torch.ops.aten.convolution.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def _keep_matmuls(ctx, op, *args, **kwargs):
    """torch.utils.checkpoint policy: keep matmul / conv / attention outputs, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in KEEP else CheckpointPolicy.PREFER_RECOMPUTE


class SelectiveCheckpoint(nn.Module):
    """The whole model under non-reentrant torch.utils.checkpoint with the `_keep_matmuls` policy."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        context = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)
        return checkpoint(self.model, x, use_reentrant=False, context_fn=context)


def _hf_checkpointing(model, inputs, budget):
    if not getattr(model.model, "supports_gradient_checkpointing", False):
        raise NotImplementedError("the model does not support gradient_checkpointing_enable()")
    model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _inductor_budget(model, inputs, budget):
    torch._dynamo.reset()
    compiled = torch.compile(model)
    with _torch_private.activation_memory_budget(budget):
        compiled(*inputs).float().sum().backward()  # compiles forward and backward under the budget
    model.zero_grad(set_to_none=True)
    return compiled


VARIANTS = {
    "eager": lambda model, inputs, budget: model,
    "fxopt (no budget)": lambda model, inputs, budget: FirstTensor(fxopt.optimize(model.model, inputs)),
    "fxopt budget": lambda model, inputs, budget: FirstTensor(fxopt.optimize(model.model, inputs, memory_budget=budget)),
    "HF gradient_checkpointing": _hf_checkpointing,
    "torch.utils.checkpoint (selective)": lambda model, inputs, budget: SelectiveCheckpoint(model),
    "Inductor activation_memory_budget": _inductor_budget,
}


def bench_model(name: str, args, device, dtype) -> list[dict]:
    model, inputs = build(name, size=args.size, batch=args.batch, training=True, dtype=dtype)
    model, inputs = FirstTensor(model).to(device).train(), tuple(x.to(device) for x in inputs)
    rows, steps = [], {}
    for variant, make in VARIANTS.items():
        if args.no_compile and variant.startswith("Inductor"):
            continue
        row = {"model": name, "variant": variant}
        try:
            owner = copy.deepcopy(model)
            forward = make(owner, inputs, args.budget)
            row["peak MB"] = dev.training_peak_bytes(owner, inputs, forward) / 1e6
            steps[variant] = lambda forward=forward: forward(*inputs).float().sum().backward()
        except Exception as e:  # noqa: BLE001 - a variant that cannot take this model is a result too
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
        rows.append(row)
        print(f"  {name} {variant}: {row.get('peak MB', row.get('error'))}", file=sys.stderr, flush=True)
    medians = dev.round_robin_ms(steps, device, args.rounds)
    eager = next(r for r in rows if r["variant"] == "eager")
    for r in rows:
        if "peak MB" in r:
            r["peak vs eager"] = r["peak MB"] / eager["peak MB"]
            r["step ms"] = medians[r["variant"]]
            r["time vs eager"] = medians[r["variant"]] / medians["eager"]
    return rows


def main(argv=None) -> list[dict]:
    p = corpus_cli.parser(__doc__, rounds=3, no_compile_help="skip the Inductor variant")
    p.add_argument("--budget", type=float, default=0.5, help="fraction of the un-checkpointed peak")
    args = p.parse_args(argv)
    return corpus_cli.run(args, bench_model, "training memory", f"budget {args.budget}, ")


if __name__ == "__main__":
    main()

"""The network the generated-network tests share (tests/fuzz.py, tests/test_fold_conv_bn_properties.py):
a program of steps over a pool of values, each step reading some values and appending one."""
from __future__ import annotations

import torch.nn as nn


class ProgramNet(nn.Module):
    """Runs `program`: value 0 is the input, each step appends `self.apply(step, [the values it reads])`;
    returns the values at `outputs`. A step has `args` (indices of the values it reads); subclasses
    say what each step computes."""

    def __init__(self, layers: dict[str, nn.Module], program: list, outputs: tuple[int, ...]):
        super().__init__()
        self.layers = nn.ModuleDict(layers)
        self.program, self.outputs = program, outputs

    def forward(self, x):
        values = [x]
        for step in self.program:
            values.append(self.apply(step, [values[i] for i in step.args]))
        return tuple(values[i] for i in self.outputs)

    def apply(self, step, a: list):  # pragma: no cover
        raise NotImplementedError

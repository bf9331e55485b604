import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

# The tests run tiny tensors: one intra-op thread is faster than two and gives the same numbers
# on every machine.
torch.set_num_threads(1)

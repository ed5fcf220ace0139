"""Model of tests/targets/torch_train.py: forward calls the functional ops itself, so the line
that runs aten::linear is in this file (not torch's nn.Linear)."""

import torch
import torch.nn.functional as F


class MLP(torch.nn.Module):
    def __init__(self, d_in: int, d_hidden: int, d_out: int):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(d_hidden, d_in) * 0.1)
        self.b1 = torch.nn.Parameter(torch.zeros(d_hidden))
        self.w2 = torch.nn.Parameter(torch.randn(d_out, d_hidden) * 0.1)
        self.b2 = torch.nn.Parameter(torch.zeros(d_out))

    def forward(self, x):
        h = F.linear(x, self.w1, self.b1)  # @linear1
        return F.linear(torch.relu(h), self.w2, self.b2)  # @linear2

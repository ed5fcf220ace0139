"""Scenario backward_cost: an embedding whose backward is dense over the whole table.

Problem: nn.Embedding(200_000, 64) with a dense gradient: every backward allocates and zeroes a
200_000 x 64 gradient to update 512 rows, and SGD then touches the whole table. Fix:
`sparse=True`: the gradient holds only the rows looked up, and SGD updates only those.
"""

import torch
from torch import nn

from scenario_recorder import main


class Model(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(200_000, 64, sparse=sparse)
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))

    def forward(self, ids):
        e = self.emb(ids)
        return self.mlp(e).squeeze(-1)


def make(fixed: bool):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Model(sparse=fixed).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ids = torch.randint(0, 200_000, (512,), device=device)
    target = torch.randn(512, device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = ((model(ids) - target) ** 2).mean()
        loss.backward()
        opt.step()

    return step


if __name__ == "__main__":
    main("embedding_backward", make, link_backward=True)

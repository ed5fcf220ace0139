"""Target: training steps of a small GPT-2 (transformers' GPT2LMHeadModel, random weights).

The shape of a real training job's Python stack (module calls through
`Module._wrapped_call_impl` / `_call_impl`, transformers' decorators, autograd, an optimizer step)
at a size a CPU runs in ~50 ms a step: 2 layers, d_model 128, 4 heads, batch 4 x 64 tokens.
Needs `transformers`, which only recording installs (tests read the recording:
tests/data/cpu_gpt2_train/, see tests/data/README.md). Prints `ready` and trains until killed.
"""

import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def make_step():
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=64, vocab_size=1024,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (4, 64))

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


if __name__ == "__main__":
    torch.set_num_threads(1)
    step = make_step()
    step()
    print(f"ready pid={os.getpid()} scenario=gpt2_train", flush=True)
    while True:
        step()

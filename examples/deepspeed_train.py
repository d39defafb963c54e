"""A plain DeepSpeed training loop as users have it: nothing of slipstream in it. The config
named on the command line decides.

    torchrun --nproc-per-node 2 examples/deepspeed_train.py ds_config.json
"""

import sys

import deepspeed
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4))
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=sys.argv[1])
g = torch.Generator().manual_seed(dist.get_rank())
losses = []
for step in range(4):
    ids = torch.randint(0, 128, (engine.train_micro_batch_size_per_gpu(), 16), generator=g)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
if dist.get_rank() == 0:
    print("losses", losses)

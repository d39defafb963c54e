"""An accelerate training loop as users have it: nothing of slipstream in it. The accelerate
YAML decides the stack (FSDP2 or HSDP); SLIPSTREAM=1 (or SLIPSTREAM_CONFIG=file) in the
environment puts FSDP2's collectives through slipstream.

    SLIPSTREAM=1 accelerate launch --config_file configs/accelerate_fsdp2.yaml examples/accelerate_fsdp.py

A tiny Llama built from a config and random variable-length batches stand in for your model
and data.
"""

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

accelerator = Accelerator()
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
g = torch.Generator().manual_seed(accelerator.process_index)
losses = []
for step in range(4):
    lengths = torch.randint(2, 24, (4,), generator=g)
    ids = torch.randint(1, 128, (4, int(lengths.max())), generator=g)
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(accelerator.gather(loss.detach()).mean().item())
if accelerator.is_main_process:
    print("distributed_type", accelerator.distributed_type, "model", type(model).__name__)
    print("losses", losses)

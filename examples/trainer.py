"""A Hugging Face Trainer script as users have it: nothing of slipstream in it. The DeepSpeed
config named on the command line decides: with a top-level "slipstream" section, slipstream
routes ZeRO's collectives (and applies its varlen pass if the section asks).

    torchrun --nproc-per-node 2 examples/trainer.py ds_config.json

A tiny Llama built from a config and random token data stand in for your model and data.
"""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4))
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (32, 16))]
args = TrainingArguments(output_dir="out", deepspeed=sys.argv[1], per_device_train_batch_size=4,
                         max_steps=4, learning_rate=1e-3, logging_steps=1, report_to=[],
                         save_strategy="no", use_cpu=True)  # use_cpu: on a machine without a GPU
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.train()
if trainer.is_world_process_zero():
    print("losses", [h["loss"] for h in trainer.state.log_history if "loss" in h])
